"""A [schema] table in a config file becomes data.schema, the text stored in checkpoints."""
import pytest

from stream_ctr.config import Config, ConfigError, load_config
from stream_ctr.connectors.schema import parse_schema
from stream_ctr.connectors.synth_json import AD_LOG_SCHEMA


def test_schema_table_is_kept_as_canonical_text(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[data]\nsource = 'json:x.jsonl'\nbatch_size = 128\n\n" + AD_LOG_SCHEMA)
    cfg = load_config(path)
    assert cfg.data.batch_size == 128
    assert parse_schema(cfg.data.schema) == parse_schema(AD_LOG_SCHEMA)
    again = Config.from_dict(cfg.to_dict())            # what a checkpoint stores and reads back
    assert again.data.schema == cfg.data.schema


def test_bad_schema_table_names_the_field(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[schema]\nencoding = 'json'\n[schema.fields.price]\nkind = 'numeric'\n"
                    "transform = 'sqrt'\n")
    with pytest.raises(ConfigError, match=r"\[schema.fields.price\].*transform"):
        load_config(path)
