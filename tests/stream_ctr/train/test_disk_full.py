"""A checkpoint disk that fills up mid-run: one clear error, and the previous checkpoint resumes.

The disk is a real size-capped tmpfs, mounted by the test (root only; skipped
elsewhere), so the failure is the kernel's ENOSPC as a user would meet it.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stream_ctr.train.checkpoint import load_checkpoint

CLI = [sys.executable, "-m", "stream_ctr"]
SAMPLE_TRAIN_RECORDS = 13_044          # criteo:sample less its held-out tenth


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + ["train", "--holdout-fraction", "0.1", "--quiet", "--json", *args],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture
def small_disk(tmp_path):
    """A 20 MiB tmpfs: the first checkpoint of the default DeepFM (~11 MiB) fits, the next does not."""
    if os.geteuid() != 0:
        pytest.skip("mounting a size-capped tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_full_checkpoint_disk_stops_with_one_clear_error_and_the_previous_checkpoint_resumes(
        tmp_path, small_disk):
    run_dir, ckpt_dir = tmp_path / "run", small_disk / "ckpts"
    first = _train("--run-dir", str(run_dir), "--checkpoint-every", "50",
                   "--set", f"train.checkpoint_dir={ckpt_dir}")
    assert first.returncode != 0
    lines = [l for l in first.stderr.splitlines() if l.strip()]
    error = lines[-1]
    assert error.startswith("stream-ctr: error: cannot write checkpoint in ") and str(ckpt_dir) in error
    assert "it needs about" in error and "MiB free" in error
    assert "ckpt-00000050, is still valid" in error
    assert "Traceback" not in first.stderr
    assert not [p for p in ckpt_dir.iterdir() if p.name.startswith(".tmp-")]   # no partial checkpoint
    assert load_checkpoint(ckpt_dir).step == 50

    # Space freed: the same --resume RUN_DIR continues from step 50 (the run dir links to
    # the checkpoint disk) and trains exactly the rest of the file.
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    resumed = _train("--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout)
    assert summary["records_trained_total"] == SAMPLE_TRAIN_RECORDS
    assert summary["records_trained"] == SAMPLE_TRAIN_RECORDS - 50 * 64
    assert "starting a new run" not in resumed.stderr


def test_resume_by_run_directory_finds_checkpoints_kept_on_another_disk(tmp_path):
    run_dir, ckpt_dir = tmp_path / "run", tmp_path / "elsewhere" / "ckpts"
    first = _train("--run-dir", str(run_dir), "--limit", "3200",
                   "--set", f"train.checkpoint_dir={ckpt_dir}", "--set", "model.mlp_dims=16")
    assert first.returncode == 0, first.stderr
    assert (run_dir / "checkpoints").is_symlink()
    assert Path(os.path.realpath(run_dir / "checkpoints")) == ckpt_dir.resolve()
    resumed = _train("--resume", str(run_dir), "--limit", "3200")
    assert resumed.returncode == 0, resumed.stderr
    assert "starting a new run" not in resumed.stderr
    assert json.loads(resumed.stdout)["records_trained_total"] == 6400


def test_a_full_store_disk_during_a_tier_flush_stops_cleanly_and_the_run_resumes(tmp_path, small_disk):
    """The tiered store's LMDB tier on the 20 MiB disk (it needs ~41 MiB for the sample)."""
    run_dir = tmp_path / "run"
    tiered = ["--set", "store.kind=tiered", "--set", f"store.store_dir={small_disk / 'store'}",
              "--set", "store.ram_bytes=1MiB", "--set", "store.cache_bytes=600KiB",
              "--set", "store.spill_bytes=1MiB"]
    first = _train("--run-dir", str(run_dir), "--checkpoint-every", "20", *tiered)
    assert first.returncode != 0
    error = [l for l in first.stderr.splitlines() if l.strip()][-1]
    assert error.startswith("stream-ctr: error: cannot write the LMDB store at ")
    assert "MiB free" in error and "Traceback" not in first.stderr
    step = load_checkpoint(run_dir / "checkpoints").step
    assert step >= 20

    subprocess.run(["mount", "-o", "remount,size=128m", str(small_disk)], check=True)
    resumed = _train("--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout)
    assert summary["records_trained_total"] == SAMPLE_TRAIN_RECORDS
    assert summary["records_trained"] == SAMPLE_TRAIN_RECORDS - step * 64


def test_a_full_run_directory_names_the_dead_letter_file_and_every_reject_is_written_once(
        tmp_path, small_disk):
    """The run directory (dead letters, time series) on the small disk, checkpoints elsewhere:
    malformed lines of 1.5 KB fill it. One line names the file and the bytes free; after
    space is freed the resume writes each rejected line exactly once."""
    import gzip
    from stream_ctr.connectors.files import SAMPLE_PATHS
    good = gzip.open(SAMPLE_PATHS["criteo"]).read().split(b"\n")[:3000]
    data = tmp_path / "clicks.tsv"
    data.write_bytes(b"".join(line + b"\n" + b"1\tbad\t" + b"z" * 1500 + b"\n" for line in good))
    run_dir = small_disk / "run"
    args = ["--holdout-fraction", "0", "--batch-size", "256", "--checkpoint-every", "2",
            "--set", f"train.checkpoint_dir={tmp_path / 'ckpts'}"]
    # filler leaves ~2 MiB: the dead letters of 6,000 lines (~10 MiB) cannot fit
    (small_disk / "filler").write_bytes(b"\0" * (18 << 20))
    first = _train(f"criteo:{data}", "--run-dir", str(run_dir), *args)
    assert first.returncode == 4, first.stderr
    error = [l for l in first.stderr.splitlines() if l.strip()][-1]
    assert error.startswith(f"stream-ctr: error: the disk is full writing {run_dir}"), error
    assert "bytes free there" in error and "--resume RUN_DIR" in error
    (small_disk / "filler").unlink()
    resumed = _train(f"criteo:{data}", "--resume", str(run_dir), *args[:2])
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["records_trained_total"] == 3000
    lines = [json.loads(l)["line"] for l in (run_dir / "dead_letter.jsonl").read_text().splitlines()]
    assert sorted(lines) == list(range(2, 6001, 2))         # each malformed line once
