"""One typed configuration tree, loaded from TOML with command-line overrides.

Every option has one home here; the CLI only maps flags onto these fields.
`validate()` names the option at fault. The resolved config is stored in every
checkpoint, so a resumed run trains with exactly the settings it started with.
"""
from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A user-supplied option is wrong; the message names it and says what to do."""


@dataclass
class DataConfig:
    # "criteo:PATH", "avazu:PATH", or a path whose name says the format;
    # "criteo:sample" / "avazu:sample" are the bundled real samples.
    source: str = "criteo:sample"
    batch_size: int = 64            # tuned for the bundled ~14K-row samples; streams use 1K-128K
    # Latency budget of the micro-batcher: a partial batch trains after this
    # long without new records (streaming sources only).
    max_batch_delay_s: float = 5.0
    holdout_fraction: float = 0.0
    limit_records: int = 0          # 0 = no limit (training records, holdout excluded)
    epochs: int = 1
    chunk_records: int = 65536      # records decoded per read
    dead_letter_path: str = ""      # default: RUN_DIR/dead_letter.jsonl


@dataclass
class ModelConfig:
    name: str = "deepfm"            # deepfm | wdl | dcn | dcnv2
    embed_dim: int = 10
    mlp_dims: tuple[int, ...] = (400, 400, 400)
    cross_layers: int = 3
    low_rank: int = 32
    experts: int = 4
    init_std: float = 1e-2          # embeddings ~ N(0, init_std), a function of the key


@dataclass
class OptimConfig:
    lr_dense: float = 3e-3
    lr_embed: float = 1e-3
    l2: float = 1e-5                # lambda * ||w||^2 on embedding rows present in the batch
    cross_l2: float = 1e-5          # DCN / DCNv2 cross kernels (not scaled, as in the paper)
    cowclip: bool = True
    cowclip_r: float = 1.0
    cowclip_zeta: float = 1e-5      # per-coordinate lower bound (paper code units)
    warmup_steps: int = 20          # dense lr ramps linearly from 0 over these steps
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-7


@dataclass
class TrainConfig:
    device: str = "auto"            # auto | cpu | cuda | cuda:N
    seed: int = 1235
    threads: int = 0                # torch intra-op threads; 0 = torch default
    deterministic: bool = True
    run_dir: str = "runs/latest"
    checkpoint_dir: str = ""        # default: RUN_DIR/checkpoints
    checkpoint_every_batches: int = 0   # 0 = only at the end of the run
    keep_checkpoints: int = 3
    eval_window_records: int = 100_000  # sliding window of the prequential metrics
    log_every_s: float = 1.0


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(raw: dict[str, Any], origin: str = "config") -> "Config":
        cfg = Config()
        for section, values in raw.items():
            if not hasattr(cfg, section) or not isinstance(values, dict):
                raise ConfigError(f"{origin}: unknown section [{section}] "
                                  f"(known: {', '.join(f.name for f in dataclasses.fields(cfg))})")
            for key, value in values.items():
                set_option(cfg, f"{section}.{key}", value, origin)
        return cfg


def set_option(cfg: Config, dotted: str, value: Any, origin: str = "override") -> None:
    """Set `section.name` to `value`, converting strings to the field's type."""
    section, _, name = dotted.partition(".")
    sub = getattr(cfg, section, None)
    if sub is None or not dataclasses.is_dataclass(sub) or not name:
        raise ConfigError(f"{origin}: unknown option '{dotted}' (use section.name, e.g. model.name)")
    fields = {f.name: f for f in dataclasses.fields(sub)}
    if name not in fields:
        raise ConfigError(f"{origin}: unknown option '{dotted}' "
                          f"(known in [{section}]: {', '.join(fields)})")
    default = getattr(type(sub)(), name)
    setattr(sub, name, _convert(value, default, dotted, origin))


def _convert(value: Any, default: Any, dotted: str, origin: str) -> Any:
    try:
        if isinstance(default, bool):
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if isinstance(default, tuple):
            if isinstance(value, str):
                value = [v for v in value.replace(" ", "").split(",") if v]
            return tuple(int(v) for v in value)
        if isinstance(default, int):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)
        if isinstance(default, float):
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        kind = type(default).__name__
        raise ConfigError(f"{origin}: option '{dotted}' must be {kind}, got {value!r}") from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load TOML (or defaults when `path` is None), apply `section.name=value` overrides."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
        cfg = Config.from_dict(raw, origin=str(p))
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override '{item}' must look like section.name=value")
        set_option(cfg, key.strip(), value.strip(), origin="--set")
    return cfg


MODELS = ("deepfm", "wdl", "dcn", "dcnv2")


def validate(cfg: Config) -> Config:
    """Raise ConfigError naming the first option whose value cannot work."""
    d, m, o, t = cfg.data, cfg.model, cfg.optim, cfg.train
    checks: list[tuple[bool, str]] = [
        (d.batch_size >= 1, f"data.batch_size must be >= 1, got {d.batch_size}"),
        (0.0 <= d.holdout_fraction < 1.0,
         f"data.holdout_fraction must be in [0, 1), got {d.holdout_fraction}"),
        (d.limit_records >= 0, f"data.limit_records must be >= 0, got {d.limit_records}"),
        (d.epochs >= 1, f"data.epochs must be >= 1, got {d.epochs}"),
        (d.chunk_records >= 1, f"data.chunk_records must be >= 1, got {d.chunk_records}"),
        (d.max_batch_delay_s > 0, f"data.max_batch_delay_s must be > 0, got {d.max_batch_delay_s}"),
        (m.name in MODELS, f"model.name must be one of {', '.join(MODELS)}, got {m.name!r}"),
        (m.embed_dim >= 1, f"model.embed_dim must be >= 1, got {m.embed_dim}"),
        (all(x >= 1 for x in m.mlp_dims), f"model.mlp_dims must be positive, got {m.mlp_dims}"),
        (m.cross_layers >= 1, f"model.cross_layers must be >= 1, got {m.cross_layers}"),
        (m.low_rank >= 1 and m.experts >= 1, "model.low_rank and model.experts must be >= 1"),
        (m.init_std > 0, f"model.init_std must be > 0, got {m.init_std}"),
        (o.lr_dense > 0 and o.lr_embed > 0, "optim.lr_dense and optim.lr_embed must be > 0"),
        (o.l2 >= 0 and o.cross_l2 >= 0, "optim.l2 and optim.cross_l2 must be >= 0"),
        (o.cowclip_r > 0, f"optim.cowclip_r must be > 0, got {o.cowclip_r}"),
        (o.cowclip_zeta >= 0, f"optim.cowclip_zeta must be >= 0, got {o.cowclip_zeta}"),
        (o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}"),
        (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)"),
        (o.eps > 0, f"optim.eps must be > 0, got {o.eps}"),
        (t.device == "auto" or t.device == "cpu" or t.device.startswith("cuda"),
         f"train.device must be auto, cpu, cuda or cuda:N, got {t.device!r}"),
        (t.threads >= 0, f"train.threads must be >= 0, got {t.threads}"),
        (t.checkpoint_every_batches >= 0, "train.checkpoint_every_batches must be >= 0"),
        (t.keep_checkpoints >= 1, f"train.keep_checkpoints must be >= 1, got {t.keep_checkpoints}"),
        (t.eval_window_records >= 1, "train.eval_window_records must be >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    return cfg


def scale_config(base: Config, s: float) -> Config:
    """CowClip's scaling rule for batch B -> s*B (reference/cowclip.md section 2.4).

    Embedding lr unchanged, L2 x s, dense lr x sqrt(s), batch size x s; warm-up
    steps shrink by s so that the warm-up covers the same number of samples.
    """
    if s <= 0:
        raise ConfigError(f"scaling factor must be > 0, got {s}")
    cfg = Config.from_dict(base.to_dict())
    cfg.data.batch_size = max(1, round(base.data.batch_size * s))
    cfg.optim.lr_dense = base.optim.lr_dense * math.sqrt(s)
    cfg.optim.l2 = base.optim.l2 * s
    cfg.optim.lr_embed = base.optim.lr_embed
    cfg.optim.warmup_steps = max(0, round(base.optim.warmup_steps / s))
    return cfg
