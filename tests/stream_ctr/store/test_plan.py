"""Budgets in bytes -> rows per tier; impossible plans are refused, naming the option."""
import pytest

from stream_ctr.cli import main
from stream_ctr.config import ConfigError, ModelConfig, StoreConfig, load_config, parse_bytes
from stream_ctr.store.plan import make_plan


def plan(**kw):
    cfg = StoreConfig(kind="tiered", **kw)
    return make_plan(cfg, ModelConfig(), batch_size=1024, n_fields=39, store_dir="/tmp/x")


def test_plan_counts_every_byte_of_a_row():
    p = plan(cache_bytes=1 << 30, ram_bytes=8 << 30, disk_bytes=1 << 40)
    assert p.row_bytes == 168                   # 3 x 11 float32 + 4 pad + 4 x int64
    assert p.cache_rows == (1 << 30) // p.cache_row_bytes and p.cache_row_bytes > p.row_bytes
    assert p.ram_rows == (8 << 30) // p.ram_row_bytes
    text = p.describe()
    assert "device cache" in text and f"{p.ram_rows:,} rows" in text and "168 B" in text


def test_cache_smaller_than_a_batch_working_set_is_refused():
    with pytest.raises(ConfigError, match=r"store.cache_bytes \(--cache-bytes\) = 1.0 MiB holds "
                                          r"[\d,]+ rows .* working set of 39,936 rows"):
        plan(cache_bytes=1 << 20)


def test_disk_smaller_than_the_resident_rows_is_refused():
    with pytest.raises(ConfigError, match=r"store.disk_bytes \(--disk-bytes\) = .* a checkpoint "
                                          "writes every resident row"):
        plan(cache_bytes=1 << 30, ram_bytes=8 << 30, disk_bytes=1 << 30)


def test_byte_sizes_parse_with_suffixes(tmp_path):
    assert parse_bytes("64MB") == 64_000_000 and parse_bytes("2GiB") == 2 << 30
    assert parse_bytes("1.5k") == 1500 and parse_bytes(4096) == 4096
    with pytest.raises(ValueError):
        parse_bytes("12 parsecs")
    toml = tmp_path / "c.toml"
    toml.write_text('[store]\nkind = "tiered"\ncache_bytes = "512MiB"\nram_bytes = 1000\n')
    cfg = load_config(toml, ["store.disk_bytes=2TB"])
    assert (cfg.store.cache_bytes, cfg.store.ram_bytes, cfg.store.disk_bytes) == (512 << 20, 1000, 2 * 10**12)


def test_cli_refuses_an_impossible_plan_in_one_line(tmp_path, capsys):
    code = main(["train", "--run-dir", str(tmp_path), "--cache-bytes", "100KB", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("stream-ctr: error: store.cache_bytes (--cache-bytes) = 97.7 KiB")
    with pytest.raises(SystemExit):
        main(["train", "--ram-bytes", "lots"])
    assert "not a byte size" in capsys.readouterr().err


def test_bad_store_options_are_named(tmp_path):
    from stream_ctr.config import Config, validate
    cfg = Config()
    cfg.store.policy = "fifo"
    with pytest.raises(ConfigError, match="store.policy"):
        validate(cfg)
