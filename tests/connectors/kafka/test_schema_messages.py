"""Kafka message values under a schema: one or many records a message, rejects at their message."""
import json

import numpy as np

from stream_ctr.connectors.kafka.decode import decode_messages
from stream_ctr.connectors.schema import parse_schema

SCHEMA = parse_schema("""
[schema]
encoding = "json"
[schema.fields.clicked]
kind = "label"
[schema.fields.ad]
kind = "categorical"
[schema.fields.price]
kind = "numeric"
""")


def rec(i: int, **extra) -> bytes:
    return json.dumps({"clicked": i % 2 == 0, "ad": f"a{i}", "price": i / 10, **extra}).encode()


def test_one_or_many_records_per_message():
    values = [rec(0), rec(1) + b"\n" + rec(2) + b"\n", b"", rec(3, price="x") + b"\n" + rec(4),
              b"not json", b"\n\n", rec(5, ad=None)]
    n = len(values)
    out = decode_messages(values, np.zeros(n, np.int32), np.arange(100, 100 + n), np.full(n, 7, np.int64),
                          ("t/0",), SCHEMA)
    b = out.batch
    assert b.offset.tolist() == [100, 101, 101, 103]          # a row's offset: its message's
    assert b.labels.tolist() == [1, 0, 1, 1]
    np.testing.assert_allclose(b.dense[:, 0], [0.0, 0.1, 0.2, 0.4])
    assert (b.event_time_ms == 7).all()                        # no event_time field: the message's
    assert out.rows_per_message.tolist() == [1, 2, 0, 1, 0, 0, 0]
    assert out.line_in_message.tolist() == [0, 0, 1, 1]
    got = sorted((r.offset, r.reason) for r in out.rejected)
    assert got == [(102, "empty_message"), (103, "bad_value:price"), (104, "bad_json"),
                   (105, "empty_message"), (106, "missing:ad")]
    assert all(r.partition == "t/0" for r in out.rejected)
    # Its message held two records: which one failed (they share the message's offset).
    assert [r.detail for r in out.rejected if r.reason == "bad_value:price"] == \
        ["price = 'x': expected a number; record line 1 of 2 in its message"]
    assert "record line" not in next(r.detail for r in out.rejected if r.reason == "missing:ad")   # alone
