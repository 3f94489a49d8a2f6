"""Crash safety: a run killed in the middle of a checkpoint flush, or between the LMDB
commit and the manifest, or stopped by a full disk, resumes bit-identically."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stream_ctr.train.checkpoint import load_checkpoint
from stream_ctr.cli import main
from stream_ctr.config import ConfigError
from stream_ctr.store.errors import StoreError
from stream_ctr.train.loop import train
from tests.stream_ctr.store.helpers import assert_same_rows, lmdb_rows, small_config, sorted_memory_rows

REPO = Path(__file__).resolve().parents[3]

CHILD = """
import os, signal, sys
import stream_ctr.store.tiered as tiered
import stream_ctr.train.loop as loop
from tests.stream_ctr.store.helpers import small_config
from stream_ctr.train.loop import train

mode, run_dir = sys.argv[1], sys.argv[2]
calls = [0]
if mode == "mid_flush":
    orig = tiered.commit_checkpoint
    def crashing(tier, batch):
        calls[0] += 1
        if calls[0] == 2:                 # the 2nd checkpoint dies inside its LMDB transaction
            write = tier._write
            def write_then_die(txn, b, seq):
                write(txn, b, seq)        # the rows are in the transaction, not committed
                os.kill(os.getpid(), signal.SIGKILL)
            tier._write = write_then_die
        return orig(tier, batch)
    tiered.commit_checkpoint = crashing
elif mode == "mid_flush_chunks":          # the 2nd checkpoint dies after 2 of its flush's commits
    orig = tiered.TieredEmbeddingStore.state_dict
    def crashing(self):
        calls[0] += 1
        if calls[0] == 2:
            self.disk.chunk_rows = 50
            commit, n = self.disk._commit, [0]
            def commit_then_die(*a, **k):
                n[0] += 1
                if n[0] == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                return commit(*a, **k)
            self.disk._commit = commit_then_die
        return orig(self)
    tiered.TieredEmbeddingStore.state_dict = crashing
else:                                     # the 2nd checkpoint's LMDB commit lands, its manifest not
    orig = loop.save_checkpoint
    def crashing(*a, **k):
        calls[0] += 1
        if calls[0] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return orig(*a, **k)
    loop.save_checkpoint = crashing
cfg = small_config(__import__("pathlib").Path(run_dir), tiered=True)
cfg.train.checkpoint_every_batches = 4
cfg.data.limit_records = 12 * 128
train(cfg, show_progress=False)
"""


def uninterrupted(tmp_path, batches):
    cfg = small_config(tmp_path / "whole", tiered=False)
    cfg.data.limit_records = batches * 128
    train(cfg, show_progress=False)
    return load_checkpoint(cfg.train.run_dir).tensors["trainer"]


@pytest.mark.parametrize("mode", ["mid_flush", "mid_flush_chunks", "after_lmdb_commit"])
def test_crash_during_checkpoint_resumes_from_the_previous_one(tmp_path, mode):
    run_dir = tmp_path / "run"
    child = subprocess.run([sys.executable, "-c", CHILD, mode, str(run_dir)], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == -9, child.stderr[-2000:]
    state = load_checkpoint(run_dir)
    assert state.step == 4                     # LATEST: the 1st checkpoint
    # Rows demoted to LMDB after it (and in `after_lmdb_commit`, a whole committed
    # generation) are in the store; resuming must undo them.
    cfg = small_config(run_dir, tiered=True)
    cfg.train.checkpoint_every_batches = 4
    cfg.data.limit_records = 16 * 128
    s = train(cfg, resume=str(run_dir), show_progress=False)
    assert s.records_trained_total == 20 * 128
    a, b = uninterrupted(tmp_path, 20), load_checkpoint(run_dir).tensors["trainer"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k])
    assert_same_rows(sorted_memory_rows(a["store"]), lmdb_rows(run_dir / "store"))


FULL_DISK = """
import resource, signal, sys
from stream_ctr.cli import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # a write past the limit fails like ENOSPC
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
sys.exit(main(sys.argv[3:]))
"""


def test_full_disk_is_a_one_line_error_and_the_checkpoint_survives(tmp_path):
    run_dir = tmp_path / "run"
    args = ["train", "criteo:sample", "--run-dir", str(run_dir), "--batch-size", "128",
            "--set", "model.mlp_dims=32,32", "--threads", "1", "--quiet", "--device", "cpu",
            "--cache-bytes", str(2 * 128 * 39 * 238), "--ram-bytes", str(3000 * 241),
            "--disk-bytes", "64MiB", "--checkpoint-every", "4", "--set", "store.spill_bytes=256KiB"]
    # Enough for the checkpoints and the first LMDB pages, not for the table.
    child = subprocess.run([sys.executable, "-c", FULL_DISK, "x", str(3 << 20)] + args, cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 4, child.stderr[-2000:]      # checkpoint / store / disk
    last = child.stderr.strip().splitlines()[-1]
    assert last.startswith("stream-ctr: error: cannot write the LMDB store at") and "disk is probably full" in last
    assert "Traceback" not in child.stderr
    state = load_checkpoint(run_dir)           # the last checkpoint before the failure is intact
    assert state.step >= 4
    cfg = small_config(run_dir, tiered=True)
    cfg.data.limit_records = 2 * 128
    s = train(cfg, resume=str(run_dir), show_progress=False)   # and resumes
    assert s.records_trained_total == state.records_trained + 2 * 128


def test_a_fresh_run_refuses_a_store_that_holds_a_table(tmp_path, capsys):
    cfg = small_config(tmp_path / "run", tiered=True)
    cfg.data.limit_records = 2 * 128
    train(cfg, show_progress=False)
    with pytest.raises(ConfigError, match="already holds a run"):     # the run directory first
        train(cfg, show_progress=False)
    cfg.train.run_dir, cfg.store.store_dir = str(tmp_path / "other"), str(tmp_path / "run" / "store")
    with pytest.raises(StoreError, match="already holds a table"):    # another run, same store
        train(cfg, show_progress=False)
    code = main(["train", "--run-dir", str(tmp_path / "third"), "--limit", "256", "--quiet",
                 "--batch-size", "128", "--store-dir", str(tmp_path / "run" / "store"),
                 "--cache-bytes", "64MiB", "--json"])
    assert code == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("stream-ctr: error: the store directory") and "--resume" in err[-1]
