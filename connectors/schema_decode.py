"""Decode newline-delimited JSON or delimited text under a declared `Schema` into a `Batch`.

`decode_records` is the schema twin of `decode.decode_lines`: the same
contract (whole lines in, one Batch row or one `Rejected` per line out,
offsets ``first_offset + line index``), for any schema.

- JSON: a compiled scan (`json_scan`) finds each declared path's value span in
  every line it is sure of (no escapes, valid UTF-8, plain grammar) without building
  Python objects; the other lines are parsed one by one (orjson, 1.5x the
  stdlib's speed), each declared path pulled out as a column.  Both feed the
  same vectorized converters (`schema_columns`) and give the same rows.
  Invalid JSON is rejected as ``bad_json``, a line that is not an object as
  ``not_an_object``.  STREAM_CTR_NO_JIT=1 turns the scan off.
- csv: separators are found with one vectorized pass, as in `decode`; a line
  with the wrong number of fields is rejected as ``field_count``.  Lines that
  hold the quote character (RFC 4180: a quoted field may hold the delimiter, a
  doubled quote stands for one) are parsed by
  the stdlib's csv reader instead, one by one, and their unquoted fields feed
  the same converters, so a quoted value decodes exactly as the same value
  unquoted.  A record is one line: a line break inside quotes, or a stray
  quote, is rejected as ``bad_quote``.

A field's failure is rejected as ``missing:FIELD`` or ``bad_value:FIELD``
(the first failing field in declared order) with the value in `detail`.
"""
from __future__ import annotations

import csv
import importlib
import math
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np

from stream_ctr.connectors import json_scan, schema_columns as col
from stream_ctr.connectors.batch import Batch, Jagged, Rejected
from stream_ctr.connectors.decode import line_buffer
from stream_ctr.connectors.schema import (CategoricalField, EventTimeField, Field, IgnoreField, LabelField,
                                          MultiHotField, NumericField, Schema, SchemaError, TimePartField,
                                          WeightField, time_format_layout)

try:                                    # a well-kept C parser; the stdlib's is the fallback
    from orjson import loads as _loads, JSONDecodeError as _JSONError
    JSON_PARSER = "orjson"
except ImportError:                     # pragma: no cover - orjson is a dependency
    from json import loads as _loads, JSONDecodeError as _JSONError  # type: ignore[assignment]
    JSON_PARSER = "json"


@contextmanager
def json_parser(name: str) -> Iterator[None]:
    """Inside the block, parse every JSON line with the stdlib's parser ("json") or orjson,
    without the compiled scan (bench and tests: the per-line path is the reference)."""
    global _loads, _JSONError, _SCAN
    saved = _loads, _JSONError, _SCAN
    module = importlib.import_module(name)
    _loads, _JSONError, _SCAN = module.loads, module.JSONDecodeError, False
    try:
        yield
    finally:
        _loads, _JSONError, _SCAN = saved

_LF, _CR = 10, 13
# The compiled JSON scan, unless STREAM_CTR_NO_JIT=1 (then every line takes the per-line parser).
_SCAN = os.environ.get("STREAM_CTR_NO_JIT", "") != "1"
_EXPECTED = {"label": "0/1 or true/false (or a number, with threshold)", "weight": "a number >= 0",
             "categorical": "a string, number or boolean", "numeric": "a number",
             "event_time": "a time", "multi_hot": "a list of strings, numbers or booleans"}


def decode_records(data: bytes, schema: Schema, partition: str, first_offset: int,
                   skip_empty_lines: bool = False) -> tuple[Batch, list[Rejected]]:
    """Decode a block of whole LF-terminated lines (the last may lack its LF) under `schema`.

    Line i has offset ``first_offset + i``; every line is either a row of the
    returned Batch (in line order, ``partitions == (partition,)``) or a
    `Rejected` with a reason naming the field at fault.  With
    `skip_empty_lines` a blank line is neither (Kafka's rule: no record).
    """
    if schema.encoding == "json":
        groups, line_bytes, line_reasons = (_json_scanned(data, schema) if _SCAN
                                            else _json_block(data))
    else:
        groups, line_bytes, line_reasons = _csv_block(data, schema)
    rejected = [Rejected(partition, first_offset + i, reason, line_bytes(i))
                for i, reason in line_reasons
                if not (skip_empty_lines and reason == "empty")]
    kept: list[tuple[np.ndarray, _Converted, np.ndarray]] = []
    for rows, raw_of in groups:
        cols = _convert(schema, raw_of, len(rows))
        ok = cols.failed_field < 0
        for r in np.flatnonzero(~ok).tolist():
            reason, detail = cols.reject_reason(r)
            i = int(rows[r])
            rejected.append(Rejected(partition, first_offset + i, reason, line_bytes(i), detail))
        kept.append((rows, cols, np.flatnonzero(ok)))
    rejected.sort(key=lambda x: x.offset)
    rows = np.concatenate([r[keep] for r, _, keep in kept])
    order = np.argsort(rows, kind="stable") if len(kept) > 1 else np.arange(len(rows))

    def column(name: str) -> np.ndarray:
        return np.concatenate([getattr(c, name)[keep] for _, c, keep in kept])[order]

    def jagged(j: int) -> Jagged:
        parts = [c.jagged[j].take(keep) for _, c, keep in kept]
        whole = Jagged.concat(parts) if len(parts) > 1 else parts[0]
        return whole.take(order) if len(kept) > 1 else whole

    return Batch(labels=column("labels"), dense=column("dense"), keys=column("keys"),
                 event_time_ms=column("event_time_ms"), partition=np.zeros(len(rows), np.int32),
                 offset=rows[order] + first_offset, partitions=(partition,),
                 jagged=tuple(jagged(j) for j in range(len(schema.multi_fields))),
                 weight=column("weight") if schema.weight is not None else None), rejected


# ------------------------------------------------------------------ JSON lines

def _json_block(data: bytes):
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    try:
        records = list(map(_loads, lines))
        bad: dict[int, str] = {}
    except (_JSONError, ValueError):
        records, bad = _parse_one_by_one(lines)
    if not all(type(r) is dict for r in records):
        for i, r in enumerate(records):
            if type(r) is not dict and i not in bad:
                bad[i] = "not_an_object"
    rows = np.arange(len(lines), dtype=np.int64)
    if bad:
        rows = np.array([i for i in range(len(lines)) if i not in bad], dtype=np.int64)
        records = [records[i] for i in rows.tolist()]
    paths: dict[str, list[Any]] = {}

    def raw_of(path: str) -> list[Any]:
        if path not in paths:
            paths[path] = _json_column(records, path, paths)
        return paths[path]

    def line_bytes(i: int) -> bytes:
        return lines[i].rstrip(b"\r")

    return [(rows, raw_of)], line_bytes, sorted(bad.items())


def _json_scanned(data: bytes, schema: Schema):
    """The compiled scan (`json_scan`) for the lines it is sure of; the per-line parser for the rest."""
    buf, n_bytes = line_buffer(data)
    lfs = np.flatnonzero(buf[:n_bytes] == _LF)
    line_start = np.concatenate([[0], lfs[:-1] + 1]).astype(np.int64)
    paths = sorted({f.path for f in schema.fields if f.path})
    trie = _trie(paths)
    status, tag, starts, ends, number, exact, is_int = json_scan.scan_lines(buf, line_start, lfs, trie)
    fast = np.flatnonzero(status == json_scan.FAST)
    slow = np.flatnonzero(status == json_scan.SLOW)
    index = {p: j for j, p in enumerate(paths)}

    line_spans = np.stack([line_start[fast], lfs[fast]], axis=1)

    def raw_of(path: str) -> col.JsonSpans:
        j = index[path]
        return col.JsonSpans(buf, tag[fast, j], starts[fast, j], ends[fast, j], number[fast, j],
                             exact[fast, j], is_int[fast, j], path, line_spans)

    def line_bytes(i: int) -> bytes:
        s, e = int(line_start[i]), int(lfs[i])
        e -= e > s and buf[e - 1] == _CR
        return buf[s:e].tobytes()

    groups = [(fast.astype(np.int64), raw_of)]
    bad = [(int(i), "empty") for i in np.flatnonzero(status == json_scan.EMPTY)]
    if len(slow):
        slow_data = b"".join(buf[line_start[i]:lfs[i] + 1].tobytes() for i in slow.tolist())
        slow_groups, _, slow_bad = _json_block(slow_data)
        (slow_rows, slow_raw), = slow_groups
        groups.append((slow[slow_rows], slow_raw))
        bad += [(int(slow[i]), reason) for i, reason in slow_bad]
    return groups, line_bytes, sorted(bad)


_TRIES: dict[tuple[str, ...], Any] = {}


def _trie(paths: list[str]):
    key = tuple(paths)
    if key not in _TRIES:
        _TRIES[key] = json_scan.PathTrie(paths)
    return _TRIES[key]


def _parse_one_by_one(lines: list[bytes]) -> tuple[list[Any], dict[int, str]]:
    records: list[Any] = []
    bad: dict[int, str] = {}
    for i, line in enumerate(lines):
        try:
            records.append(_loads(line))
        except (_JSONError, ValueError):
            records.append(None)
            bad[i] = "empty" if not line.strip() else "bad_json"
    return records, bad


def _json_column(records: list[dict], path: str, cache: dict[str, list[Any]]) -> list[Any]:
    """The value at dotted `path` of every record (None where absent); a parent that is not
    an object gives a `WrongParent` value, which no converter accepts."""
    head, dot, tail = path.rpartition(".")
    if not dot:
        return [r.get(path) for r in records]
    parents = cache.get(head)
    if parents is None:
        parents = cache[head] = _json_column(records, head, cache)
    return [p.get(tail) if type(p) is dict else (None if p is None else col.WrongParent(p))
            for p in parents]


# ------------------------------------------------------------------ delimited text

def _csv_block(data: bytes, schema: Schema):
    if not schema.columns:
        raise SchemaError("a csv schema needs its column names (columns = [...], or header = true "
                          "with the file's header read first)")
    buf, n_bytes = line_buffer(data)
    body = buf[:n_bytes]
    is_sep = body == ord(schema.delimiter)
    is_sep |= body == _LF
    sep = np.flatnonzero(is_sep)
    line_last = np.flatnonzero(body[sep] == _LF)         # index in `sep` of each line's LF
    lfs = sep[line_last]
    line_start = np.concatenate([[0], lfs[:-1] + 1]).astype(np.int64)
    n_cols = len(schema.columns)
    fields_per_line = np.diff(line_last, prepend=-1)
    quoted = np.zeros(len(lfs), bool)
    if schema.quote:
        quote_at = np.flatnonzero(body == ord(schema.quote))
        quoted[np.searchsorted(lfs, quote_at)] = True      # the lines holding a quote
    good = (fields_per_line == n_cols) & ~quoted
    rows = np.flatnonzero(good).astype(np.int64)
    ends = sep[line_last[good][:, None] + np.arange(1 - n_cols, 1)]      # [m, n_cols]
    starts = np.empty_like(ends)
    starts[:, 0] = line_start[good]
    starts[:, 1:] = ends[:, :-1] + 1
    last = ends[:, -1]
    last -= (last > starts[:, -1]) & (buf[last - 1] == _CR)
    index = {name: j for j, name in enumerate(schema.columns)}
    bad = [(i, "empty" if lfs[i] == line_start[i] else "field_count")
           for i in np.flatnonzero(~good & ~quoted).tolist()]

    def raw_of(path: str) -> col.TextColumn:
        j = index[path]
        return col.TextColumn(buf, starts[:, j], ends[:, j])

    def line_bytes(i: int) -> bytes:
        s, e = int(line_start[i]), int(lfs[i])
        e -= e > s and buf[e - 1] == _CR
        return buf[s:e].tobytes()

    groups = [(rows, raw_of)]
    if quoted.any():
        quoted_rows, quoted_raw_of, quoted_bad = _quoted_csv_lines(np.flatnonzero(quoted), line_bytes,
                                                                   schema, index)
        groups.append((quoted_rows, quoted_raw_of))
        bad = sorted(bad + quoted_bad)
    return groups, line_bytes, bad


def _quoted_csv_lines(lines: np.ndarray, line_bytes: Callable[[int], bytes], schema: Schema,
                      index: dict[str, int]):
    """(rows, raw_of, rejected) of the csv lines that hold a quote: each parsed by the
    stdlib's reader (strict RFC 4180), its unquoted fields laid end to end in a new
    buffer so that they are spans like any other line's.  Text round-trips through
    surrogateescape, so a field's bytes are exactly the bytes between its quotes."""
    n_cols = len(schema.columns)
    rows: list[int] = []
    cells: list[bytes] = []
    bad: list[tuple[int, str]] = []
    for i in lines.tolist():
        text = line_bytes(i).decode("utf-8", errors="surrogateescape")
        try:
            parsed = list(csv.reader([text], delimiter=schema.delimiter, quotechar=schema.quote,
                                     strict=True))
        except csv.Error:
            bad.append((i, "bad_quote"))
            continue
        fields = parsed[0] if parsed else []
        if len(fields) != n_cols:
            bad.append((i, "field_count"))
            continue
        rows.append(i)
        cells.extend(f.encode("utf-8", errors="surrogateescape") for f in fields)
    lengths = np.fromiter(map(len, cells), np.int64, len(cells))
    ends = np.cumsum(lengths).reshape(len(rows), n_cols)
    starts = ends - lengths.reshape(len(rows), n_cols)
    buf = np.frombuffer(b"".join(cells) + bytes(8), np.uint8)      # 8 bytes of slack, as TextColumn wants

    def raw_of(path: str) -> col.TextColumn:
        j = index[path]
        return col.TextColumn(buf, starts[:, j], ends[:, j])

    return np.array(rows, np.int64), raw_of, bad


# ------------------------------------------------------------------ fields -> columns

class _Converted:
    """Decoded columns of m parsed rows and, per field that can fail, its status and raw values."""

    def __init__(self, schema: Schema, m: int) -> None:
        self.labels = np.zeros(m, np.float32)
        self.dense = np.zeros((m, schema.n_dense), np.float32)
        self.keys = np.zeros((m, schema.n_keys), np.int64)
        self.event_time_ms = np.full(m, -1, np.int64)
        self.jagged = [Jagged.empty(f.pooling) for f in schema.multi_fields]
        self.weight = np.ones(m, np.float32) if schema.weight is not None else None
        self.failed_field = np.full(m, -1, np.int64)    # index into `checks` of the first failure
        self.checks: list[tuple[Field, np.ndarray, Any]] = []

    def check(self, f: Field, status: np.ndarray, raw: Any) -> None:
        failed = (status != col.OK) & (self.failed_field < 0)
        self.failed_field[failed] = len(self.checks)
        self.checks.append((f, status, raw))

    def reject_reason(self, row: int) -> tuple[str, str]:
        f, status, raw = self.checks[self.failed_field[row]]
        value = col.raw_value(raw, row)
        if status[row] == col.MISSING:
            if isinstance(f, LabelField):       # a default label would invent clicks
                return f"missing:{f.name}", f"{f.name} (path {f.path!r}) is missing or null: no label to train on"
            return f"missing:{f.name}", (f"{f.name} (path {f.path!r}) is missing or null; give it a "
                                         "default, or optional = true")
        expected = _EXPECTED.get(f.kind, "a value")
        if isinstance(f, EventTimeField):
            lo, hi = col.EPOCH_MS_SECONDS_LIKE
            expected = (f"a time like {f.format!r}" if f.format else
                        f'a number (epoch s, below {col.EPOCH_S_MAX:g}: larger ones look like epoch ms, unit = "ms")'
                        if f.unit == "s" else
                        f'a number (epoch ms; {lo:g}-{hi:g} looks like epoch seconds, unit = "s")')
        if _is_number(value) and (isinstance(f, NumericField) or (isinstance(f, WeightField)
                                                                  and float(value) >= 0)):
            expected += " (within float32's range, +-3.4e38, after its transform)"   # 1e300
        if isinstance(f, NumericField) and f.transform == "log":
            expected = 'a number > 0 (transform = "log")'
        return f"bad_value:{f.name}", f"{f.name} = {_shown(value)}: expected {expected}"


DETAIL_VALUE_CHARS = 200             # of a bad value shown in a reject's detail


def _is_number(value: Any) -> bool:
    """A finite number (or a string of one) that a field still rejected: out of range."""
    try:
        return not isinstance(value, bool) and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _shown(value: Any) -> str:
    """`value`'s repr for a person, cut to DETAIL_VALUE_CHARS: the record itself is in the
    dead letter's `raw`, and a multi-megabyte value must not make the dead-letter message
    larger than a broker accepts."""
    text = repr(value)
    if len(text) <= DETAIL_VALUE_CHARS:
        return text
    return f"{text[:DETAIL_VALUE_CHARS]}... ({len(text):,} characters)"


def _convert(schema: Schema, raw_of: Callable[[str], Any], m: int) -> _Converted:
    out = _Converted(schema, m)
    key_index = {name: j for j, name in enumerate(schema.key_fields)}
    dense_index = {name: j for j, name in enumerate(schema.dense_fields)}
    multi_index = {f.name: j for j, f in enumerate(schema.multi_fields)}
    ordered = sorted(schema.fields, key=lambda f: not isinstance(f, EventTimeField))  # time parts need it
    for f in ordered:
        if isinstance(f, IgnoreField):
            continue
        if isinstance(f, TimePartField):
            out.keys[:, key_index[f.name]] = col.time_parts_ms(out.event_time_ms, f.part, key_index[f.name])
            continue
        raw = raw_of(f.path)
        if isinstance(f, LabelField):
            values, status = _with_default(f, raw, lambda r: col.labels(r, f.threshold))
            out.labels[:] = values
        elif isinstance(f, WeightField):
            values, status = _with_default(f, raw, col.numbers)
            # negative, NaN, or beyond float32 (inf as the loss's weight)
            status[(status == col.OK) & ~((values >= 0) & (values <= np.finfo(np.float32).max))] = col.BAD
            values[status == col.BAD] = 0.0
            out.weight[:] = values
        elif isinstance(f, EventTimeField):
            layout = time_format_layout(f.format) if f.format else ()
            convert = (lambda r: col.formatted_time_ms(r, layout)) if f.format else (lambda r: col.epoch_ms(r, f.unit))
            values, status = _with_default(f, raw, convert)
            out.event_time_ms[:] = values
        elif isinstance(f, CategoricalField):
            fid = key_index[f.name]
            values, status = _with_default(f, raw, lambda r: col.category_keys(r, fid, f.integer_ids))
            if f.optional:
                status[status == col.MISSING] = col.OK    # the key of an empty token: the missing key
            out.keys[:, fid] = values
        elif isinstance(f, NumericField):
            values, status = _with_default(f, raw, col.numbers)
            missing = status == col.MISSING
            if f.optional:
                status[missing] = col.OK
            values[missing] = 0.0
            if f.transform == "log":        # ln needs x > 0: anything else is a bad value
                out_of_domain = ~missing & ~(values > 0)
                status[out_of_domain & (status == col.OK)] = col.BAD
                values[missing | out_of_domain] = 1.0
            if f.is_key:
                out.keys[:, key_index[f.name]] = col.bucket_keys(values, missing, f.boundaries,
                                                                 key_index[f.name])
            else:
                dense = col.dense_values(values, f.transform, f.mean, f.std)
                dense[missing] = 0.0
                # 1e300 is a finite float64 but inf as the model's float32: one such value
                # made its whole batch's loss non-finite, and the batch was skipped.
                overflow = ~np.isfinite(dense)
                status[overflow & (status == col.OK)] = col.BAD
                dense[overflow] = 0.0
                out.dense[:, dense_index[f.name]] = dense
        elif isinstance(f, MultiHotField):
            j = multi_index[f.name]
            values, offsets, status = col.multi_hot_keys(raw, schema.n_keys + j, f.max_len, f.separator,
                                                          f.integer_ids)
            if f.optional:
                status[status == col.MISSING] = col.OK    # a missing list is an empty one
            out.jagged[j] = Jagged(values, offsets, f.pooling)
        else:                                            # a kind this decoder does not know
            raise SchemaError(f"field {f.name!r}: kind {f.kind!r} cannot be decoded here")
        out.check(f, status, raw)
    for c in schema.crosses:
        parts = [out.keys[:, key_index[n]] for n in c.fields]
        out.keys[:, key_index[c.name]] = col.cross_keys(parts, key_index[c.name])
    return out


def _with_default(f: Field, raw: Any, convert: Callable[[Any], tuple[np.ndarray, np.ndarray]]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """`convert(raw)`, with missing values replaced by the field's declared default."""
    values, status = convert(raw)
    default = getattr(f, "default", None)
    if default is not None:
        missing = status == col.MISSING
        if missing.any():
            fill, fill_status = convert([default])
            if fill_status[0] != col.OK:
                raise SchemaError(f"field {f.name!r}: default {default!r} is not a valid value "
                                  f"({_EXPECTED.get(f.kind, 'a value')})")
            values[missing] = fill[0]
            status[missing] = col.OK
    return values, status

