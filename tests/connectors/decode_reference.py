"""The decoder as it was before the fast path (frozen copy), the reference the tests compare to.

`decode_lines` and `decode_messages` here are the pre-optimisation
`connectors.decode.decode_lines` and `connectors.kafka_decode.decode_messages`
with the `connectors.hashing` functions they used, copied verbatim (only the
imports differ), so tests can prove that the fast decoder produces
bit-identical Batches and the same rejects.  Not used by the product.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from connectors.batch import Batch, Rejected
from connectors.formats import RecordFormat
from connectors.kafka_decode import json_to_lines

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
SEED = np.uint64(0x5C7A_11E5_D00D_F00D)
INT_TAG = np.uint64(1 << 62)          # "length" tag of integer tokens; no byte span is this long
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_SIGN_MASK = np.uint64(0x7FFF_FFFF_FFFF_FFFF)
_INT_TAG_GOLDEN = np.uint64((int(INT_TAG) * int(GOLDEN)) % (1 << 64))
# _LEN_MASK[k] keeps the low k bytes of a little-endian word (k = 0..8).
_LEN_MASK = np.array([(1 << (8 * k)) - 1 for k in range(9)], dtype=np.uint64)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer, in place on a uint64 array; returns it."""
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def field_salt(field_ids: np.ndarray) -> np.ndarray:
    """Per-field salt (uint64), same shape as `field_ids`."""
    shape = np.shape(field_ids)
    f = np.atleast_1d(np.asarray(field_ids, dtype=np.int64)).astype(np.uint64)
    return mix64(f * GOLDEN ^ SEED).reshape(shape)


def padded_buffer(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """A uint8 copy of `data` followed by 8 zero bytes, ready for `word_view`."""
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    out = np.zeros(len(raw) + 8, dtype=np.uint8)
    out[: len(raw)] = raw
    return out


def word_view(buf: np.ndarray) -> np.ndarray:
    """Overlapping little-endian uint64 windows: ``word_view(buf)[i]`` = bytes i..i+7.

    Valid for i <= len(buf) - 8; use `padded_buffer` so every span start has a window.
    """
    buf = np.ascontiguousarray(buf, dtype=np.uint8)
    n = max(len(buf) - 7, 0)
    return np.ndarray(shape=(n,), dtype="<u8", buffer=buf, strides=(1,))


def hash_tokens(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                field_ids: np.ndarray) -> np.ndarray:
    """63-bit keys of the byte spans ``buf[starts:ends]`` salted by field id.

    `starts` and `ends` are int64 arrays of any equal shape; `field_ids` must
    broadcast against them (e.g. shape [F] for spans of shape [B, F]).  Returns
    int64 keys of the broadcast shape, all >= 0.  `buf` is a uint8 array; it is
    copied once if it lacks 8 bytes of slack after the last span start.
    """
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    length = ends - starts
    if starts.size and starts.max() + 8 > len(buf):
        buf = padded_buffer(buf)
    words = word_view(buf)
    state = length.view(np.uint64) * GOLDEN
    state += field_salt(field_ids)
    state ^= words[starts] & np.take(_LEN_MASK, length, mode="clip")
    mix64(state)
    if length.size and length.max() > 8:
        _hash_long_tail(state, words, starts, length)
    state &= _SIGN_MASK
    return state.view(np.int64)


def _hash_long_tail(state: np.ndarray, words: np.ndarray, starts: np.ndarray,
                    length: np.ndarray) -> None:
    """Fold chunks 1.. of tokens longer than 8 bytes into `state`, in place."""
    flat_state = state.reshape(-1)
    flat_starts = np.broadcast_to(starts, state.shape).reshape(-1)
    flat_len = np.broadcast_to(length, state.shape).reshape(-1)
    idx = np.flatnonzero(flat_len > 8)
    chunk = 1
    while idx.size:
        remaining = flat_len[idx] - 8 * chunk
        w = words[flat_starts[idx] + 8 * chunk] & _LEN_MASK[np.minimum(remaining, 8)]
        flat_state[idx] = mix64(flat_state[idx] ^ w)
        chunk += 1
        idx = idx[flat_len[idx] > 8 * chunk]


def hash_ints(values: np.ndarray, field_ids: np.ndarray,
              missing: np.ndarray | None = None) -> np.ndarray:
    """63-bit keys of integer tokens (e.g. buckets) salted by field id.

    An integer token never equals a byte token (its length tag is INT_TAG).
    Where `missing` is True the key is the field's missing sign, the same as
    an empty span in `hash_tokens`.  `field_ids` and `missing` broadcast
    against `values`, which sets the shape of the result.
    """
    values = np.asarray(values, dtype=np.int64)
    if values.ndim == 0:
        return hash_ints(values[None], field_ids, missing)[0]
    word = values.view(np.uint64)                   # two's complement
    salt = field_salt(field_ids)
    int_salt = salt + _INT_TAG_GOLDEN
    if missing is None:
        state = word ^ int_salt
    else:
        state = np.where(missing, salt, int_salt)
        state ^= np.where(missing, np.uint64(0), word)
    mix64(state)
    state &= _SIGN_MASK
    return state.view(np.int64)


def hash_strings(tokens: list[bytes | str], field_id: int) -> np.ndarray:
    """Keys of a list of tokens in one field; equal to `hash_tokens` on the same bytes.

    For tests and JSON-shaped records (str tokens are encoded as UTF-8).
    """
    raw = [t.encode("utf-8") if isinstance(t, str) else bytes(t) for t in tokens]
    lengths = np.array([len(t) for t in raw], dtype=np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    buf = padded_buffer(b"".join(raw))
    return hash_tokens(buf, starts, ends, np.full(len(raw), field_id, dtype=np.int64))

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


# --- connectors/kafka_decode.py (text and json values; json_to_lines is shared) ---
EMPTY_MESSAGE, BAD_JSON = "empty_message", "bad_json"


@dataclass
class DecodedMessages:
    batch: Batch                    # good rows, in message order then line order
    rejected: list[Rejected]        # offset = Kafka offset of the message the bad record was in
    rows_per_message: np.ndarray    # int64 [n_messages]: good rows each message produced
    line_in_message: np.ndarray     # int64 [B]: 0-based line of each row inside its message


def decode_messages(values: list[bytes], msg_partition: np.ndarray, msg_offset: np.ndarray,
                    msg_time_ms: np.ndarray, partitions: tuple[str, ...], fmt: RecordFormat,
                    value_format: str = "text") -> DecodedMessages:
    """Decode message `values` (message i is at `msg_offset[i]` of partition
    `partitions[msg_partition[i]]`, produced at `msg_time_ms[i]`).

    Rows of formats without an event time (Criteo) get the message timestamp.
    Nothing is dropped silently: every line is a row or a `Rejected`; a
    message with no line at all is rejected as ``empty_message``.
    """
    raw_values, bad_json = values, []
    if value_format == "json":
        values, bad_json = json_to_lines(values, fmt)
    data, line_msg = _join_lines(values)
    batch, line_rejects = decode_lines(data, fmt, "", 0)
    row_line = batch.offset
    if line_msg is None:                  # one line per message: line i is message i
        row_msg, line_msg, first_line = row_line, np.arange(len(values)), None
    else:
        row_msg = line_msg[row_line]
        first_line = np.searchsorted(line_msg, line_msg, side="left")
    batch.offset = msg_offset[row_msg].astype(np.int64)
    batch.partition = msg_partition[row_msg].astype(np.int32)
    batch.partitions = partitions
    if fmt.name == "criteo":          # no event time in the record: use the message's
        batch.event_time_ms = msg_time_ms[row_msg].astype(np.int64)
    rows_per_message = np.bincount(row_msg, minlength=len(values)).astype(np.int64)
    line_in_message = np.zeros_like(row_line) if first_line is None else row_line - first_line[row_line]

    def reject(msg: int, reason: str, raw: bytes) -> Rejected:
        return Rejected(partitions[msg_partition[msg]], int(msg_offset[msg]), reason, raw)

    rejected = [reject(int(line_msg[r.offset]), r.reason, r.raw) for r in line_rejects]
    no_line = [] if first_line is None else np.flatnonzero(np.bincount(line_msg, minlength=len(values)) == 0)
    if len(no_line):
        json_bad = set(bad_json)
        rejected += [reject(m, BAD_JSON, raw_values[m]) if m in json_bad
                     else reject(m, EMPTY_MESSAGE, b"")
                     for m in map(int, no_line)]
    return DecodedMessages(batch, rejected, rows_per_message, line_in_message)


def _join_lines(values: list[bytes]) -> tuple[bytes, np.ndarray | None]:
    """All lines of all messages as one buffer of LF-terminated lines without
    empty ones, and the message index of each line (ascending; None when
    every message is exactly one line)."""
    # One join, LF-terminated: the decoder's fast path (no unterminated last line).
    data = b"\n".join(values + [b""])
    if data.count(b"\n") == len(values) and b"" not in values:
        return data, None                        # one line per message: the common case
    buf = np.frombuffer(data, dtype=np.uint8)
    line_end = np.flatnonzero(buf == _LF)
    line_start = np.empty_like(line_end)
    line_start[:1] = 0
    line_start[1:] = line_end[:-1] + 1
    lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    msg_start = np.zeros(len(values), dtype=np.int64)
    np.cumsum(lengths[:-1] + 1, out=msg_start[1:])
    line_msg = np.searchsorted(msg_start, line_start, side="right") - 1
    empty = line_start == line_end
    if empty.any():
        # Empty lines come from a message's trailing LF, blank lines and empty
        # messages; none is a record.  Dropping the LF that ends each one
        # leaves the other lines intact.
        keep = np.ones(len(buf), dtype=bool)
        keep[line_end[empty]] = False
        data = buf[keep].tobytes()
        line_msg = line_msg[~empty]
    return data, line_msg
