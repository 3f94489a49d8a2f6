"""A rebalance drops the untrained rows of revoked partitions from everything that holds
them: the batch read ahead (single process) and a rank's cut batches and batch in hand.

These rows must go even when the group hands the same partitions straight back (eager
revocation revokes every partition on every rebalance): the partition then continues at
its trained position, so they are read again.  The end-to-end version (two trainers,
tiered store) is in test_kafka_faults.py.
"""
import numpy as np

from stream_ctr.connectors.batch import Batch
from stream_ctr.connectors.kafka.positions import GIVEN_UP, ROWS_DONE, PositionBook, given_up_positions
from stream_ctr.config import Config
from stream_ctr.connectors.kafka.options import parse_kafka_url
from stream_ctr.connectors.kafka.source import Revocation
from stream_ctr.train.batches import LookAhead
from stream_ctr.train.events import IDLE, Ready, Revoked
from stream_ctr.train.inputs import KafkaInput, ready_events


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
    lookahead = LookAhead()

    def batches():
        yield b1
        yield b2                          # read while b1 is held
        lookahead.discard(["t/0"])        # the read of b3 rebalances: t/0 revoked
        yield b3

    got = [(pairs(e.batch), pairs(e.upcoming) if e.upcoming is not None else None)
           for e in ready_events(batches(), lookahead)]
    assert got[0][0] == pairs(b1)                         # trained before the rebalance
    assert got[1][0] == [("t/1", 1)]                      # b2 was held ahead: t/0 rows gone
    assert got[2] == (pairs(b3), None)


def test_without_look_ahead_every_batch_is_handed_out_as_read():
    b1 = rows([(0, 0)])
    events = list(ready_events(iter([b1, IDLE]), None))
    assert [pairs(e.batch) for e in events if isinstance(e, Ready)] == [[("t/0", 0)]]
    assert events[1] is IDLE and events[0].upcoming is None


class Acknowledgements:
    """Records what the input tells the source about a revocation (the real source's
    `acknowledge` is exercised against a broker in tests/connectors/kafka/test_source.py)."""
    def __init__(self):
        self.given = []
        self.revocation = None

    def acknowledge(self, durable: bool) -> None:
        self.given.append(durable)

    def owned_rows(self, batch: Batch) -> Batch:
        return batch


def kafka_input(checkpoints_revocations=True) -> KafkaInput:
    cfg = Config()
    cfg.data.source, cfg.data.batch_size = "kafka://127.0.0.1:9/t", 100     # never connected here
    inp = KafkaInput(cfg, parse_kafka_url(cfg.data.source, cfg.kafka), lambda: 0, checkpoints_revocations)
    inp.source = Acknowledgements()
    return inp


def test_revoke_drops_pending_cut_and_handed_out_rows_then_tells_the_loop():
    source = kafka_input()
    source.batcher.add(rows([(0, 10), (1, 10)]))
    source._ready = [rows([(0, 5), (1, 5)]), rows([(0, 6)])]
    in_hand = rows([(0, 4), (1, 4)])       # handed out, not yet trained (a rank agreeing on its step)
    source._take_revocation(Revocation(("t/0",), False))
    assert [pairs(b) for b in source._ready] == [[("t/1", 5)]]
    assert pairs(source.owned(in_hand)) == [("t/1", 4)]
    assert pairs(source.batcher.flush()) == [("t/1", 10)]
    events = source._with_revocations(iter([]))
    assert next(events) == Revoked(("t/0",), False)
    assert source.source.given == []        # nothing committed before the loop has checkpointed
    assert list(events) == []
    assert source.source.given == [True]    # asked for the next event: commit


def test_a_loop_that_stops_at_a_revocation_commits_nothing_and_a_job_commits_at_once():
    source = kafka_input()
    source._take_revocation(Revocation(("t/1",), False))
    events = source._with_revocations(iter([]))
    assert next(events) == Revoked(("t/1",), False)
    events.close()                          # no checkpoint was made: nothing may be committed
    assert source.source.given == [False]
    job = kafka_input(checkpoints_revocations=False)    # a job checkpoints at its next agreed step
    job._take_revocation(Revocation(("t/1",), False))
    assert job.source.given == [True]
    assert list(job._with_revocations(iter([]))) == [Revoked(("t/1",), False)]


def test_checkpoint_positions_keep_given_up_partitions_marked():
    book = PositionBook()
    book.own("t/0", (3, 0))
    book.own("t/1", (7, 0))
    book.trained["t/1"] = (8, 20)              # inside a packed message
    book.release(["t/1"])
    positions = book.checkpoint_positions().to_checkpoint()
    assert positions == {"t/0": 3, "t/1": 8, "t/1" + ROWS_DONE: 20, "t/1" + GIVEN_UP: 1}
    assert given_up_positions(positions) == {"t/1": (8, 20)}
    book.own("t/1", (9, 0))                    # it came back: owned again, no marker
    assert book.checkpoint_positions().to_checkpoint() == {"t/0": 3, "t/1": 9}
