"""Criteo and Avazu as declared schemas, in the same language as a user's own.

Decoding a Criteo or Avazu file through the general schema decoder
(`schema_decode`) with these gives the same keys, dense features, labels and
event times, bit for bit, as the hand-written decoders (`decode`,
`decode_jit`), which stay the fast path for these two layouts
(tests/connectors/test_schema_builtin.py checks it on the bundled samples).
"""
from __future__ import annotations

from stream_ctr.connectors.formats import AVAZU, CRITEO
from stream_ctr.connectors.schema import (CategoricalField, EventTimeField, IgnoreField, LabelField,
                                          NumericField, Schema, TimePartField)

_CRITEO_INTS = tuple(f"I{i}" for i in range(1, 14))

# Keys: I1..I13 as Criteo winners' buckets, then C1..C26; dense: I1..I13 as
# sign(x)*log1p(|x|).  An empty field is a value of its own (optional).
CRITEO_SCHEMA = Schema(
    encoding="csv", delimiter="\t", header=False, columns=CRITEO.field_names, name="criteo",
    fields=(LabelField("label", "label"),)
    + tuple(NumericField(n, n, transform="bucketize", boundaries="log_squared", optional=True)
            for n in _CRITEO_INTS)
    + tuple(CategoricalField(n, n, optional=True) for n in CRITEO.field_names[14:])
    + tuple(NumericField(f"{n}_log", n, transform="log1p", optional=True) for n in _CRITEO_INTS),
)

# Keys: the 21 categoricals, then hour of day and day of week of `hour` (YYMMDDHH, UTC).
AVAZU_SCHEMA = Schema(
    encoding="csv", delimiter=",", header=True, columns=AVAZU.field_names, name="avazu",
    fields=(IgnoreField("id", "id"), LabelField("click", "click"),
            EventTimeField("hour", "hour", format="%y%m%d%H"))
    + tuple(CategoricalField(n, n, optional=True) for n in AVAZU.field_names[3:])
    + (TimePartField("hour_of_day", "hour_of_day"), TimePartField("day_of_week", "day_of_week")),
)

BUILTIN_SCHEMAS: dict[str, Schema] = {"criteo": CRITEO_SCHEMA, "avazu": AVAZU_SCHEMA}
