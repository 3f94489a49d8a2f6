"""stream_ctr: a streaming trainer for click-through-rate models.

One package, one subpackage per job; imports flow one way, top to bottom
(tests/test_layout.py checks it from the source):

    cli/          argument parsing and what each command prints
    bench/        `stream-ctr bench ...`: measurements; nothing in the core imports them
    distributed/  several replicas: process group, k-step merges, sharded rows, job checkpoints
    train/        the run: batches, trainer step, streaming, checkpoints, evaluation
    serving/      serving bundles (export) and the scorer `predict` and a server share
    store/        where embedding rows live (one table, or device cache + RAM + LMDB)
    telemetry/    Prometheus metrics, scrape-time collectors, time series, report, progress
    models/       DeepFM, W&D, DCN, DCNv2 on gathered embedding rows
    config        the typed configuration tree (every option's one home)
    resources     files shipped in the wheel: samples, monitoring, example config
    connectors/   sources and sinks (files, Kafka); numpy only, never the trainer
    ops/          Triton kernels beside their torch references

`connectors/` and `ops/` are top-level folders of the repository that install
as `stream_ctr.connectors` and `stream_ctr.ops`.

The public API (docs/python-api.md), loaded on first use so that `import
stream_ctr` (and `stream-ctr --help`) stays light:

    stream_ctr.train(config=None, **options)   train; returns a RunSummary
    stream_ctr.load_bundle(path)               an exported bundle (checksums checked)
    stream_ctr.Scorer(bundle)                  scores decoded batches with it
    stream_ctr.Schema, parse_schema            a declared record layout
    stream_ctr.Config, load_config, ConfigError, RunSummary
"""
from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("stream-ctr")
except _metadata.PackageNotFoundError:      # run from a source tree that was never installed
    __version__ = "0+unknown"


def _numba_cache_dir() -> None:
    # The compiled decoders keep their machine code beside the source (__pycache__) or in
    # the user's cache. With neither writable (a read-only install run by a user without
    # a home, common in containers) numba raises "cannot cache function ...: no locator
    # available" at import, so every command failed. Point it at a per-user temp folder.
    import os
    import tempfile
    from pathlib import Path
    if "NUMBA_CACHE_DIR" in os.environ or os.access(Path(__file__).parent, os.W_OK):
        return
    home = Path(os.path.expanduser("~"))
    if home.is_dir() and os.access(home, os.W_OK):
        return
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    os.environ["NUMBA_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / f"stream-ctr-numba-{uid}")


_numba_cache_dir()


# name -> (module, attribute): what `from stream_ctr import NAME` loads on first use.
_PUBLIC = {
    "load_bundle": ("stream_ctr.serving.bundle", "read_bundle"),
    "Scorer": ("stream_ctr.serving.scorer", "Scorer"),
    "Schema": ("stream_ctr.connectors.schema", "Schema"),
    "parse_schema": ("stream_ctr.connectors.schema", "parse_schema"),
    "Config": ("stream_ctr.config", "Config"),
    "load_config": ("stream_ctr.config", "load_config"),
    "ConfigError": ("stream_ctr.config", "ConfigError"),
    "RunSummary": ("stream_ctr.train.loop", "RunSummary"),
}
__all__ = ["__version__", "train", *_PUBLIC]


def __getattr__(name: str):
    # `train` is also the subpackage stream_ctr/train/, which is callable (its __init__
    # says why), so `stream_ctr.train(...)` works however it was first imported.
    if name == "train":
        import importlib
        return importlib.import_module("stream_ctr.train")
    if name in _PUBLIC:
        import importlib
        module, attr = _PUBLIC[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'stream_ctr' has no attribute {name!r}")
