"""Compiled (numba) line decoder: the fast path of `stream_ctr.connectors.decode.decode_buffer`.

The numpy decoder makes ~70 passes over each block of lines; this one makes
one pass over the bytes, line by line, field by field, and writes the same
columns.  Its kernels are ``@njit(nogil=True)``: they run without the GIL, so
KafkaSource's decode threads really run beside kafka-python's fetch thread.

The output is bit-identical to the numpy path, by construction where floating
point is involved:

- splitting, the reject rules (`decode.REASONS`, same precedence: field count,
  then label, then integers / time), integer parsing and the token hash
  (`stream_ctr.connectors.hashing`: splitmix64 over 8-byte little-endian chunks, uint64
  arithmetic) are integer code, re-implemented here;
- everything that takes a logarithm (Criteo's dense features and integer
  bucket keys) comes from tables that the numpy path's own functions fill
  once (`_IntKeyTable`, `_signed_log1p_into` on the same value range).  The
  rare integers outside the tables (~1% in Criteo data) are only noted by the
  kernel, and `decode_jit.decode` computes them afterwards with those same
  numpy functions: numba's `log` need not round like numpy's SIMD one.

Rejected lines need no special path: the kernel gives every line a reason and
its position, exactly what `decode_buffer` already turns into `Rejected`s.

First call compiles the kernels (a few seconds); ``cache=True`` keeps the
machine code in ``__pycache__`` for later processes.
"""
from __future__ import annotations

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import intrinsic

from stream_ctr.connectors import decode_tables as _np_decode
from stream_ctr.connectors.hashing import hash_ints
from stream_ctr.connectors.formats import RecordFormat
from stream_ctr.connectors.hashing import _LEN_MASK, GOLDEN   # _LEN_MASK[k] keeps the low k bytes of a word

FORMATS = ("criteo", "avazu")

# Same codes as stream_ctr.connectors.decode (REASONS index).
_OK, _FIELD_COUNT, _BAD_LABEL, _BAD_INTEGER, _BAD_TIME = range(5)
_LF, _CR, _MINUS, _ZERO = 10, 13, 45, 48
_MAX_DIGITS = 18
_MS_PER_HOUR = 3_600_000

# splitmix64 constants, as uint64 scalars so that numba keeps all hash arithmetic in uint64
# (mixing int64 and uint64 would promote to float64).
_GOLDEN = np.uint64(GOLDEN)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_SIGN_MASK = np.uint64(0x7FFF_FFFF_FFFF_FFFF)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_S8, _S16, _S24, _S32, _S40, _S48, _S56 = (np.uint64(8 * k) for k in range(1, 8))
_U1, _U2, _U3, _U4, _U5, _U6, _U7 = (np.uint64(k) for k in range(1, 8))
_LOW7 = np.uint64(0x7F7F_7F7F_7F7F_7F7F)
_LFS = np.uint64(0x0A0A_0A0A_0A0A_0A0A)    # LF in every byte
_ONE = np.uint64(1)
# SWAR digits: '0' in every byte; +0x76 sets a byte's high bit iff it was >= 10; the
# multipliers fold 8 digits pairwise (10, 100, 10^4) into one integer.
_ZEROS = np.uint64(0x3030_3030_3030_3030)
_PLUS_0X76 = np.uint64(0x7676_7676_7676_7676)
_HIGH_BITS = np.uint64(0x8080_8080_8080_8080)
_BYTE_PAIRS = np.uint64(0x00FF_00FF_00FF_00FF)
_HALF_PAIRS = np.uint64(0x0000_FFFF_0000_FFFF)
_TIMES_10, _TIMES_100, _TIMES_10K = np.uint64(2561), np.uint64(6553601), np.uint64(42949672960001)


# ---------------------------------------------------------------- hashing

@intrinsic
def popcount(typingctx, x):
    """Set bits of an unsigned integer (one POPCNT instruction)."""
    def codegen(context, builder, signature, args):
        ctpop = builder.module.declare_intrinsic("llvm.ctpop", [args[0].type])
        return builder.call(ctpop, args)
    return x(x), codegen


@njit(nogil=True, cache=True)
def mix64(x):
    """splitmix64 finalizer of a uint64 (stream_ctr.connectors.hashing.mix64)."""
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


@njit(nogil=True, cache=True)
def load_word(buf, pos, n):
    """The first `n` (0..8) bytes at buf[pos] as a little-endian uint64, higher bytes zero
    (= ``word_view(buf)[pos] & _LEN_MASK[n]``).

    Always reads 8 bytes (the buffer's slack keeps that inside), written out so
    that LLVM combines them into one 64-bit load, then masks: a loop over `n`
    bytes costs several times more."""
    # Unsigned indices: numba then skips its negative-index fixup, which would
    # otherwise keep LLVM from merging the eight loads.
    p = np.uint64(pos)
    word = (np.uint64(buf[p]) | np.uint64(buf[p + _U1]) << _S8
            | np.uint64(buf[p + _U2]) << _S16 | np.uint64(buf[p + _U3]) << _S24
            | np.uint64(buf[p + _U4]) << _S32 | np.uint64(buf[p + _U5]) << _S40
            | np.uint64(buf[p + _U6]) << _S48 | np.uint64(buf[p + _U7]) << _S56)
    return word & _LEN_MASK[n]


@njit(nogil=True, cache=True, inline="always")
def hash_span(buf, start, length, salt):
    """Key of the token buf[start:start+length] in the field with `salt`
    (stream_ctr.connectors.hashing.hash_spans for one span): one mix per 8-byte chunk,
    and one zero chunk for an empty token."""
    state = mix64((np.uint64(length) * _GOLDEN + salt) ^ load_word(buf, start, min(length, 8)))
    if length > 8:              # rare in click logs; kept off the common path's branches
        pos, remaining = start + 8, length - 8
        while remaining > 0:
            state = mix64(state ^ load_word(buf, pos, min(remaining, 8)))
            pos += 8
            remaining -= 8
    return np.int64(state & _SIGN_MASK)


# ---------------------------------------------------------------- fields

@njit(nogil=True, cache=True)
def byte_matches(word, pattern):
    """High bit of each byte of `word` that equals the byte repeated in `pattern`, others 0.

    Exact (no false positives, unlike the shorter has-zero-byte trick): a
    byte of ``y = word ^ pattern`` is zero iff adding 0x7F to its low 7 bits
    leaves the high bit clear and it had no high bit itself."""
    y = word ^ pattern
    t = (y & _LOW7) + _LOW7
    return ~(t | y | _LOW7)


@njit(nogil=True, cache=True, inline="always")
def split_line(buf, pos, delimiters, field_ends):
    """Scan the line at `pos` up to its LF; returns (its number of fields, LF position).

    The end (delimiter / LF position) of field i goes to field_ends[i] for the
    first ``len(field_ends) - 8`` fields (the last 8 slots are scratch); more
    fields are only counted.  Eight bytes at a time, without a branch per
    field: a word's separator positions are written four at a time
    (eight when it holds more than four, which is rare), whether or not they
    exist, and the count advances by the word's popcount; the loop over a
    word's separators that this replaces mispredicted at nearly every field.
    It may read up to 7 bytes past the LF: the next line, or the buffer's
    slack after the last one.  `delimiters` is the delimiter byte repeated 8
    times."""
    n_fields, capacity = 0, len(field_ends) - 8
    while True:
        word = load_word(buf, pos, 8)
        lfs = byte_matches(word, _LFS)
        found = byte_matches(word, delimiters) | lfs
        if lfs:
            found &= lfs ^ (lfs - _ONE)             # separators up to and including the first LF
        count = np.int64(popcount(found))
        if n_fields < capacity:
            # Written out: numba leaves range() loops rolled (twice as slow here).
            field_ends[n_fields] = pos + np.int64(trailing_zeros(found) >> 3)
            found &= found - _ONE
            field_ends[n_fields + 1] = pos + np.int64(trailing_zeros(found) >> 3)
            found &= found - _ONE
            field_ends[n_fields + 2] = pos + np.int64(trailing_zeros(found) >> 3)
            found &= found - _ONE
            field_ends[n_fields + 3] = pos + np.int64(trailing_zeros(found) >> 3)
            if count > 4:
                found &= found - _ONE
                field_ends[n_fields + 4] = pos + np.int64(trailing_zeros(found) >> 3)
                found &= found - _ONE
                field_ends[n_fields + 5] = pos + np.int64(trailing_zeros(found) >> 3)
                found &= found - _ONE
                field_ends[n_fields + 6] = pos + np.int64(trailing_zeros(found) >> 3)
                found &= found - _ONE
                field_ends[n_fields + 7] = pos + np.int64(trailing_zeros(found) >> 3)
        n_fields += count
        if lfs:
            return n_fields, pos + np.int64(trailing_zeros(lfs) >> 3)
        pos += 8


@njit(nogil=True, cache=True)
def parse_label(buf, start, end):
    """"0" / "1" -> 0 / 1; -1 for anything else (decode.parse_labels)."""
    if end - start != 1:
        return -1
    digit = np.int64(buf[start]) - _ZERO
    return digit if digit == 0 or digit == 1 else -1


@njit(nogil=True, cache=True)
def parse_int(buf, start, end):
    """Decimal integer (optional leading '-', 1..18 digits) -> (value, ok) (decode.parse_ints).

    An empty span is ok with value 0 (a missing value; callers check the length)."""
    if end == start:
        return 0, True
    negative = buf[start] == _MINUS
    first = start + 1 if negative else start
    if end == first or end - first > _MAX_DIGITS:      # a lone '-', or may not fit int64
        return 0, False
    value = 0
    for pos in range(first, end):
        digit = np.int64(buf[pos]) - _ZERO
        if digit < 0 or digit > 9:
            return 0, False
        value = value * 10 + digit
    return (-value if negative else value), True


@njit(nogil=True, cache=True, inline="always")
def parse_short_int(buf, start, end):
    """`parse_int`, eight bytes at a time for spans of up to 8 bytes (sign included).

    The digits are checked all at once (a byte is a digit iff byte ^ '0' < 10),
    moved to the high end of the word (so missing leading digits read as
    zeros) and folded pairwise by three multiplications; longer spans go to
    `parse_int`."""
    length = end - start
    if length == 0:
        return 0, True
    if length > 8:
        return parse_int(buf, start, end)
    word = load_word(buf, start, 8)
    negative = (word & np.uint64(0xFF)) == np.uint64(_MINUS)
    if negative:
        word >>= _S8
        length -= 1
        if length == 0:
            return 0, False
    digits = (word ^ _ZEROS) & _LEN_MASK[length]
    if ((digits + _PLUS_0X76) | digits) & _HIGH_BITS & _LEN_MASK[length]:
        return 0, False
    digits <<= np.uint64(8 * (8 - length))
    digits = (digits * _TIMES_10) >> _S8
    digits = ((digits & _BYTE_PAIRS) * _TIMES_100) >> _S16
    digits = ((digits & _HALF_PAIRS) * _TIMES_10K) >> _S32
    value = np.int64(digits)
    return (-value if negative else value), True


@njit(nogil=True, cache=True)
def count_lines(buf, n_bytes):
    n = 0
    for i in range(n_bytes):
        if buf[i] == _LF:
            n += 1
    return n


# ---------------------------------------------------------------- Criteo

@njit(nogil=True, cache=True)
def decode_criteo_lines(buf, n_bytes, delimiters, labels, dense, keys, event_time_ms, reason,
                        line_start, line_lf, int_keys, int_span, int_low, dense_table, cat_salt,
                        outside_row, outside_field, outside_value):
    """All lines of buf[:n_bytes] -> columns (one row per line, rejected too); returns n_outside.

    A line has 40 fields: label, 13 integers, 26 tokens.  Integers outside the
    tables are appended to the outside_* arrays for `decode` to finish with
    numpy.  One flat loop on purpose: the same steps as an inlined per-row
    function returning (reason, n_outside) ran about twice as slow."""
    fe = np.empty(40 + 8, np.int64)
    int_high = int_low + int_span - 1
    pos = row = n_outside = 0
    while pos < n_bytes:
        n_fields, lf = split_line(buf, pos, delimiters, fe)
        line_start[row], line_lf[row] = pos, lf
        event_time_ms[row] = -1
        why = _OK
        label = parse_label(buf, pos, fe[0])
        if n_fields != 40:
            why = _FIELD_COUNT
        elif label < 0:
            why = _BAD_LABEL
        else:
            if buf[lf - 1] == _CR:                          # the last field ends before a CR
                fe[39] -= 1
            labels[row] = np.float32(label)
            for j in range(13):
                s, e = fe[j] + 1, fe[j + 1]
                value, ok = parse_short_int(buf, s, e)
                if not ok:
                    why = _BAD_INTEGER
                    break
                base = j * int_span
                if e == s:                                     # missing: the field's last table slot
                    keys[row, j] = int_keys[base + int_span - 1]
                    dense[row, j] = np.float32(0.0)
                elif int_low <= value < int_high:
                    keys[row, j] = int_keys[base + value - int_low]
                    dense[row, j] = dense_table[value - int_low]
                else:                                          # rare: needs a log, done by numpy
                    outside_row[n_outside] = row
                    outside_field[n_outside] = j
                    outside_value[n_outside] = value
                    n_outside += 1
            if why == _OK:
                for k in range(26):
                    s = fe[13 + k] + 1
                    keys[row, 13 + k] = hash_span(buf, s, fe[14 + k] - s, cat_salt[k])
        reason[row] = why
        pos = lf + 1
        row += 1
    return n_outside


# ---------------------------------------------------------------- Avazu

@njit(nogil=True, cache=True)
def days_from_civil(year, month, day):
    """Days since 1970-01-01 (decode.days_from_civil, scalar; numba's // floors like numpy's)."""
    y = year - (1 if month <= 2 else 0)
    era = y // 400
    yoe = y - era * 400
    doy = (153 * (month - 3 if month > 2 else month + 9) + 2) // 5 + day - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


@njit(nogil=True, cache=True)
def parse_avazu_hour(buf, start, end, days_in_month):
    """YYMMDDHH (UTC, 20YY) -> hours since the epoch, or -1 if invalid (decode.parse_avazu_hour)."""
    if end - start != 8 or buf[start] == _MINUS:
        return -1
    value, ok = parse_int(buf, start, end)
    if not ok:
        return -1
    yy, mm, dd, hh = value // 1_000_000, value // 10_000 % 100, value // 100 % 100, value % 100
    year = 2000 + yy
    leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    if mm < 1 or mm > 12 or hh > 23:
        return -1
    month_days = days_in_month[mm] + (1 if leap and mm == 2 else 0)
    if dd < 1 or dd > month_days:
        return -1
    return days_from_civil(year, mm, dd) * 24 + hh


@njit(nogil=True, cache=True)
def decode_avazu_row(buf, fe, row, labels, keys, event_time_ms, cat_salt, hour_keys, weekday_keys,
                     days_in_month):
    """Decode one Avazu line of 24 fields (`fe`: field ends) into `row`; returns its reason."""
    label = parse_label(buf, fe[0] + 1, fe[1])
    if label < 0:
        return _BAD_LABEL
    labels[row] = np.float32(label)
    hours = parse_avazu_hour(buf, fe[1] + 1, fe[2], days_in_month)
    if hours < 0:
        return _BAD_TIME
    for k in range(21):
        s = fe[2 + k] + 1
        keys[row, k] = hash_span(buf, s, fe[3 + k] - s, cat_salt[k])
    keys[row, 21] = hour_keys[hours % 24]                     # hour of day, UTC
    keys[row, 22] = weekday_keys[(hours // 24 + 3) % 7]       # day of week, Monday = 0
    event_time_ms[row] = hours * _MS_PER_HOUR
    return _OK


@njit(nogil=True, cache=True)
def decode_avazu_lines(buf, n_bytes, delimiters, labels, keys, event_time_ms, reason,
                       line_start, line_lf, cat_salt, hour_keys, weekday_keys, days_in_month):
    """All lines of buf[:n_bytes] -> columns (one row per line, rejected too)."""
    fe = np.empty(24 + 8, np.int64)
    pos = row = 0
    while pos < n_bytes:
        n_fields, lf = split_line(buf, pos, delimiters, fe)
        line_start[row], line_lf[row] = pos, lf
        if n_fields != 24:
            reason[row] = _FIELD_COUNT
        else:
            if buf[lf - 1] == _CR:                          # the last field ends before a CR
                fe[23] -= 1
            reason[row] = decode_avazu_row(buf, fe, row, labels, keys, event_time_ms, cat_salt,
                                           hour_keys, weekday_keys, days_in_month)
        pos = lf + 1
        row += 1


# ---------------------------------------------------------------- driver

class _Tables:
    """Inputs of the kernels that the numpy path computes (so they are its exact values)."""

    def __init__(self) -> None:
        ints = _np_decode._CRITEO_INT_KEYS
        self.int_keys = np.ascontiguousarray(ints.table)
        self.int_span = np.int64(ints.span)
        self.int_low = np.int64(ints.LOW)
        values = np.arange(ints.LOW, ints.HIGH, dtype=np.int64)
        self.dense_table = np.empty(len(values), np.float32)
        _np_decode._signed_log1p_into(values, self.dense_table)
        self.criteo_salt = np.ascontiguousarray(_np_decode._CRITEO_CAT_SALT)
        self.avazu_salt = np.ascontiguousarray(_np_decode._AVAZU_CAT_SALT)
        self.hour_keys = np.ascontiguousarray(_np_decode._HOUR_OF_DAY_KEYS)
        self.weekday_keys = np.ascontiguousarray(_np_decode._DAY_OF_WEEK_KEYS)
        self.days_in_month = np.ascontiguousarray(_np_decode._DAYS_IN_MONTH)


_TABLES: _Tables | None = None


def decode(buf: np.ndarray, n_bytes: int, fmt: RecordFormat):
    """Decode the LF-terminated lines of buf[:n_bytes] (8 bytes of slack after them).

    Returns (columns, line_start, line_lf) as `decode_buffer`'s block loop
    fills them: a `decode_tables._Columns` with one row per line, rejected lines
    included (their reason set, their other values unspecified).
    """
    global _TABLES
    if _TABLES is None:
        _TABLES = _Tables()
    t = _TABLES
    n_lines = count_lines(buf, n_bytes)
    cols = _np_decode._Columns.empty(n_lines, fmt)
    line_start, line_lf = np.empty(n_lines, np.int64), np.empty(n_lines, np.int64)
    delimiters = np.uint64(fmt.delimiter_byte * 0x0101_0101_0101_0101)   # in every byte
    if fmt.name == "criteo":
        # Worst case every integer is outside the tables; np.empty only reserves the pages.
        outside_row = np.empty(n_lines * 13, np.int64)
        outside_field = np.empty(n_lines * 13, np.int64)
        outside_value = np.empty(n_lines * 13, np.int64)
        n_outside = decode_criteo_lines(
            buf, n_bytes, delimiters, cols.labels, cols.dense, cols.keys, cols.event_time_ms,
            cols.reason, line_start, line_lf, t.int_keys, t.int_span, t.int_low, t.dense_table,
            t.criteo_salt, outside_row, outside_field, outside_value)
        if n_outside:
            _finish_outside_ints(cols, outside_row[:n_outside], outside_field[:n_outside],
                                 outside_value[:n_outside])
    elif fmt.name == "avazu":
        decode_avazu_lines(buf, n_bytes, delimiters, cols.labels, cols.keys, cols.event_time_ms,
                           cols.reason, line_start, line_lf, t.avazu_salt, t.hour_keys,
                           t.weekday_keys, t.days_in_month)
    else:
        raise ValueError(f"no compiled decoder for format {fmt.name!r}")
    return cols, line_start, line_lf


def _finish_outside_ints(cols, rows: np.ndarray, fields: np.ndarray, values: np.ndarray) -> None:
    """Keys and dense values of Criteo integers outside the tables, with the numpy path's functions."""
    cols.keys[rows, fields] = hash_ints(_np_decode.criteo_buckets(values), fields)
    dense = np.empty(len(values), np.float32)
    _np_decode._signed_log1p_into(values, dense)
    cols.dense[rows, fields] = dense
