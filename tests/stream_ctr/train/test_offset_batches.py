"""kafka.deterministic_batches: batches a function of offsets alone, over several partitions.

The plan itself (`allocate`, the batcher fed in two different interleavings),
then the contract against a real broker: a known stream replayed into 3
partitions, trained once uninterrupted and once SIGKILLed at several points
(after a step, inside a checkpoint write, before a group commit) and resumed
each time with the same command line: the two final models are bit-identical
(dense state, optimizer, embedding rows and moments, the prequential window)
and count the same records.
"""
from __future__ import annotations

import json
import signal

import numpy as np
import pytest

from stream_ctr.connectors.batch import Batch
from stream_ctr.connectors.kafka.replay import replay_file
from stream_ctr.train.checkpoint import load_checkpoint
from stream_ctr.train.offset_batches import CutJournal, OffsetOrderBatcher, allocate, plan_order
from tests.stream_ctr.train.test_kafka_faults import checkpointed, trainer, train_args
from tests.stream_ctr.train.test_loop import tensors_equal


def test_allocate_splits_evenly_rotates_the_remainder_and_refills_from_the_others():
    assert allocate(64, [64, 64, 64]) == [22, 21, 21]
    assert allocate(64, [64, 64, 64], first=1) == [21, 22, 21]
    assert allocate(64, [64, 64, 64], first=2) == [21, 21, 22]
    assert allocate(64, [5, 100, 100]) == [5, 30, 29]          # a short partition's share moves on
    assert allocate(64, [5, 0, 10]) == [5, 0, 10]               # less than a batch in all
    assert allocate(7, [0, 0, 0]) == [0, 0, 0]
    for size, avail in ((100, [1, 2, 300]), (9, [3, 3, 3]), (1000, [999, 0, 1])):
        got = allocate(size, avail)
        assert sum(got) == min(size, sum(avail)) and all(g <= a for g, a in zip(got, avail))


def rows(partitions: tuple[str, ...], part: list[int], offsets: list[int]) -> Batch:
    n = len(part)
    return Batch(np.arange(n, dtype=np.float32) % 2, np.zeros((n, 1), np.float32),
                 np.array(offsets, np.int64).reshape(n, 1) * 10 + np.array(part).reshape(n, 1),
                 np.zeros(n, np.int64), np.array(part, np.int32), np.array(offsets, np.int64), partitions)


def batches_of(chunks: list[Batch], tmp_path, size: int = 5) -> list[list[tuple[str, int]]]:
    b = OffsetOrderBatcher(size, CutJournal(tmp_path / "cuts.jsonl", 0), lambda: 0)
    b.set_partitions(plan_order(["t/0", "t/1", "t/2"]))
    out = []
    for chunk in chunks:
        b.add(chunk)
        while (batch := b.planned(size)) is not None:
            out.append([(batch.partitions[p], int(o)) for p, o in zip(batch.partition, batch.offset)])
    return out


def test_two_fetch_orders_give_the_same_batches(tmp_path):
    names = ("t/0", "t/1", "t/2")
    # The same 12 rows per partition, fetched partition by partition ...
    by_partition = [rows(names, [p] * 12, list(range(12))) for p in range(3)]
    # ... or interleaved in small runs, another table order too.
    mixed = []
    for start in range(0, 12, 3):
        mixed.append(rows(("t/2", "t/0", "t/1"), [0, 1, 2] * 3, [start + i for i in range(3) for _ in range(3)]))
    a = batches_of(by_partition, tmp_path / "a")
    b = batches_of(mixed, tmp_path / "b")
    assert a == b and len(a) == 7
    assert a[0] == [("t/0", 0), ("t/0", 1), ("t/1", 0), ("t/1", 1), ("t/2", 0)]


def test_a_recorded_cut_is_replayed_after_a_resume(tmp_path):
    names = ("t/0", "t/1")
    journal_path = tmp_path / "cuts.jsonl"
    first = OffsetOrderBatcher(4, CutJournal(journal_path, 0), lambda: 0)
    first.set_partitions(list(names))
    first.add(rows(names, [0, 0, 0], [0, 1, 2]))
    assert first.planned(4) is None                 # partition 1 has nothing yet
    cut = first.cut(4)                              # the budget is spent: what is there
    assert [int(o) for o in cut.offset] == [0, 1, 2]
    # A resume from the checkpoint before that batch, where partition 1 has rows by now.
    again = OffsetOrderBatcher(4, CutJournal(journal_path, 0), lambda: 0)
    again.set_partitions(list(names))
    again.add(rows(names, [0, 1, 0, 1, 0], [0, 0, 1, 1, 2]))
    replayed = again.planned(4)
    assert [(int(p), int(o)) for p, o in zip(replayed.partition, replayed.offset)] == [(0, 0), (0, 1), (0, 2)]
    # A resume past it forgets it (the journal keeps only what may be replayed).
    CutJournal(journal_path, 3)
    assert journal_path.read_text() == ""


def test_a_cut_dropped_by_a_rebalance_before_it_trained_comes_out_the_same_again(tmp_path):
    names = ("t/0", "t/1")
    batcher = OffsetOrderBatcher(4, CutJournal(tmp_path / "cuts.jsonl", 0), lambda: 0)
    batcher.set_partitions(list(names))
    batcher.add(rows(names, [0, 0, 0], [0, 1, 2]))
    first = batcher.cut(4)                          # emitted (held ahead), not trained
    assert batcher.discard(list(names)) == 0        # eager revocation: every partition
    batcher.add(rows(names, [0, 1, 0, 1, 0], [0, 0, 1, 1, 2]))     # read again, and more
    again = batcher.planned(4)
    assert again is not None and again.offset.tolist() == first.offset.tolist() == [0, 1, 2]


@pytest.mark.parametrize("packed", [1, 7])
def test_sigkilled_and_resumed_over_three_partitions_is_bit_identical(kafka, tmp_path, packed):
    """packed=7: seven records a message, so batch boundaries split messages
    (positions with rows_done) in every partition."""
    total = 2000
    topic = kafka.topic(partitions=3)
    replay_file("criteo:sample", kafka.url(topic), limit=total, packed=packed)
    # Small polls: fetch order then interleaves the partitions differently in every
    # run and after every resume (without the flag these models differ).
    flags = ["--set", "kafka.deterministic_batches=true", "--stop-when-idle", "3",
             "--set", "kafka.max_poll_records=37"]

    whole = tmp_path / "whole"
    child = trainer("none", 0, "-", train_args(kafka.url(topic, "whole"), whole, "--checkpoint-every", "4",
                                               *flags))
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["records_trained_total"] == total

    run_dir = tmp_path / "crash"
    url = kafka.url(topic, "crash")
    # The same command line each time (--resume of a run without a checkpoint starts it).
    for mode, n in (("step", 6), ("checkpoint", 2), ("step", 9), ("commit", 2), ("none", 0)):
        before = checkpointed(run_dir)
        child = trainer(mode, n, "-", train_args(url, run_dir, "--resume", str(run_dir),
                                                 "--checkpoint-every", "4", *flags))
        out, err = child.communicate(timeout=300)
        if mode == "none":
            assert child.returncode == 0, err[-3000:]
            assert json.loads(out.strip().splitlines()[-1])["records_trained_total"] == total
        else:
            assert child.returncode == -signal.SIGKILL, err[-3000:]
            assert checkpointed(run_dir) >= before
    crashed, uninterrupted = load_checkpoint(run_dir), load_checkpoint(whole)
    assert crashed.records_trained == uninterrupted.records_trained == total
    assert crashed.positions == uninterrupted.positions
    assert crashed.step == uninterrupted.step
    assert tensors_equal(crashed.tensors["trainer"], uninterrupted.tensors["trainer"])
    assert tensors_equal(crashed.tensors["window"], uninterrupted.tensors["window"])
