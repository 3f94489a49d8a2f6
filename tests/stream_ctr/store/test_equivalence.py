"""Model quality does not depend on where a row lives: tiny tiers == one big table, bit for bit."""
import pytest
import torch

from stream_ctr.train.checkpoint import load_checkpoint
from stream_ctr.train.batches import LookAhead
from stream_ctr.train.inputs import ready_events
from stream_ctr.train.loop import configure_torch, train
from stream_ctr.train.trainer import Trainer
from tests.stream_ctr.store.helpers import (LAYOUT, assert_same_rows, criteo_batches, lmdb_rows,
                                            small_config, sorted_memory_rows)


def run_steps(cfg, batches, lookahead, upload_staged=None):
    configure_torch(cfg)
    trainer = Trainer(cfg, batches[0].n_fields, batches[0].n_dense)
    if upload_staged is not None:
        trainer.store.upload_staged = upload_staged
    events = ready_events(iter(batches), LookAhead() if lookahead else None)
    probs = [trainer.train_step(e.batch, e.upcoming).probs for e in events]
    return trainer, torch.cat(probs)


@pytest.mark.parametrize("spill_rows,evict_ahead,upload", [
    (1500, "on", False), (0, "on", False), (1500, "off", False), (1500, "on", True)])
def test_tiny_tiers_train_bit_identical_to_one_table(tmp_path, spill_rows, evict_ahead, upload):
    batches = criteo_batches(60, tmp=tmp_path)
    mem, mem_probs = run_steps(small_config(tmp_path / "mem", tiered=False), batches, False)
    # Device cache of 2 worst-case working sets, 3000 rows of RAM, a spill of 1500 rows
    # (or none), the rest in LMDB; the cache's room made on the I/O thread or in prepare.
    # `upload`: the staged rows copied during the step and installed from the copies, as
    # on a GPU (here the copy stays on the CPU; the order of the rows is what is tested).
    cfg = small_config(tmp_path / "tier", tiered=True, spill_bytes=spill_rows * LAYOUT.row_bytes,
                       evict_ahead=evict_ahead)
    tier, tier_probs = run_steps(cfg, batches, True, upload_staged=upload)
    store = tier.store
    stats = store.stats()
    assert (stats["rows_uploaded_ahead"] > 5000) == upload
    # The tiers were really used: rows went down to disk and came back up.
    assert stats["evictions"]["ram_to_disk"] > 5000 and stats["rows_written_back"] > 5000
    assert stats["lookups"]["disk"]["hit"] > 1000 and stats["lookups"]["ram"]["hit"] > 500
    assert stats["prefetched_rows"] > 0
    # On: the cache's room was made on the I/O thread, during the step before.
    assert (stats["rows_evicted_ahead"] > 0) == (evict_ahead == "on")
    if spill_rows:          # and through the spill, both ways
        assert stats["rows_spilled"] > 5000 and stats["spill_hits"] > 100
        assert 0 < stats["rows"]["spill"] <= spill_rows
    else:
        assert stats["rows_spilled"] == 0 and store.spill is None

    assert torch.equal(mem_probs, tier_probs)           # prequential scores, every step
    for a, b in zip(mem.model.state_dict().values(), tier.model.state_dict().values()):
        assert torch.equal(a, b)
    keys, packed = store.export()
    w, m, v, meta = store.layout.unpack(torch.from_numpy(packed))
    assert_same_rows(sorted_memory_rows(mem.store.state_dict()),
                     {"keys": torch.from_numpy(keys), "weight": w, "exp_avg": m, "exp_avg_sq": v})
    assert len(store) == len(mem.store)
    # Evaluation reads rows wherever they are, without moving them.
    uniq = torch.unique(torch.from_numpy(batches[-1].keys).view(-1))
    assert torch.equal(store.peek(uniq), mem.store.peek(uniq))
    store.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tiny_tiers_on_cuda_train_as_one_table(tmp_path):
    """On a GPU the prefetch's lookups and evictions ahead run on the I/O thread's own
    stream, beside the step's kernels: a missing wait between the streams, or memory
    reused while the other stream still read it, would show as rows or scores that
    differ from the one-table run's (the kernels' float sums may differ in order, so
    the numbers are compared to float32 rounding; keys and steps exactly)."""
    batches = criteo_batches(60, tmp=tmp_path)
    mem_cfg = small_config(tmp_path / "mem", tiered=False)
    cfg = small_config(tmp_path / "tier", tiered=True, evict_ahead="on")
    for c in (mem_cfg, cfg):
        c.train.device = "cuda"
    mem, mem_probs = run_steps(mem_cfg, batches, False)
    tier, tier_probs = run_steps(cfg, batches, True)
    store = tier.store
    assert store.io.stream is not None
    stats = store.stats()
    assert stats["rows_evicted_ahead"] > 1000 and stats["lookups"]["disk"]["hit"] > 1000
    assert stats["rows_uploaded_ahead"] > 1000
    assert torch.allclose(mem_probs.cpu(), tier_probs.cpu(), rtol=1e-4, atol=1e-6)
    keys, packed = store.export()
    w, m, v, _ = store.layout.unpack(torch.from_numpy(packed))
    want = {k: t.cpu() for k, t in sorted_memory_rows(mem.store.state_dict()).items()}
    assert torch.equal(want["keys"], torch.from_numpy(keys))
    for name, got in (("weight", w), ("exp_avg", m), ("exp_avg_sq", v)):
        assert torch.allclose(want[name], got, rtol=1e-4, atol=1e-6), name
    store.close()


def test_tiered_resume_is_bit_identical_to_uninterrupted_memory_run(tmp_path):
    whole = small_config(tmp_path / "whole", tiered=False)
    whole.data.limit_records = 20 * 128
    train(whole, show_progress=False)
    # Tiered: 8 batches (checkpoint every 3), stop, resume for 12 more.
    part = small_config(tmp_path / "part", tiered=True)
    part.train.checkpoint_every_batches = 3
    part.data.limit_records = 8 * 128
    train(part, show_progress=False)
    part.data.limit_records = 12 * 128
    s = train(part, resume=part.train.run_dir, show_progress=False)
    assert s.records_trained_total == 20 * 128
    a = load_checkpoint(whole.train.run_dir).tensors["trainer"]
    b = load_checkpoint(part.train.run_dir).tensors["trainer"]
    assert a["step"] == b["step"] == 20
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k])
    assert b["store"]["kind"] == "tiered" and b["store"]["generation"] >= 2
    # After the final checkpoint every row is in LMDB.
    assert_same_rows(sorted_memory_rows(a["store"]), lmdb_rows(tmp_path / "part" / "store"))


def test_eval_of_a_tiered_checkpoint_reads_without_writing(tmp_path):
    from stream_ctr.distributed.job_checkpoint import load_any
    from stream_ctr.train.loop import evaluate_checkpoint
    cfg = small_config(tmp_path / "run", tiered=True)
    cfg.data.limit_records = 10 * 128
    train(cfg, show_progress=False)
    data = tmp_path / "run" / "store" / "data.mdb"
    before = data.read_bytes()
    mem = small_config(tmp_path / "mem", tiered=False)
    mem.data.limit_records = 10 * 128
    train(mem, show_progress=False)
    r_tier = evaluate_checkpoint(load_any(cfg.train.run_dir), cfg.train.run_dir, "criteo:sample", start=5000, stop=6000)
    r_mem = evaluate_checkpoint(load_any(mem.train.run_dir), mem.train.run_dir, "criteo:sample", start=5000, stop=6000)
    assert r_tier["auc"] == r_mem["auc"] and r_tier["logloss"] == r_mem["logloss"]
    assert data.read_bytes() == before


def test_resume_without_store_options_uses_the_checkpoints_tiered_store(tmp_path):
    cfg = small_config(tmp_path / "run", tiered=True)
    cfg.data.limit_records = 3 * 128
    train(cfg, show_progress=False)
    again = small_config(tmp_path / "run", tiered=False)       # e.g. `stream-ctr train --resume RUN`
    again.data.limit_records = 2 * 128
    s = train(again, resume=again.train.run_dir, show_progress=False)
    assert s.records_trained_total == 5 * 128
    assert load_checkpoint(again.train.run_dir).tensors["trainer"]["store"]["kind"] == "tiered"
