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


@pytest.mark.parametrize("fmt_name, threads", [("criteo", 3), ("avazu", 2)])
def test_several_decoding_threads_hand_out_the_same_chunks_in_file_order(fmt_name, threads):
    fmt, path = detect_format(f"{fmt_name}:sample")
    with FileSource(path, fmt, chunk_records=700, start_offset=100) as plain:
        expected = chunks(plain)
    with ReadAhead(FileSource(path, fmt, chunk_records=700, start_offset=100), 2, decode_threads=threads) as ahead:
        assert ahead._pool is not None
        got = [c for c in chunks(ahead) if len(c[0])]
    assert len(got) == len(expected) > 10
    for (o1, k1, r1), (o2, k2, r2) in zip(got, expected):
        assert np.array_equal(o1, o2) and np.array_equal(k1, k2) and r1 == r2


@pytest.mark.parametrize("threads", [1, 3])
def test_finish_maps_each_chunk_on_the_thread_that_decoded_it(threads):
    # (a GPU trainer's copy into pinned memory; here a copy that notes its thread)
    import dataclasses
    fmt, path = detect_format("criteo:sample")
    with FileSource(path, fmt, chunk_records=700) as plain:
        expected = chunks(plain)
    seen = []

    def finish(batch):
        seen.append(threading.current_thread().name)
        return dataclasses.replace(batch, keys=batch.keys.copy())
    with ReadAhead(FileSource(path, fmt, chunk_records=700), 2, decode_threads=threads,
                   finish=finish) as ahead:
        got = [c for c in chunks(ahead) if len(c[0])]
    assert len(got) == len(expected) == len(seen) > 10
    for (o1, k1, r1), (o2, k2, r2) in zip(got, expected):
        assert np.array_equal(o1, o2) and np.array_equal(k1, k2) and r1 == r2
    prefix = "stream-ctr-decode" if threads > 1 else "stream-ctr-read-ahead"
    assert all(name.startswith(prefix) for name in seen)


def test_a_decode_error_surfaces_in_file_order_after_the_chunks_before_it(monkeypatch):
    fmt, path = detect_format("criteo:sample")
    decode = FileSource.decode_raw

    def failing(self, raw):
        if raw.first_offset == 3000:
            raise SourceError("chunk at 3000 is bad")
        return decode(self, raw)
    monkeypatch.setattr(FileSource, "decode_raw", failing)
    with ReadAhead(FileSource(path, fmt, chunk_records=1000), depth=2, decode_threads=3) as ahead:
        firsts = [ahead.read()[0].offset[0] for _ in range(3)]
        assert firsts == [0, 1000, 2000]
        with pytest.raises(SourceError, match="chunk at 3000"):
            ahead.read()
        assert ahead.exhausted


def test_close_mid_file_stops_the_decoding_threads():
    fmt, path = detect_format("criteo:sample")
    source = FileSource(path, fmt, chunk_records=100)
    ahead = ReadAhead(source, depth=2, decode_threads=4)
    assert ahead.read()[0].offset[0] == 0
    ahead.close()
    assert not any(t.name.startswith("stream-ctr-decode") for t in threading.enumerate())
    # At most max(depth, threads) chunks (+ the one being put) beyond what was handed out.
    assert source.next_offset <= 100 * (1 + 4 + 1)


def test_a_ranks_stripe_decoded_on_several_threads_is_its_stripe():
    from stream_ctr.train.inputs import StripedSource
    fmt, path = detect_format("criteo:sample")
    with StripedSource(FileSource(path, fmt, chunk_records=900), 1, 3) as plain:
        expected = chunks(plain)
    with ReadAhead(StripedSource(FileSource(path, fmt, chunk_records=900), 1, 3), 2, decode_threads=2) as ahead:
        assert ahead._pool is not None
        got = [c for c in chunks(ahead) if len(c[0])]
    assert len(got) == len(expected)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(got, expected))
    assert all((c[0] % 3 == 1).all() for c in got)


def test_sources_without_a_raw_read_stay_on_one_thread():
    class Plain:
        exhausted, fmt, partition = True, None, "p"

        def read(self):
            raise AssertionError("exhausted: never read")

        def close(self):
            pass
    with ReadAhead(Plain(), 2, decode_threads=4) as ahead:
        assert ahead._pool is None


def test_decode_threads_default_to_one_per_four_cores_of_the_process_share(monkeypatch):
    import os
    from stream_ctr.connectors import read_ahead
    got = {}
    for cores in (1, 2, 4, 16, 64):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        got[cores] = read_ahead.decode_threads(0)
    assert got == {1: 1, 2: 1, 4: 1, 16: 4, 64: 8}
    assert read_ahead.decode_threads(0, processes_per_host=4) == 4      # 64 cores, 4 ranks
    assert read_ahead.decode_threads(3) == 3                             # as configured
    # Training on a GPU leaves the cores to decoding: one per 2.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert read_ahead.decode_threads(0, gpu=True) == 8
    assert read_ahead.decode_threads(0, processes_per_host=4, gpu=True) == 2
    assert read_ahead.decode_threads(3, gpu=True) == 3
