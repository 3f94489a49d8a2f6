"""Record formats the file and Kafka sources understand.

A `RecordFormat` names the raw fields of one text line and the columns the
decoder produces: `key_fields` (one int64 feature sign per row each, in this
order; a key's field id is its index in this tuple) and `n_dense` dense
float32 features.  The decoding rules live in `stream_ctr.connectors.decode`.

CRITEO  Kaggle DAC / Criteo 1TB TSV, no header, 40 fields:
        label, I1..I13 (integer counts), C1..C26 (8-hex categorical hashes);
        an empty field is a missing value.  Keys: I1..I13 as integer buckets,
        then C1..C26.  Dense: I1..I13 as sign(x)*log1p(|x|).  No event time.
AVAZU   Kaggle Avazu CSV with a header, 24 fields: id, click, hour (YYMMDDHH,
        UTC), 21 categoricals.  Keys: the 21 categoricals, then hour_of_day and
        day_of_week derived from `hour`.  No dense features.  `id` is not a
        feature; event time comes from `hour`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RecordFormat:
    name: str
    field_names: tuple[str, ...]      # raw fields of a line, in order
    key_fields: tuple[str, ...]       # key columns of a decoded Batch, in order
    n_dense: int
    has_header: bool
    delimiter: str                    # one ASCII character

    @property
    def n_fields(self) -> int:
        """Raw fields per line."""
        return len(self.field_names)

    @property
    def n_keys(self) -> int:
        """Key columns per decoded row."""
        return len(self.key_fields)

    @property
    def pooling(self) -> tuple[str, ...]:
        """Pooling of each multi-hot (jagged) field: none in these formats."""
        return ()

    @property
    def n_model_fields(self) -> int:
        """Embedded fields the model sees (key columns; no multi-hot fields here)."""
        return self.n_keys

    @property
    def max_keys_per_record(self) -> int:
        return self.n_keys

    @property
    def delimiter_byte(self) -> int:
        return ord(self.delimiter)


_CRITEO_INTS = tuple(f"I{i}" for i in range(1, 14))
_CRITEO_CATS = tuple(f"C{i}" for i in range(1, 27))

CRITEO = RecordFormat(
    name="criteo",
    field_names=("label",) + _CRITEO_INTS + _CRITEO_CATS,
    key_fields=_CRITEO_INTS + _CRITEO_CATS,
    n_dense=13,
    has_header=False,
    delimiter="\t",
)

_AVAZU_CATS = ("C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id",
               "app_domain", "app_category", "device_id", "device_ip", "device_model",
               "device_type", "device_conn_type", "C14", "C15", "C16", "C17", "C18",
               "C19", "C20", "C21")

AVAZU = RecordFormat(
    name="avazu",
    field_names=("id", "click", "hour") + _AVAZU_CATS,
    key_fields=_AVAZU_CATS + ("hour_of_day", "day_of_week"),
    n_dense=0,
    has_header=True,
    delimiter=",",
)

FORMATS: dict[str, RecordFormat] = {f.name: f for f in (CRITEO, AVAZU)}


def format_by_name(name: str) -> RecordFormat:
    """The format called `name` (case-insensitive); ValueError listing known names otherwise."""
    fmt = FORMATS.get(name.strip().lower())
    if fmt is None:
        raise ValueError(f"unknown record format {name!r}; known formats: {', '.join(sorted(FORMATS))}")
    return fmt
