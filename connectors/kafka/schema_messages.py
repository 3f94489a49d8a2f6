"""Kafka message values under a declared schema -> one `Batch` (the schema twin of
`decode.decode_messages`, which calls it for a Schema).

A message holds one record (a JSON object, or a delimited line) or several,
LF-separated; blank lines are no records.  All values of a fetch are joined and
decoded by one `schema_decode.decode_records` call (the compiled JSON scan for
JSON), then each row and reject is mapped back to its message: a row's offset
is its message's Kafka offset.  Without an event_time field, rows take the
message timestamp.
"""
from __future__ import annotations

import numpy as np

from stream_ctr.connectors.batch import Rejected
from stream_ctr.connectors.schema import Schema
from stream_ctr.connectors.schema_decode import decode_records

EMPTY_MESSAGE = "empty_message"


def decode_schema_messages(values: list[bytes], msg_partition: np.ndarray, msg_offset: np.ndarray,
                           msg_time_ms: np.ndarray, partitions: tuple[str, ...], schema: Schema):
    """`decode_messages` for a Schema: (batch, rejected, rows_per_message, line_in_message), the
    fields of its `DecodedMessages`."""
    data = b"\n".join(values) + b"\n"
    batch, line_rejects = decode_records(data, schema, "", 0, skip_empty_lines=True)
    raw = np.frombuffer(data, dtype=np.uint8)
    lfs = np.flatnonzero(raw == 10)
    line_start = np.concatenate([[0], lfs[:-1] + 1]).astype(np.int64)
    lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    msg_start = np.zeros(len(values), dtype=np.int64)
    np.cumsum(lengths[:-1] + 1, out=msg_start[1:])
    line_msg = np.searchsorted(msg_start, line_start, side="right") - 1
    row_line = batch.offset
    row_msg = line_msg[row_line]
    rows_per_message = np.bincount(row_msg, minlength=len(values)).astype(np.int64)
    # Line of each row inside its message, counting the lines that are records.
    record = np.ones(len(line_start), dtype=bool)
    record[_blank_lines(data, line_start, lfs, schema)] = False
    rank = np.cumsum(record) - 1
    per_message = np.bincount(line_msg[record], minlength=len(values))
    first_rank = np.cumsum(per_message) - per_message
    line_in_message = rank[row_line] - first_rank[row_msg]
    batch.offset = msg_offset[row_msg].astype(np.int64)
    batch.partition = msg_partition[row_msg].astype(np.int32)
    batch.partitions = partitions
    if schema.event_time is None:                   # no event time in the record: the message's
        batch.event_time_ms = msg_time_ms[row_msg].astype(np.int64)

    def at_message(m: int, reason: str, raw_bytes: bytes, detail: str = "") -> Rejected:
        return Rejected(partitions[msg_partition[m]], int(msg_offset[m]), reason, raw_bytes, detail)

    rejected = [at_message(int(m), r.reason, r.raw, in_message(r.detail, int(rank[r.offset] - first_rank[m]),
                                                               int(per_message[m])))
                for r in line_rejects for m in (line_msg[r.offset],)]
    rejected += [at_message(m, EMPTY_MESSAGE, b"") for m in np.flatnonzero(per_message == 0).tolist()]
    return batch, rejected, rows_per_message, line_in_message


def in_message(detail: str, line: int, lines: int) -> str:
    """A reject's detail, with which of its message's record lines it was when the message
    held several (its dead letter names the message's offset, shared by all of them)."""
    if lines <= 1:
        return detail
    where = f"record line {line + 1} of {lines} in its message"
    return f"{detail}; {where}" if detail else where


def _blank_lines(data: bytes, line_start: np.ndarray, lfs: np.ndarray, schema: Schema) -> np.ndarray:
    """Indices of the lines that are no record: empty (csv), or only whitespace (JSON)."""
    empty = np.flatnonzero(lfs == line_start)
    if schema.encoding != "json":
        return empty
    short = np.flatnonzero((lfs - line_start) <= 8)            # whitespace-only lines are rare and short
    blank = [i for i in short.tolist() if not data[line_start[i]:lfs[i]].strip()]
    return np.union1d(empty, np.array(blank, dtype=np.int64))
