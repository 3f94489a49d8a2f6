"""The schema decoder on JSON lines and delimited text: columns, defaults, and rejects that name the field."""
import json
from datetime import datetime, timezone

import numpy as np
import pytest

from stream_ctr.connectors.hashing import hash_ints, hash_strings
from stream_ctr.connectors.schema import SchemaError, parse_schema
from stream_ctr.connectors.schema_decode import decode_records

JSON_SCHEMA = parse_schema("""
[schema]
encoding = "json"
[schema.fields.clicked]
kind = "label"
[schema.fields.user]
kind = "categorical"
[schema.fields.os]
kind = "categorical"
path = "device.os"
default = "unknown"
[schema.fields.price]
kind = "numeric"
transform = "log1p"
[schema.fields.price_bucket]
kind = "numeric"
path = "price"
transform = "bucketize"
boundaries = [0.1, 1.0]
[schema.fields.age]
kind = "numeric"
transform = "standardize"
mean = 30
std = 10
optional = true
[schema.fields.ts]
kind = "event_time"
format = "%Y-%m-%dT%H:%M:%S"
[schema.fields.hour]
kind = "time_part"
part = "hour_of_day"
[schema.fields.weight]
kind = "weight"
default = 1.0
[schema.crosses.user_x_os]
fields = ["user", "os"]
""")


def _lines(*records) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records)


GOOD = {"clicked": True, "user": "u1", "device": {"os": "ios"}, "price": 0.5, "age": 40,
        "ts": "2024-01-02T03:04:05"}


def test_json_columns_are_the_declared_features():
    b, rejected = decode_records(_lines(GOOD, {**GOOD, "clicked": 0, "user": 7, "device": {}, "price": 2,
                                                "age": None}), JSON_SCHEMA, "p", 10)
    assert rejected == []
    assert b.offset.tolist() == [10, 11] and b.partitions == ("p",)
    assert b.labels.tolist() == [1.0, 0.0]
    assert b.keys[:, 0].tolist() == hash_strings(["u1", "7"], 0).tolist()      # an int hashes as its text
    assert b.keys[:, 1].tolist() == hash_strings(["ios", "unknown"], 1).tolist()  # the default
    assert b.keys[:, 2].tolist() == hash_ints(np.array([1, 2]), 2).tolist()       # bucket of 0.5, of 2
    assert b.keys[:, 3].tolist() == hash_ints(np.array([3, 3]), 3).tolist()       # 03:04 UTC
    assert b.keys[0, 4] != b.keys[1, 4] and (b.keys >= 0).all()
    np.testing.assert_array_equal(b.dense[:, 0], np.log1p(np.float32([0.5, 2.0])))
    np.testing.assert_allclose(b.dense[:, 1], [1.0, 0.0])                         # optional: 0.0
    expected = datetime(2024, 1, 2, 3, 4, 5, tzinfo=timezone.utc).timestamp() * 1000
    assert b.event_time_ms.tolist() == [expected, expected]


def test_crosses_depend_on_every_component():
    recs = [GOOD, {**GOOD, "user": "u2"}, {**GOOD, "device": {"os": "android"}}, GOOD]
    b, _ = decode_records(_lines(*recs), JSON_SCHEMA, "p", 0)
    cross = b.keys[:, 4].tolist()
    assert len(set(cross[:3])) == 3 and cross[0] == cross[3]


@pytest.mark.parametrize("line, reason, detail", [
    (b"not json", "bad_json", ""),
    (b"", "empty", ""),
    (b"[1, 2]", "not_an_object", ""),
    (b"null", "not_an_object", ""),
    ({**GOOD, "price": "abc"}, "bad_value:price", "price = 'abc': expected a number"),
    ({**GOOD, "price": [1]}, "bad_value:price", "expected a number"),
    ({k: v for k, v in GOOD.items() if k != "user"}, "missing:user", "user"),
    ({**GOOD, "user": None}, "missing:user", "default"),
    ({**GOOD, "user": {"id": 1}}, "bad_value:user", "user = {'id': 1}"),
    ({**GOOD, "device": "ios"}, "bad_value:os", "not an object"),
    ({**GOOD, "clicked": 2}, "bad_value:clicked", "clicked = 2"),
    ({**GOOD, "clicked": "maybe"}, "bad_value:clicked", "maybe"),
    ({**GOOD, "ts": "2024-02-30T03:04:05"}, "bad_value:ts", "%Y-%m-%dT%H:%M:%S"),
    ({**GOOD, "ts": "2024-01-02 03:04:05"}, "bad_value:ts", "2024-01-02 03:04:05"),
    ({**GOOD, "weight": -1}, "bad_value:weight", ">= 0"),
    # finite as float64, inf as the model's float32: one of them made its batch's loss inf
    ({**GOOD, "age": 1e300}, "bad_value:age", "age = 1e+300: expected a number (within float32's range"),
    ({**GOOD, "price": -1e300}, "bad_value:price", "float32"),
    ({**GOOD, "weight": 1e39}, "bad_value:weight", "weight = 1e+39: expected a number >= 0 (within float32's range"),
    ({**GOOD, "clicked": None}, "missing:clicked", "is missing or null: no label to train on"),
])
def test_bad_records_are_rejected_naming_the_field(line, reason, detail):
    data = _lines(GOOD, line, GOOD)
    b, rejected = decode_records(data, JSON_SCHEMA, "p", 0)
    assert b.offset.tolist() == [0, 2]
    assert [(r.offset, r.reason) for r in rejected] == [(1, reason)]
    assert detail in rejected[0].detail
    assert rejected[0].raw == data.split(b"\n")[1]


def test_a_huge_bad_value_is_shown_cut_in_the_detail_and_whole_in_raw():
    """The detail is for a person (and goes into a dead-letter message a broker caps)."""
    big = "x" * 3_000_000
    data = _lines({**GOOD, "price": big})
    _, (rejected,) = decode_records(data, JSON_SCHEMA, "p", 0)
    assert rejected.reason == "bad_value:price" and len(rejected.detail) < 400
    assert rejected.detail.startswith("price = 'xxx") and "(3,000,002 characters)" in rejected.detail
    assert rejected.raw == data.rstrip(b"\n")


def test_first_failing_field_in_declared_order_names_the_reject():
    _, rejected = decode_records(_lines({**GOOD, "user": None, "price": "x"}), JSON_SCHEMA, "p", 0)
    assert rejected[0].reason == "missing:user"


def test_kafka_rule_skips_blank_lines():
    b, rejected = decode_records(_lines(GOOD, b"", GOOD), JSON_SCHEMA, "p", 0, skip_empty_lines=True)
    assert (len(b), rejected) == (2, [])


def test_label_words_and_threshold():
    s = parse_schema("[schema]\nencoding='json'\n[schema.fields.y]\nkind='label'\n"
                     "[schema.fields.a]\nkind='categorical'\n")
    b, rej = decode_records(_lines(*({"y": v, "a": "x"} for v in [0, 1, "true", "false", "1", False])),
                            s, "p", 0)
    assert b.labels.tolist() == [0, 1, 1, 0, 1, 0] and rej == []
    s = parse_schema("[schema]\nencoding='json'\n[schema.fields.y]\nkind='label'\nthreshold=0.5\n"
                     "[schema.fields.a]\nkind='categorical'\n")
    b, _ = decode_records(_lines(*({"y": v, "a": "x"} for v in [0.2, 0.5, 3])), s, "p", 0)
    assert b.labels.tolist() == [0, 1, 1]


def test_epoch_seconds_and_milliseconds():
    for unit, value in (("s", 1700000000.25), ("ms", 1700000000250)):
        s = parse_schema(f"[schema]\nencoding='json'\n[schema.fields.y]\nkind='label'\n"
                         f"[schema.fields.a]\nkind='categorical'\n[schema.fields.t]\nkind='event_time'\n"
                         f"unit='{unit}'\n")
        b, _ = decode_records(_lines({"y": 1, "a": "x", "t": value}), s, "p", 0)
        assert b.event_time_ms.tolist() == [1700000000250]


@pytest.mark.parametrize("unit, value, hint", [
    ("s", 1700000000250, 'look like epoch ms, unit = "ms"'),       # ms declared as seconds: year ~55,800
    ("ms", 1700000000, 'looks like epoch seconds, unit = "s"'),     # seconds declared as ms: 1970-01-20
])
def test_a_unit_that_does_not_fit_the_numbers_is_a_bad_value(unit, value, hint):
    s = parse_schema(f"[schema]\nencoding='json'\n[schema.fields.y]\nkind='label'\n"
                     f"[schema.fields.a]\nkind='categorical'\n[schema.fields.t]\nkind='event_time'\n"
                     f"unit='{unit}'\n")
    b, rejected = decode_records(_lines({"y": 1, "a": "x", "t": value}, {"y": 1, "a": "x", "t": 5}), s, "p", 0)
    assert len(b) == 1 and b.event_time_ms.tolist() == [5000 if unit == "s" else 5]   # small: accepted
    assert [r.reason for r in rejected] == ["bad_value:t"] and hint in rejected[0].detail


def test_non_ascii_tokens_hash_as_utf8():
    s = parse_schema("[schema]\nencoding='json'\n[schema.fields.y]\nkind='label'\n[schema.fields.a]\n"
                     "kind='categorical'\n")
    b, _ = decode_records(_lines({"y": 1, "a": "café"}, {"y": 0, "a": "x"}), s, "p", 0)
    assert b.keys[:, 0].tolist() == hash_strings(["café", "x"], 0).tolist()


def _id_schema(encoding: str, integer_ids: bool) -> object:
    columns = 'columns = ["y", "ad"]\n' if encoding == "csv" else ""
    return parse_schema(f"[schema]\nencoding='{encoding}'\n{columns}[schema.fields.y]\nkind='label'\n"
                        f"[schema.fields.ad]\nkind='categorical'\ndefault=3.0\n"
                        f"integer_ids={'true' if integer_ids else 'false'}\n")


# JSON: 3 written eight ways (the last one on a line with an escape, which the per-line
# parser decodes), then the values that stay as written.
ID_LINES = (b'{"y":1,"ad":3}\n{"y":0,"ad":3.0}\n{"y":0,"ad":3e0}\n{"y":0,"ad":30e-1}\n'
            b'{"y":0,"ad":"3"}\n{"y":0,"ad":3.000}\n{"y":1}\n{"y":0,"ad":3.0,"z":"a\\n"}\n'
            b'{"y":1,"ad":3.5}\n{"y":1,"ad":"3.0"}\n{"y":0,"ad":-0.0}\n{"y":0,"ad":12345678901234567}\n')


def test_integer_ids_key_a_whole_number_as_its_integer_however_written():
    b, rejected = decode_records(ID_LINES, _id_schema("json", True), "p", 0)
    assert rejected == []
    three, = hash_strings(["3"], 0)
    assert b.keys[:8, 0].tolist() == [three] * 8
    # not whole, a string, -0 (the integer 0), beyond 2**53 (kept as written)
    assert b.keys[8:, 0].tolist() == hash_strings(["3.5", "3.0", "0", "12345678901234567"], 0).tolist()
    # Without the option a value hashes as written: 3.0 (and 3e0: its repr) is another key.
    plain, _ = decode_records(ID_LINES, _id_schema("json", False), "p", 0)
    assert plain.keys[:2, 0].tolist() == hash_strings(["3", "3.0"], 0).tolist()
    assert plain.keys[10, 0] == hash_strings(["-0.0"], 0)[0]


def test_integer_ids_read_csv_text_as_json_numbers():
    data = b"1,3\n0,3.0\n0,3e0\n0,\"3.00\"\n0,\n1,007\n1,+3\n1,3.5\n1,abc\n"
    b, rejected = decode_records(data, _id_schema("csv", True), "p", 0)
    assert rejected == []
    three, = hash_strings(["3"], 0)
    assert b.keys[:5, 0].tolist() == [three] * 5       # the empty one takes the default 3.0
    assert b.keys[5:, 0].tolist() == hash_strings(["007", "+3", "3.5", "abc"], 0).tolist()
    bj, _ = decode_records(ID_LINES, _id_schema("json", True), "p", 0)
    assert bj.keys[1, 0] == b.keys[1, 0]               # csv 3.0 and JSON 3.0: one key


@pytest.mark.parametrize("encoding", ["json", "csv"])
def test_integer_ids_on_multi_hot_elements(encoding):
    columns = 'columns = ["y", "ad", "h"]\n' if encoding == "csv" else ""
    spec = (f"[schema]\nencoding='{encoding}'\n{columns}[schema.fields.y]\nkind='label'\n"
            "[schema.fields.ad]\nkind='categorical'\n[schema.fields.h]\nkind='multi_hot'\nmax_len=4\n")
    if encoding == "json":
        data = (b'{"y":1,"ad":1,"h":[3,4]}\n{"y":0,"ad":1,"h":[3.0,4e0,"3",3.5]}\n'
                b'{"y":0,"ad":1,"h":[-0.0,"x"]}\n')
    else:
        data = b"1,1,3|4\n0,1,3.0|4e0|007|3.5\n0,1,-0.0|x\n"
    third = "3" if encoding == "json" else "007"       # a JSON string "3"; csv text 007
    for integer_ids, expected in ((True, [["3", "4"], ["3", "4", third, "3.5"], ["0", "x"]]),
                                  (False, [["3", "4"], ["3.0", "4.0" if encoding == "json" else "4e0",
                                                        third, "3.5"], ["-0.0", "x"]])):
        schema = parse_schema(spec + f"integer_ids={'true' if integer_ids else 'false'}\n")
        b, rejected = decode_records(data, schema, "p", 0)
        assert rejected == []
        jagged = b.jagged[0]
        got = [jagged.values[jagged.offsets[i]:jagged.offsets[i + 1]].tolist() for i in range(3)]
        assert got == [hash_strings(row, 1).tolist() for row in expected], integer_ids


def test_integer_ids_leave_integers_of_any_size_as_written():
    from stream_ctr.connectors.schema_columns import category_keys
    huge = 10 ** 400                    # the stdlib parser's int; no float holds it
    keys, status = category_keys([huge, 3.0, 3], 0, integer_ids=True)
    assert status.tolist() == [0, 0, 0]
    assert keys.tolist() == hash_strings([str(huge), "3", "3"], 0).tolist()


def test_integer_ids_must_be_a_boolean():
    with pytest.raises(SchemaError, match="integer_ids must be true or false"):
        parse_schema("[schema]\nencoding='json'\n[schema.fields.y]\nkind='label'\n"
                     "[schema.fields.ad]\nkind='categorical'\ninteger_ids='yes'\n")


CSV_SCHEMA = parse_schema("""
[schema]
encoding = "csv"
delimiter = ";"
columns = ["y", "site", "price", "when"]
[schema.fields.y]
kind = "label"
[schema.fields.site]
kind = "categorical"
optional = true
[schema.fields.price]
kind = "numeric"
default = 0.5
[schema.fields.when]
kind = "event_time"
format = "%y%m%d%H"
""")


def test_csv_decodes_the_same_tokens_as_json():
    b, rejected = decode_records(b"1;news;1.5;24010203\r\n0;;;24010204\n0;a;b;24010203\n1;x\n",
                                 CSV_SCHEMA, "file:x", 0)
    assert [(r.offset, r.reason) for r in rejected] == [(2, "bad_value:price"), (3, "field_count")]
    assert b.keys[:, 0].tolist() == hash_strings(["news", ""], 0).tolist()
    assert b.dense[:, 0].tolist() == [1.5, 0.5]
    hour = datetime(2024, 1, 2, 3, tzinfo=timezone.utc).timestamp() * 1000
    assert b.event_time_ms.tolist() == [hour, hour + 3_600_000]
    assert rejected[0].raw == b"0;a;b;24010203" and "price = 'b'" in rejected[0].detail
    js = parse_schema("[schema]\nencoding='json'\n[schema.fields.y]\nkind='label'\n[schema.fields.site]\n"
                      "kind='categorical'\n")
    bj, _ = decode_records(_lines({"y": 1, "site": "news"}), js, "p", 0)
    assert bj.keys[0, 0] == b.keys[0, 0]


QUOTED = """
[schema]
encoding = "csv"
columns = ["y", "site", "price", "tags"]
[schema.fields.y]
kind = "label"
[schema.fields.site]
kind = "categorical"
[schema.fields.price]
kind = "numeric"
[schema.fields.tags]
kind = "multi_hot"
max_len = 5
"""


def test_quoted_csv_fields_decode_as_the_same_values_unquoted():
    schema = parse_schema(QUOTED)
    data = (b'1,news,1.5,a|b\n'                        # plain: the vectorized path
            b'0,"news, sports",2,"c|d"\n'               # the delimiter inside quotes
            b'1,"say ""hi""",3,\r\n'                     # a doubled quote, CRLF, an empty list
            b'0,"news",1.5,"a|b"\n'                      # quoted, the same values as line 0
            b'1,"open,4,x\n'                            # an unclosed quote (or a line break inside)
            b'0,"a",1\n'                                # quoted but a field short
            b'1,caf\xc3\xa9,"7",x\n')                    # UTF-8 and a quoted number
    b, rejected = decode_records(data, schema, "p", 0)
    assert [(r.offset, r.reason) for r in rejected] == [(4, "bad_quote"), (5, "field_count")]
    assert rejected[0].raw == b'1,"open,4,x'
    assert b.offset.tolist() == [0, 1, 2, 3, 6]
    assert b.keys[:, 0].tolist() == hash_strings(["news", "news, sports", 'say "hi"', "news", "café"],
                                                 0).tolist()
    assert b.dense[:, 0].tolist() == [1.5, 2.0, 3.0, 1.5, 7.0]
    assert b.jagged[0].lengths.tolist() == [2, 2, 0, 2, 1]
    assert np.array_equal(b.jagged[0].values[:2], b.jagged[0].values[4:6])    # "a|b" == a|b
    # with quoting off, quotes are plain data and the delimiter always splits
    off = parse_schema(QUOTED.replace('columns', 'quote = ""\ncolumns'))
    b_off, rejected = decode_records(b'0,"news",1.5,x\n0,"a,b",1,x\n', off, "p", 0)
    assert b_off.keys[0, 0] == hash_strings(['"news"'], 0)[0]
    assert [(r.offset, r.reason) for r in rejected] == [(1, "field_count")]


def test_a_quote_that_is_the_delimiter_is_refused():
    with pytest.raises(Exception, match="quote must be one ASCII character"):
        parse_schema(QUOTED.replace('columns', 'quote = ","\ncolumns'))


MULTI = """
[schema]
encoding = "{enc}"
{csv}
[schema.fields.y]
kind = "label"
[schema.fields.a]
kind = "categorical"
[schema.fields.tags]
kind = "multi_hot"
max_len = 3
pooling = "sum"
{optional}
"""


def _multi_schema(enc: str):
    csv = 'delimiter = ","\ncolumns = ["y", "a", "tags"]' if enc == "csv" else ""
    return parse_schema(MULTI.format(enc=enc, csv=csv, optional="optional = true" if enc == "json" else ""))


def _lists(batch):
    j = batch.jagged[0]
    return [j.values[j.offsets[i]:j.offsets[i + 1]].tolist() for i in range(len(batch))]


def test_multi_hot_keys_hash_elements_like_categorical_values_in_json_and_csv():
    js = _multi_schema("json")
    lines = ['{"y": 1, "a": "x", "tags": ["p", 7, "q", "r", "s"]}', '{"y": 0, "a": "x", "tags": []}',
             '{"y": 0, "a": "x"}', '{"y": 1, "a": "x", "tags": [true, 2.5]}']
    batch, rejected = decode_records(("\n".join(lines) + "\n").encode(), js, "p", 0)
    assert not rejected and batch.pooling == ("sum",) and batch.keys.shape == (4, 1)
    # field id of a multi-hot field: n_keys + its index (here 1); kept: the first max_len = 3
    assert _lists(batch) == [hash_strings([b"p", b"7", b"q"], 1).tolist(), [], [],
                             hash_strings([b"true", b"2.5"], 1).tolist()]
    cs = _multi_schema("csv")
    batch_csv, rejected = decode_records(b"1,x,p|7|q|r|s\n0,x,\n", cs, "p", 0)
    assert not rejected and _lists(batch_csv) == _lists(batch)[:2]
    assert np.array_equal(batch_csv.keys, batch.keys[:2])


@pytest.mark.parametrize("tags, reason", [('"p"', "bad_value:tags"), ('[["p"]]', "bad_value:tags"),
                                          ('[null]', "bad_value:tags"), ('{"k": 1}', "bad_value:tags")])
def test_bad_multi_hot_values_are_rejected_naming_the_field(tags, reason):
    line = f'{{"y": 1, "a": "x", "tags": {tags}}}\n'.encode()
    batch, rejected = decode_records(line, _multi_schema("json"), "p", 0)
    assert len(batch) == 0 and [r.reason for r in rejected] == [reason]
    assert "tags" in rejected[0].detail


def test_a_missing_list_needs_optional():
    text = MULTI.format(enc="json", csv="", optional="")
    batch, rejected = decode_records(b'{"y": 1, "a": "x"}\n', parse_schema(text), "p", 0)
    assert len(batch) == 0 and rejected[0].reason == "missing:tags"


LOG_SCHEMA = parse_schema("""
[schema]
encoding = "json"
[schema.fields.clicked]
kind = "label"
[schema.fields.user]
kind = "categorical"
default = "none"
[schema.fields.price]
kind = "numeric"
transform = "log"
mean = -2.0
std = 2.0
[schema.fields.bid]
kind = "numeric"
transform = "log"
optional = true
""")


def test_log_transform_and_its_domain():
    records = [{"clicked": 1, "price": 0.5, "bid": 10}, {"clicked": 0, "price": 0.0, "bid": 1},
               {"clicked": 0, "price": -1, "bid": 1}, {"clicked": 1, "price": 2.0}]
    b, rejected = decode_records(_lines(*records), LOG_SCHEMA, "p", 0)
    np.testing.assert_allclose(b.dense[:, 0], (np.log([0.5, 2.0]) + 2.0) / 2.0, rtol=1e-6)
    np.testing.assert_allclose(b.dense[:, 1], [np.log(10.0), 0.0], rtol=1e-6)   # optional: 0.0
    assert [r.offset for r in rejected] == [1, 2]
    assert {r.reason for r in rejected} == {"bad_value:price"}
    assert all('a number > 0 (transform = "log")' in r.detail for r in rejected)
