"""FileSource: gzip/plain, chunking, resume offsets, stop offsets, bad lines, format specs."""
import gzip
import io
import json
import shutil

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from stream_ctr.connectors.batch import Batch
from stream_ctr.connectors.dead_letter import DeadLetterFile
from stream_ctr.connectors.files import (SAMPLE_PATHS, FileSource, SourceError, _LineReader, count_readable,
                              count_records, detect_format)
from stream_ctr.connectors.formats import AVAZU, CRITEO, format_by_name


def read_all(source: FileSource, max_records=None) -> tuple[Batch, list, list]:
    """Drain a source; returns the concatenated batch, rejects, and snapshot after each read."""
    batches, rejected, snapshots = [], [], []
    while not source.exhausted:
        batch, rej = source.read(max_records)
        batches.append(batch)
        rejected += rej
        snapshots.append((batch, rej, source.snapshot()))
    batch, rej = source.read()
    assert len(batch) == 0 and rej == []
    return Batch.concat(batches + [batch]), rejected, snapshots


def assert_same(a: Batch, b: Batch) -> None:
    for name in ("labels", "dense", "keys", "event_time_ms", "offset"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


@pytest.fixture(scope="module")
def plain_samples(tmp_path_factory):
    """Uncompressed copies of the bundled samples (names keep 'criteo'/'avazu')."""
    out = tmp_path_factory.mktemp("plain")
    paths = {}
    for name, gz in SAMPLE_PATHS.items():
        paths[name] = out / gz.name.removesuffix(".gz")
        paths[name].write_bytes(gzip.decompress(gz.read_bytes()))
    return paths


@pytest.fixture(scope="module")
def full():
    return {name: read_all(FileSource(SAMPLE_PATHS[name], format_by_name(name)))[0]
            for name in SAMPLE_PATHS}


def test_sample_counts(full):
    assert len(full["criteo"]) == 14493 and full["criteo"].labels.sum() == 3291
    assert len(full["avazu"]) == 9999 and full["avazu"].labels.sum() == 1706
    assert count_records(SAMPLE_PATHS["criteo"], CRITEO) == 14493
    assert count_records(SAMPLE_PATHS["avazu"], AVAZU) == 9999


@pytest.mark.parametrize("name", ["criteo", "avazu"])
def test_gzip_and_plain_give_identical_batches(full, plain_samples, name):
    with FileSource(plain_samples[name], format_by_name(name)) as source:
        plain, rejected, _ = read_all(source)
    assert rejected == [] and source.partition == "file:" + plain_samples[name].name
    assert_same(plain, full[name])


@pytest.mark.parametrize("name", ["criteo", "avazu"])
def test_small_chunks_equal_one_big_read(full, name):
    fmt = format_by_name(name)
    with FileSource(SAMPLE_PATHS[name], fmt, chunk_records=1000, read_bytes=64 << 10) as source:
        chunked, _, snapshots = read_all(source)
    assert_same(chunked, full[name])
    for batch, _, snap in snapshots:
        if len(batch):
            assert snap == {source.partition: int(batch.offset[-1]) + 1}
            assert snap == batch.positions_after()
    with FileSource(SAMPLE_PATHS[name], fmt) as source:
        one, _ = source.read(max_records=10**6)
        assert source.exhausted and source.snapshot() == {source.partition: len(full[name])}
    assert_same(one, full[name])


@pytest.mark.parametrize("name, k", [("criteo", 1), ("criteo", 7777), ("avazu", 4321), ("avazu", 9999)])
def test_resume_from_start_offset_yields_exactly_the_rest(full, name, k):
    with FileSource(SAMPLE_PATHS[name], format_by_name(name), start_offset=k,
                    chunk_records=3000, read_bytes=1 << 20) as source:
        assert source.snapshot() == {source.partition: k}
        rest, _, _ = read_all(source)
    assert_same(rest, full[name].slice(k, len(full[name])))


def test_resume_after_a_snapshot_matches_an_uninterrupted_read(full):
    with FileSource(SAMPLE_PATHS["criteo"], CRITEO, chunk_records=2500) as first:
        head, _ = first.read()
        head2, _ = first.read(1234)
        snap = first.snapshot()
    with FileSource(SAMPLE_PATHS["criteo"], CRITEO, start_offset=snap[first.partition]) as second:
        tail, _, _ = read_all(second)
    assert_same(Batch.concat([head, head2, tail]), full["criteo"])


def test_stop_offset_holds_out_the_end(full):
    with FileSource(SAMPLE_PATHS["criteo"], CRITEO, start_offset=100, stop_offset=14000,
                    chunk_records=4096) as source:
        part, _, _ = read_all(source)
        assert source.exhausted and source.snapshot() == {source.partition: 14000}
    assert_same(part, full["criteo"].slice(100, 14000))


def test_start_beyond_the_end_is_exhausted_immediately():
    with FileSource(SAMPLE_PATHS["avazu"], AVAZU, start_offset=50_000) as source:
        assert source.exhausted
        assert len(source.read()[0]) == 0
        assert source.snapshot() == {source.partition: 9999}


def test_bad_lines_are_dead_lettered_with_line_numbers_and_nothing_is_dropped(tmp_path, full):
    lines = gzip.decompress(SAMPLE_PATHS["criteo"].read_bytes()).splitlines()
    bad = {10: b"\t".join(lines[10].split(b"\t")[:30]), 2500: b"x" + lines[2500],
           7000: lines[7000].replace(b"\t", b"\tzz", 1).replace(b"\tzz", b"\t1.5", 1),
           9000: b"", 14492: b"1\t" + lines[14492]}
    reasons = {10: "field_count", 2500: "bad_label", 7000: "bad_integer", 9000: "field_count",
               14492: "field_count"}
    data = [bad.get(i, line) for i, line in enumerate(lines)]
    path = tmp_path / "criteo_bad.tsv.gz"
    path.write_bytes(gzip.compress(b"\n".join(data)))                 # no final LF either
    assert count_records(path, CRITEO) == 14493
    with FileSource(path, CRITEO, chunk_records=1000, read_bytes=64 << 10) as source, \
            DeadLetterFile(tmp_path / "dead" / "letters.jsonl") as dead:
        batch, rejected, _ = read_all(source)
        dead.write(rejected)
        assert source.snapshot() == {source.partition: 14493}
    assert len(batch) + len(rejected) == 14493
    assert dict(dead.counts) == {"field_count": 3, "bad_label": 1, "bad_integer": 1}
    records = [json.loads(line) for line in (tmp_path / "dead" / "letters.jsonl").read_text().splitlines()]
    assert [(r["offset"], r["line"], r["reason"]) for r in records] == \
        [(i, i + 1, reasons[i]) for i in sorted(bad)]
    assert records[1]["raw"] == data[2500].decode()
    good = np.array(sorted(set(range(14493)) - set(bad)))
    assert batch.offset.tolist() == good.tolist()
    assert (batch.keys == full["criteo"].keys[good]).all()


def test_avazu_file_without_header_is_refused(tmp_path):
    path = tmp_path / "avazu_noheader.csv"
    path.write_bytes(gzip.decompress(SAMPLE_PATHS["avazu"].read_bytes()).split(b"\n", 1)[1])
    with pytest.raises(SourceError, match="header"):
        FileSource(path, AVAZU)


def test_crlf_file_reads_like_lf(tmp_path, full):
    path = tmp_path / "avazu_crlf.csv"
    path.write_bytes(gzip.decompress(SAMPLE_PATHS["avazu"].read_bytes()).replace(b"\n", b"\r\n"))
    with FileSource(path, AVAZU, chunk_records=999) as source:
        assert_same(read_all(source)[0], full["avazu"])


def test_detect_format_specs(tmp_path, plain_samples):
    assert detect_format("criteo:sample") == (CRITEO, SAMPLE_PATHS["criteo"])
    assert detect_format("avazu:sample") == (AVAZU, SAMPLE_PATHS["avazu"])
    assert detect_format(f"criteo:{plain_samples['criteo']}") == (CRITEO, plain_samples["criteo"])
    assert detect_format(str(plain_samples["avazu"]))[0] is AVAZU
    for name, fmt in (("day_0.tsv.gz", CRITEO), ("train.csv", AVAZU), ("my_criteo_log", CRITEO)):
        shutil.copy(plain_samples["criteo"], tmp_path / name)
        assert detect_format(str(tmp_path / name))[0] is fmt
    (tmp_path / "clicks.log").write_bytes(b"")
    assert detect_format(f"avazu:{tmp_path / 'clicks.log'}")[0] is AVAZU


@pytest.mark.parametrize("spec, message", [
    ("criteo:/no/such/file.tsv", "no such file"), ("/no/such/criteo.tsv", "no such file"),
    ("parquet:/tmp/x", "unknown record format 'parquet'"), ("/tmp", "cannot tell|no such file"),
])
def test_detect_format_errors_are_clear(spec, message):
    with pytest.raises(SourceError, match=message):
        detect_format(spec)


def test_unknown_file_and_format_errors():
    with pytest.raises(SourceError, match="no such file"):
        FileSource("/no/such/file.tsv", CRITEO)
    with pytest.raises(ValueError, match="known formats: avazu, criteo"):
        format_by_name("libsvm")
    assert format_by_name(" Criteo ") is CRITEO


def test_count_records_without_final_newline(tmp_path):
    path = tmp_path / "x.tsv"
    path.write_bytes(b"a\nb\nc")
    assert count_records(path, CRITEO) == 3
    path.write_bytes(b"")
    assert count_records(path, CRITEO) == 0 and count_records(path, AVAZU) == 0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"")), max_size=40),
       st.booleans(), st.integers(1, 20), st.lists(st.tuples(st.booleans(), st.integers(0, 9)), max_size=30))
def test_line_reader_takes_and_skips_exactly_like_splitlines(lines, final_lf, read_bytes, ops):
    data = b"\n".join(lines) + (b"\n" if final_lf and lines else b"")
    expected = data.split(b"\n")
    if expected and expected[-1] == b"":
        expected.pop()
    reader = _LineReader(io.BytesIO(data), read_bytes=read_bytes)
    got, pos = [], 0
    for is_skip, n in ops:
        if is_skip:
            k = reader.skip(n)
        else:
            chunk, k = reader.take(n)
            got.append(chunk)
            assert chunk.count(b"\n") in (k, k - 1)
            assert chunk.split(b"\n")[:k] == expected[pos:pos + k]
        assert k == min(n, len(expected) - pos)
        pos += k
    rest, k = reader.take(10**6)
    assert k == len(expected) - pos and reader.at_end()
    assert rest.split(b"\n")[:k] == expected[pos:]


def test_truncated_gzip_is_a_clear_source_error(tmp_path):
    path = tmp_path / "criteo_cut.tsv.gz"
    path.write_bytes(SAMPLE_PATHS["criteo"].read_bytes()[:200_000])
    with pytest.raises(SourceError, match="truncated"):
        with FileSource(path, CRITEO) as source:
            while not source.exhausted:
                source.read()
    # Training counts the records first: the lines before the damage, and the same error
    # to raise once they are trained (it was an EOFError traceback; tests/connectors/test_files_damaged.py).
    n, damage = count_readable(path, CRITEO)
    assert count_records(path, CRITEO) == n > 0
    assert str(damage).startswith(f"{path}: gzip stream truncated after {n:,} lines")
