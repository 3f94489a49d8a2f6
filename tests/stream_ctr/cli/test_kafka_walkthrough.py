"""docs/kafka.md's "Try it locally", run as a newcomer runs it: every command as written.

The first command starts `stream-ctr broker` (the page's terminal one); the test
starts it with `--port 0` instead of the page's port, reads the address it
prints, and puts that port in place of the page's in every other command. The
others run in order through bash in a scratch directory, with this
interpreter's `stream-ctr` first on PATH; each must exit 0. Then Ctrl-C (SIGINT)
stops the broker, which must exit 0 and leave nothing listening.
"""
from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.doc_shell import DOCS, listening, section_commands, stream_ctr_on_path

KAFKA_DOC = DOCS / "kafka.md"
SECTION = "Try it locally"
SAMPLE_RECORDS = 14_493                 # the bundled Criteo sample


def walkthrough_commands() -> list[str]:
    return section_commands(KAFKA_DOC, SECTION)


@pytest.fixture
def user_shell(tmp_path: Path):
    """A scratch directory, and an environment whose `stream-ctr` is this package."""
    work = tmp_path / "work"
    work.mkdir()
    return work, stream_ctr_on_path(tmp_path / "bin")


def start_broker(command: str, cwd: Path, env: dict) -> tuple[subprocess.Popen, int]:
    """Run the page's broker command on a free port; (process, the port it printed)."""
    proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()      # the address comes first
    found = re.search(r"kafka://127\.0\.0\.1:(\d+)", first)
    if found is None:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"`{command}` printed {first!r}, no kafka://127.0.0.1:PORT; stderr: {err[-3000:]}")
    return proc, int(found.group(1))


def test_try_it_locally_runs_as_written(user_shell):
    cwd, env = user_shell
    commands = walkthrough_commands()
    broker_cmd, rest = commands[0], commands[1:]
    assert broker_cmd.startswith("stream-ctr broker"), broker_cmd
    page_port = re.search(r"--port (\d+)", broker_cmd)
    assert page_port, f"the page's broker command names no --port: {broker_cmd}"
    assert [c.split()[1] for c in rest] == ["replay", "train", "eval", "export", "predict"], rest
    assert all(f"127.0.0.1:{page_port.group(1)}" in c for c in rest[:2]), rest

    proc, port = start_broker(broker_cmd.replace(page_port.group(0), "--port 0"), cwd, env)
    try:
        assert listening(port)
        outputs = {}
        for command in rest:
            command = command.replace(f"127.0.0.1:{page_port.group(1)}", f"127.0.0.1:{port}")
            done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True,
                                  text=True, timeout=300)
            assert done.returncode == 0, f"`{command}` exited {done.returncode}: {done.stderr[-3000:]}"
            outputs[command.split()[1]] = done.stdout
        replayed = re.search(r"replayed ([\d,]+) records", outputs["replay"])
        assert replayed, outputs["replay"]
        n = int(replayed.group(1).replace(",", ""))
        assert 0 < n < SAMPLE_RECORDS
        # train trained exactly what was replayed; eval and predict scored the rest
        assert re.search(rf"trained {n:,} records \(0 rejected\)", outputs["train"]), outputs["train"]
        assert f"on {SAMPLE_RECORDS - n:,} records" in outputs["eval"], outputs["eval"]
        assert f"{SAMPLE_RECORDS - n:,} records (0 rejected)" in outputs["predict"], outputs["predict"]
        probs = cwd / re.search(r"--out (\S+)$", rest[-1]).group(1)
        assert len(probs.read_text().split()) == SAMPLE_RECORDS - n
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)         # Ctrl-C, as the page says
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "stopped the broker" in out, out
    deadline = time.monotonic() + 30
    while listening(port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not listening(port), "the broker still listens after `stream-ctr broker` exited"
