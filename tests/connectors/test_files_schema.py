"""File sources under a declared schema: json:/csv: specs, gzip, csv headers, resume offsets."""
import gzip

import numpy as np
import pytest

from stream_ctr.connectors.files import FileSource, SourceError, count_records, detect_format
from stream_ctr.connectors.schema import parse_schema, schema_to_toml
from stream_ctr.connectors.synth_json import AD_LOG_SCHEMA, write_synthetic_json

CSV_SCHEMA = """
[schema]
encoding = "csv"
header = true
[schema.fields.y]
kind = "label"
[schema.fields.site]
kind = "categorical"
[schema.fields.n]
kind = "numeric"
transform = "log1p"
"""


def test_json_source_reads_and_resumes_exactly(tmp_path):
    path = tmp_path / "log.jsonl.gz"
    write_synthetic_json(path, 1000, gzip=True)
    fmt, p = detect_format(f"json:{path}", AD_LOG_SCHEMA)
    assert p == path and fmt == parse_schema(AD_LOG_SCHEMA) and count_records(p, fmt) == 1000
    with FileSource(p, fmt, chunk_records=300) as src:
        first, _ = src.read()
        position = src.snapshot()
        rest = [src.read()[0] for _ in range(4)]
    assert position == {"file:log.jsonl.gz": 300}
    with FileSource(p, fmt, start_offset=300, chunk_records=700) as again:
        resumed, rejected = again.read()
        assert again.exhausted and rejected == []
    np.testing.assert_array_equal(resumed.keys, np.concatenate([b.keys for b in rest]))
    assert resumed.offset.tolist() == list(range(300, 1000))


def test_csv_header_names_the_columns(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("y,site,n\n1,a,3\n0,b,\n1,c,x\n")
    fmt, p = detect_format(f"csv:{path}", CSV_SCHEMA)
    assert count_records(p, fmt) == 3
    with FileSource(p, fmt) as src:
        assert src.fmt.columns == ("y", "site", "n")
        batch, rejected = src.read()
    assert batch.offset.tolist() == [0]
    assert [(r.offset, r.reason) for r in rejected] == [(1, "missing:n"), (2, "bad_value:n")]


def test_a_quoted_csv_file_reads_through_its_header_and_schema_infer(tmp_path):
    from stream_ctr.connectors.schema_infer import infer_schema
    path = tmp_path / "log.csv"
    path.write_text('y,"site, name",n\n' + "".join(f'{i % 2},"s{i % 3}, ""x""",{i}\n' for i in range(60)))
    schema, _ = infer_schema(path, "csv", 50)
    assert [(f.name, f.path, f.kind) for f in schema.fields][:2] == [("y", "y", "label"),
                                                                      ("site__name", "site, name", "categorical")]
    fmt, p = detect_format(f"csv:{path}", schema_to_toml(schema))
    with FileSource(p, fmt) as src:
        assert src.fmt.columns == ("y", "site, name", "n")
        batch, rejected = src.read()
    assert len(batch) == 60 and rejected == []
    assert len(set(batch.keys[:, 0].tolist())) == 3

def test_csv_header_without_a_declared_column_is_one_clear_error(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("y,place,n\n1,a,3\n")
    fmt, p = detect_format(f"csv:{path}", CSV_SCHEMA)
    with pytest.raises(SourceError, match="'site'.*not in columns"):
        FileSource(p, fmt)


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path):
    from stream_ctr.connectors.schema_infer import infer_schema
    path = tmp_path / "export.csv"
    path.write_bytes(b"\xef\xbb\xbfy,site,n\n" + b"".join(b"%d,s%d,%d\n" % (i % 2, i % 3, i) for i in range(60)))
    schema, _ = infer_schema(path, "csv", 50)
    assert schema.fields[0].name == "y" and schema.fields[0].path == "y"
    fmt, p = detect_format(f"csv:{path}", CSV_SCHEMA)
    with FileSource(p, fmt) as src:
        assert src.fmt.columns == ("y", "site", "n")
        batch, rejected = src.read()
    assert len(batch) == 60 and rejected == []


def test_a_header_that_is_one_column_under_the_delimiter_names_the_likely_one(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("y,site,n\n1,a,3\n")
    fmt, p = detect_format(f"csv:{path}", CSV_SCHEMA.replace('header = true', 'header = true\ndelimiter = ";"'))
    with pytest.raises(SourceError, match="one column under the schema's delimiter ';'.*delimiter = ','"):
        FileSource(p, fmt)


@pytest.mark.parametrize("spec, schema, needle", [
    ("json:{p}", "", "needs a schema"),
    ("csv:{p}", AD_LOG_SCHEMA, "the schema's encoding is 'json'"),
    ("avazu:{p}", AD_LOG_SCHEMA, "built-in layout"),
    ("{p}", "", "looks like JSON lines"),
    ("json:{p}x", AD_LOG_SCHEMA, "no such file"),
])
def test_spec_errors(tmp_path, spec, schema, needle):
    path = tmp_path / "log.jsonl"
    path.write_text('{"a": 1}\n')
    with pytest.raises(SourceError, match=needle):
        detect_format(spec.format(p=path), schema)


def test_bare_path_with_a_schema_reads_under_it(tmp_path):
    path = tmp_path / "events.log"
    path.write_bytes(gzip.compress(b'{"clicked": true}\n'))
    schema = parse_schema(AD_LOG_SCHEMA)
    assert detect_format(str(path), schema_to_toml(schema)) == (schema, path)
