"""What the numpy decoder (`decode`) and the compiled one (`decode_jit`) share.

The reject reasons, the decoded-columns type, and the lookup tables both
decoders read (integer keys, field salts, Avazu's calendar keys), computed
once here with the numpy functions: so the compiled decoder uses their exact
values, and neither decoder module imports the other's internals.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from stream_ctr.connectors.formats import RecordFormat
from stream_ctr.connectors.hashing import field_salt, hash_ints

# Reject reasons; the index is the code used inside this module (0 = decoded).
REASONS = ("ok", "field_count", "bad_label", "bad_integer", "bad_time")
OK, FIELD_COUNT, BAD_LABEL, BAD_INTEGER, BAD_TIME = range(len(REASONS))


class _Columns(NamedTuple):
    """Decoded columns of a run of lines, one row per line (rejected lines too)."""
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


def criteo_buckets(values: np.ndarray) -> np.ndarray:
    """Criteo-winners integer buckets: v if v <= 2 else floor(ln(v)**2)."""
    logs = np.log(np.maximum(values, 2).astype(np.float64))
    return np.where(values <= 2, values, np.floor(logs * logs).astype(np.int64))


def signed_log1p(values: np.ndarray, missing: np.ndarray) -> np.ndarray:
    """sign(x) * log1p(|x|) as float32, 0 where missing."""
    mag = np.log1p(np.abs(values).astype(np.float32))
    return np.where(missing, np.float32(0), np.copysign(mag, values.astype(np.float32)))


def _signed_log1p_into(values: np.ndarray, out: np.ndarray) -> None:
    """`signed_log1p` written into `out`, for values that are 0 where missing
    (what `parse_ints` gives): copysign(log1p(0), +0.0) is the same +0.0.
    abs(float32(v)) == float32(abs(v)) since rounding is symmetric."""
    as_float = values.astype(np.float32)
    mag = np.abs(as_float)
    np.log1p(mag, out=mag)
    np.copysign(mag, as_float, out=out)


class _IntKeyTable:
    """Keys of Criteo's integer features for the values most counts have.

    The key of I_j is ``hash_ints(criteo_buckets(v), j)``, or the field's
    missing sign: a logarithm and a 10-step hash per value.  For v in [LOW,
    HIGH) and for missing values it is read from a table built once with
    those same functions (so it is the same key); the rare values outside
    (about 1% in Criteo-like data) are computed.
    """
    LOW, HIGH = -16, 1 << 14

    def __init__(self, n_fields: int) -> None:
        values = np.arange(self.LOW, self.HIGH, dtype=np.int64)
        fields = np.arange(n_fields)
        missing = hash_ints(np.zeros(n_fields, np.int64), fields, np.ones(n_fields, bool))
        self.span = len(values) + 1                   # the last slot of a field: its missing sign
        self.table = np.concatenate([np.append(hash_ints(criteo_buckets(values), j), missing[j])
                                     for j in range(n_fields)])
        self.base = fields * self.span - self.LOW
        self.missing_step = np.int64(self.span - 1 + self.LOW)   # value 0 -> the missing slot

    def keys(self, values: np.ndarray, missing: np.ndarray) -> np.ndarray:
        """Keys [m, n_fields] of `values` [m, n_fields] (0 where `missing`)."""
        index = np.clip(values, self.LOW, self.HIGH - 1)
        outside = index != values
        index += self.base
        index += missing * self.missing_step
        keys = np.take(self.table, index, mode="clip")
        if outside.any():
            flat = np.flatnonzero(outside)
            fields = flat % values.shape[1]
            keys.reshape(-1)[flat] = hash_ints(criteo_buckets(values.reshape(-1)[flat]), fields)
        return keys


_CRITEO_INT_KEYS = _IntKeyTable(13)
_CRITEO_CAT_SALT = field_salt(np.arange(13, 39))


_DAYS_IN_MONTH = np.array([0, 31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31], dtype=np.int64)


_AVAZU_CAT_SALT = field_salt(np.arange(21))
_HOUR_OF_DAY_KEYS = hash_ints(np.arange(24), 21)
_DAY_OF_WEEK_KEYS = hash_ints(np.arange(7), 22)
