"""One training run: source -> micro-batches -> prequential score + step -> checkpoint.

    loop        `train()`, the run in one screen, and checkpoint evaluation
    inputs      the one source protocol: a file or a Kafka topic behind `events()`,
                `trained()`, `snapshot()`, `commit()` (events: Ready, Revoked, Idle)
    events      those events
    batches     file micro-batches, the look-ahead batch, the stop signal
    batcher     rows -> batches of the configured size
    streaming   Kafka sources: latency-bounded batches, dead letters
    offset_batches  Kafka batches as a function of offsets (kafka.deterministic_batches)
    trainer     the model, its store and both optimizers; one step
    heap        glibc malloc kept from returning a step's memory to the kernel
    checkpoint  atomic, checksummed checkpoints with the source position
    evaluation  AUC, logloss, calibration, the prequential window

May import serving (to publish), store, telemetry, models, config, connectors and
ops; never distributed, bench or cli.
"""

import sys as _sys
import types as _types


class _TrainPackage(_types.ModuleType):
    """This package, callable: `stream_ctr.train(...)` is the public API's train. Importing
    a submodule (stream_ctr.train.loop) binds the name `train` on `stream_ctr` to this
    package, so a plain function of that name there would be replaced by it; the
    package itself being callable keeps both."""

    def __call__(self, config=None, /, *, resume=None, show_progress: bool = False, **options):
        """Train as `stream-ctr train` does in one process; return its `RunSummary`.

        `config`: a Config (not changed: a copy is trained), a TOML file, or None for
        the defaults (the bundled Criteo sample). `options` set config fields:
        `train(source="criteo:day_0.gz", batch_size=8192, model__name="dcn")`.
        `resume`: a run directory or checkpoint to continue. Blocks until the data
        ends (all epochs), `data.limit_records`, or SIGTERM / Ctrl-C (the current
        batch finishes); always checkpoints into `train.run_dir` first. Raises
        ConfigError for a bad option, SourceError for data it cannot read."""
        from stream_ctr.config import config_with_options
        from stream_ctr.train.loop import train
        cfg = config_with_options(config, options)
        return train(cfg, None if resume is None else str(resume), show_progress)


_sys.modules[__name__].__class__ = _TrainPackage
