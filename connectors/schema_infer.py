"""Guess a schema from a sample of records: what `stream-ctr schema infer` prints.

Every leaf of the sample (JSON: nested objects become dotted paths; csv: each
column) gets a kind, and a comment saying why:

- the label: the field named by `label`, else a field of booleans or 0/1
  values (preferring names like click, label, target);
- the event time: the first string field in a common time format, or a
  number in the range of epoch seconds or milliseconds under a name that says
  time (ts, time, date);
- `multi_hot`: lists of scalars (max_len the longest list sampled, mean
  pooling; the comment gives the length distribution);
- `ignore`: lists of objects or lists, objects of mixed shape, and
  strings unique to nearly every record (request ids: no two records share one,
  so they teach nothing);
- `categorical`: strings, booleans, integers with few distinct values, and
  whole numbers under an id-like name (site_id, adId: an id's number has no
  order);
- `numeric`: other numbers: `log` (ln, standardized with the sample's mean and
  std of ln) when all positive and spanning three decades or more (prices,
  durations: their effect is usually on a log scale, and standardizing the
  raw values crowds most of them near zero), `log1p` when non-negative and
  heavy-tailed, else `standardize` with the sample's mean and std.

A field missing from some sampled records is `optional` (its own "missing"
key, or 0.0).  Values of another shape in at most 1% of a field's records
(a word in a number field, a list in an id field, a string where the others
hold an object) are outliers: the field keeps the shape of the rest, the
comment counts them and quotes one, and training rejects such records into
the dead-letter file rather than letting one row change a column's kind.
The result is a valid schema that trains as it is; the comments
are there for the person who edits it.
"""
from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from stream_ctr.connectors.schema import (CategoricalField, EventTimeField, Field, IgnoreField, LabelField,
                                          MultiHotField, NumericField, Schema, SchemaError, parse_schema,
                                          schema_to_toml)

try:
    from orjson import loads as _loads
except ImportError:                     # pragma: no cover - orjson is a dependency
    from json import loads as _loads    # type: ignore[assignment]

DEFAULT_RECORDS = 10_000
MAX_CATEGORICAL_INTS = 100              # an integer field with at most this many values is categorical
LOG_MIN_RATIO = 1000                    # positive numbers whose max/min is this or more are logged
ID_UNIQUE_SHARE = 0.95                  # a string field this unique is an id
OUTLIER_SHARE = 0.01                    # values of another shape in this share of a field's records are outliers
LABEL_NAMES = ("click", "clicked", "label", "is_click", "target", "y", "conversion", "converted")
TIME_NAMES = re.compile(r"(^|_|\.)(ts|time|timestamp|date|datetime|event_time)($|_)|time$", re.I)
# A leaf named like an id (site_id, id, adId, campaignID; not bid or paid): its numbers are
# labels with no order, so they are categorical however many there are.
ID_NAMES = re.compile(r"(^|_)[iI][dD]s?$|[a-z0-9](Id|ID)s?$")
TIME_FORMATS = ("%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%d",
                "%Y%m%d%H%M%S", "%y%m%d%H")
DELIMITERS = (",", "\t", ";", "|")


@dataclass
class _Leaf:
    path: str
    values: list[Any] = field(default_factory=list)
    missing: int = 0
    outliers: list[Any] = field(default_factory=list)     # values of a rare shape, set aside
    object_outlier: bool = False                          # scalars where most records hold an object


def infer_schema(path: str | Path, encoding: str, n_records: int = DEFAULT_RECORDS,
                 label: str | None = None) -> tuple[Schema, dict[str, str]]:
    """(schema, comment per field) guessed from the first `n_records` records of a file.

    `encoding` is "json" or "csv" (csv: the first line names the columns; the
    delimiter is the one of , TAB ; | that splits it most).  SchemaError when
    no label can be found or `label` is not a field of the sample.
    """
    from stream_ctr.connectors.files import open_binary
    with open_binary(path) as f:
        lines = []
        for line in f:
            if line.strip():
                lines.append(line)
            if len(lines) > n_records:
                break
    return infer_from_lines(lines, encoding, n_records, label, str(path))


def infer_from_lines(lines: list[bytes], encoding: str, n_records: int = DEFAULT_RECORDS,
                     label: str | None = None, origin: str = "sample") -> tuple[Schema, dict[str, str]]:
    """`infer_schema` of records already read (e.g. from a topic; csv: the first is the header);
    `origin` names them in errors."""
    if encoding == "json":
        leaves, n, extra = _json_leaves(lines[:n_records])
    else:
        leaves, n, extra = _csv_leaves(lines)
    if n == 0 and lines and encoding == "json":
        first = lines[0][:80].decode("utf-8", errors="replace").rstrip("\r\n")
        raise SchemaError(f"{origin}: none of the {len(lines[:n_records]):,} records read is a JSON object "
                          f"(the first: {first!r}); a csv log infers as csv:PATH, and Criteo TSV trains "
                          "as criteo:PATH without a schema")
    if n == 0:
        raise SchemaError(f"{origin}: no records to infer a schema from")
    fields, comments = _guess_fields(leaves, n, label, origin)
    schema = Schema(encoding=encoding, fields=tuple(fields), **extra)
    schema = parse_schema(schema_to_toml(schema), f"inferred from {origin}")       # validated
    return schema, comments


def format_inferred(schema: Schema, comments: dict[str, str], source: str, n_records: int) -> str:
    """The TOML that `stream-ctr schema infer` prints: a header, then the schema with comments."""
    head = (f"# Schema inferred by `stream-ctr schema infer` from the first {n_records:,} records (at most) "
            f"of {source}.\n"
            "# Each comment says why a field got its kind; edit freely (connectors/schema.py documents\n"
            "# the language), then train with --schema THIS_FILE.\n")
    # max_len is what the sample showed, written even at the parser's default (50): the
    # comment above the field says where it came from, and it is the line to edit.
    return head + schema_to_toml(schema, comments, explicit=frozenset({"max_len"}))


def _json_leaves(lines: list[bytes]) -> tuple[dict[str, _Leaf], int, dict]:
    records = []
    for line in lines:
        try:
            r = _loads(line)
        except ValueError:
            continue
        if isinstance(r, dict):
            records.append(r)
    leaves: dict[str, _Leaf] = {}
    for r in records:
        for path, value in _flatten(r):
            leaf = leaves.get(path)
            if leaf is None:
                leaf = leaves[path] = _Leaf(path)
            leaf.values.append(value)
    for leaf in leaves.values():
        leaf.missing = len(records) - sum(v is not None for v in leaf.values)
        leaf.values = [v for v in leaf.values if v is not None]
    # A path that holds an object in most records (device.os, device.type) and a scalar in a
    # few ("device": "iphone"): the scalars are outliers of the object, not a field of their own.
    for path in [p for p in leaves if any(q.startswith(p + ".") for q in leaves)]:
        leaf = leaves[path]
        if len(leaf.values) <= OUTLIER_SHARE * len(records):
            leaf.outliers, leaf.values = leaf.values, []
            leaf.object_outlier = True
    return leaves, len(records), {}


def _flatten(record: dict, prefix: str = ""):
    for key, value in record.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from _flatten(value, path + ".")
        else:
            yield path, value


def _csv_leaves(lines: list[bytes]) -> tuple[dict[str, _Leaf], int, dict]:
    if lines[0].startswith(b"\xef\xbb\xbf"):     # a byte-order mark is not part of the first name
        lines = [lines[0][3:], *lines[1:]]
    header = lines[0].rstrip(b"\r\n").decode("utf-8", errors="replace")
    delimiter = max(DELIMITERS, key=header.count)
    rows = csv.reader((line.rstrip(b"\r\n").decode("utf-8", errors="replace") for line in lines),
                      delimiter=delimiter)          # RFC 4180 quoting, as the decoder reads it
    names = next(rows)
    leaves = {name: _Leaf(name) for name in names}
    n = 0
    for cells in rows:
        if len(cells) != len(names):
            continue
        n += 1
        for name, cell in zip(names, cells):
            if cell == "":
                leaves[name].missing += 1
            else:
                leaves[name].values.append(_csv_value(cell))
    return leaves, n, {"delimiter": delimiter, "header": True}


def _csv_value(cell: str) -> Any:
    for parse in (int, float):
        try:
            return parse(cell)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(cell.lower(), cell)


def _guess_fields(leaves: dict[str, _Leaf], n: int, label: str | None, origin: str
                  ) -> tuple[list[Field], dict[str, str]]:
    if label is not None and label not in leaves:
        raise SchemaError(f"{origin}: --label {label!r} is not a field of the sample; fields: "
                          f"{', '.join(leaves)}")
    for leaf in leaves.values():
        if not leaf.object_outlier:
            _set_aside_outliers(leaf)
    named = label is not None
    label = label or _label_candidate(leaves)
    if label is None:
        raise SchemaError(f"{origin}: no field looks like a label (booleans or 0/1); name it with "
                          f"--label FIELD (fields: {', '.join(leaves)})")
    fields: list[Field] = []
    comments: dict[str, str] = {}
    have_time = False
    for path, leaf in leaves.items():
        name = _field_name(path, {f.name for f in fields})
        if path == label:
            threshold = None if _is_binary(leaf.values) else 0.5
            fields.insert(0, LabelField(name, path, threshold=threshold))
            comments[name] = (f"the label: {'named by --label' if named else 'guessed: booleans or 0/1'}; "
                              f"{_share_true(leaf.values):.1%} positive in the {n:,} records sampled"
                              + ("" if threshold is None else "; not 0/1, so >= 0.5 counts as a click")
                              + _outlier_note(leaf.outliers, n))
            continue
        f, comment = _guess_one(name, path, leaf, n, have_time)
        have_time |= isinstance(f, EventTimeField)
        fields.append(f)
        if path.rsplit(".", 1)[-1].lower() in LABEL_NAMES and leaf.values and _is_binary(leaf.values):
            # --label named another field: a second outcome as a feature would leak the answer.
            comment += (f"; WARNING: named and valued like a label ({_share_true(leaf.values):.1%} "
                        "positive): if it is an outcome known only after the impression, set "
                        'kind = "ignore"')
        comments[name] = comment
    if not any(isinstance(f, (CategoricalField,)) or (isinstance(f, NumericField) and f.is_key)
               for f in fields):
        raise SchemaError(f"{origin}: no field could be a categorical feature; write the schema by hand")
    return fields, comments


def _label_candidate(leaves: dict[str, _Leaf]) -> str | None:
    binary = [p for p, leaf in leaves.items() if leaf.values and _is_binary(leaf.values)]
    named = [p for p in binary if p.rsplit(".", 1)[-1].lower() in LABEL_NAMES]
    return (named or binary or [None])[0]


def _is_binary(values: list[Any]) -> bool:
    return all(v is True or v is False or (type(v) is int and v in (0, 1)) for v in values)


def _share_true(values: list[Any]) -> float:
    numeric = [float(v) for v in values if isinstance(v, (bool, int, float))]
    return float(np.mean(numeric)) if numeric else float("nan")


def _field_name(path: str, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9_]", "_", path.rsplit(".", 1)[-1]) or "field"
    if base in taken:
        base = re.sub(r"[^A-Za-z0-9_]", "_", path)
    name, k = base, 2
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    return name


def _guess_one(name: str, path: str, leaf: _Leaf, n: int, have_time: bool) -> tuple[Field, str]:
    if leaf.object_outlier:
        return IgnoreField(name, path), (f"a scalar in {len(leaf.outliers):,} of {n:,} records (e.g. "
                                         f"{_example(leaf.outliers)}) where the others hold an object, whose "
                                         "fields follow: ignored (such records are rejected into the dead-letter file when trained)")
    values, optional = leaf.values, leaf.missing > 0
    missing_note = f"; missing in {leaf.missing:,} of {n:,} records: optional" if optional else ""
    missing_note += _outlier_note(leaf.outliers, n)
    if not values:
        return IgnoreField(name, path), "always missing or null in the sample"
    kinds = {_kind_of(v) for v in values}
    if "list" in kinds:
        return _guess_list(name, path, values, optional, kinds, missing_note)
    non_numbers = kinds - {"int", "float"}
    if "object" in kinds or len(non_numbers) > 1 or (non_numbers and non_numbers != kinds):
        if kinds <= {"str", "int", "float", "bool"}:
            return (CategoricalField(name, path, optional=optional),
                    f"mixed {'/'.join(sorted(kinds))} values: hashed as tokens{missing_note}")
        return IgnoreField(name, path), f"values of mixed shape ({', '.join(sorted(kinds))})"
    distinct = len(set(map(repr, values)))
    if kinds == {"str"}:
        fmt = _time_format(values) if not have_time else None
        if fmt is not None:
            return (EventTimeField(name, path, format=fmt),
                    f"time strings in the format {fmt} (UTC): the event time"
                    + ("; missing in some records: they are rejected" if optional else ""))
        if distinct >= ID_UNIQUE_SHARE * len(values) and len(values) >= 20:
            return IgnoreField(name, path), (f"{distinct:,} distinct of {len(values):,}: unique per record "
                                             "(an id), it teaches nothing")
        return CategoricalField(name, path, optional=optional), f"strings, {distinct:,} distinct{missing_note}"
    if kinds == {"bool"}:
        return CategoricalField(name, path, optional=optional), f"true/false{missing_note}"
    numbers = np.array(values, dtype=np.float64)
    lo, hi = float(numbers.min()), float(numbers.max())
    if not have_time and TIME_NAMES.search(path):
        unit = "ms" if 1e12 <= lo and hi < 1e14 else "s" if 1e9 <= lo and hi < 1e11 else None
        if unit is not None:
            return (EventTimeField(name, path, unit=unit),
                    f"numbers {lo:.0f}..{hi:.0f}: epoch {'milliseconds' if unit == 'ms' else 'seconds'}, "
                    "the event time" + ("; missing in some records: they are rejected" if optional else ""))
    leaf_name = path.rsplit(".", 1)[-1]
    if ID_NAMES.search(leaf_name) and bool(np.all(numbers == np.round(numbers))):
        if distinct >= ID_UNIQUE_SHARE * len(values) and len(values) >= 20:
            return IgnoreField(name, path), (f"{distinct:,} distinct ids of {len(values):,}: unique per "
                                             "record, it teaches nothing")
        # A value is hashed as written: ids seen as floats (3.0) would key apart from a
        # record or request that writes 3, unless keyed as integers.
        as_floats = "float" in kinds
        return (CategoricalField(name, path, optional=optional, integer_ids=as_floats),
                f"whole numbers {lo:.0f}..{hi:.0f}, {distinct:,} distinct, named like an id: categorical "
                f"(an id's number has no order)"
                + ("; written as floats (e.g. 3.0): integer_ids = true keys 3.0 and 3 alike"
                   if as_floats else "") + missing_note)
    if kinds == {"int"} and distinct <= MAX_CATEGORICAL_INTS:
        return (CategoricalField(name, path, optional=optional),
                f"integers {lo:.0f}..{hi:.0f}, {distinct} distinct: categorical{missing_note}")
    mean, std = float(numbers.mean()), float(numbers.std())
    median = float(np.median(numbers))
    int_id = kinds == {"int"} and distinct >= ID_UNIQUE_SHARE * len(values) and len(values) >= 20
    # Integer ids 1..N span decades too: they stay ids (below), not logged numbers.
    if lo > 0 and hi >= LOG_MIN_RATIO * lo and not int_id:
        logs = np.log(numbers)
        decades = math.log10(hi / lo)
        return (NumericField(name, path, transform="log", mean=round(float(logs.mean()), 6),
                             std=float(f"{float(logs.std()):.6g}"), optional=optional),
                f"numbers {lo:g}..{hi:g} ({decades:.1f} decades), median {median:g}: positive and "
                f"scale-free, so ln, standardized with the sample's mean and std of ln{missing_note}")
    if lo >= 0 and hi > 10 * max(median, 1e-12) and hi > 1:
        return (NumericField(name, path, transform="log1p", optional=optional),
                f"numbers {lo:g}..{hi:g}, median {median:g}: heavy-tailed, log1p{missing_note}")
    if int_id:
        return IgnoreField(name, path), f"{distinct:,} distinct integers of {len(values):,}: an id"
    if std == 0 or not math.isfinite(std):
        return IgnoreField(name, path), f"always {lo:g} in the sample: no information"
    return (NumericField(name, path, transform="standardize", mean=round(mean, 6), std=float(f"{std:.6g}"),
                         optional=optional),
            f"numbers {lo:g}..{hi:g}: standardized with the sample's mean and std{missing_note}")


def _shape(v: Any) -> str:
    """A value's shape for outliers: booleans, ints and floats are one shape (a label
    mixes true and 0; a numeric field's true is a 1)."""
    kind = _kind_of(v)
    return "number" if kind in ("bool", "int", "float") else kind


def _set_aside_outliers(leaf: _Leaf) -> None:
    """Move the values of rare shapes (together at most OUTLIER_SHARE of the field's
    records, e.g. one "cheap" among 2,000 prices) from `leaf.values` to `leaf.outliers`."""
    if not leaf.values:
        return
    shapes = [_shape(v) for v in leaf.values]
    top = max(set(shapes), key=shapes.count)
    rare = len(shapes) - shapes.count(top)
    if 0 < rare <= OUTLIER_SHARE * len(shapes):
        leaf.outliers = [v for v, sh in zip(leaf.values, shapes) if sh != top]
        leaf.values = [v for v, sh in zip(leaf.values, shapes) if sh == top]


def _outlier_note(outliers: list[Any], n: int) -> str:
    if not outliers:
        return ""
    return (f"; {len(outliers):,} of {n:,} records {'holds' if len(outliers) == 1 else 'hold'} another "
            f"shape (e.g. {_example(outliers)}): outliers, rejected into the dead-letter file when trained")


def _example(values: list[Any]) -> str:
    example = repr(values[0])
    return example if len(example) <= 40 else example[:37] + "..."


def _guess_list(name: str, path: str, values: list[Any], optional: bool, kinds: set[str],
                missing_note: str) -> tuple[Field, str]:
    """A list of scalars is multi-hot: max_len the sample's longest list, mean pooling."""
    lengths = np.array([len(v) for v in values if isinstance(v, list)], dtype=np.int64)
    spread = (f"{lengths.min()}-{lengths.max()} items (median {np.median(lengths):g}, "
              f"p90 {np.percentile(lengths, 90):g}, {np.mean(lengths == 0):.0%} empty)")
    if kinds != {"list"}:
        return IgnoreField(name, path), f"lists of {spread} mixed with {', '.join(sorted(kinds - {'list'}))}"
    element_kinds = {_kind_of(x) for v in values for x in v}
    if element_kinds - {"str", "int", "float", "bool"}:
        return IgnoreField(name, path), f"lists of {spread} holding {', '.join(sorted(element_kinds))}"
    max_len = max(int(lengths.max()), 1)
    # Whole numbers written as floats (3.0): keyed as integers, as an id field's would be.
    whole_floats = "float" in element_kinds and all(
        float(x).is_integer() for v in values for x in v if _kind_of(x) == "float")
    return (MultiHotField(name, path, max_len=max_len, pooling="mean", optional=optional,
                          integer_ids=whole_floats),
            f"lists of {spread}, {'/'.join(sorted(element_kinds)) or 'no'} elements: multi-hot, each "
            f"element hashed as a categorical value"
            + ("; whole numbers written as floats (e.g. 3.0): integer_ids = true keys 3.0 and 3 alike"
               if whole_floats else "")
            + f";\nmax_len = the longest in the sample (a longer list keeps its first {max_len}); "
            f"mean pooling{missing_note}")


def _kind_of(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    if isinstance(v, list):
        return "list"
    return "object"


def _time_format(values: list[str]) -> str | None:
    sample = values[:200]
    for fmt in TIME_FORMATS:
        try:
            for v in sample:
                datetime.strptime(v, fmt).replace(tzinfo=timezone.utc)
        except ValueError:
            continue
        if all(len(v) == len(sample[0]) for v in sample):
            return fmt
    return None
