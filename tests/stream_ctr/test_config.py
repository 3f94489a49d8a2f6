import math

import pytest

from stream_ctr.config import Config, ConfigError, load_config, scale_config, validate


def test_defaults_validate():
    validate(Config())


def test_toml_and_overrides(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[model]\nname = "dcnv2"\nmlp_dims = [200, 100]\n[optim]\nlr_dense = 0.004\n')
    cfg = load_config(p, ["optim.cowclip=false", "data.batch_size=4096"])
    assert cfg.model.name == "dcnv2" and cfg.model.mlp_dims == (200, 100)
    assert cfg.optim.lr_dense == 0.004 and cfg.optim.cowclip is False
    assert cfg.data.batch_size == 4096


@pytest.mark.parametrize("override, needle", [
    ("model.name=xgboost", "model.name"),
    ("data.batch_size=0", "data.batch_size"),
    ("data.holdout_fraction=1.5", "data.holdout_fraction"),
    ("optim.lr_embed=-1", "optim.lr_dense and optim.lr_embed"),
    ("train.device=tpu", "train.device"),
    ("store.ttl_steps=100", "need store.kind = tiered"),     # the memory store has no TTL
    ("store.admission_min_count=2", "need store.kind = tiered"),
])
def test_bad_values_name_the_option(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        validate(load_config(None, [override]))


@pytest.mark.parametrize("override, needle", [
    ("data.batch_size=lots", "must be int"),
    ("model.colour=red", "unknown option 'model.colour'"),
    ("nosection.x=1", "unknown option"),
    ("justtext", "section.name=value"),
    ("optim.cowclip=maybe", "must be bool"),
])
def test_unparseable_overrides(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [override])


def test_bad_toml_file(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[model\nname=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(p)
    p.write_text("[models]\nname='x'\n")
    with pytest.raises(ConfigError, match=r"unknown section \[models\]"):
        load_config(p)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")


def test_scaling_rule_reproduces_readme_rows():
    # reference/cowclip.md 2.4 / 6.9: Criteo base at 1K: lr 8e-4, l2 1e-5, lr_embed 1e-4.
    base = Config()
    base.data.batch_size, base.optim.lr_dense, base.optim.l2, base.optim.lr_embed = 1024, 8e-4, 1e-5, 1e-4
    big = scale_config(base, 128)
    assert big.data.batch_size == 131072
    assert math.isclose(big.optim.lr_dense, 90.51e-4, rel_tol=1e-4)
    assert math.isclose(big.optim.l2, 128e-5)
    assert big.optim.lr_embed == 1e-4
    eight = scale_config(base, 8)
    assert math.isclose(eight.optim.lr_dense, 22.6274e-4, rel_tol=1e-5)
    assert base.data.batch_size == 1024        # the base is not modified
