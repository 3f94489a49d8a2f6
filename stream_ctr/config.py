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

from stream_ctr.connectors.dead_letter import RAW_LIMIT_BYTES
from stream_ctr.connectors.kafka.options import KafkaOptions


class ConfigError(ValueError):
    """A user-supplied option is wrong; the message names it and says what to do."""


@dataclass
class DataConfig:
    # "criteo:PATH", "avazu:PATH", or a path whose name says the format;
    # "criteo:sample" / "avazu:sample" are the bundled real samples;
    # "kafka://HOST:PORT/TOPIC?group=G" a Kafka topic (options in [kafka]).
    source: str = "criteo:sample"
    batch_size: int = 64            # tuned for the bundled ~14K-row samples; streams use 1K-128K
    # Latency budget of the micro-batcher: a partial batch trains once its
    # oldest record has waited this long (streaming sources only).
    max_batch_delay_s: float = 5.0
    holdout_fraction: float = 0.0
    limit_records: int = 0          # 0 = no limit (training records, holdout excluded)
    epochs: int = 1
    chunk_records: int = 65536      # records decoded per read
    # File sources: chunks decoded ahead on a background thread while the trainer
    # steps (the decoder releases the GIL); 0 = decode on the training thread.
    read_ahead_chunks: int = 2
    # Threads decoding those chunks at once (handed out in file order); 0 = auto, one
    # per 4 cores (1 on a 2-core machine, 4 on 16 cores), one per 2 when training on a
    # GPU, whose step leaves the cores to decoding (8 on a 16-core GPU host).
    decode_threads: int = 0
    dead_letter_path: str = ""      # default: RUN_DIR/dead_letter.jsonl
    # Bytes of a rejected record kept in its dead-letter entry (file or topic); a longer
    # one keeps its first bytes with its size and SHA-256 (a 50 MB bad line is not copied).
    dead_letter_max_bytes: int = RAW_LIMIT_BYTES
    # The declared schema of json:/csv: sources, as TOML text (connectors/schema.py): set by
    # --schema FILE or a [schema] table in the config file; stored in every checkpoint.
    schema: str = ""
    # A --resume whose --schema decodes otherwise than the checkpoint's (a transform, a
    # path, a field added) is refused: the model's weights mean what the run's schema
    # decoded. true = the log itself changed (a field renamed upstream) and the new
    # schema says how to read it; the run goes on under it.
    allow_schema_change: bool = False


@dataclass
class ModelConfig:
    name: str = "deepfm"            # deepfm | wdl | dcn | dcnv2 | lr (logistic regression)
    embed_dim: int = 10
    mlp_dims: tuple[int, ...] = (400, 400, 400)
    cross_layers: int = 3
    low_rank: int = 32
    experts: int = 4
    init_std: float = 1e-2          # embeddings ~ N(0, init_std), a function of the key


@dataclass
class OptimConfig:
    # lr_dense, lr_embed and l2 are for the batch that trains, or, with
    # scale_from_batch = B0, for batch B0: the scaling rule (`resolve_optim`)
    # derives the values the run uses from them and data.batch_size.
    lr_dense: float = 3e-3
    lr_embed: float = 1e-3
    l2: float = 1e-5                # lambda * ||w||^2 on embedding rows present in the batch
    cross_l2: float = 1e-5          # DCN / DCNv2 cross kernels (not scaled, as in the paper)
    cowclip: bool = True
    cowclip_r: float = 1.0
    cowclip_zeta: float = 1e-5      # per-coordinate lower bound (paper code units)
    # Units of the clip threshold r * cnt * max(||w||, zeta): "mean" compares it with the
    # row's gradient of the batch-MEAN loss (the paper's code: it almost never binds, the
    # gradient being ~cnt/batch of a per-occurrence gradient); "occurrence" with the
    # gradient of the SUM loss, i.e. it bounds each occurrence's gradient by r*max(||w||, zeta).
    cowclip_units: str = "mean"     # mean | occurrence
    # Dense lr ramps linearly from ~0 over this many trained samples, whatever the
    # batch (the paper warms up over one epoch of samples); 0 = no warm-up.
    warmup_samples: int = 20_480
    # Under the scaling rule (s > 1) the warm-up lasts at least this many samples: a
    # single pass at 128K takes 55 steps on 8M rows, and 20,480 samples is less than one
    # of them, so the scaled dense lr hit a cold model at full strength (docs/large-batches.md).
    rule_warmup_samples: int = 500_000
    # Base batch of the rates above (CLI --scale-from); 0 = use them as they are.
    # With s = data.batch_size / scale_from_batch: lr_dense x sqrt(s), l2 x s,
    # lr_embed unchanged (the CowClip paper's rule for N epochs; docs/large-batches.md).
    scale_from_batch: int = 0
    # Embedding lr per row under the scaling rule: "constant" = lr_embed for every row
    # (the paper); "count" = lr_embed x s*(1-(1-1/s)**cnt), the expected number of
    # base-size batches (of the s this batch replaces) that would have held the row's
    # cnt occurrences: the steps it would have taken at the base batch, so a rare id
    # moves as far per occurrence as at the base batch. A no-op without scale_from_batch.
    embed_lr_rule: str = "count"    # count | constant
    # With embed_lr_rule = count: s in that formula is min(s, cap), so no row takes more
    # than cap base steps at once. "sqrt": cap = sqrt(s / 2) (4 at 32x the base batch, 8
    # at 128x), so a frequent row's step grows as the square root of the batch, as the
    # dense lr does; "fixed": cap = embed_lr_max_scale (0 = no cap). Uncapped, frequent
    # rows took 128 base steps in one at 128K and the model came out 6x under-calibrated;
    # a fixed 8 cost 0.4 point at 32K on the additive stream, a fixed 4 2.3 points at 128K
    # on an interaction stream (docs/large-batches.md). The ramp's steps keep the run's cap.
    embed_lr_cap_rule: str = "sqrt"     # sqrt | fixed
    embed_lr_max_scale: float = 8.0
    # With the sqrt cap: not under min(s / 2, floor). sqrt(s / 2) alone gave 2 at 8x the
    # base batch (8K from 1K), where 4 was 0.5 point better on an interaction stream; 32x
    # already has 4 (BENCHMARKS, "Large batches"). 0 = sqrt(s / 2) alone.
    embed_lr_cap_floor: float = 4.0
    # How L2 follows the batch under the scaling rule: "scaled" = l2 x s (the paper, for
    # N epochs); "constant" = l2 as configured. L2 acts on a row only in the steps that
    # hold it: a rare id seen once takes one step at any batch, so l2 x s shrinks it s
    # times harder than at the base batch (BENCHMARKS, "Large batches").
    l2_rule: str = "constant"       # constant | scaled
    # How Adam's beta2 follows the batch under the scaling rule: "scaled" = beta2 ** s' with
    # s' = min(s, beta2_max_scale), so the second moment forgets over the same number of
    # samples as at the base batch (the SDE scaling rule for Adam: 1 - (1 - beta2) x s, to
    # first order); "constant" = beta2 as configured. At 32K on 8M rows beta2 = 0.999
    # remembered every one of the pass's 220 steps: early, large gradients kept the steps
    # of the late ones small (docs/large-batches.md).
    beta2_rule: str = "scaled"      # scaled | constant
    beta2_max_scale: float = 32.0
    # Under the scaling rule with s > ramp_scale, the first ramp_samples samples train at
    # sub-batches of ramp_scale x scale_from_batch (each batch split into that many rows
    # per step, each step under the rule for that smaller batch); then every batch is one
    # step. Interactions between ids start from a saddle (two near-zero vectors whose
    # product has near-zero gradient): escaping it takes steps, not samples, and a pass of
    # 55 steps at 128K never did (docs/large-batches.md); 256 small steps (2,097,152
    # samples) left it closer to batch 1,024 than 128 did at 32K and 128K. 0 = no ramp. In
    # a distributed job each rank splits its own batch, the ramp counting the job's steps.
    ramp_samples: int = 2_097_152
    ramp_scale: float = 8.0
    # The output bias starts at the log-odds of the first batch's click rate, so the
    # first predictions sit at the base rate rather than 0.5 (on a 2.6% CTR log the
    # mean prediction after one pass was 1.4-2.8x the CTR starting from 0).
    init_bias_from_data: bool = True
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-7


@dataclass
class ResolvedOptim(OptimConfig):
    """OptimConfig after the scaling rule, plus what the update kernels derive from it."""
    batch_size: int = 0             # the batch that trains
    scale: float = 1.0              # s = batch_size / scale_from_batch (1 without a rule)
    clip_scale: float = 1.0         # threshold factor in mean-gradient units (1/batch: occurrence)
    count_lr_s: float = 1.0         # s of the per-row count rule (1: off)
    ramp_batch: int = 0             # rows per step during the ramp (0: no ramp)
    ramp_steps: int = 0             # the ramp's steps: ceil(ramp_samples / ramp_batch)


# torch.compile's modes that train.compile_mode takes.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


@dataclass
class TrainConfig:
    device: str = "auto"            # auto | cpu | cuda | cuda:N
    # The dense model's matmuls: "bf16" (autocast; weights, rows, Adam and CowClip stay
    # fp32), "fp32", or "auto" = bf16 where the hardware runs it fast (CUDA 8.0+, a CPU
    # with AMX or AVX512-BF16), fp32 elsewhere (models/scoring.py).
    precision: str = "auto"         # auto | fp32 | bf16
    # CUDA: synchronize at each step-phase boundary so the phase metrics charge each
    # phase its own GPU time (costs some CPU/GPU overlap; CPU runs are always exact).
    sync_phases: bool = False
    # torch.compile the dense model (inductor: fused bias+activation kernels, on CPU and
    # CUDA): 1.24-1.32x the eager trainer at batch 8,192 in bf16 on a 2-vCPU EPYC in one
    # pair, not separable from the noise in two later ones (BENCHMARKS). Off by default: it
    # compiles for ~10-20 s at start and again for each new batch shape (the last partial
    # batch), which a short run never earns back.
    compile: bool = False
    # torch.compile's mode: "default"; "reduce-overhead" also records the compiled forward
    # and backward as CUDA graphs, one launch each instead of one per kernel, which is what
    # bounds a GPU step at small batches (a graph per batch shape; on the CPU the same as
    # default); "max-autotune-no-cudagraphs" times kernel variants while compiling.
    compile_mode: str = "default"
    seed: int = 1235
    # torch intra-op threads; 0 = auto: the cores the process may use (affinity, cgroup
    # quota, its share among the ranks on the host), fewer when other processes keep
    # them busy (the host's load; $STREAM_CTR_LOAD_AVG pins it): stream_ctr/threads.py
    threads: int = 0
    deterministic: bool = True
    # Free heap glibc's malloc may keep between steps instead of handing it back and
    # faulting it in again next step (train/heap.py): 1.2x faster steps at batch 8,192
    # and 1.7x at 65,536 on the CPU, for up to this much more RSS; 0 = glibc's defaults
    # (otherwise at least 64 MiB: a smaller setting would map more memory afresh, not less).
    heap_keep_bytes: int = 1 << 30
    # "" = a new directory per run, runs/<UTC time>-<model>-<source>, with runs/latest
    # linking to the run trained last; --resume DIR keeps writing into DIR (train/run_dir.py).
    run_dir: str = ""
    checkpoint_dir: str = ""        # default: RUN_DIR/checkpoints
    checkpoint_every_batches: int = 0   # 0 = only at the end of the run
    keep_checkpoints: int = 3
    eval_window_records: int = 100_000  # sliding window of the prequential metrics
    # The window's AUC, logloss and calibration are recomputed at most this often for
    # progress, the time series and the gauges (sorting 100K scores per batch halved
    # the speed at batch 64); summaries and checkpoints always compute them exactly.
    eval_refresh_s: float = 1.0
    # The model that is tested, evaluated and exported holds an average of the dense
    # weights over about this many trained samples (Trainer._update_average; the live
    # weights still score the prequential metrics and take every step); 0 = the live
    # weights. The output of a few hundred noisy steps wanders: on the bundled Avazu
    # sample the live model's mean prediction on its own training rows swung between
    # 0.74x and 1.22x of their click rate from one checkpoint to the next (BENCHMARKS,
    # "The evaluated model"). 65,536 rather than 8,192 since 0.9.0: +0.02-0.06 test AUC
    # points on 1M-row streams at batch 64-8,192 and on the own-log example, the bundled
    # samples unchanged (their ~200 steps never leave the plain-mean start).
    average_dense_samples: int = 65_536
    log_every_s: float = 1.0


@dataclass
class StoreConfig:
    # Where embedding rows live (stream_ctr/store, docs/tiers-and-sizing.md):
    # "memory" = one growable table on the device; "tiered" = device
    # cache + host RAM + LMDB on disk, each bounded by a byte budget (a number,
    # or a string with a suffix: "512MiB", "2GB", "64G").
    kind: str = "memory"            # memory | tiered
    cache_bytes: int = 256 << 20    # device cache (GPU memory, or CPU memory without a GPU)
    ram_bytes: int = 1 << 30        # host RAM tier
    disk_bytes: int = 64 << 30      # cap of the LMDB store (rows, undo logs, B-tree slack)
    # LMDB pages kept mapped in the process (they count in its RSS; beyond this they are
    # unmapped but stay in the OS page cache); 0 = no limit.
    mapped_bytes: int = 256 << 20
    # A file (store_dir/spill.bin) for dirty rows RAM pushes out, written to LMDB in key
    # order a range at a time instead of one random B-tree write per row; its index takes
    # 73 B of RAM a row (~37% of its size). Never state: a checkpoint drains it. 0 = off.
    spill_bytes: int = 256 << 20
    store_dir: str = ""             # LMDB directory; default RUN_DIR/store
    policy: str = "lru"             # demotion order: lru | lfu
    admission_min_count: int = 1    # a key gets a row once seen in this many batches; 1 = at once
    ttl_steps: int = 0              # delete rows unseen for more batches than this; 0 = never
    ttl_seconds: int = 0            # ... or whose event time is older than this; 0 = never
    # Who frees the cache slots the next batch's misses take: the I/O thread while the step
    # trains (on), or the next `prepare` (off). auto = on where the I/O thread has a core of
    # its own: a GPU run (the host waits on the device), or torch on fewer threads than
    # the usable cores. On 2 busy cores moving it only slowed the step (docs/tiers-and-sizing.md).
    evict_ahead: str = "auto"       # auto | on | off


@dataclass
class MetricsConfig:
    # Prometheus endpoint (/metrics); 0 = off. Under torchrun, rank r with
    # local rank l serves on port + l; in a job of several ranks every series is labelled
    # rank="r" (a single process, torchrun with one rank included, carries no rank label).
    port: int = 0
    addr: str = "127.0.0.1"         # bind address; 0.0.0.0 lets other hosts scrape
    # RUN_DIR/timeseries.jsonl (for `stream-ctr report`): one record per
    # interval; 0 = off. Raise it (e.g. 60) for runs that last weeks.
    timeseries_every_s: float = 1.0
    # Past this size the file is renamed to timeseries.jsonl.<n> and a new one
    # started (stream_ctr/telemetry/timeseries.py); 0 = never rotate. At most
    # timeseries_keep_segments renamed files are kept whole, the oldest folded
    # (thinned) into timeseries.jsonl.0 and deleted: the defaults keep three to four
    # weeks of 1 s intervals whole in about 576 MiB per rank, plus the history.
    timeseries_max_bytes: int = 64 << 20
    timeseries_keep_segments: int = 8
    # Exported as stream_ctr_prequential_auc_baseline; the AUC alert fires
    # below it. 0 = no baseline.
    auc_baseline: float = 0.0


@dataclass
class ServingConfig:
    # Publish the model for predict servers while training (stream_ctr/serving/publisher.py):
    # a directory, or kafka://HOST:PORT/TOPIC, that `stream-ctr serve --follow` reads; "" = off. Each invocation's first
    # publish is a full snapshot, every later one a delta (rows touched since the last one +
    # the dense weights), each right after a durable checkpoint.
    publish: str = ""
    # Checkpoint and publish at least this often (seconds of training); 0 = only at the
    # checkpoints train.checkpoint_every_batches makes.
    publish_every_s: float = 0.0
    # A full snapshot instead of a delta every N publishes (bounds a follower's catch-up
    # and, with store TTL, the rows a follower keeps past their expiry); 0 = never.
    full_every: int = 50


@dataclass
class DistributedConfig:
    # Several replicas under torchrun (stream_ctr/distributed/context.py, docs/distributed.md).
    merge_every_k_steps: int = 8    # average the dense replicas every k steps (k-step Adam)
    merge_moments: bool = True      # ... with Adam's exp_avg / exp_avg_sq too
    hierarchical: bool = False      # all-reduce gradients inside a node every step, merge across nodes every k
    timeout_s: float = 300.0        # a collective waiting longer on a lost rank fails the job
    backend: str = "auto"           # auto (nccl on CUDA, gloo on CPU) | gloo | nccl


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
    # kafka:// sources (connectors/kafka/options.py; the URL's ?group=&format= override)
    kafka: KafkaOptions = field(default_factory=KafkaOptions)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(raw: dict[str, Any], origin: str = "config") -> "Config":
        cfg = Config()
        raw = _upgrade_legacy(raw)
        if "schema" in raw:             # [schema]: the data's declared layout, kept as its TOML text
            raw = dict(raw)
            cfg.data.schema = schema_text(raw.pop("schema"), origin)
        sections = [f.name for f in dataclasses.fields(cfg)]
        for section, values in raw.items():
            if hasattr(cfg, section) and not isinstance(values, dict):
                raise ConfigError(f"{origin}: [{section}] is a section: write its options under a "
                                  f"[{section}] header, not {section} = {values!r}")
            if not isinstance(values, dict):
                owners = [f"[{s}] {section}" for s in sections
                          if any(f.name == section for f in dataclasses.fields(getattr(cfg, s)))]
                raise ConfigError(f"{origin}: {section} = {values!r} is outside any section"
                                  + (f"; it belongs under {' or '.join(owners)}" if owners else
                                     f" and names no option (sections: {', '.join(sections)})"))
            if not hasattr(cfg, section):
                raise ConfigError(f"{origin}: unknown section [{section}] (known: {', '.join(sections)})")
            for key, value in values.items():
                set_option(cfg, f"{section}.{key}", value, origin)
        return cfg


def schema_text(table: Any, origin: str) -> str:
    """The canonical TOML text of a [schema] table (or TOML text); ConfigError if it cannot work."""
    from stream_ctr.connectors.schema import SchemaError, parse_schema, schema_to_toml
    try:
        return schema_to_toml(parse_schema(table if isinstance(table, str) else {"schema": table}, origin))
    except SchemaError as exc:
        raise ConfigError(str(exc)) from None


def read_schema_file(path: str) -> str:
    """--schema FILE: the schema's canonical TOML text (what data.schema holds); ConfigError
    naming the file and field when it cannot work."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--schema {path}: cannot read it ({exc})") from None
    return schema_text(text, path)


# Optimizer rules a checkpoint written before them ran without: a resumed run keeps
# training the way it started (a full checkpoint config names every field it had).
_RULES_ADDED_IN_0_14 = {"beta2_rule": "constant", "rule_warmup_samples": 0, "ramp_samples": 0,
                        "embed_lr_cap_rule": "fixed", "embed_lr_cap_floor": 0.0}


def checkpoint_config(raw: dict[str, Any], origin: str) -> "Config":
    """The Config a checkpoint (its state.json "config") ran with."""
    optim = raw.get("optim")
    if isinstance(optim, dict):
        raw = {**raw, "optim": {**_RULES_ADDED_IN_0_14, **optim}}
    return Config.from_dict(raw, origin=origin)


def _upgrade_legacy(raw: dict[str, Any]) -> dict[str, Any]:
    """Configs (checkpoints) from before warmup_samples: warmup_steps x the batch they ran."""
    optim = raw.get("optim")
    if not isinstance(optim, dict) or "warmup_steps" not in optim:
        return raw
    raw = {**raw, "optim": dict(optim)}
    steps = int(raw["optim"].pop("warmup_steps"))
    batch = int((raw.get("data") or {}).get("batch_size", DataConfig.batch_size))
    raw["optim"].setdefault("warmup_samples", steps * batch)
    return raw


def set_option(cfg: Config, dotted: str, value: Any, origin: str = "override") -> None:
    """Set `section.name` to `value`, converting strings to the field's type."""
    section, _, name = dotted.partition(".")
    sub = getattr(cfg, section, None)
    if sub is None or not dataclasses.is_dataclass(sub) or not name:
        sections = [f.name for f in dataclasses.fields(cfg)]
        raise ConfigError(f"{origin}: unknown option '{dotted}' (use section.name, e.g. model.name; "
                          f"sections: {', '.join(sections)})")
    fields = {f.name: f for f in dataclasses.fields(sub)}
    if name not in fields:
        raise ConfigError(f"{origin}: unknown option '{dotted}' "
                          f"(known in [{section}]: {', '.join(fields)})")
    default = getattr(type(sub)(), name)
    setattr(sub, name, _convert(value, default, dotted, origin))


def config_with_options(config: "Config | str | Path | None", options: dict[str, Any]) -> "Config":
    """A Config from `config` (a Config, copied; a TOML file; None: the defaults) with
    `options` set on it (the Python API's keywords). An option is `section__name`
    (`data__batch_size=1024`), or the bare name when one section alone has it
    (`batch_size=1024`); ConfigError names an unknown or ambiguous one."""
    if isinstance(config, Config):
        cfg = Config.from_dict(config.to_dict(), origin="config")
    else:
        cfg = load_config(config)
    sections = [f.name for f in dataclasses.fields(cfg)]
    for key, value in options.items():
        section, sep, name = key.partition("__")
        if not sep:
            owners = [s for s in sections if any(f.name == key for f in dataclasses.fields(getattr(cfg, s)))]
            if len(owners) != 1:
                why = (f"{' and '.join(f'{s}.{key}' for s in owners)} both exist: write "
                       f"{owners[0]}__{key}" if owners else "no section has it")
                raise ConfigError(f"option {key!r}: {why}")
            section, name = owners[0], key
        set_option(cfg, f"{section}.{name}", value, origin="options")
    return cfg


def _convert(value: Any, default: Any, dotted: str, origin: str) -> Any:
    try:
        if isinstance(default, bool):
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
                return bool(value)
            raise ValueError(value)
        # TOML's true is a Python int too: batch_size = true trained batches of 1 record.
        if isinstance(value, bool) or (isinstance(value, (list, tuple)) and any(isinstance(v, bool) for v in value)):
            raise ValueError(value)
        if isinstance(default, tuple):
            if isinstance(value, str):
                value = [v for v in value.replace(" ", "").split(",") if v]
            return tuple(int(v) for v in value)
        if isinstance(default, int) and dotted.endswith("_bytes") and isinstance(value, str):
            return parse_bytes(value)
        if isinstance(default, int):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)
        if isinstance(default, float):
            number = float(value)
            if not math.isfinite(number):       # lr_dense = inf skipped every batch as non-finite
                raise ValueError(value)
            return number
        return str(value)
    except (TypeError, ValueError, OverflowError):
        kind = {bool: "true or false", tuple: "a comma-separated list of integers",
                float: "a finite number", int: "an integer"}.get(type(default), type(default).__name__)
        if isinstance(default, int) and dotted.endswith("_bytes"):
            kind = "a byte size (an integer, or e.g. 512MiB, 2GB, 64G)"
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        raise ConfigError(f"{origin}: option '{dotted}' must be {kind}, got {shown}") from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load TOML (or defaults when `path` is None), apply `section.name=value` overrides."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            raw = tomllib.loads(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{p}: not a UTF-8 text file; --config takes a TOML file "
                              "(stream-ctr config example writes one)") from None
        except OSError as e:
            raise ConfigError(f"{p}: cannot read it ({e.strerror})") from None
        cfg = Config.from_dict(raw, origin=str(p))
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override '{item}' must look like section.name=value")
        set_option(cfg, key.strip(), value.strip(), origin="--set")
    return cfg


_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
               "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
               "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str | int) -> int:
    """A byte count from '123', '64MB', '512MiB', '2G', '1.5GiB' (k/M/G/T = powers of 1000,
    KiB/MiB/GiB/TiB = powers of 1024)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().lower().replace("_", "").replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if unit not in _BYTE_UNITS or not num:
        raise ValueError(f"not a byte size: {text!r} (use e.g. 512MiB, 2GB, 64G)")
    return int(float(num) * _BYTE_UNITS[unit])


MODELS = ("deepfm", "wdl", "dcn", "dcnv2", "lr")
# A smaller rotation size would rename the time series every few lines and keep almost nothing.
TIMESERIES_MIN_BYTES = 64 << 10


# train.heap_keep_bytes and predict --heap-keep-bytes: setting a threshold turns off glibc's own,
# which rises to 32 MiB by itself, so a small setting would map more memory afresh (train/heap.py).
HEAP_KEEP_MIN_BYTES = 64 << 20
HEAP_KEEP_RULE = ("0 (glibc's defaults) or at least 64MiB (a smaller setting maps more memory afresh "
                  "than glibc's default does)")


def heap_keep_bytes_ok(value: int) -> bool:
    return value == 0 or value >= HEAP_KEEP_MIN_BYTES


def check_line_range(start: int | None, stop: int | None) -> None:
    """`--start` / `--stop` of eval and predict (data-line offsets): 0 <= start <= stop."""
    if (start or 0) < 0 or (stop is not None and stop < (start or 0)):
        raise ConfigError(f"--start {start} / --stop {stop}: need 0 <= start <= stop (data-line offsets)")


MAX_THREADS = 1024


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
        (d.dead_letter_max_bytes >= 0,
         f"data.dead_letter_max_bytes must be >= 0 (0: keep only each record's size and hash), "
         f"got {d.dead_letter_max_bytes}"),
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
        (o.warmup_samples >= 0, f"optim.warmup_samples must be >= 0, got {o.warmup_samples}"),
        (o.scale_from_batch >= 0,
         f"optim.scale_from_batch (--scale-from) must be >= 0 (0 = no scaling rule), got {o.scale_from_batch}"),
        (o.cowclip_units in ("mean", "occurrence"),
         f"optim.cowclip_units must be mean or occurrence, got {o.cowclip_units!r}"),
        (o.l2_rule in ("scaled", "constant"),
         f"optim.l2_rule must be scaled or constant, got {o.l2_rule!r}"),
        (o.rule_warmup_samples >= 0, f"optim.rule_warmup_samples must be >= 0, got {o.rule_warmup_samples}"),
        (o.ramp_samples >= 0, f"optim.ramp_samples must be >= 0 (0 = no ramp), got {o.ramp_samples}"),
        (o.ramp_scale >= 1, f"optim.ramp_scale must be >= 1 (the ramp's sub-batch in base batches), got {o.ramp_scale}"),
        (o.beta2_rule in ("scaled", "constant"), f"optim.beta2_rule must be scaled or constant, got {o.beta2_rule!r}"),
        (o.beta2_max_scale >= 1, f"optim.beta2_max_scale must be >= 1, got {o.beta2_max_scale}"),
        (o.embed_lr_rule in ("constant", "count"),
         f"optim.embed_lr_rule must be constant or count, got {o.embed_lr_rule!r}"),
        (o.embed_lr_cap_rule in ("sqrt", "fixed"),
         f"optim.embed_lr_cap_rule must be sqrt or fixed, got {o.embed_lr_cap_rule!r}"),
        (o.embed_lr_cap_floor >= 0, f"optim.embed_lr_cap_floor must be >= 0 (0 = none), got {o.embed_lr_cap_floor}"),
        (o.embed_lr_max_scale >= 0,
         f"optim.embed_lr_max_scale must be >= 0 (0 = no cap), got {o.embed_lr_max_scale}"),
        (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)"),
        (o.eps > 0, f"optim.eps must be > 0, got {o.eps}"),
        (t.device == "auto" or t.device == "cpu" or t.device.startswith("cuda"),
         f"train.device must be auto, cpu, cuda or cuda:N, got {t.device!r}"),
        # torch crashed outright at 100,000 (each thread's stack), and crawled at 5,000.
        (0 <= t.threads <= MAX_THREADS,
         f"train.threads must be in [0, {MAX_THREADS}] (0: chosen by the cores and the load), got {t.threads}"),
        (cfg.data.decode_threads <= MAX_THREADS, f"data.decode_threads must be <= {MAX_THREADS}, got {cfg.data.decode_threads}"),
        (heap_keep_bytes_ok(t.heap_keep_bytes),
         f"train.heap_keep_bytes must be {HEAP_KEEP_RULE}, got {t.heap_keep_bytes}"),
        (t.checkpoint_every_batches >= 0, "train.checkpoint_every_batches must be >= 0"),
        (t.keep_checkpoints >= 1, f"train.keep_checkpoints must be >= 1, got {t.keep_checkpoints}"),
        (t.eval_window_records >= 1, "train.eval_window_records must be >= 1"),
        (cfg.data.read_ahead_chunks >= 0, "data.read_ahead_chunks must be >= 0 (0: no read-ahead)"),
        (cfg.data.decode_threads >= 0, "data.decode_threads must be >= 0 (0: one per 4 cores, per 2 on a GPU)"),
        (t.compile_mode in COMPILE_MODES,
         f"train.compile_mode must be one of {', '.join(COMPILE_MODES)}, got {t.compile_mode!r}"),
        (t.precision in ("auto", "fp32", "bf16"),
         f"train.precision must be auto, fp32 or bf16, got {t.precision!r}"),
        (t.eval_refresh_s >= 0, "train.eval_refresh_s must be >= 0 (0: recompute the window after every batch)"),
        (t.average_dense_samples >= 0,
         f"train.average_dense_samples must be >= 0 (0: evaluate the live weights), got {t.average_dense_samples}"),
        (0 <= cfg.metrics.port <= 65535, f"metrics.port must be in [0, 65535], got {cfg.metrics.port}"),
        (bool(cfg.metrics.addr.strip()), "metrics.addr must be an address to bind, e.g. 127.0.0.1"),
        (cfg.metrics.timeseries_every_s >= 0,
         f"metrics.timeseries_every_s must be >= 0, got {cfg.metrics.timeseries_every_s}"),
        (cfg.metrics.timeseries_max_bytes == 0 or cfg.metrics.timeseries_max_bytes >= TIMESERIES_MIN_BYTES,
         f"metrics.timeseries_max_bytes must be 0 (never rotate) or at least 64KiB (a few hundred "
         f"intervals per file), got {cfg.metrics.timeseries_max_bytes}; e.g. 64MiB"),
        (cfg.metrics.timeseries_keep_segments >= 1,
         f"metrics.timeseries_keep_segments must be >= 1 (rotated files kept besides the current one), "
         f"got {cfg.metrics.timeseries_keep_segments}"),
        (0 <= cfg.metrics.auc_baseline <= 1,
         f"metrics.auc_baseline must be in [0, 1], got {cfg.metrics.auc_baseline}"),
        (cfg.store.kind in ("memory", "tiered"),
         f"store.kind must be memory or tiered, got {cfg.store.kind!r}"),
        (cfg.store.policy in ("lru", "lfu"), f"store.policy must be lru or lfu, got {cfg.store.policy!r}"),
        (cfg.store.evict_ahead in ("auto", "on", "off"),
         f"store.evict_ahead must be auto, on or off, got {cfg.store.evict_ahead!r}"),
        (cfg.store.cache_bytes > 0, f"store.cache_bytes (--cache-bytes) must be > 0, got {cfg.store.cache_bytes}"),
        (cfg.store.ram_bytes >= 0, f"store.ram_bytes (--ram-bytes) must be >= 0, got {cfg.store.ram_bytes}"),
        (cfg.store.disk_bytes > 0, f"store.disk_bytes (--disk-bytes) must be > 0, got {cfg.store.disk_bytes}"),
        (cfg.store.spill_bytes >= 0, f"store.spill_bytes must be >= 0 (0 = no spill), got {cfg.store.spill_bytes}"),
        (cfg.store.mapped_bytes >= 0, f"store.mapped_bytes must be >= 0 (0 = no limit), got {cfg.store.mapped_bytes}"),
        (cfg.store.admission_min_count >= 1,
         f"store.admission_min_count must be >= 1, got {cfg.store.admission_min_count}"),
        (cfg.store.ttl_steps >= 0 and cfg.store.ttl_seconds >= 0,
         "store.ttl_steps and store.ttl_seconds must be >= 0 (0 = no expiry)"),
        # The in-memory table has no row metadata to expire or admit by: silently
        # ignoring these would grow the table the user meant to bound.
        (cfg.store.kind == "tiered" or (cfg.store.admission_min_count == 1 and not cfg.store.ttl_steps
                                        and not cfg.store.ttl_seconds),
         "store.admission_min_count, store.ttl_steps and store.ttl_seconds need store.kind = "
         "tiered (the in-memory table keeps every row); set --set store.kind=tiered or drop them"),
        (cfg.serving.publish_every_s >= 0,
         f"serving.publish_every_s must be >= 0 (0: publish at checkpoints only), got {cfg.serving.publish_every_s}"),
        (cfg.serving.full_every >= 0, f"serving.full_every must be >= 0 (0: deltas only), got {cfg.serving.full_every}"),
        (cfg.distributed.merge_every_k_steps >= 1,
         f"distributed.merge_every_k_steps must be >= 1, got {cfg.distributed.merge_every_k_steps}"),
        (cfg.distributed.timeout_s > 0, f"distributed.timeout_s must be > 0, got {cfg.distributed.timeout_s}"),
        (cfg.distributed.backend in ("auto", "gloo", "nccl"),
         f"distributed.backend must be auto, gloo or nccl, got {cfg.distributed.backend!r}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    kafka_problem = cfg.kafka.problem(prefix="kafka.")
    if kafka_problem:
        raise ConfigError(kafka_problem)
    if cfg.data.schema:
        _check_field_widths(cfg.data.schema, m.embed_dim)
    return cfg


def _check_field_widths(schema: str, embed_dim: int) -> None:
    """A schema field's embed_dim is stored as whole rows of model.embed_dim."""
    from stream_ctr.connectors.schema import parse_schema
    parsed = parse_schema(schema)
    names = parsed.key_fields + tuple(f.name for f in parsed.multi_fields)
    for name, dim in zip(names, parsed.embed_dims):
        if dim % embed_dim:
            raise ConfigError(f"schema field {name!r}: embed_dim {dim} is not a multiple of "
                              f"model.embed_dim {embed_dim} (a field is stored as whole rows of "
                              f"model.embed_dim); use {max(dim // embed_dim, 1) * embed_dim} or "
                              f"{(dim // embed_dim + 1) * embed_dim}, or change model.embed_dim")


def resolve_optim(cfg: Config, batch: int | None = None) -> ResolvedOptim:
    """The optimizer settings a run uses for `batch` (default `cfg.data.batch_size`).

    Without optim.scale_from_batch they are the configured ones. With a base
    batch B0 and s = batch / B0 (docs/large-batches.md): lr_dense x sqrt(s) (CowClip's
    rule), l2 x s only with l2_rule = scaled, lr_embed per row by its count
    (embed_lr_rule), beta2 ** min(s, beta2_max_scale) with beta2_rule = scaled, and,
    for s > 1, a warm-up of at least rule_warmup_samples; for s > ramp_scale, the ramp's
    sub-batch and step count (`ramp_optim` gives the sub-steps' settings). Paper check:
    Criteo base 1K (lr 8e-4, l2 1e-5, l2_rule = scaled) at 128K gives lr 90.51e-4, l2 1.28e-3.
    """
    o = cfg.optim
    batch = cfg.data.batch_size if batch is None else batch
    s = batch / o.scale_from_batch if o.scale_from_batch > 0 else 1.0
    fields = {f.name: getattr(o, f.name) for f in dataclasses.fields(OptimConfig)}
    fields.update(lr_dense=o.lr_dense * math.sqrt(s), l2=o.l2 * s if o.l2_rule == "scaled" else o.l2)
    if s > 1:
        fields.update(warmup_samples=max(o.warmup_samples, o.rule_warmup_samples))
        if o.beta2_rule == "scaled":
            fields.update(beta2=o.beta2 ** min(s, o.beta2_max_scale))
    ramp_batch = int(round(o.ramp_scale * o.scale_from_batch)) if o.ramp_samples > 0 and s > o.ramp_scale else 0
    return ResolvedOptim(**fields, batch_size=batch, scale=s,
                         clip_scale=1.0 / batch if o.cowclip_units == "occurrence" else 1.0,
                         count_lr_s=count_lr_scale(o, s, s),
                         ramp_batch=ramp_batch,
                         ramp_steps=math.ceil(o.ramp_samples / ramp_batch) if ramp_batch else 0)


def count_lr_scale(o: OptimConfig, s: float, run_s: float) -> float:
    """s' of the per-row count rule for a step at scale s in a run at scale run_s: s
    capped at the run's cap (optim.embed_lr_cap_rule); 1 = off."""
    if o.embed_lr_rule != "count":
        return 1.0
    if o.embed_lr_cap_rule == "sqrt":
        cap = max(math.sqrt(run_s / 2), min(run_s / 2, o.embed_lr_cap_floor))
    else:
        cap = o.embed_lr_max_scale if o.embed_lr_max_scale > 0 else s
    return max(1.0, min(s, cap))


def ramp_optim(cfg: Config, run: ResolvedOptim) -> ResolvedOptim | None:
    """The settings of the ramp's sub-steps (the rule for `run.ramp_batch`, with the run's
    warm-up, which spans samples whatever the step), or None without a ramp."""
    if not run.ramp_batch:
        return None
    sub = resolve_optim(cfg, run.ramp_batch)
    return dataclasses.replace(sub, warmup_samples=run.warmup_samples, ramp_batch=run.ramp_batch,
                               ramp_steps=run.ramp_steps,
                               count_lr_s=count_lr_scale(cfg.optim, sub.scale, run.scale))


def steps_for(r: ResolvedOptim, samples: int) -> int:
    """How many steps `samples` samples take under `r`: the ramp's at its sub-batch, the
    rest at the run's batch."""
    in_ramp = min(r.ramp_steps, math.ceil(samples / r.ramp_batch)) if r.ramp_batch else 0
    return in_ramp + math.ceil(max(0, samples - in_ramp * r.ramp_batch) / r.batch_size)


def describe_optim(r: ResolvedOptim) -> str:
    """One line of the resolved values, printed when a run starts."""
    rule = (f"batch {r.batch_size:,} = {r.scale:g} x base {r.scale_from_batch:,}" if r.scale_from_batch
            else f"batch {r.batch_size:,}, no scaling rule")
    warm_steps = steps_for(r, r.warmup_samples)
    warm = (f"warm-up {r.warmup_samples:,} samples ({warm_steps:,} steps)"
            if r.warmup_samples else "no warm-up")
    if r.scale_from_batch and r.scale > 1 and warm_steps < 4:
        # The scaled dense lr at full strength on a cold model was what broke 32K-128K.
        warm += " - under 4 steps at this batch: raise optim.rule_warmup_samples (docs/large-batches.md)"
    if r.ramp_batch:
        warm += (f", the first {r.ramp_samples:,} samples in sub-batches of {r.ramp_batch:,} "
                 f"({r.ramp_steps:,} steps)")
    clip = (f"cowclip r={r.cowclip_r:g} zeta={r.cowclip_zeta:g} ({r.cowclip_units} units)"
            if r.cowclip else "no cowclip")
    return (f"optim: {rule}: lr_dense {r.lr_dense:.4g}, lr_embed {r.lr_embed:.4g}"
            f"{f' (count per row, s={r.count_lr_s:g})' if r.count_lr_s > 1 else ''}, l2 {r.l2:.4g}, "
            f"adam beta2 {r.beta2:.4g}, {warm}, {clip}"
            f"{', output bias from the first batch' if r.init_bias_from_data else ''}")
