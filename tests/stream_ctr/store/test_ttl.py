"""TTL is a rule on a row's metadata, the same in every tier: where a row lives, and
whether a scan already reclaimed it, never changes a number (nor a resume, nor a rollback)."""
import random

import pytest
import torch

from stream_ctr.store.embedding import init_rows
from stream_ctr.store import tiered
from stream_ctr.store.layout import COUNT, WRITE_GEN
from stream_ctr.train.batches import LookAhead
from stream_ctr.train.inputs import ready_events
from stream_ctr.train.loop import configure_torch
from stream_ctr.train.trainer import Trainer
from tests.stream_ctr.store.helpers import criteo_batches, small_config, step, tiny_store, where

BIG, TINY = dict(cache_rows=400, ram_rows=400), dict(cache_rows=8, ram_rows=4)
K = 5


def _trace(seed: int, steps: int) -> list[tuple[int, list[int]]]:
    """(event time ms, keys) per step: a new key every step, 20 rare keys that come back
    after gaps around the TTLs below, and event time that advances unevenly. Key 500 comes
    back 34 steps after step 30: expired at step 64 by ttl_steps 32, one step after its
    cache copy could have been scanned (the case the old per-tier TTL got wrong)."""
    r = random.Random(seed)
    out, t = [], 0
    for c in range(1, steps + 1):
        t += r.choice((0, 500, 1000, 1000, 3000))
        rare = [k for k in range(1, 21) if r.random() < 1 / 30] + ([500] if c in (30, 64) else [])
        out.append((t, rare + [1000 + c]))
    return out


def _run(s, trace, start: int = 0) -> None:
    for c, (t, keys) in enumerate(trace, 1):
        if c > start:
            s.observe_event_time(t)
            step(s, keys, counts=[1 + (k % 3) for k in keys])


def _live(s):
    """Every row held, its floats and metadata (write_gen says which tier: not compared),
    and every key's value as `peek` (evaluation) reads it."""
    keys, packed = s.export()
    rows = torch.from_numpy(packed)
    every = torch.arange(1, 1200)           # every key of the traces
    return (torch.from_numpy(keys), s.layout.floats(rows), s.layout.meta(rows)[:, :WRITE_GEN],
            s.peek(every))


def _assert_same(a, b) -> None:
    for x, y, name in zip(a, b, ("keys", "floats", "meta", "peek")):
        assert torch.equal(x, y), f"{name} differ"


@pytest.mark.parametrize("ttl", [dict(ttl_steps=32), dict(ttl_steps=64, ttl_seconds=30)])
def test_ttl_with_a_tiny_cache_is_bit_identical_to_a_big_one(tmp_path, ttl):
    # ttl_steps 32 / 64: the cache and RAM are scanned every 2nd / 4th step, the disk every
    # step; rows found expired between two scans must be treated alike in every tier.
    trace = _trace(1, 128)                        # ends on a step where every tier was scanned
    big, tiny = tiny_store(tmp_path / "big", **BIG, **ttl), tiny_store(tmp_path / "tiny", **TINY, **ttl)
    for s in (big, tiny):
        _run(s, trace)
    assert big.stats()["evictions"]["cache_to_ram"] == 0
    assert tiny.stats()["lookups"]["disk"]["hit"] > 10
    _assert_same(_live(big), _live(tiny))
    eb, et = big.stats()["evictions"], tiny.stats()["evictions"]
    for reason in ("ttl_steps", "ttl_seconds"):
        assert eb[reason] == et[reason], reason
    assert eb["ttl_seconds" if "ttl_seconds" in ttl else "ttl_steps"] > 50
    assert len(big) == len(tiny)
    big.close(), tiny.close()


@pytest.mark.parametrize("tiers", [BIG, TINY])
def test_ttl_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, tiers):
    ttl = dict(ttl_steps=32, ttl_seconds=40)
    trace = _trace(2, 80)                         # ends before key 500 expires again
    whole = tiny_store(tmp_path / "whole", **tiers, **ttl)
    _run(whole, trace)
    part = tiny_store(tmp_path / "part", **tiers, **ttl)
    _run(part, trace[:45])
    state = part.state_dict()
    _run(part, trace[:60], start=45)              # trained past the checkpoint, then lost
    part.close()
    part = tiny_store(tmp_path / "part", **tiers, **ttl)
    part.load_state_dict(state)                   # an empty cache and RAM: all rows on disk
    _run(part, trace, start=45)
    _assert_same(_live(whole), _live(part))
    assert whole.stats()["evictions"]["ttl_steps"] > 0
    whole.close(), part.close()


def _fillers(s, first: int, last: int) -> None:
    for c in range(first, last + 1):           # each filler key seen twice (admission 2)
        step(s, [1000 + c, 1001 + c])


@pytest.mark.parametrize("tiers", [BIG, dict(cache_rows=2, ram_rows=1)])
def test_rollback_after_an_expired_row_was_recreated_restores_the_old_row(tmp_path, tiers):
    s = tiny_store(tmp_path, **tiers, ttl_steps=32)
    step(s, [K, 1001])                            # step 1
    step(s, [K, 1002], counts=[3, 1])             # step 2: K last seen
    _fillers(s, 3, 3)
    state = s.state_dict()                        # generation 1 holds K (count 4)
    old = s.peek(torch.tensor([K]))
    _fillers(s, 4, 34)
    step(s, [K, 1035])                            # step 35: unseen for 33 > 32 steps
    # Re-created from its initial row (whether its cache copy was scanned yet or not) ...
    keys, packed = s.export()
    meta = s.layout.meta(torch.from_numpy(packed))[keys == K]
    assert meta[0, COUNT].item() == 1
    assert s.stats()["evictions"]["ttl_steps"] >= 1
    _fillers(s, 36, 40)
    s.state_dict()                                # ... and written in generation 2
    s.load_state_dict(state)
    assert torch.equal(s.peek(torch.tensor([K])), old)
    s.close()


def test_an_expired_row_whose_recreation_is_not_admitted_is_gone(tmp_path):
    s = tiny_store(tmp_path, cache_rows=2, ram_rows=1, ttl_steps=32, admission_min_count=2)
    init = init_rows(torch.tensor([K]), s.dim, s.init_std, s.seed)
    step(s, [K])
    step(s, [K])                                  # step 2: admitted
    state = s.state_dict()
    old = s.peek(torch.tensor([K]))
    _fillers(s, 3, 34)
    assert where(s, K) == "disk"
    s.sketch.table.zero_()                        # its sightings faded from the sketch
    step(s, [K])                                  # step 35: expired, and not admitted again
    assert where(s, K) == "none"                  # no old copy is served again
    assert s.stats()["evictions"]["ttl_steps"] == 1   # deleted by prepare, not again by a sweep
    assert torch.equal(s.peek(torch.tensor([K])), init)
    slots = s.prepare(torch.tensor([K]))          # step 36: admitted, a new row
    assert torch.equal(s.weight[slots], init)
    s.state_dict()
    s.load_state_dict(state)
    assert torch.equal(s.peek(torch.tensor([K])), old)
    s.close()


def test_ttl_training_with_tiny_tiers_is_bit_identical_to_one_big_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(tiered, "SWEEP_MIN_ROWS", 1 << 20)   # every sweep scans the whole table
    batches = criteo_batches(60, tmp=tmp_path)

    def run(cfg):
        configure_torch(cfg)
        trainer = Trainer(cfg, batches[0].n_fields, batches[0].n_dense)
        probs = [trainer.train_step(e.batch, e.upcoming).probs for e in ready_events(iter(batches), LookAhead())]
        return trainer, torch.cat(probs)

    big, big_probs = run(small_config(tmp_path / "big", tiered=True, cache_batches=30, disk_bytes=256 << 20,
                                      ram_rows=3000, ttl_steps=32))
    tiny, tiny_probs = run(small_config(tmp_path / "tiny", tiered=True, ttl_steps=32))
    assert big.store.stats()["evictions"]["cache_to_ram"] == 0
    assert tiny.store.stats()["lookups"]["disk"]["hit"] > 1000
    assert torch.equal(big_probs, tiny_probs)
    for a, b in zip(big.model.state_dict().values(), tiny.model.state_dict().values()):
        assert torch.equal(a, b)
    (kb, pb), (kt, pt) = big.store.export(), tiny.store.export()     # waits for the sweeps
    eb, et = big.store.stats()["evictions"], tiny.store.stats()["evictions"]
    assert eb["ttl_steps"] == et["ttl_steps"] > 0
    assert (kb == kt).all() and (pb[:, :big.store.layout.meta_off] == pt[:, :big.store.layout.meta_off]).all()
    big.store.close(), tiny.store.close()
