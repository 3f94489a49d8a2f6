"""ReadAhead: the same chunks as the file source, in order, from a background thread."""
import gzip
import threading

import numpy as np
import pytest

from stream_ctr.connectors.files import FileSource, SourceError, detect_format
from stream_ctr.connectors.read_ahead import ReadAhead


def chunks(source) -> list:
    out = []
    while not source.exhausted:
        batch, rejected = source.read()
        out.append((batch.offset.copy(), batch.keys.copy(), [r.offset for r in rejected]))
    return out


def test_same_chunks_in_the_same_order_then_exhausted():
    fmt, path = detect_format("criteo:sample")
    with FileSource(path, fmt, chunk_records=1000, start_offset=500, stop_offset=9000) as plain:
        expected = chunks(plain)
    with ReadAhead(FileSource(path, fmt, chunk_records=1000, start_offset=500, stop_offset=9000), 2) as ahead:
        got = chunks(ahead)
        assert ahead.exhausted and len(ahead.read()[0]) == 0           # the end stays the end
    got = [c for c in got if len(c[0])]                                 # the one empty read at the end
    assert len(got) == len(expected) == 9
    for (o1, k1, r1), (o2, k2, r2) in zip(got, expected):
        assert np.array_equal(o1, o2) and np.array_equal(k1, k2) and r1 == r2


def test_close_before_the_end_stops_the_thread_and_reads_no_further():
    fmt, path = detect_format("criteo:sample")
    source = FileSource(path, fmt, chunk_records=100)
    ahead = ReadAhead(source, depth=2)
    first, _ = ahead.read()
    assert first.offset[0] == 0 and not ahead.exhausted
    ahead.close()                                        # a stop signal mid-epoch
    assert not ahead._thread.is_alive() and not ahead.exhausted
    # At most `depth` chunks (+ the one being put) were read beyond what was handed out.
    assert source.next_offset <= 100 * (1 + 2 + 1)
    assert not any(t.name == "stream-ctr-read-ahead" for t in threading.enumerate())


def test_a_read_error_surfaces_on_the_callers_thread(tmp_path):
    fmt, sample = detect_format("criteo:sample")
    data = gzip.open(sample).read()
    broken = tmp_path / "broken.tsv.gz"
    broken.write_bytes(gzip.compress(data)[: 40_000])        # a gzip cut short
    with ReadAhead(FileSource(broken, fmt, chunk_records=500), depth=2) as ahead:
        with pytest.raises(SourceError, match="broken.tsv.gz"):
            chunks(ahead)
