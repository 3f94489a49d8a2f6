"""A declared feature schema: which field of a record becomes which column of a `Batch`.

A schema is TOML, the ``[schema]`` table of a config file or a file of its
own passed with ``--schema``::

    [schema]
    encoding = "json"          # json (one object per line) | csv (delimited text)
    # csv only:
    delimiter = ","            # one character ("\\t" for TSV)
    quote = '"'                # RFC 4180 quoting: a quoted field holds the delimiter, and a doubled
                               # quote stands for one; "" turns quoting off (quotes are plain data)
    header = true              # the first line names the columns ...
    columns = ["a", "b", ...]  # ... or these names, in order (both: they must agree)

    [schema.fields.clicked]    # one table per field, in the order the columns come out
    kind = "label"             # 0/1, true/false; threshold = 0.5 for a number (>= is a click)

    [schema.fields.user_id]
    kind = "categorical"       # any scalar, hashed with its field to a 63-bit key
    default = "none"           # a missing value takes this value ...
    # optional = true          # ... or is its own value (the field's "missing" key, 0.0 dense)
    # embed_dim = 32           # this field's embedding width, a multiple of model.embed_dim
                               # (default: model.embed_dim); any embedded field or cross
    # integer_ids = true       # a value is hashed as written (3 and 3.0 are two keys); with this,
                               # a whole number is its integer: 3, 3.0, 3e0 are one key (JSON
                               # strings and csv text such as 007 stay as written)

    [schema.fields.os]
    kind = "categorical"
    path = "device.os"         # JSON: a dotted path into nested objects; csv: a column name.
                               # Default: the field's name.  Several fields may read one path.
    [schema.fields.price]
    kind = "numeric"           # one dense column, or one key column with bucketize
    transform = "log1p"        # raw | log1p (sign(x)*log1p(|x|)) | log | standardize | bucketize
    # mean = 0.1, std = 0.05   # standardize: (x - mean) / std;  log: (ln(x) - mean) / std, x > 0
    # boundaries = [0.01, 0.1] # bucketize: a key per interval; "log_squared" = Criteo's rule

    [schema.fields.ts]
    kind = "event_time"        # at most one; epoch numbers or a time string, UTC
    unit = "ms"                # s | ms  ... or format = "%Y-%m-%dT%H:%M:%S" (%Y %y %m %d %H %M %S)

    [schema.fields.hour]
    kind = "time_part"         # a key of the event time: part = hour_of_day | day_of_week

    [schema.fields.weight]
    kind = "weight"            # a number >= 0 per record: its share of the training loss (e.g. 1/rate
                               # after negative down-sampling); metrics stay unweighted

    [schema.fields.history]
    kind = "multi_hot"         # a list: a JSON array of scalars (csv: one field cut at `separator`)
    max_len = 50               # longer lists keep their FIRST max_len elements
    pooling = "mean"           # sum | mean of the elements' embeddings (an empty list pools to 0)
    # separator = "|"          # csv only (default "|"); an empty csv field is an empty list
    # optional = true          # JSON: a missing (absent or null) list is an empty one
    # integer_ids = true       # each element as a categorical field's with integer_ids

    [schema.fields.request_id]
    kind = "ignore"            # read nowhere; documents that the field is left out on purpose

    [schema.crosses.ad_x_os]
    fields = ["ad_id", "os"]   # a hashed key of two or more key fields' values

Decoded columns: ``keys`` are the key-producing fields (categorical,
bucketized numeric, time_part) in declared order, then the crosses; a key's
field id for hashing is its column index.  ``jagged`` are the multi-hot
fields in declared order (`Batch.jagged`); the j-th hashes its elements, as
a categorical value is hashed, with field id ``n_keys + j``.  ``dense`` are
the other numeric fields in declared order.  Exactly one label is required.
A multi-hot element must be a string, number or boolean; anything else
(null, a list, an object) rejects the record as ``bad_value:FIELD``.

A field's `embed_dim` of k x model.embed_dim is stored as k rows of the
store's one width, under the field's key and k - 1 keys derived from it
(`stream_ctr.models.field_inputs`): memory grows with each field's own width,
and the store, its tiers, shards and checkpoints are unchanged.  The model
sees the k rows as k fields side by side: the DNN and cross nets read the
field's whole k x d vector; DeepFM's FM term pairs the sums of two fields'
rows.

A missing value (JSON: absent or null; csv: an empty field) takes the field's
`default`; a field with ``optional = true`` gives its own "missing" key (or
0.0 for a dense column); otherwise the record is rejected with reason
``missing:FIELD``.  A value of the wrong type is rejected as ``bad_value:FIELD``
with the value in the reject's detail.

Room to grow: a field kind is one frozen dataclass with a `kind` name.
"""
from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, fields as dataclass_fields
from typing import Any, Union

ENCODINGS = ("json", "csv")
TRANSFORMS = ("raw", "log1p", "log", "standardize", "bucketize")
TIME_UNITS = ("s", "ms")
TIME_PARTS = ("hour_of_day", "day_of_week")
LOG_SQUARED = "log_squared"                 # Criteo winners' buckets: v if v <= 2 else floor(ln(v)^2)
# strftime directives the vectorized time parser reads: fixed-width digits.
TIME_DIRECTIVE_WIDTH = {"Y": 4, "y": 2, "m": 2, "d": 2, "H": 2, "M": 2, "S": 2}
POOLINGS = ("sum", "mean")


class SchemaError(ValueError):
    """A schema cannot work; the message names the field or option and says what to do."""


Scalar = Union[str, int, float, bool]


@dataclass(frozen=True)
class LabelField:
    name: str
    path: str
    threshold: float | None = None          # a number >= threshold is a click; None: 0/1, true/false
    default: Scalar | None = None
    kind: str = "label"


@dataclass(frozen=True)
class WeightField:
    name: str
    path: str
    default: float | None = None
    kind: str = "weight"


@dataclass(frozen=True)
class CategoricalField:
    name: str
    path: str
    default: Scalar | None = None
    optional: bool = False
    embed_dim: int = 0                      # 0: model.embed_dim; else a multiple of it
    integer_ids: bool = False               # whole numbers keyed as integers: 3.0 is 3
    kind: str = "categorical"


@dataclass(frozen=True)
class NumericField:
    name: str
    path: str
    transform: str = "raw"
    mean: float = 0.0
    std: float = 1.0
    boundaries: tuple[float, ...] | str = ()  # bucketize: sorted edges, or LOG_SQUARED
    default: float | None = None
    optional: bool = False
    embed_dim: int = 0                      # bucketize only: as a categorical field's
    kind: str = "numeric"

    @property
    def is_key(self) -> bool:
        return self.transform == "bucketize"


@dataclass(frozen=True)
class EventTimeField:
    name: str
    path: str
    unit: str = "ms"                        # epoch unit of a number
    format: str = ""                        # strftime format of a string (then unit is unused)
    default: Scalar | None = None
    kind: str = "event_time"


@dataclass(frozen=True)
class TimePartField:
    name: str
    part: str                               # hour_of_day | day_of_week (UTC, Monday = 0)
    embed_dim: int = 0
    kind: str = "time_part"

    @property
    def path(self) -> str:
        return ""                           # reads the event time, not the record


@dataclass(frozen=True)
class MultiHotField:
    name: str
    path: str
    max_len: int = 50                       # keep the first max_len elements of a longer list
    pooling: str = "sum"                    # sum | mean
    separator: str = "|"                    # csv: the element separator inside the field
    optional: bool = False                  # JSON: missing (absent/null) is an empty list
    embed_dim: int = 0
    integer_ids: bool = False               # as a categorical field's, for each element
    kind: str = "multi_hot"


@dataclass(frozen=True)
class IgnoreField:
    name: str
    path: str
    kind: str = "ignore"


@dataclass(frozen=True)
class Cross:
    name: str
    fields: tuple[str, ...]                 # names of key fields
    embed_dim: int = 0


Field = Union[LabelField, WeightField, CategoricalField, NumericField, EventTimeField,
              TimePartField, MultiHotField, IgnoreField]
KINDS: dict[str, type] = {c.kind: c for c in (LabelField, WeightField, CategoricalField, NumericField,  # type: ignore[attr-defined]
                                              EventTimeField, TimePartField, MultiHotField, IgnoreField)}


@dataclass(frozen=True)
class Schema:
    """A validated schema (build it with `parse_schema`); what the decoders and the trainer read."""
    encoding: str
    fields: tuple[Field, ...]
    crosses: tuple[Cross, ...] = ()
    delimiter: str = ","
    quote: str = '"'                        # csv: the quote character, "" for none
    header: bool = False
    columns: tuple[str, ...] = ()
    name: str = ""                          # "criteo" / "avazu" for the built-ins, else the encoding

    @property
    def label(self) -> LabelField:
        return next(f for f in self.fields if isinstance(f, LabelField))

    @property
    def weight(self) -> WeightField | None:
        return next((f for f in self.fields if isinstance(f, WeightField)), None)

    @property
    def event_time(self) -> EventTimeField | None:
        return next((f for f in self.fields if isinstance(f, EventTimeField)), None)

    @property
    def key_fields(self) -> tuple[str, ...]:
        """Names of the key columns of a decoded Batch, in order (fields, then crosses)."""
        return tuple(f.name for f in self.fields if is_key_field(f)) + tuple(c.name for c in self.crosses)

    @property
    def dense_fields(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields if isinstance(f, NumericField) and not f.is_key)

    @property
    def n_keys(self) -> int:
        return len(self.key_fields)

    @property
    def n_dense(self) -> int:
        return len(self.dense_fields)

    @property
    def multi_fields(self) -> tuple[MultiHotField, ...]:
        """The multi-hot fields: `Batch.jagged`, in order."""
        return tuple(f for f in self.fields if isinstance(f, MultiHotField))

    @property
    def pooling(self) -> tuple[str, ...]:
        return tuple(f.pooling for f in self.multi_fields)

    @property
    def n_model_fields(self) -> int:
        """Embedded fields the model sees: the key columns, then one pooled per multi-hot field."""
        return self.n_keys + len(self.multi_fields)

    @property
    def max_keys_per_record(self) -> int:
        """The most keys one record can bring (the store plans its working set from it)."""
        return self.n_keys + sum(f.max_len for f in self.multi_fields)

    @property
    def embed_dims(self) -> tuple[int, ...]:
        """Declared embedding width of each model field (key columns, then multi-hot
        fields); 0 where the field takes model.embed_dim."""
        return (tuple(f.embed_dim for f in self.fields if is_key_field(f))  # type: ignore[union-attr]
                + tuple(c.embed_dim for c in self.crosses) + tuple(f.embed_dim for f in self.multi_fields))

    # What FileSource and the CLI read of a RecordFormat, so a Schema can stand in for one.
    @property
    def has_header(self) -> bool:
        return self.encoding == "csv" and self.header

    @property
    def field_names(self) -> tuple[str, ...]:
        return self.columns


def is_key_field(f: Field) -> bool:
    return isinstance(f, (CategoricalField, TimePartField)) or (isinstance(f, NumericField) and f.is_key)


def parse_schema(raw: dict[str, Any] | str, origin: str = "schema") -> Schema:
    """A Schema from TOML text or its parsed table (the ``[schema]`` table, or a document that
    holds one); SchemaError naming the field and what to do when it cannot work."""
    if isinstance(raw, str):
        try:
            raw = tomllib.loads(raw)
        except tomllib.TOMLDecodeError as exc:
            raise SchemaError(f"{origin}: not valid TOML: {exc}") from None
    table = raw.get("schema", raw) if isinstance(raw, dict) else raw
    if not isinstance(table, dict):
        raise SchemaError(f"{origin}: expected a [schema] table")
    known = {"encoding", "delimiter", "quote", "header", "columns", "fields", "crosses", "name"}
    _no_unknown(table, known, f"{origin}: [schema]")
    encoding = table.get("encoding")
    if encoding not in ENCODINGS:
        raise SchemaError(f"{origin}: [schema] encoding must be one of {', '.join(ENCODINGS)}, "
                          f"got {encoding!r}")
    delimiter = table.get("delimiter", ",")
    if not isinstance(delimiter, str) or len(delimiter) != 1 or ord(delimiter) > 127 or delimiter in "\n\r\"":
        raise SchemaError(f"{origin}: [schema] delimiter must be one ASCII character (not a quote or "
                          f"line break), got {delimiter!r}")
    quote = table.get("quote", '"')
    if not isinstance(quote, str) or len(quote) > 1 or (quote and (ord(quote) > 127 or quote in "\n\r"
                                                                   or quote == delimiter)):
        raise SchemaError(f"{origin}: [schema] quote must be one ASCII character other than the "
                          f"delimiter and line breaks, or \"\" for no quoting; got {quote!r}")
    header = table.get("header", False)
    columns = table.get("columns", [])
    if not isinstance(header, bool) or not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
        raise SchemaError(f"{origin}: [schema] header must be true/false and columns a list of names")
    if encoding == "csv" and not header and not columns:
        raise SchemaError(f"{origin}: a csv schema needs header = true (the first line names the "
                          "columns) or columns = [...] (their names, in order)")
    if len(set(columns)) != len(columns):
        raise SchemaError(f"{origin}: [schema] columns has a name twice: {columns}")
    raw_fields = table.get("fields")
    if not isinstance(raw_fields, dict) or not raw_fields:
        raise SchemaError(f"{origin}: no fields; declare one table per field, e.g. "
                          "[schema.fields.clicked] kind = \"label\"")
    parsed = tuple(_parse_field(name, spec, f"{origin}: [schema.fields.{name}]")
                   for name, spec in raw_fields.items())
    crosses = tuple(_parse_cross(name, spec, f"{origin}: [schema.crosses.{name}]")
                    for name, spec in (table.get("crosses") or {}).items())
    schema = Schema(encoding=encoding, fields=parsed, crosses=crosses, delimiter=delimiter,
                    quote=quote, header=header, columns=tuple(columns), name=str(table.get("name", encoding)))
    _check_whole(schema, origin)
    return schema


def load_schema(path: str, origin: str | None = None) -> Schema:
    """`parse_schema` of a TOML file; SchemaError when it cannot be read."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SchemaError(f"cannot read schema file {path}: {exc}") from None
    return parse_schema(text, origin or path)


def _no_unknown(spec: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(spec) - known)
    if unknown:
        raise SchemaError(f"{where}: unknown option {unknown[0]!r} (known: {', '.join(sorted(known))})")


def _parse_field(name: str, spec: Any, where: str) -> Field:
    if not isinstance(spec, dict):
        raise SchemaError(f"{where}: must be a table with kind = ...")
    kind = spec.get("kind")
    cls = KINDS.get(kind)
    if cls is None:
        raise SchemaError(f"{where}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    known = {f.name for f in dataclass_fields(cls)} - {"name"}
    if cls is TimePartField:
        known.discard("path")
    _no_unknown(spec, known, where)
    values = {k: v for k, v in spec.items() if k != "kind"}
    if cls is not TimePartField:
        values.setdefault("path", name)
        if not isinstance(values["path"], str) or not values["path"]:
            raise SchemaError(f"{where}: path must be a non-empty string (a JSON dotted path or column name)")
    if "boundaries" in values:
        b = values["boundaries"]
        if b != LOG_SQUARED and not (isinstance(b, list) and b and
                                     all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in b)):
            raise SchemaError(f"{where}: boundaries must be a non-empty list of numbers or "
                              f"\"{LOG_SQUARED}\", got {b!r}")
        if isinstance(b, list):
            if any(b2 <= b1 for b1, b2 in zip(b, b[1:])):
                raise SchemaError(f"{where}: boundaries must increase strictly, got {b}")
            values["boundaries"] = tuple(float(x) for x in b)
    try:
        f = cls(name=name, **values)
    except TypeError as exc:
        raise SchemaError(f"{where}: {exc}") from None
    _check_field(f, where)
    return f


def _check_field(f: Field, where: str) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise SchemaError(f"{where}: {message}")
    default = getattr(f, "default", None)
    need(default is None or isinstance(default, (str, int, float, bool)),
         f"default must be a scalar, got {default!r}")
    need(isinstance(getattr(f, "optional", False), bool), "optional must be true or false")
    need(isinstance(getattr(f, "integer_ids", False), bool), "integer_ids must be true or false")
    need(not (getattr(f, "optional", False) and default is not None),
         "give a default or optional = true, not both")
    if isinstance(f, LabelField):
        need(f.threshold is None or _is_number(f.threshold), f"threshold must be a number, got {f.threshold!r}")
        # A bad default would fail mid-stream, at the first record that lacks the label.
        need(default is None or (_is_number(default) if f.threshold is not None else
                                 default in (0, 1) or str(default).lower() in ("true", "false", "0", "1")),
             f"default must be 0, 1, true or false{' (or a number: threshold is set)' if f.threshold is not None else ''}, "
             f"got {default!r}")
    if isinstance(f, (WeightField, NumericField)):
        need(default is None or _is_number(default), f"default must be a number, got {default!r}")
    if isinstance(f, WeightField):
        need(default is None or not _is_number(default) or default >= 0,
             f"a weight's default must be >= 0, got {default!r}")
    if isinstance(f, NumericField):
        need(f.transform in TRANSFORMS, f"transform must be one of {', '.join(TRANSFORMS)}, got {f.transform!r}")
        need(_is_number(f.mean) and _is_number(f.std) and math.isfinite(f.std) and f.std > 0,
             f"standardize needs a number mean and std > 0, got mean={f.mean!r} std={f.std!r}")
        need(not (f.transform == "log" and default is not None and _is_number(default) and default <= 0),
             f'transform = "log" needs a default > 0 (ln of it), got {default!r}')
        need((f.transform == "bucketize") == bool(f.boundaries),
             "boundaries = [...] (or \"log_squared\") goes with transform = \"bucketize\", and only there")
    if isinstance(f, EventTimeField):
        need(f.unit in TIME_UNITS, f"unit must be one of {', '.join(TIME_UNITS)}, got {f.unit!r}")
        need(isinstance(f.format, str), "format must be a string such as \"%Y-%m-%d %H:%M:%S\"")
        if f.format:
            time_format_layout(f.format, where)
            need(default is None or isinstance(default, str),
                 f"default must be a time string in format {f.format!r}, got {default!r}")
        else:
            need(default is None or (_is_number(default) and default >= 0),
                 f"default must be a number >= 0 (epoch {f.unit}), got {default!r}")
    if isinstance(f, TimePartField):
        need(f.part in TIME_PARTS, f"part must be one of {', '.join(TIME_PARTS)}, got {f.part!r}")
    dim = getattr(f, "embed_dim", 0)
    need(_is_embed_dim(dim), f"embed_dim must be a positive integer, a multiple of model.embed_dim; got {dim!r}")
    need(not (dim and isinstance(f, NumericField) and not f.is_key),
         "embed_dim goes with a field that is embedded: categorical, multi_hot, time_part or a "
         "bucketized numeric")
    if isinstance(f, MultiHotField):
        need(isinstance(f.max_len, int) and not isinstance(f.max_len, bool) and f.max_len >= 1,
             f"max_len must be an integer >= 1, got {f.max_len!r}")
        need(f.pooling in POOLINGS, f"pooling must be one of {', '.join(POOLINGS)}, got {f.pooling!r}")
        need(isinstance(f.separator, str) and len(f.separator) == 1 and f.separator not in "\n\r",
             f"separator must be one character, got {f.separator!r}")


def _is_embed_dim(x: Any) -> bool:
    """0 (the default: model.embed_dim) or a positive integer."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def time_format_layout(fmt: str, where: str = "format") -> tuple[tuple[str, int, int], ...]:
    """(directive, offset, width) of each directive of a fixed-width strftime format, and
    ("=" + character, offset, 1) of each literal character; SchemaError for anything else."""
    layout: list[tuple[str, int, int]] = []
    at = i = 0
    while i < len(fmt):
        if fmt[i] == "%":
            d = fmt[i + 1:i + 2]
            if d == "%":
                layout.append(("=%", at, 1))
                at, i = at + 1, i + 2
                continue
            if d not in TIME_DIRECTIVE_WIDTH:
                raise SchemaError(f"{where}: time format {fmt!r}: %{d} is not supported; use the "
                                  f"fixed-width directives %{' %'.join(TIME_DIRECTIVE_WIDTH)}")
            layout.append((d, at, TIME_DIRECTIVE_WIDTH[d]))
            at, i = at + TIME_DIRECTIVE_WIDTH[d], i + 2
        else:
            if ord(fmt[i]) > 127:
                raise SchemaError(f"{where}: time format {fmt!r}: literal {fmt[i]!r} is not ASCII")
            layout.append(("=" + fmt[i], at, 1))
            at, i = at + 1, i + 1
    if not any(d in ("Y", "y") for d, _, _ in layout):
        raise SchemaError(f"{where}: time format {fmt!r} needs a year (%Y or %y)")
    return tuple(layout)


def _parse_cross(name: str, spec: Any, where: str) -> Cross:
    if not isinstance(spec, dict):
        raise SchemaError(f"{where}: must be a table with fields = [...]")
    _no_unknown(spec, {"fields", "embed_dim"}, where)
    names = spec.get("fields")
    if not isinstance(names, list) or len(names) < 2 or not all(isinstance(n, str) for n in names):
        raise SchemaError(f"{where}: fields must list two or more key field names")
    dim = spec.get("embed_dim", 0)
    if not _is_embed_dim(dim):
        raise SchemaError(f"{where}: embed_dim must be a positive integer, a multiple of "
                          f"model.embed_dim; got {dim!r}")
    return Cross(name=name, fields=tuple(names), embed_dim=dim)


def _check_whole(schema: Schema, origin: str) -> None:
    labels = [f.name for f in schema.fields if isinstance(f, LabelField)]
    if len(labels) != 1:
        raise SchemaError(f"{origin}: a schema needs exactly one field of kind = \"label\", "
                          f"found {len(labels)}{': ' + ', '.join(labels) if labels else ''}")
    times = [f.name for f in schema.fields if isinstance(f, EventTimeField)]
    weights = [f.name for f in schema.fields if isinstance(f, WeightField)]
    if len(times) > 1 or len(weights) > 1:
        raise SchemaError(f"{origin}: at most one event_time and one weight field; found "
                          f"event_time {times}, weight {weights}")
    parts = [f.name for f in schema.fields if isinstance(f, TimePartField)]
    if parts and not times:
        raise SchemaError(f"{origin}: time_part field {parts[0]!r} needs an event_time field to read")
    key_names = {f.name for f in schema.fields if is_key_field(f)}
    all_names = {f.name for f in schema.fields}
    for c in schema.crosses:
        if c.name in all_names:
            raise SchemaError(f"{origin}: cross {c.name!r} has the name of a field; rename it")
        for n in c.fields:
            if n not in key_names:
                raise SchemaError(f"{origin}: [schema.crosses.{c.name}] field {n!r} is not a key field "
                                  f"(categorical, bucketized numeric or time_part); key fields: "
                                  f"{', '.join(sorted(key_names)) or 'none'}")
    if not schema.key_fields:
        raise SchemaError(f"{origin}: no key field; declare at least one categorical field")
    for f in schema.multi_fields:
        if schema.encoding == "csv" and f.separator == schema.delimiter:
            raise SchemaError(f"{origin}: [schema.fields.{f.name}] separator {f.separator!r} is the "
                              "record delimiter; pick another (e.g. \"|\")")
    if schema.encoding == "csv" and schema.columns:
        for f in schema.fields:
            if f.path and f.path not in schema.columns:
                raise SchemaError(f"{origin}: [schema.fields.{f.name}] reads column {f.path!r}, which is "
                                  f"not in columns ({', '.join(schema.columns[:8])}...)")


# ------------------------------------------------------------------ writing

def schema_to_toml(schema: Schema, comments: dict[str, str] | None = None,
                   explicit: frozenset[str] = frozenset()) -> str:
    """The schema as TOML that `parse_schema` reads back to an equal Schema.

    `comments` (field name -> text) are written as ``#`` lines above each
    field's table: `stream-ctr schema infer` explains its guesses there.
    An option at its default is left out, unless named in `explicit` (`schema
    infer` writes each list's inferred ``max_len``, 50 included, to be edited).
    """
    comments = comments or {}
    out = ["[schema]", f"encoding = {_toml_value(schema.encoding)}"]
    if schema.name and schema.name != schema.encoding:
        out.append(f"name = {_toml_value(schema.name)}")
    if schema.encoding == "csv":
        out.append(f"delimiter = {_toml_value(schema.delimiter)}")
        if schema.quote != '"':
            out.append(f"quote = {_toml_value(schema.quote)}")
        out.append(f"header = {_toml_value(schema.header)}")
        if schema.columns:
            out.append(f"columns = {_toml_value(list(schema.columns))}")
    for f in schema.fields:
        out.append("")
        for line in comments.get(f.name, "").splitlines():
            out.append(f"# {line}".rstrip())
        out.append(f"[schema.fields.{_toml_key(f.name)}]")
        out.append(f"kind = {_toml_value(f.kind)}")
        for spec in dataclass_fields(f):
            if spec.name in ("name", "kind"):
                continue
            value = getattr(f, spec.name)
            if spec.name == "path" and value == f.name:
                continue
            if value == spec.default and spec.name != "path" and spec.name not in explicit:
                continue
            out.append(f"{spec.name} = {_toml_value(value)}")
    for c in schema.crosses:
        out += ["", f"[schema.crosses.{_toml_key(c.name)}]", f"fields = {_toml_value(list(c.fields))}"]
        if c.embed_dim:
            out.append(f"embed_dim = {c.embed_dim}")
    return "\n".join(out) + "\n"


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _toml_value(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if value != value else ("inf" if value > 0 else "-inf"))
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
        return f'"{escaped}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def describe(schema: Schema) -> str:
    """One line: encoding, key and dense columns (for logs and errors)."""
    multi = f"{len(schema.multi_fields)} multi-hot, " if schema.multi_fields else ""
    return (f"{schema.name} schema ({schema.encoding}): {schema.n_keys} key columns, {multi}"
            f"{schema.n_dense} dense, label {schema.label.name!r}")


__all__ = ["Schema", "SchemaError", "Field", "LabelField", "WeightField", "CategoricalField",
           "NumericField", "EventTimeField", "TimePartField", "MultiHotField", "IgnoreField", "Cross", "parse_schema",
           "load_schema", "schema_to_toml", "is_key_field", "time_format_layout", "describe"]
