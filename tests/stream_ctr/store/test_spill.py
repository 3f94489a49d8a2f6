"""The spill between RAM and LMDB: where rows go, what a checkpoint and a resume see, and
what a user is told when its file cannot be made."""
import numpy as np
import pytest
import torch

from stream_ctr.store.device_cache import Rows
from stream_ctr.store.errors import StoreError
from stream_ctr.store.spill_tier import SPILL_FILE, SpillTier
from tests.stream_ctr.store.helpers import LAYOUT, step, tiny_store, where


def rows(keys):
    k = torch.tensor(keys, dtype=torch.int64)
    packed = LAYOUT.empty(len(keys))
    packed[:, :8] = torch.from_numpy(np.asarray(keys, dtype=np.int64).view(np.uint8).reshape(-1, 8))
    return Rows(k, packed, torch.ones(len(keys), dtype=torch.bool))


def test_drain_hands_out_key_ranges_in_order_and_always_makes_room(tmp_path):
    spill = SpillTier(16, LAYOUT, tmp_path)
    assert (tmp_path / SPILL_FILE).stat().st_size == 16 * LAYOUT.row_bytes
    assert len(spill.drain(8)) == 0                 # under half full: nothing leaves
    spill.put(rows([50, 10, 40, 30, 20, 60, 70, 80]))
    out = spill.drain(4)                            # over half: a round starts, 2 a step
    assert out.keys.tolist() == [10, 20]
    found, got = spill.take(torch.tensor([30]))     # taken back by a batch: not drained
    assert found.tolist() == [True] and got.packed[0, :8].view(torch.int64).item() == 30
    assert spill.drain(4).keys.tolist() == [40, 50]  # the round goes on in key order
    spill.put(rows([1, 2, 3, 4]))
    assert spill.drain(10).keys.tolist() == [60, 70]
    spill.put(rows(list(range(100, 110))))          # 15 held of 16
    out = spill.drain(5)                            # 4 must leave: the round's last row,
    assert out.keys.tolist() == [80, 1, 2, 3]       # then a new round from the smallest key
    spill.put(rows([200, 201, 202, 203, 204]))
    assert len(spill) == 16
    # The bytes went through the file unchanged.
    held = torch.nonzero(spill.slot_keys >= 0).view(-1)
    assert torch.equal(spill.rows[held, :8].contiguous().view(torch.int64).view(-1), spill.slot_keys[held])
    spill.clear()                                   # a checkpoint wrote them all
    assert len(spill) == 0 and spill.take(torch.tensor([200]))[0].tolist() == [False]
    spill.put(rows([7]))
    assert spill.take(torch.tensor([7]))[0].tolist() == [True]
    spill.close()
    assert not (tmp_path / SPILL_FILE).exists()


def test_a_spill_file_left_by_a_killed_process_is_not_read(tmp_path):
    (tmp_path / SPILL_FILE).write_bytes(b"\xff" * 4096)
    spill = SpillTier(8, LAYOUT, tmp_path)
    assert len(spill) == 0 and bool((spill.rows == 0).all())
    spill.close()


def test_a_spill_that_cannot_be_reserved_names_the_option(tmp_path):
    with pytest.raises(StoreError, match=r"spill file .*store.spill_bytes \(0 turns the spill off\)"):
        SpillTier(1 << 50, LAYOUT, tmp_path)        # 1 PiB of rows: no disk has it
    assert not (tmp_path / SPILL_FILE).exists()


def test_rows_pass_through_the_spill_and_a_checkpoint_drains_it(tmp_path):
    s = tiny_store(tmp_path, cache_rows=2, ram_rows=2, spill_rows=64)
    for k in range(1, 20):
        step(s, [k])
    assert where(s, 1) == "spill" and where(s, 15) == "spill" and where(s, 16) == "ram"
    assert s.stats()["rows"]["spill"] == 15 and s.disk.entries() == 0   # under half: kept
    before = s.peek(torch.tensor([1, 2, 19]))
    state = s.state_dict()
    assert len(s.spill) == 0 and s.disk.entries() == 19               # every row, once
    assert torch.equal(s.peek(torch.tensor([1, 2, 19])), before)
    step(s, [1])                                    # read back from LMDB, not created
    assert s.stats()["rows_created"] == 19
    assert state["generation"] == 1
    s.close()
    assert not (tmp_path / "store" / SPILL_FILE).exists()


def test_a_resume_forgets_rows_spilled_after_the_checkpoint(tmp_path):
    s = tiny_store(tmp_path, cache_rows=2, ram_rows=2, spill_rows=64)
    for k in range(1, 8):
        step(s, [k])
    state = s.state_dict()
    keys, saved = s.export()
    for k in range(1, 30):                          # trains 1..7 again and spills them
        step(s, [k])
    assert len(s.spill) > 0
    s.load_state_dict(state)
    assert len(s.spill) == 0 and len(s.ram) == 0
    got_keys, got = s.export()
    floats = LAYOUT.meta_off
    assert np.array_equal(got_keys, keys) and np.array_equal(got[:, :floats], saved[:, :floats])
    s.close()


def test_expired_rows_leave_the_spill(tmp_path):
    s = tiny_store(tmp_path, cache_rows=1, ram_rows=1, spill_rows=64, ttl_steps=4)
    step(s, [1])
    for k in range(100, 110):
        step(s, [k])
    assert where(s, 1) == "none"                    # not served, and its slot reclaimed
    assert s.stats()["evictions"]["ttl_steps"] > 0
    s.close()
