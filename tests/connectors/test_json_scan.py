"""The compiled JSON scan gives the same rows and rejects as the per-line parser it stands in for."""
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from stream_ctr.connectors.schema import parse_schema
from stream_ctr.connectors.schema_decode import decode_records, json_parser
from stream_ctr.connectors.synth_json import AD_LOG_SCHEMA, write_synthetic_json

SCHEMA = parse_schema("""
[schema]
encoding = "json"
[schema.fields.y]
kind = "label"
[schema.fields.a]
kind = "categorical"
optional = true
[schema.fields.os]
kind = "categorical"
path = "d.os"
default = "none"
[schema.fields.n]
kind = "numeric"
transform = "log1p"
optional = true
[schema.fields.nb]
kind = "numeric"
path = "n"
transform = "bucketize"
boundaries = [-1.0, 0.0, 1.5, 100.0]
optional = true
[schema.fields.t]
kind = "event_time"
unit = "s"
default = 0
[schema.fields.h]
kind = "multi_hot"
max_len = 2
pooling = "mean"
optional = true
""")

EDGE_LINES = [
    '{"y": 1, "a": "x", "d": {"os": "ios"}, "n": 1.5, "t": 1700000000}',
    '{"y":0,"a":"x\\"q","n":2}',                       # an escape: per-line path
    '{"y": 0, "a": "café", "n": 2}',                    # UTF-8 text
    '{"y": 0, "a": "日本 🎉", "n": 2, "é": "x"}',
    '{"y": 1, "a": 1.50, "n": -0}',                     # a float token; integer -0
    '{"y": 1, "a": 7, "n": -0.0, "t": 1.7e9}',
    '{"y": 1, "a": true, "n": 1e400}',                  # inexact: Python's float -> inf -> bad
    '{"y": 1, "a": "x", "n": 123456789012345678}',      # 18 digits: exact enough, inexact flag
    '{"y": 1, "a": "x", "n": 12345678901234567890}',    # 20 digits: per-line path
    '{"y": 1, "a": "x", "a": "z"}',                     # duplicate key: the parser's rule
    '{"y": 1, "d": "ios"}',                             # a parent that is not an object
    '{"y": 1, "d": null, "n": null}',
    '{"y": 1, "d": {}, "a": {"k": [1, 2]}}',            # an object where a scalar belongs
    '{"y": 1, "a": [1, {"b": "c"}], "n": "3.5"}',        # a list; a number as a string
    '{"y": "true", "a": "x"}',
    '{"y": 2, "a": "x"}',
    '  {"y": 1 , "a" : "x" }  \r',
    '{"y": 1, "a": "x",}',
    '{"y": 1, "a": "x"} {}',
    '{"y": 01}',
    '[1, 2]',
    'null',
    '',
    '{"y": tru}',
    '{"y": 1, "a": "x", "z": {"deep": [[[]]], "e": 1E+2}}',
    '{"y": 1, "a": "x", "h": [1, "b", 2.50, true, 7]}',    # multi-hot: mixed scalars, cut at 2
    '{"y": 1, "a": "x", "h": [ ]}',                      # an empty list
    '{"y": 1, "a": "x", "h": null}',                     # missing, optional: empty
    '{"y": 1, "a": "x", "h": [1.5e3, -0, "caf\u00e9"]}',  # an escape: per-line path
    '{"y": 1, "a": "x", "h": [[1], 2]}',                 # a list inside: bad_value:h
    '{"y": 1, "a": "x", "h": [null]}',
    '{"y": 1, "a": "x", "h": {"k": 1}}',
    '{"y": 1, "a": "x", "h": "1,2"}',
    '{"y": 1, "a": "x", "h": [12, 0, 7]}',                # integer lists: cut into digit runs
    '{"y": 1, "a": "x", "h": [ 5 ,\t60 ]}',
    '{"y": 1, "a": "x", "h": [-0, 3]}',                  # -0 is 0 to the parser: list path
    '{"y": 1, "a": "x", "h": [42]}',
]


def _both(data: bytes):
    fast = decode_records(data, SCHEMA, "p", 5)
    with json_parser("orjson"):
        slow = decode_records(data, SCHEMA, "p", 5)
    return fast, slow


def _assert_same(fast, slow):
    (fb, fr), (sb, sr) = fast, slow
    for name in ("labels", "dense", "keys", "event_time_ms", "offset"):
        a, b = getattr(fb, name), getattr(sb, name)
        assert a.shape == b.shape and a.tobytes() == b.tobytes(), name      # bit for bit
    assert len(fb.jagged) == len(sb.jagged)
    for a, b in zip(fb.jagged, sb.jagged):                                 # multi-hot keys
        assert a.values.tobytes() == b.values.tobytes() and a.offsets.tobytes() == b.offsets.tobytes()
    assert [(r.offset, r.reason, r.detail, r.raw) for r in fr] == [(r.offset, r.reason, r.detail, r.raw) for r in sr]


def test_edge_cases_decode_the_same_both_ways():
    data = ("\n".join(EDGE_LINES) + "\n").encode()
    fast, slow = _both(data)
    _assert_same(fast, slow)
    assert len(fast[0]) > 5 and len(fast[1]) > 5
    reasons = {r.offset - 5: r.reason for r in fast[1]}
    h = [EDGE_LINES.index(line) for line in EDGE_LINES if '"h"' in line]
    assert [reasons.get(i) for i in h] == [None] * 4 + ["bad_value:h"] * 4 + [None] * 4
    rows = {o - 5: r for r, o in enumerate(fast[0].offset)}
    ok = h[:4] + h[8:]
    assert [len(fast[0].jagged[0].slice(rows[i], rows[i] + 1).values) for i in ok] == [2, 0, 0, 2, 2, 2, 2, 1]


def test_the_synthetic_log_decodes_the_same_both_ways(tmp_path):
    path = tmp_path / "log.jsonl"
    write_synthetic_json(path, 3000)
    data = path.read_bytes()
    ad = parse_schema(AD_LOG_SCHEMA)
    fast = decode_records(data, ad, "p", 0)
    with json_parser("json"):
        slow = decode_records(data, ad, "p", 0)
    _assert_same(fast, slow)
    assert len(fast[0]) == 3000


scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6),
                    st.sampled_from(["0", "1", "true", "x y", "2024"]))
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(st.sampled_from(["os", "k"]), scalars))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(["y", "a", "d", "n", "t", "h", "other"]), values), min_size=1,
                max_size=20))
def test_random_records_decode_the_same_both_ways(records):
    data = ("\n".join(json.dumps(r, ensure_ascii=bool(len(r) % 2)) for r in records) + "\n").encode()
    _assert_same(*_both(data))


def test_invalid_utf8_is_the_parsers_to_reject():
    lines = [b'{"y": 1, "a": "ok"}', b'{"y": 1, "a": "\xff"}', b'{"y": 1, "a": "\xc3"}',
             b'{"y": 1, "a": "\xed\xa0\x80"}', b'{"y": 1, "a": "\xe0\x80\x80"}',
             b'{"y": 1, "a": "\xf4\x90\x80\x80"}', b'{"y": 1, "a": "\xf0\x9f\x8e\x89"}']
    fast, slow = _both(b"\n".join(lines) + b"\n")
    _assert_same(fast, slow)
    assert fast[0].offset.tolist() == [5, 11]
