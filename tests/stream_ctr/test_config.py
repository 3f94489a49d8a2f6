import math

import pytest

from stream_ctr.config import Config, ConfigError, load_config, resolve_optim, validate


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
    ("store.evict_ahead=yes", "store.evict_ahead must be auto, on or off"),
    ("train.compile_mode=fast", "train.compile_mode must be one of default, reduce-overhead"),
])
def test_bad_values_name_the_option(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        validate(load_config(None, [override]))


@pytest.mark.parametrize("override, needle", [
    ("data.batch_size=lots", "must be an integer"),
    ("store.cache_bytes=abc", "must be a byte size .* 512MiB"),
    ("model.colour=red", "unknown option 'model.colour'"),
    ("nosection.x=1", "unknown option .*sections: data, model, optim"),
    ("justtext", "section.name=value"),
    ("optim.cowclip=maybe", "must be true or false"),
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
    p.write_bytes(b"\x7fELF\x02\x01\x01\x00\xff\xfe")
    with pytest.raises(ConfigError, match="not a UTF-8 text file"):
        load_config(p)


@pytest.mark.parametrize("text, needle", [
    # TOML's true is a Python int: it trained batches of one record
    ("[data]\nbatch_size = true\n", "'data.batch_size' must be an integer, got true"),
    ("[model]\nmlp_dims = [true, 4]\n", "'model.mlp_dims' must be a comma-separated list"),
    ("[optim]\ncowclip = 2\n", "'optim.cowclip' must be true or false, got 2"),
    ("[optim]\nlr_dense = inf\n", "'optim.lr_dense' must be a finite number, got inf"),
    ("[optim]\nlr_embed = nan\n", "'optim.lr_embed' must be a finite number"),
    ("batch_size = 1024\n", r"batch_size = 1024 is outside any section; it belongs under \[data\] batch_size"),
    ("data = 5\n", r"\[data\] is a section: write its options under a \[data\] header"),
    ("[train]\nthreads = 100000\n", r"train.threads must be in \[0, 1024\]"),
])
def test_config_values_of_the_wrong_kind_are_named(tmp_path, text, needle):
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        validate(load_config(p))


def _criteo_base(batch: int) -> Config:
    # The CowClip paper (docs/large-batches.md, "CowClip in brief"): Criteo base at 1K: lr 8e-4, l2 1e-5, lr_embed 1e-4.
    cfg = Config()
    cfg.optim.lr_dense, cfg.optim.l2, cfg.optim.lr_embed = 8e-4, 1e-5, 1e-4
    cfg.optim.scale_from_batch, cfg.data.batch_size = 1024, batch
    return cfg


def _paper(cfg):
    """The paper's rule as published (docs/large-batches.md, "CowClip in brief"): L2 x s, one embedding lr."""
    cfg.optim.l2_rule, cfg.optim.embed_lr_rule = "scaled", "constant"
    return cfg


def test_scaling_rule_reproduces_readme_rows():
    big = resolve_optim(_paper(_criteo_base(131072)))
    assert big.batch_size == 131072 and big.scale == 128
    assert math.isclose(big.lr_dense, 90.51e-4, rel_tol=1e-4)
    assert math.isclose(big.l2, 128e-5)
    assert big.lr_embed == 1e-4
    eight = resolve_optim(_paper(_criteo_base(8192)))
    assert math.isclose(eight.lr_dense, 22.6274e-4, rel_tol=1e-5)
    base = _paper(_criteo_base(1024))
    same = resolve_optim(base)
    assert (same.lr_dense, same.l2, same.scale) == (8e-4, 1e-5, 1.0)
    assert base.optim.lr_dense == 8e-4 and base.data.batch_size == 1024    # not modified


def test_no_base_batch_means_the_configured_values():
    cfg = Config()
    cfg.data.batch_size = 65536
    r = resolve_optim(cfg)
    assert (r.lr_dense, r.l2, r.lr_embed, r.scale) == (cfg.optim.lr_dense, cfg.optim.l2, cfg.optim.lr_embed, 1.0)


def test_warmup_covers_the_same_samples_at_every_batch():
    from stream_ctr.train.trainer import Trainer
    ramps = {}
    for batch in (1024, 8192, 131072):
        cfg = _criteo_base(batch)
        cfg.optim.warmup_samples = 262_144
        cfg.optim.rule_warmup_samples = 0        # the rule's floor is tested on its own below
        cfg.optim.ramp_samples = 0               # the ramp: tests/stream_ctr/train/test_ramp.py
        t = Trainer(cfg, n_fields=3, n_dense=2)
        lrs = []
        for samples in range(0, 400_000, 1024):     # the lr after `samples` trained ...
            step = samples // batch                  # ... with every batch size
            if step * batch == samples:
                lrs.append((samples, round(t.dense_lr(step) / t.optim.lr_dense, 12)))
        ramps[batch] = dict(lrs)
    for samples, frac in ramps[131072].items():
        assert ramps[1024][samples] == ramps[8192][samples] == frac == min(1.0, samples / 262_144)
    assert len(ramps[131072]) == 4 and ramps[1024][131072] == 0.5


def test_the_rule_warms_up_over_a_floor_of_samples_and_scales_beta2():
    base = resolve_optim(_criteo_base(1024))
    assert (base.warmup_samples, base.beta2) == (20_480, 0.999)           # s = 1: as configured
    mid = resolve_optim(_criteo_base(32768))
    assert mid.warmup_samples == 500_000 and math.isclose(mid.beta2, 0.999 ** 32)
    big = _criteo_base(131072)
    r = resolve_optim(big)
    assert math.isclose(r.beta2, 0.999 ** min(128, big.optim.beta2_max_scale))
    big.optim.warmup_samples, big.optim.beta2_rule = 2_000_000, "constant"
    r = resolve_optim(big)
    assert (r.warmup_samples, r.beta2) == (2_000_000, 0.999)              # a longer warm-up stays
    unscaled = _criteo_base(131072)
    unscaled.optim.scale_from_batch = 0
    assert resolve_optim(unscaled).beta2 == 0.999 and resolve_optim(unscaled).warmup_samples == 20_480


def test_a_checkpoint_from_before_the_beta2_rule_keeps_training_as_it_started():
    from stream_ctr.config import checkpoint_config
    old = Config().to_dict()
    for name in ("beta2_rule", "rule_warmup_samples", "ramp_samples", "embed_lr_cap_rule", "embed_lr_cap_floor"):
        del old["optim"][name]
    cfg = checkpoint_config(old, origin="test")
    assert (cfg.optim.beta2_rule, cfg.optim.rule_warmup_samples) == ("constant", 0)
    assert (cfg.optim.ramp_samples, cfg.optim.embed_lr_cap_rule) == (0, "fixed")
    assert cfg.optim.embed_lr_cap_floor == 0            # a run keeps the cap it started with
    new = checkpoint_config(Config().to_dict(), origin="test")
    assert new.optim.embed_lr_cap_floor == 4
    assert (new.optim.beta2_rule, new.optim.rule_warmup_samples) == ("scaled", 500_000)
    assert (new.optim.ramp_samples, new.optim.embed_lr_cap_rule) == (2_097_152, "sqrt")
    # A checkpoint with the beta2 rule but from before the ramp and the sqrt cap.
    mid = Config().to_dict()
    for name in ("ramp_samples", "embed_lr_cap_rule", "embed_lr_cap_floor"):
        del mid["optim"][name]
    cfg = checkpoint_config(mid, origin="test")
    assert (cfg.optim.beta2_rule, cfg.optim.ramp_samples, cfg.optim.embed_lr_cap_rule) == ("scaled", 0, "fixed")


def test_legacy_warmup_steps_become_samples():
    cfg = Config.from_dict({"data": {"batch_size": 512}, "optim": {"warmup_steps": 20}})
    assert cfg.optim.warmup_samples == 20 * 512


def test_scaling_options_are_validated():
    for option, value, match in (("optim.warmup_samples", -1, "warmup_samples"),
                                 ("optim.scale_from_batch", -5, "scale-from"),
                                 ("optim.cowclip_units", "sum", "cowclip_units"),
                                 ("optim.embed_lr_rule", "linear", "embed_lr_rule"),
                                 ("optim.l2_rule", "sqrt", "l2_rule"),
                                 ("optim.embed_lr_max_scale", -1, "embed_lr_max_scale"),
                                 ("optim.beta2_rule", "linear", "beta2_rule"),
                                 ("optim.beta2_max_scale", 0.5, "beta2_max_scale"),
                                 ("optim.rule_warmup_samples", -1, "rule_warmup_samples")):
        cfg = Config()
        setattr(cfg.optim, option.split(".")[1], value)
        with pytest.raises(ConfigError, match=match):
            validate(cfg)


def test_l2_rule_constant_keeps_the_base_l2():
    cfg = _criteo_base(131072)
    cfg.optim.l2_rule = "constant"
    r = resolve_optim(cfg)
    assert r.l2 == 1e-5 and math.isclose(r.lr_dense, 90.51e-4, rel_tol=1e-4)
    cfg.optim.l2_rule = "scaled"
    assert math.isclose(resolve_optim(cfg).l2, 128e-5)


def test_the_default_rule_is_the_single_pass_one_and_idle_without_a_base_batch():
    """Defaults: count rule capped at sqrt(s / 2) base steps (8 at 128x), L2 not scaled;
    all of it a no-op until --scale-from names a base batch."""
    cfg = _criteo_base(131072)
    r = resolve_optim(cfg)
    assert (r.embed_lr_rule, r.count_lr_s, r.l2) == ("count", 8, 1e-5)
    assert resolve_optim(_criteo_base(32768)).count_lr_s == 4
    # sqrt(s / 2), not under min(s / 2, 4): 2 at 4x, 4 from 8x to 32x, then sqrt
    assert [resolve_optim(_criteo_base(b)).count_lr_s for b in (4096, 8192, 16384, 65536)] == \
        [2, 4, 4, math.sqrt(32)]
    assert resolve_optim(_criteo_base(2048)).count_lr_s == 1.0       # cap 1: off
    cfg8k = _criteo_base(8192)
    cfg8k.optim.embed_lr_cap_floor = 0
    assert resolve_optim(cfg8k).count_lr_s == 2                      # sqrt(8 / 2) alone
    assert math.isclose(r.lr_dense, 90.51e-4, rel_tol=1e-4)
    cfg.optim.scale_from_batch = 0
    r = resolve_optim(cfg)
    assert (r.count_lr_s, r.l2, r.lr_dense, r.scale) == (1.0, 1e-5, 8e-4, 1.0)


def test_resolved_kernel_factors():
    cfg = _criteo_base(32768)
    cfg.optim.cowclip_units, cfg.optim.embed_lr_rule = "occurrence", "count"
    r = resolve_optim(cfg)
    assert r.clip_scale == 1 / 32768 and r.count_lr_s == 4          # the default cap, sqrt(32 / 2)
    cfg.optim.embed_lr_cap_rule = "fixed"
    assert resolve_optim(cfg).count_lr_s == 8                       # embed_lr_max_scale
    cfg.optim.embed_lr_max_scale = 0
    assert resolve_optim(cfg).count_lr_s == 32
    cfg.optim.cowclip_units, cfg.optim.embed_lr_rule = "mean", "constant"
    r = resolve_optim(cfg)
    assert r.clip_scale == 1.0 and r.count_lr_s == 1.0


def test_config_sections_are_listed_in_the_config_trees_order():
    """`stream-ctr --help`, docs/configuration.md (its sentence and its table) and the
    example config name the sections of Config, all of them, in its field order."""
    import dataclasses
    import re
    import tomllib
    from pathlib import Path

    from stream_ctr.cli.main import build_parser
    from stream_ctr.resources import example_config_text

    sections = [f.name for f in dataclasses.fields(Config)]
    assert sections[:4] == ["data", "model", "optim", "train"] and "kafka" in sections
    help_line = build_parser().epilog.rstrip().splitlines()[-1]
    assert help_line.split(", ") == sections
    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    sentence = re.search(r"sections (`\w+`(?:,\s+`\w+`)*),\s+and a\s+`\[schema\]` table", page)
    assert sentence and re.findall(r"`(\w+)`", sentence.group(1)) == sections
    table = page.split("\n## Sections\n", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^\| `(\w+)` \|", table, flags=re.M) == sections
    example = example_config_text()
    assert re.findall(r"^\[(\w+)\]", example, flags=re.M) == sections
    assert list(tomllib.loads(example)) == sections
