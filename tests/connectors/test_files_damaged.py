"""Damaged and empty files: every complete line before the damage is read, counted and
handed out, then one clear error; an empty input reads as no records, not as an error.

The reference for "readable" is zlib itself, fed the damaged bytes and stopped at its
first error: what it inflated before, cut at the last newline.
"""
import gzip
import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from stream_ctr.connectors import files
from stream_ctr.connectors.batch import Batch
from stream_ctr.connectors.files import (SAMPLE_PATHS, DamagedFile, FileSource, GzipDamage, count_readable,
                                         count_records, open_binary)
from stream_ctr.connectors.formats import AVAZU, CRITEO
from stream_ctr.connectors.read_ahead import ReadAhead

N_LINES = 10_000


@pytest.fixture(scope="module")
def text() -> bytes:
    """10,000 lines of the bundled Criteo sample."""
    lines = gzip.decompress(SAMPLE_PATHS["criteo"].read_bytes()).split(b"\n")[:N_LINES]
    return b"\n".join(lines) + b"\n"


@pytest.fixture(scope="module")
def gz(text) -> bytes:
    return gzip.compress(text, mtime=0)


def readable(damaged: bytes) -> bytes:
    """zlib's output of `damaged` (gzip members one after another) up to its first error,
    fed a byte at a time so nothing before the error is lost; cut at the last newline."""
    out, member, rest = [], zlib.decompressobj(wbits=31), damaged
    while rest:
        try:
            for i in range(len(rest)):
                out.append(member.decompress(rest[i:i + 1]))
                if member.eof:
                    break
        except zlib.error:
            break
        rest = member.unused_data + rest[i + 1:] if member.eof else b""
        member = zlib.decompressobj(wbits=31)
    data = b"".join(out)
    return data[:data.rfind(b"\n") + 1]


def drain(source) -> tuple[bytes, DamagedFile | None]:
    """The raw lines a FileSource hands out, and the error that ends them (None at a clean end)."""
    parts = []
    try:
        while not source.exhausted:
            parts.append(source.read_raw().data)
    except DamagedFile as exc:
        return b"".join(parts), exc
    return b"".join(parts), None


def decode_all(source) -> tuple[list[Batch], list, DamagedFile | None]:
    batches, rejected = [], []
    try:
        while not source.exhausted:
            batch, bad = source.read()
            batches.append(batch)
            rejected += bad
    except DamagedFile as exc:
        return batches, rejected, exc
    return batches, rejected, None


def cut_points(size: int) -> list[int]:
    # inside the gzip header, early, mid-stream, near the end, at and inside the 8-byte trailer
    return [5, 30, size // 7, size // 2, size - 500, size - 8, size - 1]


@pytest.mark.parametrize("where", range(7))
def test_truncated_gzip_hands_out_every_readable_line_then_says_where(tmp_path, gz, where):
    cut = cut_points(len(gz))[where]
    path = tmp_path / "day_criteo.tsv.gz"
    path.write_bytes(gz[:cut])
    expected = zlib.decompressobj(wbits=31).decompress(gz[:cut])   # a cut raises nothing in zlib
    expected = expected[:expected.rfind(b"\n") + 1]
    n = expected.count(b"\n")
    assert where < 5 or n == N_LINES                   # the trailer alone cut: every line there

    assert count_records(path, CRITEO) == n
    counted, damage = count_readable(path, CRITEO)
    assert counted == n and damage.lines == n
    for read_bytes in (files.READ_BYTES, 4096):
        got, error = drain(FileSource(path, CRITEO, chunk_records=997, read_bytes=read_bytes))
        assert got == expected
        assert error is not None and error.lines == n and str(error) == str(damage)
    message = str(damage)
    assert message.startswith(f"{path}: gzip stream truncated after {n:,} lines (byte {cut:,} of {cut:,})")
    assert "the file is damaged: re-copy it" in message and "\n" not in message
    # Decoded, every readable line is a record or a reject, with its own offset.
    batches, rejected, error = decode_all(FileSource(path, CRITEO, chunk_records=1000))
    assert error is not None and error.lines == n
    offsets = sorted([o for b in batches for o in b.offset.tolist()] + [r.offset for r in rejected])
    assert offsets == list(range(n))


def test_a_cut_line_is_dropped_with_its_byte_count_and_resumes_whole(tmp_path, text, gz):
    """The line the damage cuts short is not a record: the repaired file holds it whole at
    the offset the reader stopped at, so a resume there trains it once."""
    path = tmp_path / "cut_criteo.tsv.gz"
    path.write_bytes(gz[:len(gz) // 2])
    inflated = zlib.decompressobj(wbits=31).decompress(gz[:len(gz) // 2])
    n, partial = inflated.count(b"\n"), len(inflated) - inflated.rfind(b"\n") - 1
    assert partial > 0                                  # this cut is mid-line
    _, damage = count_readable(path, CRITEO)
    assert damage.cut_bytes == partial and f"the {partial:,} bytes of the line it cut short" in str(damage)
    # A resume from where it stopped, on the repaired file, starts with that line, whole.
    repaired = tmp_path / "repaired_criteo.tsv.gz"
    repaired.write_bytes(gz)
    with FileSource(repaired, CRITEO, start_offset=n) as source:
        rest = source.read_raw(N_LINES).data
    assert rest == text.split(b"\n", n)[n]
    # A resume past the damage on the damaged file is that error, not an empty read.
    with pytest.raises(DamagedFile, match=f"truncated after {n:,} lines"):
        FileSource(path, CRITEO, start_offset=n + 5)


def full_flush_gzip(first: bytes, second: bytes) -> tuple[bytes, int]:
    """One gzip member whose deflate stream restarts on a byte boundary after `first`
    (a full flush): (the member, the offset of the block that follows)."""
    c = zlib.compressobj(6, zlib.DEFLATED, 31)
    head = c.compress(first) + c.flush(zlib.Z_FULL_FLUSH)
    return head + c.compress(second) + c.flush(), len(head)


def test_bytes_that_do_not_inflate_stop_at_the_exact_byte(tmp_path, text):
    """A block header that is invalid (type 3) mid-stream: all 6,000 lines before it are
    read (not just those of whole 1 MiB reads before it), and the message has its offset."""
    k = text.split(b"\n")[:6000]
    first = b"\n".join(k) + b"\n"
    member, at = full_flush_gzip(first, text[len(first):])
    damaged = member[:at] + b"\xff" + member[at + 1:]     # BFINAL=1, BTYPE=11: reserved
    path = tmp_path / "bad_criteo.tsv.gz"
    path.write_bytes(damaged)
    assert readable(damaged) == first
    counted, damage = count_readable(path, CRITEO)
    assert counted == 6000
    got, error = drain(FileSource(path, CRITEO, chunk_records=4096))
    assert got == first and error.lines == 6000
    assert str(error).startswith(f"{path}: gzip stream corrupt after 6,000 lines (byte {at:,} of "
                                 f"{len(damaged):,}: bytes that do not inflate: invalid block type)")


def test_a_changed_byte_is_found_by_the_checksum_and_said_to_garble(tmp_path, gz):
    """Deflate inflates most changed bytes to other bytes: only the member's CRC at its end
    finds them. The reader hands out what zlib inflates (as the reference does) and says
    the lines before may be garbled."""
    damaged = bytearray(gz)
    damaged[len(gz) // 2] ^= 0x10
    damaged = bytes(damaged)
    path = tmp_path / "flipped_criteo.tsv.gz"
    path.write_bytes(damaged)
    expected = readable(damaged)
    counted, damage = count_readable(path, CRITEO)
    got, error = drain(FileSource(path, CRITEO))
    assert got == expected and counted == error.lines == expected.count(b"\n")
    assert "gzip stream corrupt" in str(error) and "may be garbled" in str(error)
    assert "may be garbled" in str(damage)


def test_multi_member_gzip_reads_whole_and_a_damaged_member_after_a_good_one(tmp_path, text):
    half = text.find(b"\n", len(text) // 2) + 1
    a, b = gzip.compress(text[:half], mtime=0), gzip.compress(text[half:], mtime=0)
    path = tmp_path / "members_criteo.tsv.gz"
    path.write_bytes(a + b"\0" * 512 + b)             # zero padding between members, as gzip allows
    assert count_readable(path, CRITEO) == (N_LINES, None)
    assert drain(FileSource(path, CRITEO, read_bytes=65536)) == (text, None)
    with open_binary(path) as stream:
        assert stream.read() == text
    with open_binary(path) as stream:
        assert sum(1 for _ in stream) == N_LINES
    # The second member cut short: the first whole, the second's readable lines.
    damaged = a + b[:len(b) // 3]
    path.write_bytes(damaged)
    expected = readable(damaged)
    assert len(expected) > half
    got, error = drain(FileSource(path, CRITEO))
    assert got == expected and count_records(path, CRITEO) == error.lines == expected.count(b"\n")
    # Bytes after the last member that are not gzip: every line read, then the error.
    path.write_bytes(a + b + b"garbage")
    got, error = drain(FileSource(path, CRITEO))
    assert got == text and error.lines == N_LINES and "not gzip data" in str(error)
    assert f"byte {len(a) + len(b):,}" in str(error)


def test_read_ahead_hands_out_every_readable_chunk_then_the_error(tmp_path, gz):
    cut = len(gz) * 2 // 3
    path = tmp_path / "cut_criteo.tsv.gz"
    path.write_bytes(gz[:cut])
    n = count_records(path, CRITEO)
    for threads in (1, 2):
        rows = 0
        with ReadAhead(FileSource(path, CRITEO, chunk_records=512), depth=2, decode_threads=threads) as source:
            with pytest.raises(DamagedFile, match=f"truncated after {n:,} lines"):
                while not source.exhausted:
                    batch, rejected = source.read()
                    rows += len(batch) + len(rejected)
        assert rows == n


def test_avazu_lines_are_counted_after_the_header(tmp_path):
    text = gzip.decompress(SAMPLE_PATHS["avazu"].read_bytes())
    gz = gzip.compress(text, mtime=0)
    path = tmp_path / "cut_avazu.csv.gz"
    path.write_bytes(gz[:len(gz) // 2])
    inflated = zlib.decompressobj(wbits=31).decompress(gz[:len(gz) // 2])
    n = inflated.count(b"\n") - 1                       # the header is not a data line
    got, error = drain(FileSource(path, AVAZU))
    assert count_records(path, AVAZU) == error.lines == n == got.count(b"\n")
    assert f"truncated after {n:,} lines" in str(error)


@pytest.mark.parametrize("name, data, fmt", [
    ("empty_criteo.tsv", b"", CRITEO),
    ("empty_criteo.tsv.gz", gzip.compress(b"", mtime=0), CRITEO),
    ("header_avazu.csv", None, AVAZU),
    ("header_avazu.csv.gz", None, AVAZU),
])
def test_an_empty_input_is_no_records_and_no_error(tmp_path, name, data, fmt):
    if data is None:                                    # the Avazu header line alone
        header = gzip.decompress(SAMPLE_PATHS["avazu"].read_bytes()).split(b"\n", 1)[0] + b"\n"
        data = gzip.compress(header) if name.endswith(".gz") else header
    path = tmp_path / name
    path.write_bytes(data)
    assert count_readable(path, fmt) == (0, None)
    with FileSource(path, fmt) as source:
        assert source.exhausted and len(source.read()[0]) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=5), st.integers(1, 64),
       st.integers(0, 3), st.data())
def test_gzip_stream_equals_gzip_at_any_input_and_read_size(tmp_path_factory, members, in_bytes, pad, data):
    """Members, zero padding and read sizes that split headers, trailers and magic bytes."""
    whole = (b"\0" * pad).join(gzip.compress(m, mtime=0) for m in members)
    path = tmp_path_factory.mktemp("gz") / "x.gz"
    path.write_bytes(whole)
    old = files.GZIP_IN_BYTES
    files.GZIP_IN_BYTES = in_bytes
    try:
        stream, parts = files.GzipStream(path), []
        while chunk := stream.read(data.draw(st.integers(1, 200))):
            parts.append(chunk)
        assert b"".join(parts) == b"".join(members)
        cut = data.draw(st.integers(1, len(whole) - 1))
        path.write_bytes(whole[:cut])
        expected, complete = zlib_prefix(whole[:cut])
        stream, parts = files.GzipStream(path), []
        try:
            while chunk := stream.read(data.draw(st.integers(1, 200))):
                parts.append(chunk)
        except GzipDamage as exc:
            assert not complete and exc.kind == "truncated" and exc.at == cut
        else:
            assert complete                             # cut in the padding after a member
        assert b"".join(parts) == expected
    finally:
        files.GZIP_IN_BYTES = old


def zlib_prefix(cut: bytes) -> tuple[bytes, bool]:
    """What zlib inflates of the members in `cut`, and whether they all end in it."""
    out, rest, complete = [], cut, True
    while rest := rest.lstrip(b"\0"):
        member = zlib.decompressobj(wbits=31)
        out.append(member.decompress(rest))
        rest, complete = (member.unused_data, True) if member.eof else (b"", False)
    return b"".join(out), complete


def test_bytes_zlib_held_back_at_a_reads_limit_come_before_the_truncation(tmp_path):
    """A read that stops at its size can leave inflated output inside zlib with all the
    input taken in; a file cut in the trailer right after must still give that byte
    before GzipDamage (found by the property test above: 5 of 6 bytes came back)."""
    member = b"\x00\x00\x00\x00\x01\x00"
    whole = gzip.compress(member, mtime=0)
    path = tmp_path / "x.gz"
    path.write_bytes(whole[:17])
    old = files.GZIP_IN_BYTES
    files.GZIP_IN_BYTES = 3
    try:
        stream, parts = files.GzipStream(path), []
        with pytest.raises(GzipDamage) as damage:
            for size in (5, 1, 1):
                parts.append(stream.read(size))
        assert b"".join(parts) == member
        assert damage.value.kind == "truncated" and damage.value.at == 17
    finally:
        files.GZIP_IN_BYTES = old
