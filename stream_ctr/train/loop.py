"""The training run: source -> micro-batches -> prequential score + step -> checkpoint.

`train()` is the whole story of a run in one screen; every phase is one call.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

from stream_ctr.connectors.batch import Batch
from stream_ctr.connectors.files import (DamagedFile, EmptySource, FileSource, SourceError, count_readable,
                                         detect_format)
from stream_ctr.connectors.read_ahead import ReadAhead, decode_threads
from stream_ctr.train.heap import keep_heap
from stream_ctr.models.scoring import no_records_error, score_file
from stream_ctr.train.checkpoint import CheckpointState, holds_checkpoint, load_checkpoint, save_checkpoint
from stream_ctr.config import (Config, ConfigError, check_line_range, checkpoint_config, describe_optim,
                               validate)
from stream_ctr.serving.export import checkpoint_record
from stream_ctr.serving.publisher import open_publisher
from stream_ctr.train.evaluation import Accuracy, PrequentialWindow, accuracy
from stream_ctr.train.run_dir import claim_run_dir, link_checkpoint_dir, point_latest, run_dir_of
from stream_ctr.telemetry.monitor import RunMonitor
from stream_ctr.telemetry.progress import Progress
from stream_ctr.train.batches import LookAhead, StopSignal, micro_batches
from stream_ctr.connectors.kafka.client import StreamGone
from stream_ctr.connectors.kafka.options import KafkaUrl
from stream_ctr.train.streaming import (declared_schema, new_stream_batcher, open_dead_letter, source_format,
                                  stream_batches, stream_url)
from stream_ctr.store import resume_store_config
from stream_ctr.threads import ThreadChoice, choose_threads
from stream_ctr.train.trainer import Trainer, resolve_device

if TYPE_CHECKING:     # kafka-python is imported only by runs that read a topic
    from stream_ctr.connectors.kafka.source import KafkaSource


@dataclass
class RunSummary:
    records_trained: int = 0            # in this invocation
    records_trained_total: int = 0      # since the first checkpoint of the run
    records_rejected: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    skipped_batches: int = 0
    # CowClip diagnostics: share of the embedding
    # rows present in a batch whose gradient was clipped, and at the norm floor.
    clipped_row_fraction: float = 0.0
    floor_row_fraction: float = 0.0
    # ||gradient|| / clip threshold over every present row (1 = the clip binds): rows,
    # mean, and the bucket edges that bound its median and 99th percentile.
    clip_ratio: dict = field(default_factory=dict)
    seconds: float = 0.0
    samples_per_s: float = 0.0
    # Wall seconds per step phase (decode, prepare, forward_backward, update, eval,
    # merge, checkpoint) in this invocation: where the time went.
    phase_seconds: dict[str, float] = field(default_factory=dict)
    precision: str = ""                 # the dense model's matmuls: fp32 or bf16
    window: dict[str, float] = field(default_factory=dict)
    test: dict[str, float] = field(default_factory=dict)
    checkpoint: str = ""
    dead_letter_path: str = ""
    source_stats: dict = field(default_factory=dict)   # Kafka: messages, outages, lag, ...
    optim: dict = field(default_factory=dict)          # the resolved optimizer settings
    stopped: bool = False               # SIGTERM / Ctrl-C ended it before the data did
    # With --epochs > 1 and a holdout: the held-out accuracy after each completed pass
    # (the window's AUC after the first pass scores rows the model has already seen).
    test_per_epoch: list = field(default_factory=list)
    empty_source: str = ""              # the file, when it held no records (nothing to train)

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("window", "test")}
        out.update({f"window_{k}": v for k, v in self.window.items()})
        out.update({f"test_{k}": v for k, v in self.test.items()})
        return out


def configure_torch(cfg: Config, processes_per_host: int = 1) -> ThreadChoice:
    """Set up torch for one of `processes_per_host` processes of a job on this host;
    returns the intra-op threads it chose (train.threads, else `choose_threads`)."""
    # Gradients of saturated units underflow to denormals, which x86 cores
    # process up to 100x slower (measured: a 4x slower DeepFM step); flush them.
    torch.set_flush_denormal(True)
    keep_heap(cfg.train.heap_keep_bytes)
    # Never torch's default (every online core): its spinning OpenMP pool collapses
    # when another process keeps the cores busy (stream_ctr/threads.py).
    threads = choose_threads(cfg.train.threads, processes_per_host)
    torch.set_num_threads(threads.threads)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        # With deterministic algorithms torch also fills every new tensor with NaN, a guard
        # for code that reads memory it never wrote. On the CPU ours writes before it reads
        # (the bit-identical resume tests would see otherwise), and the fills were ~226 a step
        # at batch 8,192, 2 of them [B, 403] (torch.profiler). The guard stays on CUDA, whose
        # Triton outputs those tests never run.
        torch.utils.deterministic.fill_uninitialized_memory = resolve_device(cfg.train.device).type != "cpu"
    return threads


def revoke_hook(run: "Run"):
    """The KafkaSource's `on_revoke`: runs while the trainer is between steps.

    Rows of the revoked partitions that were read but not trained are dropped
    (the partitions' next owner reads them; if that is this member again, it
    continues at the trained position and reads them again); then, unless the
    membership was lost (no commit is possible then), the model is checkpointed
    so that what was trained from those partitions is durable before the source
    commits their offsets for the next owner.  The checkpoint keeps the revoked
    partitions' positions, marked given up (see `PositionBook.released`).
    """
    def on_revoke(partitions: list[str], lost: bool) -> None:
        run.batcher.discard(partitions)
        if run.lookahead is not None:
            run.lookahead.discard(partitions)
        run.positions = run.source.trained_positions
        if not lost:
            run.checkpoint(commit=False)        # the source commits once this returns
    return on_revoke


def open_kafka_source(run: "Run", url: KafkaUrl) -> "KafkaSource":
    from stream_ctr.connectors.kafka.source import KafkaSource
    return KafkaSource(url, positions=run.positions, on_revoke=revoke_hook(run),
                       chunk_records=run.cfg.data.chunk_records, schema=declared_schema(run.cfg))


def resume_data_config(cfg: Config, saved: Config) -> None:
    """What a resumed run reads: the checkpoint's source and holdout unless the command
    names others. A resume that names none goes on with the same file and keeps its
    held-out lines held out (it used to fall back to the bundled sample, and to
    train the held-out lines); naming another file continues training on it (a
    new day of logs), from its first line."""
    default = Config().data
    for name in ("source", "holdout_fraction", "schema"):
        if getattr(cfg.data, name) == getattr(default, name):     # not named by the command
            setattr(cfg.data, name, getattr(saved.data, name))


def refuse_changed_model(cfg: Config, saved: Config, resume: str) -> None:
    """A resume trains the checkpoint's model with its optimizer settings. A model.* or
    optim.* value the command set (it differs from the default) that differs from the
    checkpoint's would be ignored silently: refuse it, naming each one."""
    default = Config()
    changed = []
    for section in ("model", "optim"):
        given, run_has, default_has = (getattr(c, section) for c in (cfg, saved, default))
        for f in dataclasses.fields(given):
            value = getattr(given, f.name)
            if value != getattr(default_has, f.name) and value != getattr(run_has, f.name):
                changed.append(f"{section}.{f.name} = {value!r} (the run has {getattr(run_has, f.name)!r})")
    if changed:
        raise ConfigError(f"--resume {resume} continues the run's model and optimizer, but this command "
                          f"sets {'; '.join(changed)}; drop those options, or train a new run with them")


class Run:
    """What one `train` invocation holds: trainer, source plan, window, counters."""

    # Score the holdout after every pass but the last (summary.test_per_epoch).
    EVALUATES_EACH_PASS = True

    def __init__(self, cfg: Config, resume: str | None) -> None:
        # A run or checkpoint root whose newest checkpoint is corrupt goes on from the newest valid one.
        state = load_checkpoint(resume, fall_back=True) if resume else None
        if state is not None:   # the model and optimizer settings are the checkpoint's
            saved = checkpoint_config(state.config, origin=f"{resume} (checkpoint config)")
            refuse_changed_model(cfg, saved, resume)
            cfg.model, cfg.optim = saved.model, saved.optim
            cfg.store = resume_store_config(cfg.store, saved.store)   # where its rows live
            resume_data_config(cfg, saved)
        validate(cfg)
        self.threads = configure_torch(cfg, self.processes_per_host)
        self.cfg = cfg
        self.stream = stream_url(cfg)         # a kafka:// source, else None (a file)
        self.stream_ended = False
        # A file that cannot be read to its end: its readable lines are trained and held
        # out as if they were the file; the pass stops at the damage (at_damage), unfinished.
        self.damage: DamagedFile | None = None
        self.at_damage = False
        if self.stream is not None:           # one long epoch: nothing to count or hold out
            self.fmt, self.path, self.n_total, self.train_end = source_format(cfg), None, 0, 0
        else:
            self.fmt, self.path = detect_format(cfg.data.source, cfg.data.schema)
            # Hold out the last fraction of the file, by data-line offset.
            self.n_total, self.damage = count_readable(self.path, self.fmt)
            self.train_end = held_out_start(self.n_total, cfg.data.holdout_fraction)
        if state is not None:
            saved_fmt = source_format(saved)
            if features(saved_fmt) != features(self.fmt):
                raise ConfigError(f"--resume {resume}: the checkpoint's model was trained on "
                                  f"{describe_features(saved_fmt)}, {cfg.data.source} decodes to "
                                  f"{describe_features(self.fmt)}: their features do not match; resume "
                                  "with the run's schema (omit --schema: the checkpoint holds it) or "
                                  "train into a new --run-dir")
            done = state.positions.get(f"file:{self.path.name}", 0) if self.path else 0
            if done > self.train_end:
                raise ConfigError(
                    f"--resume {resume}: the run already trained {self.path.name} up to line "
                    f"{done:,}, past where data.holdout_fraction = {cfg.data.holdout_fraction:g} "
                    f"starts the held-out lines ({self.train_end:,}); resume with the run's "
                    f"holdout ({saved.data.holdout_fraction:g}) or train into a new --run-dir")
        self.trainer = Trainer.for_format(cfg, self.fmt)
        self.window = PrequentialWindow(cfg.train.eval_window_records, cfg.train.eval_refresh_s)
        self.positions: dict[str, int] = {}
        self.epoch, self.total_before = 0, 0
        if state is not None:
            self.trainer.load_state_tensors(state.tensors["trainer"])
            self.window.load_state_dict({k: (v.numpy() if torch.is_tensor(v) else v)
                                         for k, v in state.tensors["window"].items()})
            self.positions, self.epoch = state.positions, state.extra.get("epoch", 0)
            self.total_before = state.records_trained
            was = state.extra.get("precision")
            if was and was != self.trainer.precision:   # train.precision=auto on other hardware
                print(f"stream-ctr: note: the checkpoint trained with {was} matmuls, this run uses "
                      f"{self.trainer.precision} (train.precision={cfg.train.precision}); set "
                      f"train.precision={was} to keep it", file=sys.stderr)
        run_dir = Path(cfg.train.run_dir)
        self.ckpt_dir = Path(cfg.train.checkpoint_dir or run_dir / "checkpoints")
        link_checkpoint_dir(run_dir, cfg.train.checkpoint_dir)
        # A file, or the dead-letter topic; once per record across restarts (the checkpoint's mark).
        self.dead_letter = open_dead_letter(cfg, self.stream, state.extra if state is not None else None)
        # A stream's batcher lives in the run: a rebalance drops its rows of revoked partitions.
        self.summary = RunSummary(dead_letter_path=str(self.dead_letter.path))
        self.batcher = (new_stream_batcher(cfg, self.stream, lambda: self.total_before + self.summary.records_trained)
                        if self.stream is not None else None)
        self.lookahead: LookAhead | None = None      # ... and so does the batch read ahead
        self.remaining = cfg.data.limit_records or -1      # -1: no limit
        self.rows_touched = self.rows_clipped = self.rows_at_floor = 0
        self.source: FileSource | None = None
        # Prometheus metrics (served if metrics.port) and RUN_DIR/timeseries.jsonl.
        self.monitor = RunMonitor(cfg, run_dir, self.total_before)
        self.monitor.watch(self.trainer.store, self.window, lag=self.source_lag,
                           source=lambda: self.source)
        if state is not None:       # the checkpoint's age counts from when it was written
            manifest = state.path / "manifest.json"
            self.monitor.metrics.resumed_from_checkpoint(manifest.stat().st_mtime)
        if self.epoch:
            self.monitor.metrics.observe_epoch(self.epoch, another_pass=self.epoch < cfg.data.epochs)
        # --publish: a resumed run publishes the model it resumed from before it trains
        # (stream_ctr/serving/publisher.py says why no rolled-back version is ever served).
        self.publisher = open_publisher(cfg, self.fmt)
        if self.publisher is not None and state is not None:
            self.publish(state.tensors, state.path, state)
        # Once nothing refuses the run: a refusal stays the one line it prints.
        if self.threads.warning and self.first_on_host:
            print(self.threads.warning, file=sys.stderr, flush=True)

    def source_lag(self) -> dict[str, int]:
        """Consumer lag of the file source: records of the training range not yet trained."""
        src = self.source
        if src is None:
            return {}
        if self.stream is not None:          # Kafka: counted per partition by the source
            return src.lag()
        if self.epoch >= self.cfg.data.epochs:        # every epoch trained: nothing left
            return {src.partition: 0}
        return {src.partition: max(self.train_end - self.positions.get(src.partition, 0), 0)}

    @property
    def limit_reached(self) -> bool:
        return self.remaining == 0

    def open_source(self):
        if self.stream is not None:          # opened once, closed when the run exits: one long epoch
            if self.source is None:
                self.source = open_kafka_source(self, self.stream)
            return contextlib.nullcontext(self.source)
        start = self.positions.get(f"file:{self.path.name}", 0)
        source = self.file_share(FileSource(self.path, self.fmt, start_offset=start,
                                            chunk_records=self.cfg.data.chunk_records,
                                            stop_offset=self.train_end))
        if self.cfg.data.read_ahead_chunks:
            source = ReadAhead(source, self.cfg.data.read_ahead_chunks,
                               decode_threads(self.cfg.data.decode_threads, self.processes_per_host))
        self.source = source
        return source

    # Processes of this job on one host, sharing its cores (a distributed run's ranks),
    # and whether this one speaks for them (a note about the host is printed once).
    processes_per_host = 1
    first_on_host = True

    def file_share(self, source: FileSource):
        """The records of the file this process trains: all of them (a rank of a
        distributed job takes its stripe). Read ahead, if configured, after this."""
        return source

    def record(self, batch: Batch, result) -> None:
        """Prequential scores into the window; the batch's end becomes the resume point."""
        self.window.add(result.probs.cpu().numpy(), batch.labels)
        if self.stream is not None:          # packed messages may straddle batches: the source folds
            self.positions = self.source.trained(batch)
        else:
            self.positions.update(batch.positions_after())
        self.summary.records_trained += len(batch)
        self.summary.batches += 1
        self.summary.skipped_batches += int(result.skipped)
        self.rows_touched += result.rows_touched
        self.rows_clipped += int(result.rows_clipped)
        self.rows_at_floor += int(result.rows_at_floor)
        if self.remaining > 0:
            self.remaining -= len(batch)

    def record_and_report(self, batch: Batch, result) -> Accuracy:
        """`record` the batch, then report it to the monitor with the window's accuracy:
        exact when a time-series record is due, else the cached one (the `eval` phase)."""
        t0 = time.perf_counter()
        self.record(batch, result)
        interval = self.monitor.interval_due()
        acc = self.window.window() if interval else self.window.latest()
        result.phase_s["eval"] = time.perf_counter() - t0
        self.monitor.on_batch(batch, result, acc, interval)
        return acc

    def end_epoch(self, source: FileSource, completed: bool) -> None:
        """After a pass over the source. `completed`: its batches ran out (every one was
        trained), as opposed to a stop signal ending the pass -- never read off the
        source, which says exhausted once closed, or once its last rows are read ahead."""
        # The epoch is over only when every record of it was trained, not
        # merely read: a limit may have stopped the loop with rows pending.
        if self.stream is not None:          # a stream ends (idle), it never starts over
            self.stream_ended = source.exhausted
        elif completed and not self.limit_reached and self.damage is not None:
            self.at_damage = True           # not the file's end: a resume with the repaired file goes on
        elif completed and not self.limit_reached:
            self.epoch, self.positions = self.epoch + 1, {}
            self.dead_letter.epoch = self.epoch         # the next pass dead-letters its bad lines again
            self.monitor.metrics.observe_epoch(self.epoch, another_pass=self.epoch < self.cfg.data.epochs)
            if (self.EVALUATES_EACH_PASS and self.cfg.data.epochs > 1 and self.epoch < self.cfg.data.epochs
                    and self.train_end < self.n_total):
                self.summary.test_per_epoch.append({"epoch": self.epoch, **self.held_out()})

    def held_out(self) -> dict[str, float]:
        """Accuracy of the current model on the held-out tail (no training)."""
        probs, labels = score(self.trainer, self.path, self.fmt, self.train_end, self.n_total,
                              self.cfg.data.chunk_records)
        return {**accuracy(probs, labels).as_dict(), **bayes_of_split(self.path, labels, self.train_end)}

    def window_label(self) -> str:
        """What the sliding window holds: after the first pass, rows scored a second time."""
        n = self.cfg.data.epochs
        if self.epoch == 0 or n == 1:       # (a finished single pass has epoch 1)
            return "prequential window"
        return f"window of re-read rows, pass {min(self.epoch + 1, n)} of {n}: not held out"

    @property
    def wants_more(self) -> bool:
        if self.stream is not None:
            return not self.limit_reached and not self.stream_ended
        return (self.epoch < self.cfg.data.epochs and not self.limit_reached and not self.at_damage
                and not self.empty)

    @property
    def empty(self) -> bool:
        """The source file holds no records (an empty file, an empty gzip, a header alone)."""
        return self.path is not None and self.n_total == 0 and self.damage is None

    def damaged(self, summary: RunSummary) -> DamagedFile:
        """The error that ends a run whose pass stopped at the damage of its file, after
        its checkpoint: what was trained, and how a resume goes on."""
        d, held = self.damage, self.n_total - self.train_end
        done = (f"were read: the first {self.train_end:,} trained, the last {held:,} held out and scored"
                if held else "were trained")
        then = (f"re-copy it, then `stream-ctr train --resume {self.cfg.train.run_dir}` goes on from line "
                f"{self.positions.get(f'file:{self.path.name}', 0):,} (checkpoint {summary.checkpoint})")
        err = DamagedFile(d.path, d.lines, d.cause, d.cut_bytes, done, then)
        err.summary = summary
        return err

    def batches(self, source, stop: "StopSignal") -> Iterator[Batch]:
        if self.stream is not None:
            return stream_batches(source, self.batcher, self.dead_letter, self.remaining,
                                  self.cfg.data.max_batch_delay_s, stop, self.monitor)
        return micro_batches(source, self.cfg.data.batch_size, self.dead_letter, self.remaining,
                             self.monitor)

    def owned(self, batch: Batch) -> Batch:
        """`batch` without rows of partitions a rebalance took away after it was read."""
        return self.source.owned_rows(batch) if self.stream is not None else batch

    def checkpoint(self, commit: bool = True) -> None:
        """Write a durable checkpoint; then (Kafka) commit its positions as the group's offsets."""
        t0 = time.perf_counter()
        # First: the dead letters up to here on disk (or acknowledged), and where the sink ends.
        dead_letter = self.dead_letter.mark(self.positions, self.epoch).as_dict()
        tensors = {"trainer": self.trainer.state_tensors(),
                   "window": {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v)
                              for k, v in self.window.state_dict().items()}}
        state = CheckpointState(self.trainer.step, self.total_before + self.summary.records_trained,
                                self.positions, self.cfg.to_dict(), tensors,
                                {"epoch": self.epoch, "source": self.cfg.data.source,
                                 # what the scaling rule made of cfg.optim for this batch size
                                 "resolved_optim": dataclasses.asdict(self.trainer.optim),
                                 "precision": self.trainer.precision, "dead_letter": dead_letter})
        self.summary.checkpoint = str(save_checkpoint(self.ckpt_dir, state, self.cfg.train.keep_checkpoints))
        self.monitor.on_checkpoint(time.perf_counter() - t0, self.summary.checkpoint)
        if commit and self.stream is not None:
            self.source.commit(self.positions)
        if self.publisher is not None:      # only now: the checkpoint is durable
            self.publish(tensors, Path(self.summary.checkpoint), state)

    def publish(self, tensors: dict, where: Path, state: CheckpointState) -> None:
        """Publish the model of the durable checkpoint at `where` (--publish)."""
        self.publisher.publish(tensors, checkpoint_record(where, state.step, state.records_trained,
                                                          state.extra.get("epoch", 0), state.positions),
                               self.trainer.precision, self.trainer.store)

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stream is not None and self.source is not None:
            self.summary.source_stats = self.source.stats.as_dict()
            self.source.close()            # leaves the group; commits happen after checkpoints only
        elif self.source is not None:      # a pass a stop cut short: its file and read-ahead thread
            self.source.close()

    def refuse_if_nothing_decoded(self) -> None:
        """Raise SourceError, before the final checkpoint, when this invocation trained
        nothing and rejected every record it read: a schema, encoding or source that does
        not fit the data (a JSON schema on a TSV file, a path that never matches). The
        resume point stays where it was, so a corrected rerun reads those records again;
        the dead-letter file keeps this attempt's rejects for diagnosis."""
        counts = self.dead_letter.counts
        if self.summary.records_trained or not counts:
            return
        raise SourceError(
            f"every record read from {self.cfg.data.source} was rejected "
            f"({sum(counts.values()):,}; {rejection_note(counts)}), nothing trained: the "
            f"schema or source does not fit the data. Nothing was checkpointed: fix the "
            f"schema or source and run again, with --resume {self.cfg.train.run_dir} to keep "
            f"this run directory (the rejects, with each record's field and value, are in "
            f"{self.dead_letter.path})")

    def finish(self, seconds: float) -> RunSummary:
        s = self.summary
        s.seconds = seconds
        s.records_trained_total = self.total_before + s.records_trained
        s.samples_per_s = s.records_trained / max(seconds, 1e-9)
        s.window = self.window.window().as_dict()
        self.monitor.metrics.observe_accuracy(s.window)       # the last interval: exact
        s.clipped_row_fraction = self.rows_clipped / max(self.rows_touched, 1)
        s.floor_row_fraction = self.rows_at_floor / max(self.rows_touched, 1)
        s.clip_ratio = self.monitor.metrics.clip_ratio.summary()
        s.phase_seconds = {k: round(v, 4) for k, v in self.monitor.metrics.phase_seconds.items()}
        s.precision = self.trainer.precision
        s.rejected_by_reason = dict(self.dead_letter.counts)
        s.records_rejected = sum(self.dead_letter.counts.values())
        self.dead_letter.close()
        if self.train_end < self.n_total:
            s.test = self.held_out()
            if s.test_per_epoch:
                s.test_per_epoch.append({"epoch": self.epoch, **s.test})
        self.monitor.close(s.as_dict())
        if self.publisher is not None:
            self.publisher.close()
        self.trainer.store.close()          # a tiered store waits for its I/O and closes LMDB
        return s


def train(cfg: Config, resume: str | None = None, show_progress: bool = True) -> RunSummary:
    """Train on `cfg.data.source`; resume from a checkpoint when `resume` is given.

    Ends at the end of the data (all epochs), at `data.limit_records`, or on
    SIGTERM / Ctrl-C after finishing the current batch; always checkpoints.
    A Kafka source (data.source kafka://...) is one long epoch: it ends on a
    signal, at the limit, or after `kafka.stop_when_idle_s` without records,
    and commits the group's offsets after every checkpoint.
    """
    if resume is not None and not holds_checkpoint(resume) and cfg.train.checkpoint_dir \
            and holds_checkpoint(cfg.train.checkpoint_dir):
        resume = cfg.train.checkpoint_dir   # --resume RUN_DIR of a run that checkpoints elsewhere
    # A supervisor restarts with the same command line (--resume DIR) whether or
    # not the first attempt lived to write a checkpoint: without one, start over.
    starting_over = resume is not None and not holds_checkpoint(resume)
    if starting_over:
        cfg.train.run_dir = str(Path(cfg.train.run_dir) if cfg.train.run_dir else run_dir_of(resume))
    # This process owns the run directory until the run ends (run_dir.py): a second
    # trainer there is refused before either writes anything.
    with claim_run_dir(cfg, None if starting_over else resume, set_aside=starting_over) as owner:
        if starting_over:
            aside = owner.set_aside
            print(f"stream-ctr: no checkpoint in {resume} yet: starting a new run in {cfg.train.run_dir}"
                  + (f" (the earlier attempt's time series moved to {aside})" if aside else ""),
                  file=sys.stderr, flush=True)
        return _train(cfg, owner.resume, show_progress)


def _train(cfg: Config, resume: str | None, show_progress: bool) -> RunSummary:
    """`train` in a run directory this process owns (cfg.train.run_dir)."""
    run = Run(cfg, resume)
    if run.empty:
        print(f"stream-ctr: warning: {run.path} holds no records (an empty file, an empty gzip or a "
              "header alone): nothing to train", file=sys.stderr, flush=True)
    point_latest(Path(cfg.train.run_dir))
    run.summary.optim = dataclasses.asdict(run.trainer.optim)
    if show_progress:
        print(describe_optim(run.trainer.optim), file=sys.stderr, flush=True)
        t = run.trainer
        print(f"model: {cfg.model.name} on {t.device}, {t.precision} matmuls "
              f"(train.precision={cfg.train.precision})", file=sys.stderr, flush=True)
    progress = Progress("train", cfg.train.log_every_s, enabled=show_progress)
    every = cfg.train.checkpoint_every_batches
    with StopSignal() as stop, run:
        while run.wants_more and not stop.requested:
            with run.open_source() as source:
                batches = keep_trained_if_gone(run, run.batches(source, stop))
                if run.publisher is not None:   # when each batch was read: what freshness counts from
                    batches = run.publisher.stamp(batches)
                # A tiered store prefetches the next batch's rows while this one trains.
                run.lookahead = LookAhead(batches, cfg.store.kind == "tiered")
                completed = False
                for batch, upcoming in run.lookahead:
                    arrived_s = run.publisher.arrival() if run.publisher is not None else 0.0
                    batch = run.owned(batch)    # a rebalance during the look-ahead read?
                    if not len(batch):
                        continue
                    # Step: its forward pass scores the batch before the update (prequential).
                    result = run.trainer.train_step(batch, upcoming)
                    if run.publisher is not None:   # its rows go in the next published delta
                        run.publisher.trained(batch, result.keys, arrived_s)
                    # Evaluate and advance the resume point past this batch.
                    acc = run.record_and_report(batch, result)
                    progress.update(run.summary.records_trained, run.summary.batches, acc.auc, acc.logloss,
                                    window=run.window_label())
                    if (every and run.summary.batches % every == 0) or (
                            run.publisher is not None and run.publisher.due()):
                        run.checkpoint()
                    if stop.requested:
                        break
                else:
                    completed = True
            run.end_epoch(source, completed)
        acc = run.window.window()
        progress.update(run.summary.records_trained, run.summary.batches, acc.auc, acc.logloss, force=True,
                        window=run.window_label())
        progress.close()
        run.refuse_if_nothing_decoded()
        run.checkpoint()
        run.summary.stopped = stop.requested
    summary = run.finish(progress.elapsed_s())
    summary.empty_source = str(run.path) if run.empty else ""
    if run.at_damage:                   # after the checkpoint: nothing trained is lost
        raise run.damaged(summary)
    return summary


def keep_trained_if_gone(run: Run, batches: Iterator[Batch]) -> Iterator[Batch]:
    """`batches`; a Kafka topic deleted under them (StreamGone) ends the run, but only
    after a checkpoint of what was trained (no group commit: the topic is gone)."""
    try:
        yield from batches
    except StreamGone as gone:
        run.checkpoint(commit=False)
        gone.checkpointed_at(run.summary.checkpoint)
        raise


def rejection_note(counts: dict[str, int], top: int = 3) -> str:
    """'missing:site 4,500, bad_json 2' for the most common dead-letter reasons."""
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return ", ".join(f"{reason} {n:,}" for reason, n in ranked)


def features(fmt) -> tuple:
    """What a model's shapes depend on: layout name, key fields, their pooling, dense columns."""
    return fmt.name, fmt.n_keys, fmt.pooling, fmt.n_dense


def describe_features(fmt) -> str:
    return (f"{fmt.name or 'schema'} records ({fmt.n_keys} key fields, {len(fmt.pooling or ())} "
            f"multi-hot, {fmt.n_dense} dense)")


def bayes_of_split(path: Path, labels: np.ndarray, start: int) -> dict[str, float]:
    """{"bayes_auc": ...} when `path` is a synthetic file with its true-probability sidecar
    (`stream-ctr synth`), so a test AUC can be read against the best reachable; else {}."""
    from stream_ctr.connectors.synth import bayes_auc, probs_path
    sidecar = probs_path(path)
    if not sidecar.is_file():
        return {}
    if np.load(sidecar, mmap_mode="r").shape[0] < start + len(labels):
        return {}                       # a sidecar of another (shorter) file
    return {"bayes_auc": bayes_auc(path, labels, start)}


def evaluate(trainer: Trainer, path: Path, fmt, start_offset: int, stop_offset: int | None,
             chunk_records: int) -> tuple[Accuracy, dict[str, int]]:
    """Score records [start_offset, stop_offset) without training on them: their accuracy
    and the records that did not decode, counted by reason."""
    rejected: Counter[str] = Counter()
    acc = accuracy(*score(trainer, path, fmt, start_offset, stop_offset, chunk_records, rejected))
    return acc, dict(rejected)


def score(trainer: Trainer, path: Path, fmt, start_offset: int, stop_offset: int | None,
          chunk_records: int, rejected: Counter[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Scores and labels of records [start_offset, stop_offset), without training on them.
    Records that do not decode are not scored; `rejected` (if given) counts them by reason."""
    rejected = Counter() if rejected is None else rejected
    probs, labels = score_file(trainer.predict, path, fmt, start_offset, stop_offset, chunk_records, rejected)
    if not len(probs):
        raise no_records_error(path, start_offset, rejected)
    return probs, labels


def held_out_start(n_total: int, holdout_fraction: float) -> int:
    """The data-line offset where a file's held-out tail starts."""
    return n_total - int(round(n_total * holdout_fraction))


def _same_file(source: str, path: Path, schema: str = "") -> bool:
    """Whether `source` (a run's data.source) names the file at `path`."""
    if "://" in source:
        return False
    try:
        return detect_format(source, schema)[1].resolve() == path.resolve()
    except (ConfigError, OSError):          # the run's file is gone or moved
        return False


def evaluate_checkpoint(state: CheckpointState, checkpoint: str, source: str | None = None,
                        start: int | None = None, stop: int | None = None,
                        whole: bool = False, schema: str | None = None) -> dict:
    """`stream-ctr eval`: score a file with a loaded checkpoint's model, no training.

    `state` is one rank's checkpoint or a distributed job's shards as one table
    (`stream_ctr.distributed.job_checkpoint.load_any`); `checkpoint` names it.
    Which rows: `start`/`stop` (data-line offsets) when given; else the whole file
    when `whole` or when `source` is not the run's own; else the run's held-out
    tail (data.holdout_fraction), the rows its test AUC was measured on. The
    result's `rows` says which it scored. `schema` (TOML text) decodes the source instead of
    the checkpoint's own schema."""
    cfg = Config.from_dict(state.config, origin=f"{checkpoint} (checkpoint config)")
    own = cfg.data.source
    if source is None:
        if own.lower().startswith("kafka://"):
            raise ConfigError(f"the run of {checkpoint} trained on a Kafka topic ({own}); "
                              "name a file to score: stream-ctr eval RUN_DIR criteo:PATH")
        source = own
    fmt, path = detect_format(source, schema or cfg.data.schema)
    saved_fmt = source_format(cfg)
    if features(saved_fmt) != features(fmt):
        raise ConfigError(f"checkpoint was trained on {describe_features(saved_fmt)}, "
                          f"{source} decodes to {describe_features(fmt)}: their features do not match")
    check_line_range(start, stop)
    n_total, damage = count_readable(path, fmt)
    if n_total == 0 and damage is None:
        raise EmptySource(f"{path} holds no records (an empty file, an empty gzip or a header alone): "
                          "nothing to score")
    if start is not None or stop is not None:
        start, rows = start or 0, "the given range"
    elif whole or not _same_file(own, path, cfg.data.schema):
        start, rows = 0, "all records"
    elif cfg.data.holdout_fraction > 0:
        start = held_out_start(n_total, cfg.data.holdout_fraction)
        rows = f"the run's held-out last {cfg.data.holdout_fraction:g}"
    else:
        start, rows = 0, "all records (the run held none out: it trained on them)"
    configure_torch(cfg)
    trainer = Trainer.for_format(cfg, fmt, read_only=True)     # never moves a row
    trainer.load_state_tensors(state.tensors["trainer"])
    acc, rejected = evaluate(trainer, path, fmt, start, stop, cfg.data.chunk_records)
    trainer.store.close()
    end = n_total if stop is None else min(stop, n_total)
    return {**acc.as_dict(), "checkpoint": str(checkpoint), "step": state.step,
            "source": source, "start": start, "stop": end, "rows": rows,
            "rejected": sum(rejected.values()), "rejected_by_reason": rejected}
