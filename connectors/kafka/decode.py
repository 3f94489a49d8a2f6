"""Kafka message values -> one columnar `Batch`, decoded a whole fetch at a time.

Value layouts (all decoded by `stream_ctr.connectors.decode`, so a record trains the same
whether it was read from a file or from a topic):

- text, one record per message: a Criteo TSV / Avazu CSV line (a trailing LF
  or CRLF is allowed);
- text, packed: many LF-separated lines in one message (what `stream-ctr
  replay --packed N` produces; far fewer, larger messages are much cheaper to
  fetch);
- json: one JSON object per message whose keys are the format's field names
  (``{"label": 1, "I1": 5, ..., "C26": "3b183c6c"}``; a missing key or null is
  a missing value);
- under a declared schema (data.schema): the schema's encoding, one record or
  several LF-separated per message (`schema_messages`).

All messages of a fetch are joined into one buffer and decoded by one
vectorized call; Python loops run only over rejected records.  JSON costs
more: one `json.loads` parses the whole fetch (in C), then each field is
picked out of the objects by a list comprehension and the values are joined
into the format's text lines (still no per-record Python call of ours).  A row's `Batch.offset` is the *Kafka offset of its message*
(the rows of a packed message share it) and `Batch.partition` indexes
``"topic/partition"`` names.

What is not a record is rejected at its message's offset, never raised: a
null value (a tombstone: a delete on a compacted topic, or a key-only
message) as ``tombstone``, an empty one as ``empty_message`` (``bad_json``
under value=json: it is no JSON object), and a value that makes a decoder
raise (seen: JSON nested deeper than Python's recursion limit) as
``undecodable`` with the error as its detail -- the fetch is then decoded in
halves, down to that message, so its other messages train as usual.  Raised,
one such message would stop the stream, and again at every restart.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import repeat
from operator import is_, itemgetter

import numpy as np

from stream_ctr.connectors.batch import Batch, Rejected
from stream_ctr.connectors.decode import decode_buffer
from stream_ctr.connectors.formats import RecordFormat
from stream_ctr.connectors.kafka.schema_messages import decode_schema_messages, in_message
from stream_ctr.connectors.schema import Schema

EMPTY_MESSAGE, BAD_JSON = "empty_message", "bad_json"
TOMBSTONE, UNDECODABLE = "tombstone", "undecodable"
TOMBSTONE_DETAIL = "the message value is null (a delete on a compacted topic, or a key-only message)"
_SLACK = bytes(8)                   # after the joined values: the decoder's word reads stay inside


@dataclass
class DecodedMessages:
    batch: Batch                    # good rows, in message order then line order
    rejected: list[Rejected]        # offset = Kafka offset of the message the bad record was in
    rows_per_message: np.ndarray    # int64 [n_messages]: good rows each message produced
    line_in_message: np.ndarray     # int64 [B]: 0-based line of each row inside its message


def decode_messages(values: list[bytes | None], msg_partition: np.ndarray, msg_offset: np.ndarray,
                    msg_time_ms: np.ndarray, partitions: tuple[str, ...], fmt: RecordFormat | Schema,
                    value_format: str = "text") -> DecodedMessages:
    """Decode message `values` (message i is at `msg_offset[i]` of partition
    `partitions[msg_partition[i]]`, produced at `msg_time_ms[i]`); never raises
    for a value.

    Rows of formats without an event time (Criteo) get the message timestamp.
    Nothing is dropped silently: every line is a row or a `Rejected`; a
    message with no line at all is rejected as ``empty_message`` (a null value
    as ``tombstone``), one a decoder cannot take as ``undecodable``.  Empty
    lines (a message's trailing LF, blank lines) are no records.
    """
    values, tombstones = _fill_tombstones(values, value_format)
    decoded = _decode_apart(values, msg_partition, msg_offset, msg_time_ms, partitions, fmt, value_format)
    if len(tombstones):
        at = {(partitions[p], o)
              for p, o in zip(msg_partition[tombstones].tolist(), msg_offset[tombstones].tolist())}
        decoded.rejected = [Rejected(r.partition, r.offset, TOMBSTONE, b"", TOMBSTONE_DETAIL)
                            if (r.partition, r.offset) in at else r for r in decoded.rejected]
    return decoded


def _fill_tombstones(values: list[bytes | None], value_format: str) -> tuple[list[bytes], np.ndarray]:
    """`values` with every null value replaced by one that decodes to no record, and
    the indices of the nulls.  (JSON gets ``null``, not an empty value, which would
    make the whole fetch's one-array parse fail and parse message by message.)"""
    if None not in values:                      # one scan in C: the usual case
        return values, np.zeros(0, dtype=np.int64)
    null = np.fromiter(map(is_, values, repeat(None)), dtype=bool, count=len(values))
    filled = np.empty(len(values), dtype=object)
    filled[:] = values
    filled[null] = b"null" if value_format == "json" else b""
    return filled.tolist(), np.flatnonzero(null)


def _decode_apart(values: list[bytes], msg_partition: np.ndarray, msg_offset: np.ndarray,
                  msg_time_ms: np.ndarray, partitions: tuple[str, ...], fmt: RecordFormat | Schema,
                  value_format: str) -> DecodedMessages:
    """`_decode` the run; if a decoder raises, decode each half the same way, so
    only the messages that raise by themselves are rejected (as ``undecodable``)."""
    try:
        return _decode(values, msg_partition, msg_offset, msg_time_ms, partitions, fmt, value_format)
    except Exception as e:      # noqa: BLE001 - a value no decoder takes must not stop the stream
        if len(values) == 1:
            return DecodedMessages(Batch.empty(fmt.n_keys, fmt.n_dense, partitions, fmt.pooling),
                                   [Rejected(partitions[msg_partition[0]], int(msg_offset[0]), UNDECODABLE,
                                             values[0], f"{type(e).__name__}: {e}"[:500])],
                                   np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64))
    half = len(values) // 2
    a, b = (_decode_apart(values[s], msg_partition[s], msg_offset[s], msg_time_ms[s], partitions, fmt,
                          value_format) for s in (slice(0, half), slice(half, None)))
    return DecodedMessages(Batch.concat([a.batch, b.batch]), a.rejected + b.rejected,
                           np.concatenate([a.rows_per_message, b.rows_per_message]),
                           np.concatenate([a.line_in_message, b.line_in_message]))


def _decode(values: list[bytes], msg_partition: np.ndarray, msg_offset: np.ndarray, msg_time_ms: np.ndarray,
            partitions: tuple[str, ...], fmt: RecordFormat | Schema, value_format: str) -> DecodedMessages:
    if isinstance(fmt, Schema):                     # a declared schema: its encoding decides
        return DecodedMessages(*decode_schema_messages(values, msg_partition, msg_offset, msg_time_ms,
                                                       partitions, fmt))
    raw_values, bad_json = values, []
    if value_format == "json":
        values, bad_json = json_to_lines(values, fmt)
    # One join: every message ends in an LF, then the decoder's 8 bytes of slack.
    data = b"\n".join(values + [_SLACK])
    lines = decode_buffer(np.frombuffer(data, dtype=np.uint8), len(data) - len(_SLACK), fmt, "", 0,
                          skip_empty_lines=True)
    batch, row_line = lines.batch, lines.batch.offset
    empty = lines.line_lf == lines.line_start
    if len(empty) == len(values) and not empty.any():   # one line per message: line i is message i
        line_msg = np.arange(len(values))      # rejects index lines, rows index good rows
        row_msg = row_line
        line_in_message = np.zeros_like(row_line)
        lines_per_message = None
    else:
        lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
        msg_start = np.zeros(len(values), dtype=np.int64)
        np.cumsum(lengths[:-1] + 1, out=msg_start[1:])
        line_msg = np.searchsorted(msg_start, lines.line_start, side="right") - 1
        row_msg = line_msg[row_line]
        # Lines are numbered inside their message without the empty ones.
        rank = np.cumsum(~empty) - 1
        lines_per_message = np.bincount(line_msg[~empty], minlength=len(values))
        first_rank = np.cumsum(lines_per_message) - lines_per_message
        line_in_message = rank[row_line] - first_rank[row_msg]
    rows_per_message = np.bincount(row_msg, minlength=len(values)).astype(np.int64)
    batch.offset = msg_offset[row_msg].astype(np.int64)
    batch.partition = msg_partition[row_msg].astype(np.int32)
    batch.partitions = partitions
    if fmt.name == "criteo":          # no event time in the record: use the message's
        batch.event_time_ms = msg_time_ms[row_msg].astype(np.int64)

    def reject(msg: int, reason: str, raw: bytes, detail: str = "") -> Rejected:
        return Rejected(partitions[msg_partition[msg]], int(msg_offset[msg]), reason, raw, detail)

    if lines_per_message is None:       # one line per message
        rejected = [reject(int(line_msg[r.offset]), r.reason, r.raw, r.detail) for r in lines.rejected]
    else:
        rejected = [reject(int(m), r.reason, r.raw,
                           in_message(r.detail, int(rank[r.offset] - first_rank[m]), int(lines_per_message[m])))
                    for r in lines.rejected for m in (line_msg[r.offset],)]
        json_bad = set(bad_json)
        rejected += [reject(m, BAD_JSON, raw_values[m]) if m in json_bad
                     else reject(m, EMPTY_MESSAGE, b"")
                     for m in np.flatnonzero(lines_per_message == 0).tolist()]
    return DecodedMessages(batch, rejected, rows_per_message, line_in_message)


def json_to_lines(values: list[bytes], fmt: RecordFormat) -> tuple[list[bytes], list[int]]:
    """JSON objects -> the format's text lines; bad messages become b"" and are listed.

    The whole fetch is parsed by one `json.loads` of a JSON array; only when
    that fails, or a value held several top-level items (``1, 2``: the array
    has more elements than messages), are the messages parsed one by one.
    """
    try:
        objects = json.loads(b"[" + b",".join(values) + b"]")
    except ValueError:
        objects = None
    if objects is None or len(objects) != len(values):
        objects = [_loads_or_none(v) for v in values]
    bad = [i for i, o in enumerate(objects) if not isinstance(o, dict)]
    for i in bad:
        objects[i] = {}
    columns = []
    for name in fmt.field_names:
        column = [o.get(name) for o in objects]
        text = list(map(str, column))
        if None in column:                        # null or absent: a missing value
            text = ["" if v is None else t for v, t in zip(column, text)]
        columns.append(text)
    lines = list(map(fmt.delimiter.join, zip(*columns)))
    if "\n".join(lines).count("\n") != len(lines) - 1:
        bad += [i for i, line in enumerate(lines) if "\n" in line]   # would split its record
    for i in bad:
        lines[i] = ""
    try:
        return "\n".join(lines).encode("utf-8").split(b"\n"), sorted(set(bad))
    except UnicodeEncodeError:                    # a lone surrogate ("\ud800") in some value
        encoded = []
        for i, line in enumerate(lines):
            try:
                encoded.append(line.encode("utf-8"))
            except UnicodeEncodeError:
                bad.append(i)
                encoded.append(b"")
        return encoded, sorted(set(bad))


def _loads_or_none(value: bytes) -> object:
    try:
        return json.loads(value)
    except ValueError:
        return None


def event_order(values: list[bytes], partition: np.ndarray, offset: np.ndarray, time_ms: np.ndarray):
    """Interleave the partitions of one fetch by message time, each partition kept in offset order.

    A fetch returns each partition as one run; trained run after run, a
    backfill would see the whole time range once per partition.  The sort key
    is the running maximum of the timestamps within each partition, so a late
    timestamp never moves a message ahead of an earlier offset of its partition.
    """
    key = time_ms.copy()
    starts = np.flatnonzero(np.diff(partition, prepend=-1))
    for lo, hi in zip(starts, np.append(starts[1:], len(key))):
        np.maximum.accumulate(key[lo:hi], out=key[lo:hi])
    order = np.argsort(key, kind="stable")
    if (order[1:] > order[:-1]).all():
        return values, partition, offset, time_ms
    return list(itemgetter(*order)(values)), partition[order], offset[order], time_ms[order]
