"""Schema inference from a sample: kinds, comments, and a result that parses."""
import json

import pytest

from stream_ctr.connectors.schema import (CategoricalField, EventTimeField, IgnoreField, LabelField,
                                          MultiHotField, NumericField, SchemaError)
from stream_ctr.connectors.schema_infer import infer_schema
from stream_ctr.connectors.synth_json import write_synthetic_json


def test_json_ad_log(tmp_path):
    path = tmp_path / "log.jsonl"
    write_synthetic_json(path, 3000)
    schema, comments = infer_schema(path, "json", 2000)
    kinds = {f.name: f for f in schema.fields}
    assert isinstance(kinds["clicked"], LabelField) and "positive" in comments["clicked"]
    assert isinstance(kinds["ts"], EventTimeField) and kinds["ts"].unit == "ms"
    assert isinstance(kinds["event_id"], IgnoreField) and "unique" in comments["event_id"]
    assert kinds["history"] == MultiHotField("history", "history", max_len=50, pooling="mean")
    assert "multi-hot" in comments["history"] and "0-50 items" in comments["history"]
    assert kinds["os"] == CategoricalField("os", "device.os")
    assert isinstance(kinds["position"], CategoricalField) and "10 distinct" in comments["position"]
    # prices span decades: ln, standardized (the teacher's price term is on a log scale)
    assert isinstance(kinds["price"], NumericField) and kinds["price"].transform == "log"
    assert "decades" in comments["price"] and abs(kinds["price"].std - 1.0) < 0.2
    assert all(f.name in comments for f in schema.fields)


@pytest.mark.parametrize("values, transform", [
    ([0.001 * 1.5 ** i for i in range(40)], "log"),      # positive, 6.9 decades
    ([0.0] + [float(2 ** (i % 20)) for i in range(39)], "log1p"),   # heavy-tailed with zeros: log1p
    ([5.0 + i for i in range(40)], "standardize"),       # under three decades
    ([1 + 97 * i for i in range(150)], "ignore"),         # 150 unique integers over decades: an id
])
def test_numeric_transform_by_range(tmp_path, values, transform):
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps({"clicked": i % 2, "site": f"s{i % 3}", "x": v}) + "\n" for i, v in enumerate(values)))
    schema, _ = infer_schema(path, "json", 1000)
    field = {f.name: f for f in schema.fields}["x"]
    assert (field.kind if transform == "ignore" else field.transform) == transform


def test_whole_numbers_named_like_ids_are_categorical_and_floats_among_them_keyed_as_integers(tmp_path):
    """site_id 1..400 would be standardized as a quantity by its range; under an id-like
    name it is categorical. Written as 3.0 it would hash apart from 3: the inferred field
    keys whole numbers as integers, and the comment says why."""
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps({
        "clicked": i % 2, "site_id": 1 + (i * 7) % 400, "adId": float(1 + i % 300),
        "bid": 0.5 + (i % 40) * 0.25, "request_id": i}) + "\n" for i in range(2000)))
    schema, comments = infer_schema(path, "json", 2000)
    kinds = {f.name: f for f in schema.fields}
    assert kinds["site_id"] == CategoricalField("site_id", "site_id")
    assert "named like an id" in comments["site_id"] and "WARNING" not in comments["site_id"]
    assert kinds["adId"] == CategoricalField("adId", "adId", integer_ids=True)
    assert "written as floats" in comments["adId"] and "integer_ids = true" in comments["adId"]
    assert isinstance(kinds["bid"], NumericField)                 # a price, not an id
    assert isinstance(kinds["request_id"], IgnoreField) and "unique per record" in comments["request_id"]


def test_csv_with_header_time_strings_and_missing_values(tmp_path):
    rows = ["y;site;amount;when"] + [f"{i % 2};s{i % 7};{'' if i % 5 == 0 else i * 3.5};"
                                     f"2024-01-0{1 + i % 9} 10:00:0{i % 10}" for i in range(200)]
    path = tmp_path / "log.csv"
    path.write_text("\n".join(rows) + "\n")
    schema, comments = infer_schema(path, "csv", 100)
    assert (schema.delimiter, schema.header) == (";", True)
    kinds = {f.name: f for f in schema.fields}
    assert isinstance(kinds["y"], LabelField)
    assert kinds["when"] == EventTimeField("when", "when", format="%Y-%m-%d %H:%M:%S")
    assert kinds["amount"].optional and "optional" in comments["amount"]


def test_label_is_needed(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(json.dumps({"a": f"x{i % 5}", "b": i * 1.5}) for i in range(50)))
    with pytest.raises(SchemaError, match="--label FIELD"):
        infer_schema(path, "json")
    schema, _ = infer_schema(path, "json", label="b")
    assert schema.label == LabelField("b", "b", threshold=0.5)


def test_lists_of_scalars_are_multi_hot_and_lists_of_objects_ignored(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(json.dumps({"y": i % 2, "a": f"x{i % 5}", "tags": ["t"] * (i % 4),
                                           "objs": [{"k": 1}]} | ({} if i % 3 else {"maybe": [1, 2]}))
                              for i in range(60)))
    schema, comments = infer_schema(path, "json")
    kinds = {f.name: f for f in schema.fields}
    assert kinds["tags"] == MultiHotField("tags", "tags", max_len=3, pooling="mean")
    assert "25% empty" in comments["tags"]
    assert kinds["maybe"] == MultiHotField("maybe", "maybe", max_len=2, pooling="mean", optional=True)
    assert isinstance(kinds["objs"], IgnoreField)


def test_schema_infer_writes_each_lists_max_len_even_at_the_default(tmp_path):
    """`stream-ctr schema infer` writes `max_len = N` (the longest list sampled) for every
    multi-hot field, 50 (the parser's default) included: the line to edit is there."""
    import tomllib
    from stream_ctr.cli.main import main
    from stream_ctr.connectors.schema import parse_schema
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(json.dumps({"y": i % 2, "a": f"x{i % 5}", "tags": [f"t{i % 9}"] * (i % 4),
                                           "hist": list(range(i % 51))}) for i in range(120)))
    out = tmp_path / "schema.toml"
    assert main(["schema", "infer", f"json:{path}", "--out", str(out), "--quiet"]) == 0
    text = out.read_text()
    fields = tomllib.loads(text)["schema"]["fields"]
    assert fields["hist"]["kind"] == "multi_hot" and fields["hist"]["max_len"] == 50
    assert fields["tags"]["kind"] == "multi_hot" and fields["tags"]["max_len"] == 3
    assert "keeps its first 50" in text and "keeps its first 3" in text     # the comments say why
    assert parse_schema(text, "s.toml") == infer_schema(path, "json")[0]   # reads back the same


def test_lists_of_whole_floats_are_keyed_as_integers(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(json.dumps({"y": i % 2, "a": f"x{i % 5}", "hist": [float(i % 7), 3.0],
                                           "prices": [0.5 + i % 3]}) for i in range(60)))
    schema, comments = infer_schema(path, "json")
    kinds = {f.name: f for f in schema.fields}
    assert kinds["hist"] == MultiHotField("hist", "hist", max_len=2, pooling="mean", integer_ids=True)
    assert "integer_ids = true" in comments["hist"]
    assert not kinds["prices"].integer_ids and "integer_ids" not in comments["prices"]


def test_a_second_label_like_field_is_flagged_when_another_is_named(tmp_path):
    """--label conversion on a log that also has `clicked`: a feature that is an outcome leaks it."""
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps({"conversion": i % 7 == 0, "clicked": i % 3 == 0, "ad": f"a{i % 5}"}) + "\n"
                            for i in range(60)))
    schema, comments = infer_schema(path, "json", 60, label="conversion")
    assert schema.fields[0].name == "conversion"
    assert "WARNING: named and valued like a label" in comments["clicked"]
    assert "WARNING" not in comments["ad"]


def _log_with_outliers(path, outliers: list[dict], n: int = 2000):
    rows = [{"user_id": f"u{i % 30}", "ad_id": i % 7, "price": 0.01 + i * 1e-4, "clicked": i % 3 == 0,
             "device": {"os": "ios" if i % 2 else "android"}} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + outliers))


def test_a_rare_value_of_another_shape_does_not_decide_the_field(tmp_path):
    """One word among 2,000 prices, one list among 2,000 ids, one string where the others
    hold an object: the field keeps the majority's kind and the comment names the outlier
    (training rejects that record into the dead-letter file)."""
    path = tmp_path / "log.jsonl"
    base = {"user_id": "u1", "ad_id": 1, "price": 0.3, "clicked": False, "device": {"os": "ios"}}
    _log_with_outliers(path, [{**base, "price": "cheap"}, {**base, "ad_id": [1, 2]},
                              {**base, "device": "iphone"}, {**base, "clicked": 0}])
    schema, comments = infer_schema(path, "json", label="clicked")
    kinds = {f.name: f for f in schema.fields}
    assert isinstance(kinds["price"], NumericField) and kinds["price"].transform == "standardize"
    assert "1 of 2,004 records holds another shape (e.g. 'cheap')" in comments["price"]
    assert kinds["ad_id"] == CategoricalField("ad_id", "ad_id")
    assert "e.g. [1, 2]" in comments["ad_id"]
    assert kinds["os"] == CategoricalField("os", "device.os", optional=True)     # missing in 1 record
    assert isinstance(kinds["device"], IgnoreField) and "'iphone'" in comments["device"]
    assert "another shape" not in comments["clicked"]      # a 0 among booleans is a label value


def test_a_field_of_two_shapes_in_earnest_stays_mixed(tmp_path):
    """5% strings among numbers is not an outlier: the field is hashed as tokens."""
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps({"clicked": i % 2, "site": f"s{i % 3}",
                                        "x": f"w{i % 4}" if i % 20 == 0 else i % 50}) + "\n"
                            for i in range(400)))
    schema, comments = infer_schema(path, "json")
    assert isinstance({f.name: f for f in schema.fields}["x"], CategoricalField)
    assert comments["x"].startswith("mixed")


def test_lines_that_are_not_json_objects_are_named(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text("a\tb\tc\n1\t2\t3\n")
    with pytest.raises(SchemaError, match=r"none of the 2 records read is a JSON object \(the first: 'a\\tb\\tc'\)"):
        infer_schema(path, "json")
