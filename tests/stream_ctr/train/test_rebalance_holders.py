"""A rebalance drops the untrained rows of revoked partitions from everything that holds
them: the batch read ahead (single process) and a rank's cut batches and batch in hand.

These rows must go even when the group hands the same partitions straight back (eager
revocation revokes every partition on every rebalance): the partition then continues at
its trained position, so they are read again.  The end-to-end version (two trainers,
tiered store) is in test_kafka_faults.py.
"""
from types import SimpleNamespace

import numpy as np

from stream_ctr.connectors.batch import Batch
from stream_ctr.connectors.kafka.positions import GIVEN_UP, ROWS_DONE, PositionBook, given_up_positions
from stream_ctr.distributed.run import DistributedRun
from stream_ctr.train.streaming import StreamBatcher
from stream_ctr.train.batches import LookAhead


def rows(partition_offsets: list[tuple[int, int]], names=("t/0", "t/1")) -> Batch:
    n = len(partition_offsets)
    part = np.array([p for p, _ in partition_offsets], np.int32)
    off = np.array([o for _, o in partition_offsets], np.int64)
    return Batch(np.zeros(n, np.float32), np.zeros((n, 13), np.float32), np.zeros((n, 39), np.int64),
                 np.zeros(n, np.int64), part, off, tuple(names))


def pairs(batch: Batch) -> list[tuple[str, int]]:
    return [(batch.partitions[p], int(o)) for p, o in zip(batch.partition, batch.offset)]


def test_look_ahead_batch_loses_revoked_rows_when_the_read_after_it_rebalances():
    b1 = rows([(0, 0), (1, 0), (0, 1)])
    b2 = rows([(1, 1), (0, 2)])
    b3 = rows([(1, 2)])
    holder: list[LookAhead] = []

    def batches():
        yield b1
        yield b2                          # read while b1 is held
        holder[0].discard(["t/0"])        # the read of b3 rebalances: t/0 revoked
        yield b3

    lookahead = LookAhead(batches(), enabled=True)
    holder.append(lookahead)
    got = [(pairs(current), pairs(upcoming) if upcoming is not None else None)
           for current, upcoming in lookahead]
    assert got[0][0] == pairs(b1)                         # trained before the rebalance
    assert got[1][0] == [("t/1", 1)]                      # b2 was held ahead: t/0 rows gone
    assert got[2] == (pairs(b3), None)


def test_look_ahead_disabled_holds_nothing():
    b1 = rows([(0, 0)])
    lookahead = LookAhead(iter([b1]), enabled=False)
    lookahead.discard(["t/0"])
    assert [pairs(c) for c, _ in lookahead] == [[("t/0", 0)]]


def test_rank_revoke_hook_filters_batcher_cut_batches_and_batch_in_hand():
    batcher = StreamBatcher(batch_size=100)
    batcher.add(rows([(0, 10), (1, 10)]))
    run = SimpleNamespace(batcher=batcher, _ready=[rows([(0, 5), (1, 5)]), rows([(0, 6)])],
                          in_hand=rows([(0, 4), (1, 4)]), checkpoint_wanted=False,
                          source=SimpleNamespace(trained_positions={"t/0": 4, "t/1": 4}))
    DistributedRun._on_revoke(run, ["t/0"], lost=False)
    assert [pairs(b) for b in run._ready] == [[("t/1", 5)]]
    assert pairs(run.in_hand) == [("t/1", 4)]
    assert pairs(batcher.flush()) == [("t/1", 10)]
    assert run.checkpoint_wanted


def test_checkpoint_positions_keep_given_up_partitions_marked():
    book = PositionBook()
    book.own("t/0", (3, 0))
    book.own("t/1", (7, 0))
    book.trained["t/1"] = (8, 20)              # inside a packed message
    book.release(["t/1"])
    positions = book.checkpoint_positions()
    assert positions == {"t/0": 3, "t/1": 8, "t/1" + ROWS_DONE: 20, "t/1" + GIVEN_UP: 1}
    assert given_up_positions(positions) == {"t/1": (8, 20)}
    book.own("t/1", (9, 0))                    # it came back: owned again, no marker
    assert book.checkpoint_positions() == {"t/0": 3, "t/1": 9}
