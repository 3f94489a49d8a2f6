"""Vectorized decoding of text lines (Criteo TSV, Avazu CSV) into a `Batch`.

`decode_lines` takes a block of whole lines and returns the decoded rows plus
the lines it rejected.  Nothing is dropped silently: every line is either a
row of the Batch or a `Rejected` with one of the fixed reasons in `REASONS`.

The hot path has no per-record Python loop: lines and fields are located with
`np.flatnonzero` on the byte buffer, integers are parsed with SWAR arithmetic
on 8-byte words, and tokens are hashed by `connectors.hashing`.  Python loops
run only over rejected lines and over the rare integers longer than 8 digits.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from connectors.batch import Batch, Rejected
from connectors.formats import RecordFormat
from connectors.hashing import hash_ints, hash_tokens, padded_buffer, word_view

# Reject reasons; the index is the code used inside this module (0 = decoded).
REASONS = ("ok", "field_count", "bad_label", "bad_integer", "bad_time")
OK, FIELD_COUNT, BAD_LABEL, BAD_INTEGER, BAD_TIME = range(len(REASONS))

_LF, _CR, _MINUS, _ZERO = 10, 13, 45, 48
_MAX_DIGITS = 18                     # |value| < 10**18 always fits int64
_Z30 = np.uint64(0x3030303030303030)
_F0 = np.uint64(0xF0F0F0F0F0F0F0F0)
_P06 = np.uint64(0x0606060606060606)
_MS_PER_HOUR = 3_600_000
BLOCK_ROWS = 8192    # rows decoded per inner step: keeps temporaries in the CPU cache


class _Columns(NamedTuple):
    """Decoded columns of the lines with the right field count (or a block of them)."""
    labels: np.ndarray          # float32 [m]
    dense: np.ndarray           # float32 [m, D]
    keys: np.ndarray            # int64 [m, F]
    event_time_ms: np.ndarray   # int64 [m]
    reason: np.ndarray          # int8 [m], OK where the row decoded

    @staticmethod
    def empty(m: int, fmt: RecordFormat) -> "_Columns":
        return _Columns(np.empty(m, np.float32), np.empty((m, fmt.n_dense), np.float32),
                        np.empty((m, fmt.n_keys), np.int64), np.empty(m, np.int64),
                        np.empty(m, np.int8))

    def rows(self, lo: int, hi: int) -> "_Columns":
        return _Columns(*(column[lo:hi] for column in self))


class _Spans(NamedTuple):
    line_starts: np.ndarray     # int64 [n_lines]
    line_ends: np.ndarray       # int64 [n_lines], without LF / CR
    counted: np.ndarray         # bool [n_lines]: the line has exactly fmt.n_fields fields
    field_ends: np.ndarray      # int64 [m, n_fields] of the counted lines; field j > 0
                                # starts at field_ends[:, j - 1] + 1


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
    buf = padded_buffer(data)
    spans = _split(buf, len(data), fmt)
    cols = _decode_counted(buf, spans, fmt)
    reason = np.full(len(spans.line_starts), FIELD_COUNT, dtype=np.int8)
    counted_idx = np.flatnonzero(spans.counted)
    reason[counted_idx] = cols.reason
    keep = cols.reason == OK
    rows = counted_idx
    if not keep.all():
        cols, rows = _Columns(*(column[keep] for column in cols)), counted_idx[keep]
    batch = Batch(labels=cols.labels, dense=cols.dense, keys=cols.keys,
                  event_time_ms=cols.event_time_ms,
                  partition=np.zeros(len(rows), dtype=np.int32),
                  offset=rows + first_offset, partitions=(partition,))
    raw = memoryview(data)
    rejected = [Rejected(partition, first_offset + int(i), REASONS[reason[i]],
                         bytes(raw[spans.line_starts[i]:spans.line_ends[i]]))
                for i in np.flatnonzero(reason != OK)]
    return batch, rejected


def _decode_counted(buf: np.ndarray, spans: _Spans, fmt: RecordFormat) -> _Columns:
    """Run the format's decoder over the counted lines, BLOCK_ROWS at a time."""
    m = len(spans.field_ends)
    cols = _Columns.empty(m, fmt)
    line_starts = spans.line_starts[spans.counted]
    decode_block = _DECODERS[fmt.name]
    for lo in range(0, m, BLOCK_ROWS):
        hi = min(lo + BLOCK_ROWS, m)
        decode_block(buf, line_starts[lo:hi], spans.field_ends[lo:hi], cols.rows(lo, hi))
    return cols


def _split(buf: np.ndarray, n_bytes: int, fmt: RecordFormat) -> _Spans:
    """Locate lines and, for lines with exactly fmt.n_fields fields, their field ends.

    One pass finds every separator (delimiter or LF); line i ends at its LF and
    its fields end at its separators, so well-formed data reshapes to
    [n_lines, n_fields] without any gather.
    """
    body = buf[:n_bytes]
    is_sep = body == fmt.delimiter_byte
    is_sep |= body == _LF
    sep = np.flatnonzero(is_sep)
    is_end = buf[sep] == _LF
    if n_bytes and body[-1] != _LF:                  # last line without LF
        sep = np.append(sep, n_bytes)
        is_end = np.append(is_end, True)
    line_last = np.flatnonzero(is_end)               # index in `sep` of each line's LF
    line_end = sep[line_last]
    line_start = np.empty_like(line_end)
    n_fields = np.empty_like(line_last)
    if len(line_last):
        line_start[0], n_fields[0] = 0, line_last[0] + 1
        line_start[1:] = line_end[:-1] + 1
        n_fields[1:] = np.diff(line_last)
    has_cr = line_end > line_start
    has_cr[has_cr] = buf[line_end[has_cr] - 1] == _CR
    line_end -= has_cr
    counted = n_fields == fmt.n_fields
    if counted.all():
        field_ends = sep.reshape(len(line_last), fmt.n_fields)
    else:
        field_ends = sep[line_last[counted][:, None] + np.arange(1 - fmt.n_fields, 1)]
    field_ends[:, -1] = line_end[counted]
    return _Spans(line_start, line_end, counted, field_ends)


def parse_labels(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Labels "0"/"1" -> (float32 labels, ok mask)."""
    digit = buf[starts].astype(np.int16) - _ZERO
    ok = ((ends - starts) == 1) & ((digit == 0) | (digit == 1))
    return np.where(ok, digit, 0).astype(np.float32), ok


def parse_ints(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parse decimal integers (optional leading '-', up to 18 digits) in byte spans.

    Returns (values int64, ok, missing): `missing` where the span is empty;
    `ok` is False only for a non-empty span that is not an integer.  `buf`
    needs 8 bytes of slack after the last span (see `padded_buffer`).
    """
    length = ends - starts
    negative = buf[starts] == _MINUS
    n_digits = length - negative
    words = word_view(buf)[starts + negative]
    values, ok = _swar_digits(words, n_digits)
    if n_digits.size and n_digits.max() > 8:
        long_idx = np.flatnonzero((n_digits > 8).reshape(-1))
        _parse_long(buf, (starts + negative).reshape(-1), n_digits.reshape(-1), long_idx,
                    values.reshape(-1), ok.reshape(-1))
    np.negative(values, out=values, where=negative)
    missing = length == 0
    ok |= missing
    return values, ok, missing


# Right-aligning shift and '0' padding for 0..8 digits; 0 digits pads with 0xFF (invalid).
_SHIFT = np.array([0] + [8 * (8 - k) for k in range(1, 9)], dtype=np.uint64)
_ZPAD = np.array([(1 << 64) - 1] + [0x3030303030303030 >> (8 * k) for k in range(1, 9)],
                 dtype=np.uint64)


def _swar_digits(x: np.ndarray, n_digits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Value and validity of `n_digits` (1..8) ASCII digits in the low bytes of words `x`.

    The digits are shifted to the high bytes (the first digit is the lowest
    byte: little-endian), the low bytes padded with '0', checked to be all in
    '0'..'9', and combined pairwise (SWAR).  Consumes `x`.
    """
    x <<= np.take(_SHIFT, n_digits, mode="clip")
    x |= np.take(_ZPAD, n_digits, mode="clip")
    ok = (x & _F0) == _Z30
    ok &= ((x + _P06) & _F0) == _Z30
    x -= _Z30
    for shift, mask in ((8, 0x00FF00FF00FF00FF), (16, 0x0000FFFF0000FFFF), (32, 0xFFFFFFFF)):
        high = x >> np.uint64(shift)
        x *= np.uint64(10 ** (shift // 8))
        x += high
        x &= np.uint64(mask)
    return x.view(np.int64), ok


def _parse_long(buf: np.ndarray, dstart: np.ndarray, n_digits: np.ndarray, idx: np.ndarray,
                values: np.ndarray, ok: np.ndarray) -> None:
    """Redo spans of 9..18 digits with a loop over character positions, in place."""
    nd = n_digits[idx]
    val = np.zeros(len(idx), dtype=np.int64)
    good = nd <= _MAX_DIGITS
    for pos in range(int(min(nd.max(), _MAX_DIGITS))):
        active = nd > pos
        digit = buf[np.minimum(dstart[idx] + pos, len(buf) - 1)].astype(np.int64) - _ZERO
        good &= ~active | ((digit >= 0) & (digit <= 9))
        val = np.where(active, val * 10 + digit, val)
    values[idx] = np.where(good, val, 0)
    ok[idx] = good


def criteo_buckets(values: np.ndarray) -> np.ndarray:
    """Criteo-winners integer buckets: v if v <= 2 else floor(ln(v)**2)."""
    logs = np.log(np.maximum(values, 2).astype(np.float64))
    return np.where(values <= 2, values, np.floor(logs * logs).astype(np.int64))


def signed_log1p(values: np.ndarray, missing: np.ndarray) -> np.ndarray:
    """sign(x) * log1p(|x|) as float32, 0 where missing."""
    mag = np.log1p(np.abs(values).astype(np.float32))
    return np.where(missing, np.float32(0), np.copysign(mag, values.astype(np.float32)))


def _decode_criteo(buf: np.ndarray, line_start: np.ndarray, fe: np.ndarray, out: _Columns) -> None:
    out.labels[:], label_ok = parse_labels(buf, line_start, fe[:, 0])
    values, int_ok, missing = parse_ints(buf, fe[:, 0:13] + 1, fe[:, 1:14])
    out.reason[:] = np.where(~label_ok, BAD_LABEL, np.where(int_ok.all(axis=1), OK, BAD_INTEGER))
    out.dense[:] = signed_log1p(values, missing)
    out.keys[:, :13] = hash_ints(criteo_buckets(values), _CRITEO_INT_FIELDS, missing)
    out.keys[:, 13:] = hash_tokens(buf, fe[:, 13:39] + 1, fe[:, 14:], _CRITEO_CAT_FIELDS)
    out.event_time_ms[:] = -1


_CRITEO_INT_FIELDS = np.arange(13)
_CRITEO_CAT_FIELDS = np.arange(13, 39)
_DAYS_IN_MONTH = np.array([0, 31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31], dtype=np.int64)


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
    out.keys[:, :21] = hash_tokens(buf, fe[:, 2:23] + 1, fe[:, 3:], _AVAZU_CAT_FIELDS)
    out.keys[:, 21] = hash_ints(hours % 24, 21)                    # hour of day, UTC
    out.keys[:, 22] = hash_ints((hours // 24 + 3) % 7, 22)         # day of week, Monday = 0
    out.event_time_ms[:] = hours * _MS_PER_HOUR


_AVAZU_CAT_FIELDS = np.arange(21)
_DECODERS = {"criteo": _decode_criteo, "avazu": _decode_avazu}
