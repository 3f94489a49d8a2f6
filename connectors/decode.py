"""Vectorized decoding of text lines (Criteo TSV, Avazu CSV) into a `Batch`.

`decode_lines` takes a block of whole lines and returns the decoded rows plus
the lines it rejected.  Nothing is dropped silently: every line is either a
row of the Batch or a `Rejected` with one of the fixed reasons in `REASONS`.

The hot path has no per-record Python loop, and is built to make few passes
over memory, since numpy's cost here is one pass per operation:

- the buffer is cut into blocks of whole lines (`BLOCK_BYTES`, about 2048
  Criteo lines) that are decoded one after the other, so that every
  temporary of a block stays in the CPU's L2 cache (worth ~1.3x over
  decoding a whole fetch at once);
- per block, one `np.flatnonzero` finds the separators (delimiters and LFs).
  When every line of the block has exactly ``fmt.n_fields`` fields (checked
  exactly: the number of separators, and every n_fields-th one an LF) they
  reshape to a [lines, fields] matrix of field ends without any gather; a
  block with a malformed line takes the general path (`_split_general`);
- integers are parsed with SWAR arithmetic on one 8-byte word per field, the
  sign read from that same word; Criteo's integer features take their keys
  from a per-field table for the values most counts have (`_IntKeyTable`)
  instead of a logarithm and a hash per value;
- tokens are hashed by `stream_ctr.connectors.hashing.hash_spans` straight into the key
  matrix.

Python loops run over blocks, over rejected lines and over the rare integers
longer than 8 characters, never over records.  Tests check it against an
independent per-line Python reference (tests/connectors/decode_reference.py).

When numba imports (and STREAM_CTR_NO_JIT=1 is not set), `decode_buffer`
hands the lines to the compiled decoder of `stream_ctr.connectors.decode_jit` instead:
one pass over the bytes, without the GIL, ~2x faster, and bit-identical to
this numpy path (tests/connectors/test_decode_jit.py), which stays as the
fallback.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from stream_ctr.connectors.batch import Batch, Rejected
from stream_ctr.connectors.formats import RecordFormat
from stream_ctr.connectors.hashing import hash_spans, word_view
from stream_ctr.connectors.decode_tables import (  # noqa: F401 (REASONS, criteo_buckets: public here too)
    REASONS, OK, FIELD_COUNT, BAD_LABEL, BAD_INTEGER, BAD_TIME, _Columns, criteo_buckets, signed_log1p, _signed_log1p_into, _IntKeyTable, _CRITEO_INT_KEYS, _CRITEO_CAT_SALT, _DAYS_IN_MONTH, _AVAZU_CAT_SALT, _HOUR_OF_DAY_KEYS, _DAY_OF_WEEK_KEYS)

_LF, _CR, _MINUS, _ZERO = 10, 13, 45, 48
_MAX_DIGITS = 18                     # |value| < 10**18 always fits int64
_SLACK_BYTES = 8                     # zero bytes after the data: a word read at any field start stays inside
_Z30 = np.uint64(0x3030303030303030)
_P76 = np.uint64(0x7676767676767676)
_H80 = np.uint64(0x8080808080808080)
_MS_PER_HOUR = 3_600_000
# Bytes per block (cut at the next LF): about 2048 Criteo lines, whose [lines,
# fields] int64 temporaries (~650 KB) stay in the L2 cache; much smaller blocks
# pay numpy's per-call overhead (about 70 calls a block) too often.  Measured
# best at 1024-4096 lines.
BLOCK_BYTES = 512 << 10


def line_buffer(data: bytes | bytearray | memoryview) -> tuple[np.ndarray, int]:
    """`data` as the buffer `decode_buffer` wants: (uint8 array, n_bytes).

    A final line without LF gets one (so every line ends in an LF), then
    `_SLACK_BYTES` zero bytes follow.  One copy of `data`.
    """
    raw = np.frombuffer(data, dtype=np.uint8)
    n_bytes = len(raw) + (1 if len(raw) and raw[-1] != _LF else 0)
    buf = np.zeros(n_bytes + _SLACK_BYTES, dtype=np.uint8)
    buf[:len(raw)] = raw
    if n_bytes > len(raw):
        buf[len(raw)] = _LF
    return buf, n_bytes


class DecodedLines(NamedTuple):
    """What `decode_buffer` returns: `decode_lines`'s pair plus where each line is."""
    batch: Batch
    rejected: list[Rejected]
    line_start: np.ndarray      # int64 [n_lines]: first byte of line i in the buffer
    line_lf: np.ndarray         # int64 [n_lines]: its LF (a line is empty iff the two are equal)


def decode_lines(data: bytes, fmt: RecordFormat, partition: str,
                 first_offset: int) -> tuple[Batch, list[Rejected]]:
    """Decode a block of whole text lines of format `fmt`.

    `data` holds complete LF-terminated lines (the last one may lack its LF;
    a CR before the LF is ignored) and no header.  Line i of `data` (0-based)
    has offset ``first_offset + i`` in `partition`: for a file that is its
    0-based data-line number.  Rejected lines consume their offset too, so the
    offsets of the returned rows and rejects together are exactly
    ``first_offset .. first_offset + n_lines - 1``.

    Returns the Batch of decoded rows (in line order, ``partitions ==
    (partition,)``, partition index 0) and the rejected lines in line order,
    each with a reason from `REASONS` and its raw bytes without line ending.
    """
    buf, n_bytes = line_buffer(data)
    decoded = decode_buffer(buf, n_bytes, fmt, partition, first_offset)
    return decoded.batch, decoded.rejected


def decode_buffer(buf: np.ndarray, n_bytes: int, fmt: RecordFormat, partition: str,
                  first_offset: int, skip_empty_lines: bool = False) -> DecodedLines:
    """`decode_lines` on lines already in a uint8 buffer, without copying them.

    ``buf[:n_bytes]`` are whole lines, each ending in an LF, and at least
    `_SLACK_BYTES` bytes of `buf` follow them (`line_buffer` makes one; the
    Kafka decoder joins messages straight into one).  `buf` is only read.
    With `skip_empty_lines` an empty line is neither a row nor a reject (it
    still has its offset): the Kafka decoder's rule, for which a blank line is
    no record.
    """
    if len(buf) < n_bytes + _SLACK_BYTES or (n_bytes and buf[n_bytes - 1] != _LF):
        raise ValueError("decode_buffer needs LF-terminated lines and 8 bytes of slack")
    if _JIT is not None and fmt.name in _JIT.FORMATS:       # compiled, GIL-free; same output
        cols, line_start, line_lf = _JIT.decode(buf, n_bytes, fmt)
        n_lines = len(line_start)
    else:
        n_lines = int(np.count_nonzero(buf[:n_bytes] == _LF))    # to allocate the columns once
        cols = _Columns.empty(n_lines, fmt)
        line_start, line_lf = np.empty(n_lines, np.int64), np.empty(n_lines, np.int64)
        row = first_byte = 0
        while first_byte < n_bytes:
            end = _block_end(buf, first_byte, n_bytes)
            row = _decode_block(buf, first_byte, end, fmt, cols, row, line_start, line_lf)
            first_byte = end
    reason = cols.reason
    ok = reason == OK
    rows = np.arange(n_lines)
    rejected: list[Rejected] = []
    if not ok.all():
        rows = np.flatnonzero(ok)
        cols = _Columns(*(column[ok] for column in cols))
        rejected = _rejected(buf, line_start, line_lf, reason, partition, first_offset,
                             skip_empty_lines)
    batch = Batch(labels=cols.labels, dense=cols.dense, keys=cols.keys,
                  event_time_ms=cols.event_time_ms,
                  partition=np.zeros(len(rows), dtype=np.int32),
                  offset=rows + first_offset, partitions=(partition,))
    return DecodedLines(batch, rejected, line_start, line_lf)


def _block_end(buf: np.ndarray, first_byte: int, n_bytes: int) -> int:
    """The end (just after an LF) of the block of about BLOCK_BYTES that starts at `first_byte`."""
    at = first_byte + BLOCK_BYTES
    window = 4096
    while at < n_bytes:
        lf = np.flatnonzero(buf[at:min(at + window, n_bytes)] == _LF)
        if len(lf):
            return at + int(lf[0]) + 1
        at, window = at + window, window * 2
    return n_bytes


def _rejected(buf: np.ndarray, line_start: np.ndarray, line_lf: np.ndarray, reason: np.ndarray,
              partition: str, first_offset: int, skip_empty_lines: bool) -> list[Rejected]:
    """The lines whose reason is not OK, with their bytes (no LF, no CR before it)."""
    bad = reason != OK
    if skip_empty_lines:
        bad &= line_lf != line_start
    bad = np.flatnonzero(bad)
    start, end = line_start[bad], line_lf[bad]
    end -= (end > start) & (buf[end - 1] == _CR)
    return [Rejected(partition, first_offset + i, REASONS[r], buf[s:e].tobytes())
            for i, r, s, e in zip(bad.tolist(), reason[bad].tolist(), start.tolist(), end.tolist())]


def _decode_block(buf: np.ndarray, first_byte: int, end: int, fmt: RecordFormat, cols: _Columns,
                  row: int, line_start: np.ndarray, line_lf: np.ndarray) -> int:
    """Decode the lines of ``buf[first_byte:end]`` into `cols` from `row` on, and note
    where they are in `line_start` / `line_lf`; returns the row after the last.

    Positions inside the block are relative to its first byte (`block` is a
    view of `buf` from there on), so no position array is shifted.
    """
    block = buf[first_byte:]
    body = block[:end - first_byte]
    is_lf = body == _LF
    is_sep = body == fmt.delimiter_byte
    is_sep |= is_lf
    sep = np.flatnonzero(is_sep)
    n_lines, n_fields = int(np.count_nonzero(is_lf)), fmt.n_fields
    out = cols.rows(row, row + n_lines)
    decode = _DECODERS[fmt.name]
    # Every line has n_fields fields exactly when there are n_lines * n_fields
    # separators and every n_fields-th one is an LF (then those are all the LFs).
    lfs = sep[n_fields - 1::n_fields]
    if len(sep) == n_lines * n_fields and (body[lfs] == _LF).all():
        lfs = lfs.copy()                            # field_ends[:, -1] loses its CR below
        starts = _line_starts(lfs)
        field_ends = sep.reshape(n_lines, n_fields)
        _strip_cr(block, field_ends[:, -1])
        decode(block, starts, field_ends, out)
    else:
        lfs = np.flatnonzero(is_lf)
        starts = _line_starts(lfs)
        counted, field_ends = _split_general(block, sep, n_fields)
        _strip_cr(block, field_ends[:, -1])
        good = _Columns.empty(len(field_ends), fmt)
        decode(block, starts[counted], field_ends, good)
        out.reason[:] = FIELD_COUNT
        for column, values in zip(out, good):
            column[counted] = values
    line_start[row:row + n_lines] = starts + first_byte
    line_lf[row:row + n_lines] = lfs + first_byte
    return row + n_lines


def _line_starts(lfs: np.ndarray) -> np.ndarray:
    starts = np.empty_like(lfs)
    starts[:1] = 0
    starts[1:] = lfs[:-1] + 1
    return starts


def _split_general(block: np.ndarray, sep: np.ndarray, n_fields: int) -> tuple[np.ndarray, np.ndarray]:
    """(lines with exactly n_fields fields, their [m, n_fields] field ends) of a block
    with some malformed line; `sep` are the positions of all its separators."""
    line_last = np.flatnonzero(block[sep] == _LF)          # index in `sep` of each line's LF
    fields = np.diff(line_last, prepend=-1)
    counted = fields == n_fields
    field_ends = sep[line_last[counted][:, None] + np.arange(1 - n_fields, 1)]
    return counted, field_ends


def _strip_cr(block: np.ndarray, line_end: np.ndarray) -> None:
    """Move line ends (at their LF) before a CR that precedes the LF, in place.

    Only for lines with at least two fields: the byte before the LF is then
    inside the line (a CR or the last field's last byte, or a separator)."""
    line_end -= block[line_end - 1] == _CR


def parse_labels(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Labels "0"/"1" -> (float32 labels, ok mask)."""
    digit = buf[starts].astype(np.int16) - _ZERO
    ok = ((ends - starts) == 1) & ((digit == 0) | (digit == 1))
    return np.where(ok, digit, 0).astype(np.float32), ok


def parse_ints(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parse decimal integers (optional leading '-', up to 18 digits) in byte spans.

    Returns (values int64, ok, missing): `missing` where the span is empty
    (its value is 0); `ok` is False only for a non-empty span that is not an
    integer.  `buf` needs 8 bytes of slack after the last span start.
    """
    length = ends - starts
    values, ok = _parse_words(word_view(buf)[starts], length)
    long_idx = np.flatnonzero(length > 8) if length.size and length.max() > 8 else ()
    if len(long_idx):
        _parse_long(buf, starts.reshape(-1), length.reshape(-1), long_idx,
                    values.reshape(-1), ok.reshape(-1))
    missing = length == 0
    ok |= missing
    return values, ok, missing


def _parse_words(x: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Value and validity of the integer spelled by the first `length` (0..8) bytes of
    each little-endian word of `x` (SWAR); consumes `x`.

    A leading '-' is read from the word's first byte and shifted out.  The
    digits are turned into 0..9 (xor '0'), moved to the high bytes (the zeros
    shifted in are leading zero digits; a shift by 64 gives 0 in numpy), checked
    to be 0..9 all at once, and combined pairwise.  Longer spans give garbage
    here and are redone by `_parse_long`; an empty span gives 0.
    """
    negative = (x & np.uint64(0xFF)) == _MINUS
    x >>= negative.astype(np.uint64) << np.uint64(3)   # (arithmetic: `where=` ufuncs are slow)
    n_digits = length - negative
    x ^= _Z30
    shift = 8 - n_digits
    shift <<= 3
    x <<= shift.view(np.uint64)
    # Every byte <= 9: adding 0x76 leaves its top bit clear and it had none.  A
    # carry out of a byte happens only from a byte that fails anyway.
    bad = x + _P76
    bad |= x
    bad &= _H80
    ok = bad == 0
    ok &= ~(negative & (n_digits == 0))              # a lone '-'
    x *= np.uint64(10 * 256 + 1)                     # pairs of digits...
    x >>= np.uint64(8)
    x &= np.uint64(0x00FF00FF00FF00FF)
    x *= np.uint64(100 * 65536 + 1)                  # ...groups of four...
    x >>= np.uint64(16)
    x &= np.uint64(0x0000FFFF0000FFFF)
    x *= np.uint64(10000 * (1 << 32) + 1)            # ...all eight
    x >>= np.uint64(32)
    values = x.view(np.int64)
    flip = -negative.astype(np.int64)                # -1 where negative: v -> (v ^ -1) + 1 = -v
    values ^= flip
    values -= flip
    return values, ok


def _parse_long(buf: np.ndarray, starts: np.ndarray, length: np.ndarray, idx: np.ndarray,
                values: np.ndarray, ok: np.ndarray) -> None:
    """Redo the spans `idx` (longer than 8 bytes) with a loop over character positions, in place."""
    negative = buf[starts[idx]] == _MINUS
    dstart = starts[idx] + negative
    nd = length[idx] - negative
    val = np.zeros(len(idx), dtype=np.int64)
    good = nd <= _MAX_DIGITS
    for pos in range(int(min(nd.max(), _MAX_DIGITS))):
        active = nd > pos
        digit = buf[np.minimum(dstart + pos, len(buf) - 1)].astype(np.int64) - _ZERO
        good &= ~active | ((digit >= 0) & (digit <= 9))
        val = np.where(active, val * 10 + digit, val)
    values[idx] = np.where(good, np.where(negative, -val, val), 0)
    ok[idx] = good


def _decode_criteo(buf: np.ndarray, line_start: np.ndarray, fe: np.ndarray, out: _Columns) -> None:
    out.labels[:], label_ok = parse_labels(buf, line_start, fe[:, 0])
    values, int_ok, missing = parse_ints(buf, fe[:, 0:13] + 1, fe[:, 1:14])
    out.reason[:] = np.where(~label_ok, BAD_LABEL, np.where(int_ok.all(axis=1), OK, BAD_INTEGER))
    _signed_log1p_into(values, out.dense)
    out.keys[:, :13] = _CRITEO_INT_KEYS.keys(values, missing)
    starts = fe[:, 13:39] + 1
    hash_spans(word_view(buf), starts, fe[:, 14:] - starts, _CRITEO_CAT_SALT, out=out.keys[:, 13:])
    out.event_time_ms[:] = -1


def days_from_civil(year: np.ndarray, month: np.ndarray, day: np.ndarray) -> np.ndarray:
    """Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm)."""
    y = year - (month <= 2)
    era = y // 400
    yoe = y - era * 400
    doy = (153 * np.where(month > 2, month - 3, month + 9) + 2) // 5 + day - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


def parse_avazu_hour(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """YYMMDDHH (UTC, 20YY) -> (hours since the epoch int64, ok mask)."""
    value, ok, _ = parse_ints(buf, starts, ends)
    ok &= ((ends - starts) == 8) & (buf[starts] != _MINUS)
    yy, mm, dd, hh = value // 1_000_000, value // 10_000 % 100, value // 100 % 100, value % 100
    year = 2000 + yy
    leap = (year % 4 == 0) & ((year % 100 != 0) | (year % 400 == 0))
    month_days = _DAYS_IN_MONTH[np.clip(mm, 0, 12)] + (leap & (mm == 2))
    ok &= (mm >= 1) & (mm <= 12) & (dd >= 1) & (dd <= month_days) & (hh <= 23)
    hours = days_from_civil(year, np.clip(mm, 1, 12), dd) * 24 + hh
    return np.where(ok, hours, 0), ok


def _decode_avazu(buf: np.ndarray, line_start: np.ndarray, fe: np.ndarray, out: _Columns) -> None:
    out.labels[:], label_ok = parse_labels(buf, fe[:, 0] + 1, fe[:, 1])
    hours, time_ok = parse_avazu_hour(buf, fe[:, 1] + 1, fe[:, 2])
    out.reason[:] = np.where(~label_ok, BAD_LABEL, np.where(time_ok, OK, BAD_TIME))
    starts = fe[:, 2:23] + 1
    hash_spans(word_view(buf), starts, fe[:, 3:] - starts, _AVAZU_CAT_SALT, out=out.keys[:, :21])
    out.keys[:, 21] = _HOUR_OF_DAY_KEYS[hours % 24]                 # hour of day, UTC
    out.keys[:, 22] = _DAY_OF_WEEK_KEYS[(hours // 24 + 3) % 7]      # day of week, Monday = 0
    out.event_time_ms[:] = hours * _MS_PER_HOUR


_DECODERS = {"criteo": _decode_criteo, "avazu": _decode_avazu}


def _load_jit():
    """stream_ctr.connectors.decode_jit (numba line decoder) if numba imports and
    STREAM_CTR_NO_JIT=1 is not set; else None and `decode_buffer` uses numpy."""
    if os.environ.get("STREAM_CTR_NO_JIT", "") == "1":
        return None
    try:
        from stream_ctr.connectors import decode_jit
    except ImportError:
        return None
    return decode_jit


_JIT = _load_jit()
