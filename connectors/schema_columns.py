"""Raw columns of a block of records, and what each schema field kind makes of them.

A raw column is the value of one path in every record of a block, in one of
two shapes:

- `TextColumn` — byte spans of one buffer (a csv column; or JSON strings,
  encoded and joined once).  An empty span is a missing value.
- a list of Python values (a JSON column, as the parser gave it; None is
  missing).

The converters below turn a raw column into typed numpy arrays plus a per-row
status (`OK`, `MISSING`, `BAD`) that the decoder turns into rejects.  Work is
vectorized over the column; a Python loop runs only over the values of a
column that the fast path could not take (mixed types, words, bad values).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from stream_ctr.connectors import json_scan
from stream_ctr.connectors.decode import days_from_civil, parse_ints
from stream_ctr.connectors.decode_tables import criteo_buckets
from stream_ctr.connectors.hashing import (field_salt, hash_ints, hash_spans, hash_strings, mix64, padded_buffer,
                                          word_view, GOLDEN)

try:                                    # the parser the per-line path uses (schema_decode)
    from orjson import loads as _json_loads
except ImportError:                     # pragma: no cover - orjson is a dependency
    from json import loads as _json_loads  # type: ignore[assignment]

OK, MISSING, BAD = 0, 1, 2
_DAYS_IN_MONTH = np.array([0, 31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31], dtype=np.int64)
_TRUE_WORDS = {"1", "true", "True", "TRUE", "yes"}
_FALSE_WORDS = {"0", "false", "False", "FALSE", "no"}


class WrongParent:
    """A dotted path whose parent is not an object (e.g. device = "ios" for device.os)."""

    def __init__(self, parent: Any) -> None:
        self.parent = parent

    def __repr__(self) -> str:
        return f"<parent is {self.parent!r}, not an object>"


@dataclass
class TextColumn:
    """Byte spans ``buf[starts[i]:ends[i]]``; `buf` has 8 zero bytes of slack after its data."""
    buf: np.ndarray
    starts: np.ndarray
    ends: np.ndarray

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def missing(self) -> np.ndarray:
        return self.ends == self.starts

    def value(self, row: int) -> str:
        return self.buf[self.starts[row]:self.ends[row]].tobytes().decode("utf-8", errors="replace")


@dataclass
class JsonSpans:
    """One path's values in scanned JSON lines (connectors/json_scan.py): a type tag per row,
    the value's byte span in `buf` (a string's without quotes), a number's float64 value,
    whether that value is exact and whether the number was written as an integer."""
    buf: np.ndarray
    tag: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    number: np.ndarray
    exact: np.ndarray
    is_int: np.ndarray
    path: str = ""
    line_spans: np.ndarray | None = None     # int64 [n, 2]: each row's line in `buf` (for details)

    def __len__(self) -> int:
        return len(self.tag)

    def text(self, row: int) -> str:
        return self.buf[self.starts[row]:self.ends[row]].tobytes().decode("utf-8")

    def value(self, row: int) -> Any:
        """The row's value as the JSON parser gives it (a placeholder for objects and lists)."""
        t = int(self.tag[row])
        if t == json_scan.STRING:
            return self.text(row)
        if t == json_scan.NUMBER:
            return int(self.text(row)) if self.is_int[row] else float(self.text(row))
        if t in (json_scan.OBJECT, json_scan.ARRAY):
            return self._container(row)
        return {json_scan.TRUE: True, json_scan.FALSE: False}.get(t)

    def _container(self, row: int) -> Any:
        """An object or list value, parsed from its line (only for a reject's detail)."""
        import json
        if self.line_spans is None:
            return {} if self.tag[row] == json_scan.OBJECT else []
        s, e = self.line_spans[row]
        value = json.loads(self.buf[s:e].tobytes())
        for part in self.path.split("."):
            value = value[part]
        return value

    def values(self) -> list[Any]:
        return [self.value(i) for i in range(len(self))]


def raw_value(raw: TextColumn | JsonSpans | list[Any], row: int) -> Any:
    """The raw value of one row, for a reject's detail."""
    return raw.value(row) if isinstance(raw, (TextColumn, JsonSpans)) else raw[row]


def scalar_token(value: Any) -> bytes | None:
    """The bytes a scalar is hashed as: strings as UTF-8, numbers as their JSON text,
    booleans as true/false; None for anything else (a list, an object)."""
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bool):
        return b"true" if value else b"false"
    if isinstance(value, int):
        return str(value).encode()
    if isinstance(value, float):
        return repr(value).encode()
    return None


def text_of_values(values: list[Any]) -> tuple[TextColumn, np.ndarray]:
    """(TextColumn of the scalar tokens, status) of a JSON column; None is missing (empty span)."""
    n = len(values)
    status = np.zeros(n, np.int8)
    try:
        joined = "".join(values)                                   # the common case: all strings
        lengths = np.fromiter(map(len, values), np.int64, n)
        data = joined.encode("utf-8")
        if len(data) != len(joined):                               # non-ASCII: byte lengths differ
            encoded = [v.encode("utf-8") for v in values]
            lengths = np.fromiter(map(len, encoded), np.int64, n)
    except TypeError:
        if all(type(v) is int for v in values):                   # all integers: their decimal text
            strings = list(map(str, values))
            lengths = np.fromiter(map(len, strings), np.int64, n)
            return _text_column("".join(strings).encode(), lengths), status
        encoded = []
        for i, v in enumerate(values):
            token = b"" if v is None else scalar_token(v)
            if v is None:
                status[i] = MISSING
            elif token is None:
                status[i], token = BAD, b""
            encoded.append(token)
        data = b"".join(encoded)
        lengths = np.fromiter(map(len, encoded), np.int64, n)
    return _text_column(data, lengths), status


def _text_column(data: bytes, lengths: np.ndarray) -> TextColumn:
    ends = np.cumsum(lengths)
    buf = np.zeros(len(data) + 8, np.uint8)
    buf[:len(data)] = np.frombuffer(data, np.uint8)
    return TextColumn(buf, ends - lengths, ends)


def as_text(raw: TextColumn | JsonSpans | list[Any],
            rekeyed: np.ndarray | None = None) -> tuple[TextColumn, np.ndarray]:
    """(TextColumn of each row's token, status). `rekeyed`: rows whose token the caller
    replaces (whole numbers under `integer_ids`), so their text need not be exact."""
    if isinstance(raw, TextColumn):
        return raw, np.where(raw.missing, MISSING, OK).astype(np.int8)
    if isinstance(raw, JsonSpans):
        fraction = (raw.tag == json_scan.NUMBER) & ~raw.is_int
        if rekeyed is not None:
            fraction &= ~rekeyed
        if fraction.any():              # a float's token is its repr (1.50 -> "1.5"), as parsed
            return text_of_values(raw.values())
        status = np.where((raw.tag == json_scan.ABSENT) | (raw.tag == json_scan.NULL), MISSING,
                          np.where(raw.tag >= json_scan.OBJECT, BAD, OK)).astype(np.int8)
        spans = status == OK
        return TextColumn(raw.buf, np.where(spans, raw.starts, 0), np.where(spans, raw.ends, 0)), status
    return text_of_values(raw)


def numbers(raw: TextColumn | list[Any], words: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(float64 values, status) of a column; with `words`, true/false/yes/no count as 1/0."""
    if isinstance(raw, TextColumn):
        return _numbers_of_text(raw, words)
    if isinstance(raw, JsonSpans):
        return _numbers_of_spans(raw, words)
    n = len(raw)
    try:
        values = np.array(raw, dtype=np.float64)       # None -> nan; numeric strings parse too
        if values.shape != (n,):
            raise ValueError("not a flat column")
        status = np.where(np.isnan(values), MISSING, np.where(np.isinf(values), BAD, OK)).astype(np.int8)
        return values, status
    except (ValueError, TypeError):
        pass
    values, status = np.zeros(n, np.float64), np.zeros(n, np.int8)
    for i, v in enumerate(raw):
        values[i], status[i] = _one_number(v, words)
    return values, status


def _one_number(v: Any, words: bool) -> tuple[float, int]:
    if v is None:
        return 0.0, MISSING
    if isinstance(v, (bool, int, float)):
        x = float(v)
        return (x, OK) if np.isfinite(x) else (0.0, BAD)
    if isinstance(v, str):
        if words and v.strip() in _TRUE_WORDS:
            return 1.0, OK
        if words and v.strip() in _FALSE_WORDS:
            return 0.0, OK
        try:
            x = float(v)
        except ValueError:
            return 0.0, BAD
        return (x, OK) if np.isfinite(x) else (0.0, BAD)
    return 0.0, BAD


def _numbers_of_spans(raw: JsonSpans, words: bool) -> tuple[np.ndarray, np.ndarray]:
    tag = raw.tag
    values = np.where(tag == json_scan.NUMBER, raw.number, (tag == json_scan.TRUE).astype(np.float64))
    status = np.where((tag == json_scan.ABSENT) | (tag == json_scan.NULL), MISSING,
                      np.where(tag >= json_scan.OBJECT, BAD, OK)).astype(np.int8)
    python = ((tag == json_scan.NUMBER) & ~raw.exact) | (tag == json_scan.STRING)
    for i in np.flatnonzero(python).tolist():        # rare: long numbers, numbers as strings
        values[i], status[i] = _one_number(raw.value(i), words)
    return values, status


def _numbers_of_text(col: TextColumn, words: bool) -> tuple[np.ndarray, np.ndarray]:
    ints, ok, missing = parse_ints(col.buf, col.starts, col.ends)
    values = ints.astype(np.float64)
    status = np.where(missing, MISSING, OK).astype(np.int8)
    for i in np.flatnonzero(~ok).tolist():                  # not an integer: a float, a word, or bad
        values[i], status[i] = _one_number(col.value(i), words)
    return values, status


def labels(raw: TextColumn | list[Any], threshold: float | None) -> tuple[np.ndarray, np.ndarray]:
    """(float32 0/1 labels, status): 0/1 and true/false, or value >= threshold."""
    values, status = numbers(raw, words=True)
    if threshold is None:
        status[(status == OK) & (values != 0) & (values != 1)] = BAD
        return values.astype(np.float32), status
    return (values >= threshold).astype(np.float32), status


def category_keys(raw: TextColumn | JsonSpans | list[Any], field_id: int,
                  integer_ids: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(63-bit keys of the tokens in field `field_id`, status); a missing value has the field's
    missing key (the key of an empty token).

    A token is hashed as written (a JSON float as its repr: 3.0 -> "3.0").  With
    `integer_ids` a number whose value is whole and below 2**53 in magnitude -- 3, 3.0,
    3e0, 30e-1, and the same csv text -- is hashed as that integer's decimal text ("3"),
    so a log that writes one id both ways (pandas turns an integer column with gaps into
    floats) keeps one key for it.  JSON strings, and csv text that is not a JSON-style
    number (007, +3, abc), stay as written."""
    whole, ints = whole_numbers(raw) if integer_ids else (None, None)
    col, status = as_text(raw, rekeyed=whole)
    salt = field_salt(np.int64(field_id))
    keys = hash_spans(word_view(col.buf), col.starts, col.ends - col.starts, salt)
    if whole is not None:
        rekey_whole_numbers(keys, whole, ints, salt)
    return keys, status


_MAX_WHOLE = float(1 << 53)


def whole_numbers(raw: TextColumn | JsonSpans | list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """(rows bool [n], int64 values [n]): the rows holding a number (not a string) whose
    exact value is a whole number of magnitude below 2**53 and whose text is not already
    that integer's (3.0, 3e0, -0; not 3), and those integers."""
    if isinstance(raw, (JsonSpans, TextColumn)):
        if isinstance(raw, JsonSpans):
            number, exact, is_int = raw.number, (raw.tag == json_scan.NUMBER) & raw.exact, raw.is_int
        else:
            number, exact, is_int, ok = json_scan.numbers_in_spans(raw.buf, raw.starts, raw.ends)
            exact &= ok
        # An integer's text is its own, but for -0 (JSON allows it; its value is 0).
        written = is_int & ~((number == 0) & (raw.ends - raw.starts != 1))
    else:       # Python values (the per-line parser's, or a declared default): an int's
        # text is its own (of any size: no float of it is taken), a float's is its repr
        number = np.array([v if type(v) is float else 0.0 for v in raw], np.float64)
        exact = np.array([type(v) is float for v in raw], bool)
        written = np.zeros(len(raw), bool)
    with np.errstate(invalid="ignore"):
        whole = exact & ~written & (np.abs(number) < _MAX_WHOLE) & (number == np.floor(number))
    return whole, np.where(whole, number, 0.0).astype(np.int64)


def rekey_whole_numbers(keys: np.ndarray, whole: np.ndarray, ints: np.ndarray, salt: np.ndarray) -> None:
    """Set keys[whole] (in place) to the keys of `ints[whole]` hashed as their decimal
    text, as `hash_strings` would (`whole_numbers` gives both)."""
    if not whole.any():
        return
    text = ints[whole].astype("S20")                # b"3", b"-12": at most 20 bytes
    starts = np.arange(len(text), dtype=np.int64) * 20
    lengths = np.char.str_len(text).astype(np.int64)
    keys[whole] = hash_spans(word_view(padded_buffer(text.tobytes())), starts, lengths, salt)


def token_key(value: Any, field_id: int) -> np.int64:
    """The key of one scalar (a declared default) in field `field_id`."""
    return hash_strings([scalar_token(value) or b""], field_id)[0]


def bucket_keys(values: np.ndarray, missing: np.ndarray, boundaries: tuple[float, ...] | str,
                field_id: int) -> np.ndarray:
    """Keys of the bucket of each value (missing rows: the field's missing key)."""
    if isinstance(boundaries, str):                     # log_squared: Criteo winners' integer buckets
        whole = np.floor(np.where(missing, 0, values)).astype(np.int64)
        bucket = criteo_buckets(whole)
    else:
        bucket = np.searchsorted(np.asarray(boundaries), values, side="right").astype(np.int64)
    return hash_ints(bucket, np.int64(field_id), missing)


def dense_values(values: np.ndarray, transform: str, mean: float, std: float) -> np.ndarray:
    """float32 dense column: raw, sign(x)*log1p(|x|) in float32, (ln(x) - mean) / std (log:
    the caller has rejected x <= 0), or (x - mean) / std. A value beyond float32's range
    comes out inf: the caller rejects its record."""
    with np.errstate(over="ignore"):
        return _dense_values(values, transform, mean, std)


def _dense_values(values: np.ndarray, transform: str, mean: float, std: float) -> np.ndarray:
    if transform == "log1p":
        # float32 all the way, as the Criteo decoder does (decode_tables._signed_log1p_into).
        as_float = values.astype(np.float32)
        mag = np.abs(as_float)
        np.log1p(mag, out=mag)
        return np.copysign(mag, as_float)
    if transform == "log":
        return ((np.log(values) - mean) / std).astype(np.float32)
    if transform == "standardize":
        return ((values - mean) / std).astype(np.float32)
    return values.astype(np.float32)


def cross_keys(parts: list[np.ndarray], field_id: int) -> np.ndarray:
    """Keys of the combination of the component keys of each row, in field `field_id`."""
    state = parts[0].astype(np.uint64)
    for k in parts[1:]:
        state = state * GOLDEN
        state ^= k.view(np.uint64)
        mix64(state)
    return hash_ints(state.view(np.int64), np.int64(field_id))


# A declared unit that does not fit the numbers: epoch seconds above 1e11 are year 5138 and
# later (epoch ms read as seconds), epoch ms in [1e8, 1e11) are 1970-01-02..1973 (epoch seconds
# read as ms). Both are bad values, so a wrong `unit` is one clear reject, not wrong event times.
EPOCH_S_MAX = 1e11
EPOCH_MS_SECONDS_LIKE = (1e8, 1e11)


def epoch_ms(raw: TextColumn | list[Any], unit: str) -> tuple[np.ndarray, np.ndarray]:
    values, status = numbers(raw)
    if unit == "s":
        status[(status == OK) & (values >= EPOCH_S_MAX)] = BAD
    else:
        lo, hi = EPOCH_MS_SECONDS_LIKE
        status[(status == OK) & (values >= lo) & (values < hi)] = BAD
    scale = 1000.0 if unit == "s" else 1.0
    ms = np.floor(values * scale)
    status[(status == OK) & ((ms < -(2.0 ** 62)) | (ms > 2.0 ** 62))] = BAD
    return np.where(status == OK, ms, 0).astype(np.int64), status


def formatted_time_ms(raw: TextColumn | list[Any], layout: tuple[tuple[str, int, int], ...]
                      ) -> tuple[np.ndarray, np.ndarray]:
    """ms since the epoch (UTC) of time strings in a fixed-width strftime layout, and status."""
    col, status = as_text(raw)
    width = sum(w for _, _, w in layout)
    ok = (col.ends - col.starts) == width
    buf = col.buf
    fields = {"Y": 1970, "m": 1, "d": 1, "H": 0, "M": 0, "S": 0}
    starts = np.where(ok, col.starts, 0)
    last = len(buf) - 1
    for directive, at, w in layout:
        if directive.startswith("="):                   # a literal character
            ok &= buf[np.minimum(starts + at, last)] == ord(directive[1])
            continue
        value = np.zeros(len(starts), np.int64)
        for k in range(w):
            digit = buf[np.minimum(starts + at + k, last)].astype(np.int64) - 48
            ok &= (digit >= 0) & (digit <= 9)
            value = value * 10 + digit
        if directive == "y":                            # POSIX: 69-99 -> 19xx, 00-68 -> 20xx
            directive, value = "Y", np.where(value >= 69, 1900 + value, 2000 + value)
        fields[directive] = value
    year, month, day = (np.asarray(fields[k]) for k in ("Y", "m", "d"))
    hour, minute, second = (np.asarray(fields[k]) for k in ("H", "M", "S"))
    leap = (year % 4 == 0) & ((year % 100 != 0) | (year % 400 == 0))
    month_days = _DAYS_IN_MONTH[np.clip(month, 0, 12)] + (leap & (month == 2))
    ok &= (month >= 1) & (month <= 12) & (day >= 1) & (day <= month_days)
    ok &= (hour <= 23) & (minute <= 59) & (second <= 60)
    days = days_from_civil(year, np.clip(month, 1, 12), day)
    ms = (((days * 24 + hour) * 60 + minute) * 60 + second) * 1000
    status[(status == OK) & ~ok] = BAD
    return np.where(status == OK, ms, 0).astype(np.int64), status


def time_parts_ms(event_ms: np.ndarray, part: str, field_id: int) -> np.ndarray:
    """Keys of the hour of day (0-23) or day of week (Monday = 0) of event times, UTC."""
    if part == "hour_of_day":
        value = event_ms // 3_600_000 % 24
    else:
        value = (event_ms // 86_400_000 + 3) % 7
    return hash_ints(value, np.int64(field_id))



def multi_hot_keys(raw: TextColumn | JsonSpans | list[Any], field_id: int, max_len: int,
                   separator: str = "|", integer_ids: bool = False
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keys int64 [N], offsets int64 [m+1], status) of a list column: each row's first `max_len`
    elements, each hashed as a categorical value of field `field_id` (its token: a string's
    UTF-8, a number's JSON text, true/false).  A missing list (absent, null) is empty with
    status MISSING; a value that is not a list, or a list holding anything but strings,
    numbers and booleans, is BAD.  `integer_ids`: whole-number elements keyed as
    integers, as `category_keys` does."""
    salt = field_salt(np.int64(field_id))
    if isinstance(raw, JsonSpans):
        return _multi_hot_of_spans(raw, salt, max_len, integer_ids)
    lists, status = _lists(raw, separator)
    keys, offsets = _keys_of_lists(lists, salt, max_len, status, integer_ids,
                                   csv_text=isinstance(raw, TextColumn))
    return keys, offsets, status


def _keys_of_lists(lists: list[list[Any]], salt: np.ndarray, max_len: int, status: np.ndarray,
                   integer_ids: bool = False, csv_text: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Keys and offsets of Python lists (rows with a bad element get status BAD).
    `csv_text`: the elements are csv text, whose numbers `integer_ids` reads from it."""
    lengths = np.fromiter(map(len, lists), np.int64, len(lists))
    if len(lengths) and lengths.max() > max_len:
        lists = [v[:max_len] for v in lists]
        lengths = np.minimum(lengths, max_len)
    offsets = np.zeros(len(lists) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = list(chain.from_iterable(lists))
    if not flat:
        return np.zeros(0, np.int64), offsets
    tokens, element_status = text_of_values(flat)
    bad_elements = np.flatnonzero(element_status != OK)
    if len(bad_elements):                     # null, a list or an object inside the list
        status[np.searchsorted(offsets, bad_elements, side="right") - 1] = BAD
    keys = hash_spans(word_view(tokens.buf), tokens.starts, tokens.ends - tokens.starts, salt)
    if integer_ids:
        rekey_whole_numbers(keys, *whole_numbers(tokens if csv_text else flat), salt)
    return keys, offsets


def _multi_hot_of_spans(raw: JsonSpans, salt: np.ndarray, max_len: int, integer_ids: bool = False
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`multi_hot_keys` of scanned JSON: arrays of non-negative integers (the common id
    list) are cut into their digit runs by a compiled pass and hashed in place; the other arrays
    are parsed (one orjson call for them all) and take the list path.  Same keys either way:
    an integer's token is its decimal text, which is what it is written as."""
    tag, n = raw.tag, len(raw)
    status = np.where((tag == json_scan.ABSENT) | (tag == json_scan.NULL), MISSING,
                      np.where(tag == json_scan.ARRAY, OK, BAD)).astype(np.int8)
    arrays = np.flatnonzero(tag == json_scan.ARRAY)
    ints, count, tok_row, rank, tok_start, tok_end = json_scan.int_list_tokens(
        raw.buf, raw.starts[arrays], raw.ends[arrays], max_len)
    # The other arrays: strings, floats, negative numbers, booleans, nested values.
    other = arrays[~ints]
    lists: list[list[Any]] = []
    if len(other):
        spans = [raw.buf[s:e].tobytes() for s, e in zip(raw.starts[other].tolist(), raw.ends[other].tolist())]
        lists = _json_loads(b"[" + b",".join(spans) + b"]")
    other_status = status[other]
    other_keys, other_offsets = _keys_of_lists(lists, salt, max_len, other_status, integer_ids)
    status[other] = other_status
    lengths = np.zeros(n, np.int64)
    lengths[arrays[ints]] = count[ints]
    lengths[other] = np.diff(other_offsets)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    keys = np.empty(int(offsets[-1]), np.int64)
    keys[offsets[arrays[tok_row]] + rank] = hash_spans(word_view(raw.buf), tok_start, tok_end - tok_start, salt)
    other_lengths = np.diff(other_offsets)
    keys[np.repeat(offsets[other] - other_offsets[:-1], other_lengths)
         + np.arange(int(other_offsets[-1]), dtype=np.int64)] = other_keys
    return keys, offsets, status


def _lists(raw: TextColumn | list[Any], separator: str) -> tuple[list[list[Any]], np.ndarray]:
    """Each row's list (empty where missing or bad) and its status."""
    if isinstance(raw, TextColumn):           # csv: one field cut at `separator`; empty is []
        status = np.zeros(len(raw), np.int8)
        return [raw.value(i).split(separator) if raw.ends[i] > raw.starts[i] else []
                for i in range(len(raw))], status
    status = np.zeros(len(raw), np.int8)
    lists = []
    for i, v in enumerate(raw):
        if type(v) is list:
            lists.append(v)
            continue
        status[i] = MISSING if v is None else BAD
        lists.append([])
    return lists, status
