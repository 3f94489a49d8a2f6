"""Every command of docs/kafka.md's "Replay into a topic and train from it", run verbatim
against a local broker.

Only the broker address changes (`broker:9092` -> the test broker). The commands
run through bash in a scratch directory that holds the files they name
(`day_0.gz`, `train.gz`: the bundled Criteo and Avazu samples), with this
interpreter's `stream-ctr` first on PATH. A Kafka run is one long epoch: the
test stops each `train` with SIGTERM, as the page says a user does, once its
time series shows every record trained.
"""
from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from stream_ctr.connectors.files import SAMPLE_PATHS
from stream_ctr.connectors.kafka.sink import topic_partitions
from stream_ctr.connectors.kafka.options import parse_kafka_url
from tests.doc_shell import DOCS, section_commands, stream_ctr_on_path
from tests.kafka_broker import KafkaHelper

KAFKA_DOC = DOCS / "kafka.md"
SECTION = "Replay into a topic and train from it"
CRITEO_LINES, AVAZU_LINES = 14_493, 9_999


def readme_section_commands(title: str) -> list[str]:
    return section_commands(KAFKA_DOC, title)


@pytest.fixture
def user_shell(tmp_path: Path):
    """A scratch directory holding the page's input files, and an environment
    whose PATH starts with a `stream-ctr` that runs this interpreter's package."""
    shutil.copy(SAMPLE_PATHS["criteo"], tmp_path / "day_0.gz")
    shutil.copy(SAMPLE_PATHS["avazu"], tmp_path / "train.gz")
    return tmp_path, stream_ctr_on_path(tmp_path / "bin")


def run_verbatim(command: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def trained_records(run_dir: Path) -> int:
    """Records the run has trained (all its invocations), from its time series' last interval."""
    path = run_dir / "timeseries.jsonl"
    if not path.exists():
        return 0
    lines = [json.loads(x) for x in path.read_text().splitlines() if '"interval"' in x]
    return lines[-1]["records"] if lines else 0


def train_until(command: str, cwd: Path, env: dict, run_dir: Path, records: int,
                timeout_s: float = 180) -> tuple[int, str, str]:
    """Start the page's `train`, SIGTERM it once the run has trained `records`; (code, stdout, stderr)."""
    proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        while trained_records(run_dir) < records:
            if proc.poll() is not None:
                pytest.fail(f"`{command}` exited with {proc.returncode}: {proc.stderr.read()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"`{command}` trained {trained_records(run_dir)} of {records} in {timeout_s}s")
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)          # the batch finishes, a checkpoint, a commit
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


def partitions(bootstrap: str, topic: str) -> int:
    return topic_partitions(parse_kafka_url(f"kafka://{bootstrap}/{topic}"), topic)


def test_readme_kafka_section_runs_verbatim(fresh_broker, user_shell):
    """A broker of its own: the page's topic names are fixed, so no other test may hold them."""
    cwd, env = user_shell
    bootstrap = fresh_broker.bootstrap
    kafka = KafkaHelper(bootstrap)
    commands = [c.replace("broker:9092", bootstrap) for c in readme_section_commands(SECTION)]
    replay_criteo, replay_avazu, train, resume = commands     # the section shows exactly these four
    assert replay_criteo.startswith("stream-ctr replay criteo:day_0.gz")
    assert replay_avazu.startswith("stream-ctr replay avazu:train.gz")
    assert train.startswith("stream-ctr train 'kafka://") and "--resume" in resume
    assert partitions(bootstrap, "clicks") == 0 and partitions(bootstrap, "avazu") == 0

    done = run_verbatim(replay_criteo, cwd, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert partitions(bootstrap, "clicks") == 12
    done = run_verbatim(replay_avazu, cwd, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "created" in done.stdout + done.stderr and partitions(bootstrap, "avazu") == 1
    assert len(kafka.read_all("avazu")) == AVAZU_LINES

    run_dir = cwd / "runs" / "clicks"
    code, out, err = train_until(train, cwd, env, run_dir, CRITEO_LINES)
    assert code == 0, err[-3000:]
    assert re.search(rf"trained {CRITEO_LINES:,} records", out), out
    assert list((run_dir / "checkpoints").glob("ckpt-*"))

    # New traffic arrives (the same replay again), then the page's resume line:
    # it continues in runs/clicks and trains exactly the new records.
    done = run_verbatim(replay_criteo, cwd, env)
    assert done.returncode == 0, done.stderr[-3000:]
    code, out, err = train_until(resume, cwd, env, run_dir, 2 * CRITEO_LINES)
    assert code == 0, err[-3000:]
    assert re.search(rf"trained {CRITEO_LINES:,} records", out), out
    assert sorted(p.name for p in (cwd / "runs").iterdir()) == ["clicks", "latest"]
    assert (cwd / "runs" / "latest").resolve() == run_dir.resolve()
