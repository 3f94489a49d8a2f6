"""Parsing and validating a declared schema: its TOML shape, the errors a person sees."""
import pytest

from stream_ctr.connectors.schema import (CategoricalField, NumericField, SchemaError, parse_schema,
                                          schema_to_toml, time_format_layout)
from stream_ctr.connectors.schema_builtin import BUILTIN_SCHEMAS

AD_LOG = """
[schema]
encoding = "json"

[schema.fields.clicked]
kind = "label"

[schema.fields.user_id]
kind = "categorical"
integer_ids = true

[schema.fields.os]
kind = "categorical"
path = "device.os"
default = "unknown"

[schema.fields.price]
kind = "numeric"
transform = "standardize"
mean = 0.5
std = 0.25

[schema.fields.price_bucket]
kind = "numeric"
path = "price"
transform = "bucketize"
boundaries = [0.1, 1.0, 10.0]

[schema.fields.ts]
kind = "event_time"
unit = "s"

[schema.fields.hour]
kind = "time_part"
part = "hour_of_day"

[schema.fields.request_id]
kind = "ignore"

[schema.crosses.user_x_os]
fields = ["user_id", "os"]
"""


def test_columns_come_out_in_declared_order():
    s = parse_schema(AD_LOG)
    assert s.key_fields == ("user_id", "os", "price_bucket", "hour", "user_x_os")
    assert s.dense_fields == ("price",)
    assert (s.n_keys, s.n_dense, s.label.name, s.event_time.name) == (5, 1, "clicked", "ts")
    os_field = s.fields[2]
    assert isinstance(os_field, CategoricalField) and os_field.path == "device.os"
    assert s.fields[4] == NumericField("price_bucket", "price", transform="bucketize",
                                       boundaries=(0.1, 1.0, 10.0))


def test_a_config_file_with_a_schema_table_parses_the_same():
    assert parse_schema("[data]\nsource = 'x'\n" + AD_LOG.replace("[schema]", "[schema]", 1)) == parse_schema(AD_LOG)


@pytest.mark.parametrize("schema", [parse_schema(AD_LOG), *BUILTIN_SCHEMAS.values()])
def test_toml_round_trip(schema):
    assert parse_schema(schema_to_toml(schema)) == schema


@pytest.mark.parametrize("fragment, words", [
    ("[schema.fields.x]\nkind = 'multi_hot'\npooling = 'max'", ["x", "pooling", "mean"]),
    ("[schema.fields.x]\nkind = 'multi_hot'\nmax_len = 0", ["x", "max_len", ">= 1"]),
    ("[schema.fields.x]\nkind = 'categorial'", ["x", "kind must be one of", "categorical"]),
    ("[schema.fields.x]\nkind = 'numeric'\ntransform = 'sqrt'", ["x", "transform", "log1p"]),
    ("[schema.fields.x]\nkind = 'numeric'\ntransform = 'log'\ndefault = 0", ["x", "default > 0"]),
    ("[schema.fields.x]\nkind = 'numeric'\ntransform = 'bucketize'", ["x", "boundaries"]),
    ("[schema.fields.x]\nkind = 'numeric'\ntransform = 'bucketize'\nboundaries = [2, 1]", ["x", "increase"]),
    ("[schema.fields.x]\nkind = 'numeric'\ntransform = 'standardize'\nstd = 0", ["x", "std > 0"]),
    ("[schema.fields.x]\nkind = 'categorical'\ncolour = 1", ["x", "unknown option 'colour'"]),
    ("[schema.fields.x]\nkind = 'categorical'\ndefault = 'a'\noptional = true", ["x", "not both"]),
    ("[schema.fields.x]\nkind = 'event_time'\nformat = '%Y-%j'", ["x", "%j", "not supported"]),
    ("[schema.fields.x]\nkind = 'event_time'\nunit = 'us'", ["x", "unit"]),
    ("[schema.fields.x]\nkind = 'time_part'\npart = 'minute'", ["x", "part"]),
    ("[schema.fields.x]\nkind = 'weight'\ndefault = -1", ["x", "weight's default must be >= 0"]),
    ("[schema.fields.x]\nkind = 'event_time'\ndefault = 'yesterday'", ["x", "number >= 0 (epoch ms)"]),
    ("[schema.fields.x]\nkind = 'event_time'\nformat = '%Y-%m-%d'\ndefault = 5", ["x", "time string"]),
    ("[schema.crosses.c]\nfields = ['user_id']", ["c", "two or more"]),
    ("[schema.crosses.c]\nfields = ['user_id', 'clicked']", ["c", "'clicked'", "not a key field"]),
    ("[schema.fields.y]\nkind = 'label'", ["exactly one", "clicked", "y"]),
])
def test_errors_name_the_field_and_what_to_do(fragment, words):
    text = "[schema]\nencoding = 'json'\n[schema.fields.clicked]\nkind = 'label'\n" \
           "[schema.fields.user_id]\nkind = 'categorical'\n" + fragment
    with pytest.raises(SchemaError) as err:
        parse_schema(text, "s.toml")
    for word in words:
        assert word in str(err.value)
    assert str(err.value).startswith("s.toml")


@pytest.mark.parametrize("label, ok", [
    ("default = 7", False), ("default = 'yes'", False), ("default = 0", True), ("default = true", True),
    ("default = 'false'", True), ("threshold = 0.5\ndefault = 0.7", True),
])
def test_a_label_default_is_checked_when_the_schema_loads(label, ok):
    """Not at the first record without a label, mid-stream."""
    text = f"[schema]\nencoding = 'json'\n[schema.fields.clicked]\nkind = 'label'\n{label}\n" \
           "[schema.fields.user_id]\nkind = 'categorical'\n"
    if ok:
        parse_schema(text, "s.toml")
    else:
        with pytest.raises(SchemaError, match="clicked.*default must be 0, 1, true or false"):
            parse_schema(text, "s.toml")


@pytest.mark.parametrize("text, words", [
    ("[schema]\nencoding = 'xml'", ["encoding", "json, csv"]),
    ("[schema]\nencoding = 'csv'\n[schema.fields.a]\nkind = 'label'", ["header = true", "columns"]),
    ("[schema]\nencoding = 'json'", ["no fields"]),
    ("[schema]\nencoding = 'json'\n[schema.fields.a]\nkind = 'label'", ["no key field"]),
    ("[schema]\nencoding = 'csv'\ncolumns = ['a', 'b']\n[schema.fields.a]\nkind = 'label'\n"
     "[schema.fields.c]\nkind = 'categorical'", ["'c'", "not in columns"]),
    ("[schema]\nencoding = 'csv'\ndelimiter = ';;'", ["delimiter", "one ASCII character"]),
    ("[schema\n", ["not valid TOML"]),
    ("[schema]\nencoding = 'json'\n[schema.fields.t]\nkind = 'time_part'\npart = 'hour_of_day'\n"
     "[schema.fields.a]\nkind = 'label'", ["time_part", "event_time"]),
])
def test_schema_level_errors(text, words):
    with pytest.raises(SchemaError) as err:
        parse_schema(text)
    for word in words:
        assert word in str(err.value)


def test_time_format_layout_is_fixed_width():
    assert time_format_layout("%Y-%m-%dT%H") == (("Y", 0, 4), ("=-", 4, 1), ("m", 5, 2), ("=-", 7, 1),
                                                  ("d", 8, 2), ("=T", 10, 1), ("H", 11, 2))
    with pytest.raises(SchemaError, match="needs a year"):
        time_format_layout("%H:%M")
