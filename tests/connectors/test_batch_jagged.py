"""Jagged (multi-hot) keys in a Batch: slice, take, concat and empty keep every row's list."""
import numpy as np
import pytest

from stream_ctr.connectors.batch import Batch, Jagged


def _batch(lists, first_offset=0, name="p", pooling="sum"):
    n = len(lists)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum([len(x) for x in lists], out=offsets[1:])
    values = np.array([v for x in lists for v in x], np.int64)
    return Batch(np.zeros(n, np.float32), np.zeros((n, 1), np.float32),
                 np.arange(n * 2, dtype=np.int64).reshape(n, 2), np.zeros(n, np.int64),
                 np.zeros(n, np.int32), np.arange(first_offset, first_offset + n, dtype=np.int64),
                 (name,), (Jagged(values, offsets, pooling),))


def _lists(batch, j=0):
    jag = batch.jagged[j]
    return [jag.values[jag.offsets[i]:jag.offsets[i + 1]].tolist() for i in range(len(batch))]


LISTS = [[1, 2], [], [3, 4, 5], [6], []]


def test_slice_take_concat_keep_each_rows_list():
    b = _batch(LISTS)
    assert _lists(b.slice(1, 4)) == LISTS[1:4]
    assert _lists(b.slice(4, 9)) == [[]]
    assert _lists(b.take(np.array([3, 0, 2]))) == [[6], [1, 2], [3, 4, 5]]
    assert _lists(b.take(np.array([True, False, True, False, False]))) == [[1, 2], [3, 4, 5]]
    c = Batch.concat([b.slice(0, 2), _batch([[9], []], 10, "q"), b.slice(2, 5)])
    assert _lists(c) == [[1, 2], [], [9], []] + LISTS[2:]
    assert c.offset.tolist() == [0, 1, 10, 11, 2, 3, 4]


def test_empty_and_validation():
    e = Batch.empty(2, 1, ("p",), ("mean",))
    assert len(e) == 0 and e.pooling == ("mean",) and e.jagged[0].offsets.tolist() == [0]
    assert _lists(Batch.concat([e, _batch(LISTS, pooling="mean")])) == LISTS
    with pytest.raises(ValueError, match="multi-hot"):
        Batch.concat([_batch(LISTS), Batch.empty(2, 1)])
    with pytest.raises(ValueError, match="rows"):
        b = _batch(LISTS)
        Batch(b.labels, b.dense, b.keys, b.event_time_ms, b.partition, b.offset, b.partitions,
              (b.jagged[0].slice(0, 3),))
    with pytest.raises(ValueError, match="offsets"):
        Jagged(np.zeros(3, np.int64), np.array([0, 2], np.int64))
