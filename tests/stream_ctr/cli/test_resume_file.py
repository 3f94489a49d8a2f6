"""`stream-ctr train --resume` on a file run, as a user runs it: real processes, real files.

A checkpoint keeps a fingerprint of its file (the SHA-256 of its first 64 KiB of data
and its size): a file replaced under the same name, or truncated, is refused with
exit 3 instead of skipping the checkpoint's lines of it; one that grew, or a gzip
recompressed, is the same file. A run that finished its passes says so on a resume and
writes no checkpoint; another file continues it from its first line."""
import gzip
import json
import subprocess
import sys
import time

import pytest

from stream_ctr.connectors.files import SAMPLE_PATHS

CLI = [sys.executable, "-m", "stream_ctr"]
SMALL = ["--set", "model.mlp_dims=16", "--batch-size", "256", "--threads", "1", "--quiet"]


def run(*args, timeout=300):
    return subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=timeout)


def summary_of(out) -> dict:
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def checkpoints(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").glob("ckpt-*"))


@pytest.fixture(scope="module")
def lines() -> list[bytes]:
    return gzip.decompress(SAMPLE_PATHS["criteo"].read_bytes()).split(b"\n")[:6000]


def text(lines: list[bytes]) -> bytes:
    return b"\n".join(lines) + b"\n"


def test_a_file_replaced_or_truncated_under_its_name_is_refused(lines, tmp_path):
    clicks, run_dir = tmp_path / "clicks.tsv", tmp_path / "run"
    clicks.write_bytes(text(lines[:4000]))
    first = summary_of(run("train", f"criteo:{clicks}", "--run-dir", run_dir, "--limit", "2000", "--json", *SMALL))
    assert first["records_trained"] == 2000
    kept = checkpoints(run_dir)
    # Other lines under the same name, longer and shorter than the position: exit 3, no
    # holdout error, nothing trained, the checkpoint kept.
    for other in (lines[2000:6000], lines[5000:6000]):
        clicks.write_bytes(text(other))
        out = run("train", f"criteo:{clicks}", "--resume", run_dir, *SMALL)
        assert out.returncode == 3, out.stderr
        assert "changed since the checkpoint (its first 64 KiB differ)" in out.stderr, out.stderr
        assert "trained lines 0-1,999 of another file" in out.stderr and "holdout" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and checkpoints(run_dir) == kept
    # The same first bytes, cut short: truncated.
    clicks.write_bytes(text(lines[:3000]))
    out = run("train", "--resume", run_dir, *SMALL)
    assert out.returncode == 3 and "it was truncated or changed" in out.stderr, out.stderr
    # The way on the message gives: the new file under a name of its own, from its first line.
    renamed = tmp_path / "clicks-2.tsv"
    renamed.write_bytes(text(lines[2000:5000]))
    out = run("train", f"criteo:{renamed}", "--resume", run_dir, "--json", *SMALL)
    s = summary_of(out)
    assert s["records_trained"] == 3000 and s["records_trained_total"] == 5000


def test_a_file_that_grew_or_was_recompressed_is_the_same_file(lines, tmp_path):
    clicks, run_dir = tmp_path / "clicks.tsv.gz", tmp_path / "run"
    clicks.write_bytes(gzip.compress(text(lines[:3000]), mtime=1))
    summary_of(run("train", f"criteo:{clicks}", "--run-dir", run_dir, "--limit", "1000", "--json", *SMALL))
    # Recompressed (another header, another level) and grown by a gzip member appended.
    clicks.write_bytes(gzip.compress(text(lines[:3000]), compresslevel=1, mtime=2)
                       + gzip.compress(text(lines[3000:4000])))
    s = summary_of(run("train", f"criteo:{clicks}", "--resume", run_dir, "--json", *SMALL))
    assert s["records_trained"] == 3000 and s["records_trained_total"] == 4000


def test_a_resume_of_a_finished_run_trains_nothing_and_writes_no_checkpoint(lines, tmp_path):
    day1, day2, run_dir = tmp_path / "day1.tsv", tmp_path / "day2.tsv", tmp_path / "run"
    day1.write_bytes(text(lines[:1000]))
    day2.write_bytes(text(lines[1000:2000]))
    summary_of(run("train", f"criteo:{day1}", "--run-dir", run_dir, "--holdout-fraction", "0.2",
                   "--json", *SMALL))
    kept = checkpoints(run_dir)
    for _ in range(2):          # a supervisor restarting it: exit 0 each time, nothing new
        out = run("train", "--resume", run_dir, "--json", *SMALL)
        s = summary_of(out)
        assert s["records_trained"] == 0 and s["records_trained_total"] == 800
        assert s["already_finished"].startswith("the run finished its 1 pass over day1.tsv")
        assert s["test_records"] == 200 and s["checkpoint"].endswith(kept[-1])
        assert "raise --epochs" in out.stderr and checkpoints(run_dir) == kept, out.stderr
    # More passes, then another file: each trains, the other from its first line.
    s = summary_of(run("train", "--resume", run_dir, "--epochs", "2", "--json", *SMALL))
    assert s["records_trained"] == 800 and not s["already_finished"]
    # The run's passes are now 2: a resume that does not name --epochs keeps them.
    s = summary_of(run("train", "--resume", run_dir, "--json", *SMALL))
    assert s["records_trained"] == 0 and s["already_finished"].startswith("the run finished its 2 passes")
    s = summary_of(run("train", f"criteo:{day2}", "--resume", run_dir, "--json", *SMALL))
    assert s["records_trained"] == 1600 and s["records_trained_total"] == 3200     # its 2 passes


def test_a_checkpoint_without_a_fingerprint_resumes_unchecked(lines, tmp_path):
    """Checkpoints of an older version hold no fingerprint: they resume as before."""
    from stream_ctr.config import Config
    from stream_ctr.train.inputs import FileInput
    clicks = tmp_path / "clicks.tsv"
    clicks.write_bytes(text(lines[3000:6000]))
    cfg = Config()
    cfg.data.source = f"criteo:{clicks}"
    files = FileInput(cfg)
    files.restore({"file:clicks.tsv": 2000}, "run", cfg, None)
    assert files.where() == "line 2,000 of clicks.tsv" and not files.another_file
    with pytest.raises(Exception, match="its first 64 KiB differ"):     # (with one: refused)
        FileInput(cfg).restore({"file:clicks.tsv": 2000}, "run", cfg,
                               {"name": "clicks.tsv", "head_sha256": "0" * 64, "head_bytes": 65536,
                                "size": 10})


# A trainer that waits after its first step until GO exists (STARTED says it got there),
# so a test can change the file while the run trains it, with no timing.
HOLD_DRIVER = r"""
import os, sys, time
started, go = sys.argv[1], sys.argv[2]
import stream_ctr.train.trainer as trainer
step = trainer.Trainer.train_step
def train_step(self, *args, **kwargs):
    result = step(self, *args, **kwargs)
    if not os.path.exists(started):
        open(started, "w").close()
        while not os.path.exists(go):
            time.sleep(0.05)
    return result
trainer.Trainer.train_step = train_step
from stream_ctr.cli import main
sys.exit(main(sys.argv[3:]))
"""


def test_appending_to_a_file_being_trained_is_not_supported_and_the_run_says_so(lines, tmp_path):
    """The run trains the lines it counted at its start; a last line still being written
    then is read as it was (one field_count reject); the run warns, naming Kafka for a
    growing log, and a resume of the finished run says the file grew since."""
    clicks, run_dir = tmp_path / "clicks.tsv", tmp_path / "run"
    half = lines[2000][:10]
    clicks.write_bytes(text(lines[:2000]) + half)          # the writer is inside line 2,001
    started, go = tmp_path / "started", tmp_path / "go"
    child = subprocess.Popen([sys.executable, "-c", HOLD_DRIVER, str(started), str(go), "train",
                              f"criteo:{clicks}", "--run-dir", str(run_dir), "--json", *SMALL],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(6000):                               # (a wait, bounded; no timing asserted)
            if started.exists() or child.poll() is not None:
                break
            time.sleep(0.05)
        assert started.exists(), child.communicate(timeout=60)[1]
        with open(clicks, "ab") as f:                       # the line completed, more appended
            f.write(lines[2000][10:] + b"\n" + text(lines[2001:2500]))
        go.touch()
        out, err = child.communicate(timeout=300)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 0, err
    s = json.loads(out.strip().splitlines()[-1])
    assert s["records_trained"] == 2000 and s["rejected_by_reason"] == {"field_count": 1}
    assert f"{clicks} grew while this run trained it" in err and "through a Kafka topic" in err, err
    out = run("train", "--resume", run_dir, *SMALL)
    assert out.returncode == 0 and "finished its 1 pass over clicks.tsv (it grew since" in out.stderr, out.stderr
