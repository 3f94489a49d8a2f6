"""One process owns a run directory: a second trainer is refused at once, naming the owner;
a dead owner's lock blocks nobody; what a dead writer left half-written is removed at start."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from stream_ctr.train.checkpoint import load_checkpoint
from stream_ctr.train.run_dir import DirLock

from tests.stream_ctr.train.small_run import CLI, EXIT_STATE, SMALL, cli


def start_long_run(cwd: Path, run_dir: str) -> subprocess.Popen:
    """A trainer that runs until stopped: many passes over the sample, a checkpoint every 2 batches."""
    return subprocess.Popen(CLI + ["train", "--run-dir", run_dir, "--epochs", "1000", "--holdout-fraction", "0",
                                   "--checkpoint-every", "2", "--seed", "1", *SMALL],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_checkpoint(proc: subprocess.Popen, root: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not (root / "LATEST").exists():
        if proc.poll() is not None:
            raise AssertionError(f"the trainer ended (exit {proc.returncode}): {proc.stderr.read()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no checkpoint in {root} after {timeout_s} s")
        time.sleep(0.2)


def stop(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
    proc.communicate(timeout=120)


def test_a_second_trainer_on_a_running_run_directory_is_refused_at_once(tmp_path):
    first = start_long_run(tmp_path, "run")
    try:
        wait_for_checkpoint(first, tmp_path / "run" / "checkpoints")
        lock = json.loads((tmp_path / "run" / ".lock").read_text())
        assert lock["pid"] == first.pid and lock["host"] == socket.gethostname() and lock["started"]
        # --resume of the running run, and a new run into its directory (another seed).
        for args in (["--resume", "run"], ["--run-dir", "run"]):
            second = cli(tmp_path, *args, "--limit", "64", "--seed", "7")
            assert second.returncode == EXIT_STATE, second.stderr
            error = second.stderr.strip().splitlines()[-1]
            assert error.startswith("stream-ctr: error: run directory run is in use by another stream-ctr "
                                    f"process, PID {first.pid} on host {socket.gethostname()}"), error
            assert f"kill {first.pid}" in error and "another --run-dir" in error
            assert "Traceback" not in second.stderr
        assert first.poll() is None, "the first trainer must not notice the second"
        first.send_signal(signal.SIGTERM)         # it checkpoints and exits
        out, err = first.communicate(timeout=120)
        assert first.returncode == 0, err
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["stopped"]
    finally:
        stop(first)
    root = tmp_path / "run" / "checkpoints"
    assert summary["checkpoint"] == f"run/checkpoints/{(root / 'LATEST').read_text()}"
    # Every checkpoint is the first trainer's (its seed), complete, and verifies.
    ckpts = sorted(root.glob("ckpt-*"))
    assert ckpts
    for ckpt in ckpts:
        assert load_checkpoint(ckpt).config["train"]["seed"] == 1
    assert load_checkpoint(root).records_trained == summary["records_trained_total"]
    assert not list(root.glob(".tmp-*")) and not (tmp_path / "run" / ".lock").exists()


def test_a_checkpoint_dir_another_process_holds_is_refused(tmp_path):
    """Two runs with their own run directories but one train.checkpoint_dir would mix their checkpoints."""
    shared = tmp_path / "ckpts"
    holder = DirLock.take(shared, "train.checkpoint_dir", "set another train.checkpoint_dir")
    try:
        second = cli(tmp_path, "--run-dir", "b", "--limit", "64", "--set", f"train.checkpoint_dir={shared}")
    finally:
        holder.release()
    assert second.returncode == EXIT_STATE, second.stderr
    error = second.stderr.strip().splitlines()[-1]
    assert error.startswith(f"stream-ctr: error: train.checkpoint_dir {shared} is in use by another "
                            f"stream-ctr process, PID {os.getpid()}"), error
    assert "set another train.checkpoint_dir" in error
    assert not list(shared.glob("ckpt-*"))


def test_a_lock_left_by_a_killed_trainer_blocks_nobody_and_its_leftovers_are_removed(tmp_path):
    first = start_long_run(tmp_path, "run")
    try:
        wait_for_checkpoint(first, tmp_path / "run" / "checkpoints")
    finally:
        stop(first, signal.SIGKILL)
    run, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    assert json.loads((run / ".lock").read_text())["pid"] == first.pid    # left behind
    # What a kill inside a checkpoint write leaves: a half-written directory, LATEST's replacement.
    half = root / f".tmp-ckpt-00000099-{first.pid}"
    half.mkdir(exist_ok=True)
    (half / "tensors.pt").write_bytes(b"\0" * 2**20)
    (root / ".LATEST.tmp").write_text("ckpt-00000099")
    before = load_checkpoint(run).records_trained

    resumed = cli(tmp_path, "--resume", "run", "--limit", "128")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["records_trained_total"] == before + 128
    assert "removed what writers that died left half-written: " in resumed.stderr
    assert f"{half.relative_to(tmp_path)} (1.0 MiB)" in resumed.stderr
    assert not half.exists() and not (root / ".LATEST.tmp").exists() and not list(root.glob(".tmp-*"))
    assert load_checkpoint(run).records_trained == before + 128


def test_a_run_refused_at_start_leaves_no_directory(tmp_path):
    refused = cli(tmp_path, "--batch-size", "0")
    assert refused.returncode == 2 and "data.batch_size" in refused.stderr, refused.stderr
    assert not (tmp_path / "runs").exists() or not [p for p in (tmp_path / "runs").iterdir()]


def test_resuming_through_runs_latest_owns_the_run_it_points_at(tmp_path, monkeypatch):
    """A new run repointing runs/latest meanwhile must not move a resumed run's files."""
    from stream_ctr.config import Config
    from stream_ctr.train.run_dir import claim_run_dir
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "a" / "checkpoints").mkdir(parents=True)
    (tmp_path / "runs" / "latest").symlink_to("a", target_is_directory=True)
    cfg = Config()
    with claim_run_dir(cfg, "runs/latest/checkpoints") as owner:
        assert (cfg.train.run_dir, owner.resume) == ("runs/a", "runs/a/checkpoints")
        assert json.loads((tmp_path / "runs" / "a" / ".lock").read_text())["pid"] == os.getpid()
    assert not (tmp_path / "runs" / "a" / ".lock").exists()


def test_eval_of_a_run_that_has_not_checkpointed_yet_says_so(tmp_path):
    run_dir = tmp_path / "run"
    holder = DirLock.take(run_dir, "run directory", "pick another --run-dir")   # a trainer starting
    try:
        out = subprocess.run(CLI + ["eval", str(run_dir)], capture_output=True, text=True, timeout=120)
    finally:
        holder.release()
    assert out.returncode == EXIT_STATE, out.stderr
    assert f"no checkpoint yet in the run directory {run_dir} (its trainer, PID {os.getpid()}" in out.stderr
