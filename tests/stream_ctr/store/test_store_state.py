"""Regressions: what a step, a skipped step, a checkpoint and a resume carry exactly."""
import random
import threading

import pytest
import torch

from stream_ctr.config import ModelConfig
from stream_ctr.store.embedding import InMemoryEmbeddingStore
from stream_ctr.store import tiered
from stream_ctr.store.layout import LAST_STEP, WRITE_GEN
from stream_ctr.store.policies import AdmissionSketch
from tests.stream_ctr.store.helpers import OPTIM, lmdb_rows, step, tiny_store, where


def test_disk_sweep_uses_the_event_time_of_the_step_that_queued_it(tmp_path):
    # The trainer observes the next batch's event time before `prepare` waits for the I/O
    # thread: a sweep still queued then must not expire rows by that newer time.
    s = tiny_store(tmp_path, cache_rows=1, ram_rows=1, ttl_seconds=10)
    s.observe_event_time(0)
    step(s, [5])
    s.observe_event_time(1)
    step(s, [100])                                # 5 -> RAM
    gate = threading.Event()
    apply = s.disk.apply
    s.disk.apply = lambda batch: (gate.wait(10), apply(batch))[1]
    s.observe_event_time(5000)
    step(s, [101])                                # 5 -> disk; its write and a sweep queued
    s.observe_event_time(20000)                   # the next batch, seen before its prepare
    gate.set()
    assert where(s, 5) == "disk"                  # 5 s old at 5000 ms: within its 10 s
    s.close()


def _trace_with_a_skipped_step(s, checkpoint_at: int = 0) -> None:
    for c in range(1, 30):
        if c == checkpoint_at:
            s.state_dict()
        keys = [1000 + c] + ([5] if c in (1, 20) else [])
        step(s, keys, update=c != 20)            # step 20: non-finite loss, no update


def _live_rows(s):
    keys, packed = s.export()
    rows = torch.from_numpy(packed)
    meta = s.layout.meta(rows)[:, :WRITE_GEN]    # write_gen says which tier; the rest must not
    return torch.from_numpy(keys), s.layout.floats(rows), meta


def test_metadata_of_a_skipped_step_survives_demotion_and_checkpoints(tmp_path):
    big = tiny_store(tmp_path / "big", cache_rows=200, ram_rows=200)
    tiny = tiny_store(tmp_path / "tiny", cache_rows=2, ram_rows=1)
    for s in (big, tiny):
        _trace_with_a_skipped_step(s)
    (kb, wb, mb), (kt, wt, mt) = _live_rows(big), _live_rows(tiny)
    assert torch.equal(kb, kt) and torch.equal(wb, wt) and torch.equal(mb, mt)
    assert mt[kt == 5, LAST_STEP].item() == 20   # seen (not trained) at step 20
    big.close(), tiny.close()
    # A checkpoint before the skipped step, one after: the second holds step 20's metadata.
    s = tiny_store(tmp_path / "ckpt", cache_rows=200, ram_rows=200)
    _trace_with_a_skipped_step(s, checkpoint_at=10)
    s.state_dict()
    s.close()
    rows = lmdb_rows(tmp_path / "ckpt" / "store")
    assert rows["meta"][rows["keys"] == 5, LAST_STEP].item() == 20


def test_state_dicts_are_copies_not_the_live_tensors():
    sketch = AdmissionSketch(min_count=2, width=1 << 10)
    sketch.admit(torch.tensor([1, 2]))
    state = sketch.state_dict()
    saved = state["table"].clone()
    sketch.admit(torch.tensor([1, 3]))            # training goes on after the checkpoint
    assert torch.equal(state["table"], saved)
    restored = AdmissionSketch(min_count=2, width=1 << 10)
    restored.load_state_dict(state)
    state["table"].zero_()                        # the caller reuses its dict
    assert torch.equal(restored.table, saved)

    mem = InMemoryEmbeddingStore(ModelConfig(), seed=7)
    slots = mem.prepare(torch.tensor([1, 2]))
    state = mem.state_dict()
    saved = {k: v.clone() for k, v in state.items()}
    mem.update(slots, torch.full((2, mem.dim + 1), 0.01), torch.tensor([1, 1]), 1, OPTIM)
    assert all(torch.equal(state[k], saved[k]) for k in saved)


def _random_trace(seed: int, steps: int) -> list[list[int]]:
    r = random.Random(seed)
    return [sorted(r.sample(range(1, 120), r.randint(1, 6))) for _ in range(steps)]


def test_a_checkpoint_keeps_the_disk_sweep_position(tmp_path, monkeypatch):
    monkeypatch.setattr(tiered, "SWEEP_MIN_ROWS", 4)     # a window much smaller than the table
    kw = dict(cache_rows=8, ram_rows=4, disk_rows=40)
    s = tiny_store(tmp_path, **kw)
    for keys in _random_trace(3, 30):
        step(s, keys)
    state = s.state_dict()                        # waits for the I/O thread's sweeps
    position = s._sweep_from
    assert position > 0 and s.stats()["evictions"]["disk_capacity"] > 0
    s.close()
    s = tiny_store(tmp_path, **kw)
    s.load_state_dict(state)
    assert s._sweep_from == position              # resumed, the next sweep scans the same rows
    s.close()


def test_a_checkpoint_without_a_sweep_position_sweeps_from_the_start(tmp_path):
    s = tiny_store(tmp_path, cache_rows=4, ram_rows=4)
    step(s, [1, 2])
    state = s.state_dict()
    s.close()
    del state["sweep_from"]                        # written before it was checkpointed
    s = tiny_store(tmp_path, cache_rows=4, ram_rows=4)
    s.load_state_dict(state)
    assert s._sweep_from == 0
    s.close()


def test_negative_keys_are_refused(tmp_path):
    # LMDB orders keys as big-endian unsigned bytes: a negative key would sort after
    # every positive one, breaking the sorted reads, the prefetch and the sweep.
    s = tiny_store(tmp_path, cache_rows=4, ram_rows=4)
    bad = torch.tensor([-3, 1])
    for call in (s.prepare, s.peek, s.prefetch):
        with pytest.raises(ValueError, match="negative key -3"):
            call(bad)
    step(s, [1, 2])                               # the store is still usable
    s.close()
