"""A local S3 server on 127.0.0.1 that keeps a tansu broker's data on disk across restarts.

tansu (the broker `local_broker` starts) ships with two storage engines:
memory (lost when the broker stops) and ``s3://``.  Pointed at s3rver (the
npm package: a filesystem-backed S3 server), ``s3://`` keeps topics, records
and the groups' committed offsets in a directory, so a broker stopped or
killed and started again serves the same log: the broker restart users meet.

Safety: an ``s3://`` engine talks to whatever ``AWS_ENDPOINT`` names, real AWS
if nothing; `LocalS3.broker_env` always names this server's 127.0.0.1 address
and `local_broker` refuses an ``s3://`` engine without it.

s3rver is found at ``$STREAM_CTR_S3RVER`` or in ``~/.cache/stream-ctr/s3rver``;
if it is in neither, `s3rver_binary` installs it there with npm (the registry's
``s3rver@3.7.1``, 14 MB; node and npm are Debian's ``nodejs`` and ``npm``).
It runs through ``s3rver_atomic.js`` beside this file, which makes a PUT
replace its object whole or not at all: a broker killed mid-write would
otherwise leave a truncated object that its next start cannot read.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

S3RVER_VERSION = "3.7.1"
BUCKET = "tansu"
START_TIMEOUT_S = 30.0


class S3Error(RuntimeError):
    pass


def s3rver_binary() -> Path:
    """The s3rver executable; installs it with npm into the user's cache if need be."""
    given = os.environ.get("STREAM_CTR_S3RVER")
    if given:
        if not Path(given).is_file():
            raise S3Error(f"STREAM_CTR_S3RVER={given} is not a file")
        return Path(given)
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stream-ctr" / "s3rver"
    binary = home / "node_modules" / ".bin" / "s3rver"
    if binary.is_file():
        return binary
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise S3Error("a broker that keeps its data across restarts needs s3rver, an npm package: "
                      "install node and npm (apt-get install nodejs npm), or set STREAM_CTR_S3RVER "
                      "to an s3rver executable")
    home.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([npm, "install", "--prefix", str(home), "--no-audit", "--no-fund",
                           "--loglevel=error", f"s3rver@{S3RVER_VERSION}"],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not binary.is_file():
        raise S3Error(f"npm install s3rver@{S3RVER_VERSION} into {home} failed: {done.stderr[-1000:]}")
    return binary


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalS3:
    """s3rver serving `data_dir` on 127.0.0.1 with the bucket tansu needs.

    ``with LocalS3(dir) as s3: LocalBroker(s3=s3)``; the data outlive both
    processes (start either again on the same `data_dir`)."""

    def __init__(self, data_dir: str | Path, port: int | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or _free_port()
        self._proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def broker_env(self) -> dict[str, str]:
        """What tansu's ``s3://`` engine reads: this server, never anything else."""
        return {"AWS_ENDPOINT": self.endpoint, "AWS_ALLOW_HTTP": "true", "AWS_ACCESS_KEY_ID": "S3RVER",
                "AWS_SECRET_ACCESS_KEY": "S3RVER", "AWS_DEFAULT_REGION": "us-east-1"}

    def start(self) -> "LocalS3":
        if self.running:
            return self
        self.starts += 1
        log = open(self.data_dir.parent / f"s3rver-{self.port}-{self.starts}.log", "wb")
        # s3rver 3.7.1 signs list continuation tokens with DES, which Node 17+ (OpenSSL 3)
        # refuses without the legacy provider: every listing of more than 1,000 objects
        # (a partition's record batches, after a while) failed with a 500.
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(self.data_dir),
               "NODE_OPTIONS": "--openssl-legacy-provider"}
        node = shutil.which("node")
        if node is None:
            raise S3Error("s3rver needs node on PATH: apt-get install nodejs")
        # the package directory behind the executable (node_modules/.bin/s3rver is a link
        # into node_modules/s3rver/bin/)
        env["S3RVER_PACKAGE_DIR"] = str(s3rver_binary().resolve().parent.parent)
        self._proc = subprocess.Popen(
            [node, str(Path(__file__).with_name("s3rver_atomic.js")),
             "-d", str(self.data_dir), "-a", "127.0.0.1", "-p", str(self.port),
             "--silent", "--configure-bucket", BUCKET],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise S3Error(f"s3rver exited with {self._proc.returncode}; see {log.name}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise S3Error(f"s3rver did not listen on 127.0.0.1:{self.port} within {START_TIMEOUT_S:.0f} s")

    def stop(self, kill: bool = False) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> "LocalS3":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
