"""A plain, independent decoder the tests hold the fast one to: one line at a time.

Written from the record rules (connectors/formats.py, the docstrings of
connectors/decode.py and connectors/kafka/decode.py) and from the key spec in
connectors/hashing.py's docstring, with Python ints, `re`, `math` and
`datetime`.  It calls no product code; it only fills the product's result
containers (`Batch`, `Rejected`, `DecodedMessages`).  Slow on purpose.
"""
from __future__ import annotations

import json
import math
import re
from datetime import datetime, timedelta, timezone
from functools import lru_cache

import numpy as np

from stream_ctr.connectors.batch import Batch, Rejected
from stream_ctr.connectors.formats import RecordFormat
from stream_ctr.connectors.kafka.decode import DecodedMessages

# --- feature signs (connectors/hashing.py's docstring) -----------------------
U64, U63 = (1 << 64) - 1, (1 << 63) - 1
GOLDEN, SEED, INT_TAG = 0x9E3779B97F4A7C15, 0x5C7A11E5D00DF00D, 1 << 62


def mix64(x: int) -> int:
    """The splitmix64 finalizer on one 64-bit int."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & U64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & U64
    return x ^ (x >> 31)


def salt(field: int) -> int:
    return mix64(((field * GOLDEN) & U64) ^ SEED)


@lru_cache(maxsize=None)
def token_key(field: int, token: bytes) -> int:
    """Key of a byte token in key column `field`; b"" (a missing value) is a token too."""
    state = (salt(field) + len(token) * GOLDEN) & U64
    for i in range(0, max(len(token), 1), 8):          # one zero chunk when empty
        state = mix64(state ^ int.from_bytes(token[i:i + 8], "little"))
    return state & U63


@lru_cache(maxsize=None)
def int_key(field: int, value: int) -> int:
    """Key of an integer token (two's complement word, length tag INT_TAG)."""
    return mix64(((salt(field) + INT_TAG * GOLDEN) & U64) ^ (value & U64)) & U63


# --- one record -----------------------------------------------------------------
INTEGER = re.compile(rb"-?[0-9]{1,18}")     # |value| < 10**18: no '+', no spaces, no '_'
HOUR = re.compile(rb"[0-9]{8}")             # Avazu YYMMDDHH
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


@lru_cache(maxsize=None)                    # the tests decode the same sample lines many times
def decode_record(line: bytes, fmt: RecordFormat):
    """(label, dense, keys, event_time_ms) of one line without its line ending, or
    the reason it is rejected (checked in this order: field count, label, the rest)."""
    fields = line.split(fmt.delimiter.encode())
    if len(fields) != fmt.n_fields:
        return "field_count"
    label = fields[0] if fmt.name == "criteo" else fields[1]
    if label not in (b"0", b"1"):
        return "bad_label"
    return (_criteo if fmt.name == "criteo" else _avazu)(int(label), fields)


def _criteo(label: int, fields: list[bytes]):
    ints, cats = fields[1:14], fields[14:]
    if not all(t == b"" or INTEGER.fullmatch(t) for t in ints):
        return "bad_integer"
    dense, keys = [], []
    for j, token in enumerate(ints):
        if token == b"":                                  # missing: dense 0, the field's missing sign
            dense.append(0.0)
            keys.append(token_key(j, b""))
        else:
            v = int(token)
            dense.append(math.copysign(math.log1p(abs(v)), v))
            keys.append(int_key(j, v if v <= 2 else math.floor(math.log(v) ** 2)))
    keys += [token_key(13 + j, token) for j, token in enumerate(cats)]
    return label, tuple(dense), tuple(keys), -1


def _avazu(label: int, fields: list[bytes]):
    hour = fields[2]
    try:
        if not HOUR.fullmatch(hour):
            raise ValueError(hour)
        yy, mm, dd, hh = (int(hour[i:i + 2]) for i in range(0, 8, 2))
        when = datetime(2000 + yy, mm, dd, hh, tzinfo=timezone.utc)   # ValueError if no such hour
    except ValueError:
        return "bad_time"
    keys = [token_key(j, token) for j, token in enumerate(fields[3:])]
    keys += [int_key(21, hh), int_key(22, when.weekday())]        # hour of day; Monday = 0
    return label, (), tuple(keys), (when - EPOCH) // timedelta(milliseconds=1)


def _without_cr(line: bytes) -> bytes:
    return line[:-1] if line.endswith(b"\r") else line


def _batch(rows: list, fmt: RecordFormat, partition: list[int], partitions: tuple) -> Batch:
    """rows: (offset, label, dense, keys, event_time_ms) tuples."""
    offset, label, dense, keys, time = (list(c) for c in zip(*rows)) if rows else ([],) * 5
    return Batch(labels=np.array(label, np.float32),
                 dense=np.array(dense, np.float64).reshape(len(rows), fmt.n_dense).astype(np.float32),
                 keys=np.array(keys, np.int64).reshape(len(rows), fmt.n_keys),
                 event_time_ms=np.array(time, np.int64), partition=np.array(partition, np.int32),
                 offset=np.array(offset, np.int64), partitions=partitions)


# --- stream_ctr.connectors.decode.decode_lines ----------------------------------------------
def decode_lines(data: bytes, fmt: RecordFormat, partition: str, first_offset: int):
    """Line i (LF-separated, the last may lack its LF, one CR before the LF
    dropped) has offset first_offset + i; it is a row or a Rejected."""
    lines = data.split(b"\n")
    if lines[-1] == b"":                  # what follows the last LF is no line
        lines.pop()
    rows, rejected = [], []
    for i, line in enumerate(map(_without_cr, lines)):
        record = decode_record(line, fmt)
        if isinstance(record, str):
            rejected.append(Rejected(partition, first_offset + i, record, line))
        else:
            rows.append((first_offset + i, *record))
    return _batch(rows, fmt, [0] * len(rows), (partition,)), rejected


# --- stream_ctr.connectors.kafka.decode.decode_messages ---------------------------------------
def json_line(value: bytes, fmt: RecordFormat) -> bytes | None:
    """A JSON object's text line (absent / null = missing, other values as str());
    None for a value that is not one JSON object or would not be one line of UTF-8."""
    try:
        obj = json.loads(value)
        if not isinstance(obj, dict):
            return None
        line = fmt.delimiter.join("" if obj.get(n) is None else str(obj[n]) for n in fmt.field_names)
        return None if "\n" in line else line.encode("utf-8")
    except ValueError:                      # not JSON; or a lone surrogate ("\ud800"): no UTF-8
        return None


def decode_messages(values, msg_partition, msg_offset, msg_time_ms, partitions, fmt,
                    value_format="text"):
    """Rows in message order then line order; the non-empty lines of a message are
    its records.  Rejects: bad lines in that order, then the messages without
    any line (bad_json with the raw value, or empty_message).  A bad line of a message
    of several records names which it was in its detail."""
    rows, row_partition, line_in_message, rows_per_message = [], [], [], []
    bad_lines, no_line = [], []
    for m, value in enumerate(values):
        p, offset = int(msg_partition[m]), int(msg_offset[m])
        text = json_line(value, fmt) if value_format == "json" else value
        lines = [] if text is None else [line for line in text.split(b"\n") if line]
        if not lines:
            no_line.append(Rejected(partitions[p], offset, "bad_json", value) if text is None
                           else Rejected(partitions[p], offset, "empty_message", b""))
        n_before = len(rows)
        for k, line in enumerate(map(_without_cr, lines)):
            record = decode_record(line, fmt)
            if isinstance(record, str):
                where = f"record line {k + 1} of {len(lines)} in its message" if len(lines) > 1 else ""
                bad_lines.append(Rejected(partitions[p], offset, record, line, where))
                continue
            label, dense, keys, time = record
            rows.append((offset, label, dense, keys, int(msg_time_ms[m]) if fmt.name == "criteo" else time))
            row_partition.append(p)
            line_in_message.append(k)
        rows_per_message.append(len(rows) - n_before)
    return DecodedMessages(_batch(rows, fmt, row_partition, tuple(partitions)), bad_lines + no_line,
                           np.array(rows_per_message, np.int64), np.array(line_in_message, np.int64))
