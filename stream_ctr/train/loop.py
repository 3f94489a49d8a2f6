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

import numpy as np
import torch

from stream_ctr.connectors.batch import Batch, Positions
from stream_ctr.connectors.files import EmptySource, SourceError, count_readable, detect_format
from stream_ctr.train.heap import keep_heap
from stream_ctr.connectors.dead_letter import rejection_note
from stream_ctr.models.scoring import no_records_error, score_file
from stream_ctr.train.checkpoint import CheckpointState, holds_checkpoint, load_checkpoint, save_checkpoint
from stream_ctr.config import (Config, ConfigError, check_line_range, checkpoint_config, describe_optim,
                               steps_for, validate)
from stream_ctr.serving.export import checkpoint_record
from stream_ctr.serving.publisher import open_publisher
from stream_ctr.train.evaluation import Accuracy, PrequentialWindow, accuracy
from stream_ctr.train.run_dir import claim_run_dir, link_checkpoint_dir, point_latest, run_dir_of
from stream_ctr.telemetry.monitor import RunMonitor
from stream_ctr.telemetry.progress import Progress
from stream_ctr.train.batches import StopSignal
from stream_ctr.connectors.kafka.client import StreamGone
from stream_ctr.train.inputs import FileInput, KafkaInput, Ready, Revoked, held_out_start
from stream_ctr.train.streaming import file_prefix, open_dead_letter, source_format, stream_url
from stream_ctr.store import resume_store_config
from stream_ctr.threads import ThreadChoice, choose_threads
from stream_ctr.train.trainer import Trainer, resolve_device


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
    # A resume of a run that had already done all its passes over its file: why nothing was
    # trained (no checkpoint written; `checkpoint` is the one it resumed from). "" otherwise.
    already_finished: str = ""

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


def resume_data_config(cfg: Config, saved: Config) -> None:
    """What a resumed run reads: the checkpoint's source, holdout, schema, passes
    (data.epochs) and [kafka] options unless the command names others. A resume that names none goes on with the same file and keeps its
    held-out lines held out (it used to fall back to the bundled sample, and to
    train the held-out lines); naming another file continues training on it (a
    new day of logs), from its first line."""
    default = Config().data
    for name in ("source", "holdout_fraction", "schema", "epochs"):
        if getattr(cfg.data, name) == getattr(default, name):     # not named by the command
            setattr(cfg.data, name, getattr(saved.data, name))
    # The run's Kafka options too (a group set with --set kafka.group=X): a resume
    # without them would read in another group.
    default_kafka = Config().kafka
    for f in dataclasses.fields(cfg.kafka):
        if getattr(cfg.kafka, f.name) == getattr(default_kafka, f.name):
            setattr(cfg.kafka, f.name, getattr(saved.kafka, f.name))


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
    """What one `train` invocation holds: trainer, input, window, counters.

    The input (`inputs.FileInput` or `inputs.KafkaInput`) owns the source: its
    batching, positions and offsets. A distributed job builds the same Run with
    its own `Job` parts (distributed/run.py): a rank's stripe of a file or its
    share of the group, a sharded store, merges, job checkpoints."""

    def __init__(self, cfg: Config, resume: str | None, job: "JobParts | None" = None) -> None:
        self.job = job or JobParts()
        # A run or checkpoint root whose newest checkpoint is corrupt goes on from the newest valid one.
        state = load_checkpoint(resume, fall_back=True) if resume else None
        saved = None
        if state is not None:   # the model and optimizer settings are the checkpoint's
            saved = checkpoint_config(state.config, origin=f"{resume} (checkpoint config)")
            refuse_changed_model(cfg, saved, resume)
            cfg.model, cfg.optim = saved.model, saved.optim
            cfg.store = resume_store_config(cfg.store, saved.store)   # where its rows live
            resume_data_config(cfg, saved)
        validate(cfg)
        self.threads = configure_torch(cfg, self.job.processes_per_host)
        self.cfg = cfg
        self.summary = RunSummary()
        # Records in the model before this invocation (a deterministic batcher's journal counts from it).
        self.total_before = state.records_trained if state is not None else 0
        self.input = self.open_input(cfg)
        self.fmt = self.input.fmt
        if state is not None:
            refuse_other_features(resume, saved, cfg, self.fmt)
            refuse_changed_schema(resume, saved, cfg)
            self.input.restore(self.job.resume_positions(state.positions), resume, saved,
                               state.extra.get("file"))
        self.trainer = Trainer.for_format(cfg, self.fmt)
        self.window = PrequentialWindow(cfg.train.eval_window_records, cfg.train.eval_refresh_s)
        self.epoch = 0
        self.resumed = ""               # what a resumed run says at its start
        self.resumed_from = state.path if state is not None else None
        if state is not None:
            self.restore(state)
            self.resumed = (f"resumed from {state.path} (step {state.step:,}, {state.records_trained:,} "
                            f"records trained) at {self.input.where()}"
                            + (f", pass {self.epoch + 1} of {cfg.data.epochs}" if cfg.data.epochs > 1 else ""))
        run_dir = Path(cfg.train.run_dir)
        self.ckpt_dir = Path(cfg.train.checkpoint_dir or run_dir / "checkpoints")
        link_checkpoint_dir(run_dir, cfg.train.checkpoint_dir)
        # A file, or the dead-letter topic; once per record across restarts (the checkpoint's mark).
        self.dead_letter = open_dead_letter(cfg, stream_url(cfg), state.extra if state is not None else None)
        self.dead_letter.epoch = self.epoch
        self.summary.dead_letter_path = str(self.dead_letter.path)
        self.remaining = cfg.data.limit_records or -1      # -1: no limit
        self.rows_touched = self.rows_clipped = self.rows_at_floor = 0
        # Prometheus metrics (served if metrics.port) and RUN_DIR/timeseries.jsonl.
        self.monitor = RunMonitor(cfg, run_dir, self.total_before)
        self.monitor.watch(self.trainer.store, self.window, lag=lambda: self.input.lag(self.epoch),
                           source=lambda: self.input.source)
        if state is not None:       # the checkpoint's age counts from when it was written
            self.monitor.metrics.resumed_from_checkpoint((state.path / "manifest.json").stat().st_mtime)
        if self.epoch:
            self.monitor.metrics.observe_epoch(self.epoch, another_pass=self.epoch < cfg.data.epochs)
        # --publish: a resumed run publishes the model it resumed from before it trains
        # (stream_ctr/serving/publisher.py says why no rolled-back version is ever served).
        self.publisher = open_publisher(cfg, self.fmt) if self.job.rank == 0 else None
        if self.publisher is not None and state is not None and not self.job.is_job:
            self.publish(state.tensors, state.path, state)
        # Once nothing refuses the run: a refusal stays the one line it prints.
        if self.threads.warning and self.job.first_on_host:
            print(self.threads.warning, file=sys.stderr, flush=True)

    def open_input(self, cfg: Config) -> FileInput | KafkaInput:
        """The run's source behind the one protocol (inputs.py): a file, or a topic whose
        revocations the loop checkpoints (`revoked`) unless the job checkpoints them itself."""
        url = stream_url(cfg)
        if url is None:
            return FileInput(cfg, self.job.processes_per_host, self.job.stripe)
        # A job's checkpoint is a collective: it comes at the next step the ranks agree on.
        return KafkaInput(cfg, url, lambda: self.total_before + self.summary.records_trained,
                          checkpoints_revocations=not self.job.is_job, wait_for_peers=self.job.is_job)

    def restore(self, state: CheckpointState) -> None:
        """The trainer, window and counters of a checkpoint."""
        self.trainer.load_state_tensors(state.tensors["trainer"])
        self.window.load_state_dict({k: (v.numpy() if torch.is_tensor(v) else v)
                                     for k, v in state.tensors["window"].items()})
        # Another file (a new day of logs) is trained from its first line, its passes from 0.
        self.epoch = 0 if self.input.another_file else state.extra.get("epoch", 0)
        was = state.extra.get("precision")
        if was and was != self.trainer.precision:   # train.precision=auto on other hardware
            print(f"stream-ctr: note: the checkpoint trained with {was} matmuls, this run uses "
                  f"{self.trainer.precision} (train.precision={self.cfg.train.precision}); set "
                  f"train.precision={was} to keep it", file=sys.stderr)

    def records_left(self) -> int | None:
        """What this invocation will train, when known (a file's lines, or the limit)."""
        left = self.input.records_left(self.epoch)
        if self.remaining >= 0:
            return self.remaining if left is None else min(left, self.remaining)
        return left

    @property
    def limit_reached(self) -> bool:
        return self.remaining == 0

    @property
    def wants_more(self) -> bool:
        return not self.limit_reached and self.input.wants_more(self.epoch)

    @property
    def empty(self) -> bool:
        """The source file holds no records (an empty file, an empty gzip, a header alone)."""
        return self.input.empty

    @property
    def finished(self) -> str:
        """Why a resumed run has nothing left to train ("" when it has, or was not resumed)."""
        return self.input.finished(self.epoch) if self.resumed_from is not None else ""

    def events(self, stop: StopSignal, look_ahead: bool):
        """The input's events for one pass (inputs.py); a Kafka topic deleted under them
        (StreamGone) ends the run, but only after a checkpoint of what was trained."""
        try:
            yield from self.input.events(self.remaining, stop, self.dead_letter, self.monitor, look_ahead)
        except StreamGone as gone:
            if not self.job.is_job:             # (a job's checkpoint is a collective)
                self.checkpoint(commit=False)   # no group commit: the topic is gone
                gone.checkpointed_at(self.summary.checkpoint)
            raise

    def record(self, batch: Batch, result) -> None:
        """Prequential scores into the window; the batch's end becomes the resume point."""
        self.window.add(result.probs.cpu().numpy(), batch.labels)
        self.input.trained(batch)
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

    def end_pass(self, completed: bool) -> None:
        """After a pass over the input. `completed`: its batches ran out (every one was
        trained), as opposed to a stop signal ending the pass. Only a file's finished
        pass starts another (its held-out tail scored in between, with --epochs)."""
        if not self.input.end_pass(completed, self.limit_reached):
            return
        self.epoch += 1
        self.dead_letter.epoch = self.epoch         # the next pass dead-letters its bad lines again
        self.monitor.metrics.observe_epoch(self.epoch, another_pass=self.epoch < self.cfg.data.epochs)
        # In a job, scoring the holdout is collective and ranks end their passes at different
        # steps: only the end of the run, which every rank reaches together, scores it.
        if (not self.job.is_job and self.cfg.data.epochs > 1 and self.epoch < self.cfg.data.epochs
                and self.input.held_out is not None):
            self.summary.test_per_epoch.append({"epoch": self.epoch, **self.held_out()})

    def held_out(self) -> dict[str, float]:
        """Accuracy of the current model on the held-out tail (no training)."""
        path, start, stop = self.input.held_out
        probs, labels = score(self.trainer, path, self.fmt, start, stop, self.cfg.data.chunk_records)
        return {**accuracy(probs, labels).as_dict(), **bayes_of_split(path, labels, start)}

    def window_label(self) -> str:
        """What the sliding window holds: after the first pass, rows scored a second time."""
        n = self.cfg.data.epochs
        if self.epoch == 0 or n == 1:       # (a finished single pass has epoch 1)
            return "prequential window"
        return f"window of re-read rows, pass {min(self.epoch + 1, n)} of {n}: not held out"

    def revoked(self, event: Revoked) -> None:
        """A rebalance took partitions (the group waits for this member): what was trained
        from them becomes durable before the input commits their offsets for the next
        owner, when the loop asks for its next event (the checkpoint's positions mark them
        given up, see connectors/kafka/positions.py). A lost membership commits nothing."""
        if not event.lost:
            self.checkpoint(commit=False)

    def checkpoint(self, commit: bool = True) -> None:
        """Write a durable checkpoint (this rank's, in a job); then commit its positions
        (Kafka: the group's offsets). A job's `Job.checkpoint` wraps this in its agreement."""
        t0 = time.perf_counter()
        positions = self.input.snapshot().to_checkpoint()
        source_record = self.input.source_record()     # a file's name and fingerprint
        # First: the dead letters up to here on disk (or acknowledged), and where the sink ends.
        dead_letter = self.dead_letter.mark(positions, self.epoch).as_dict()
        tensors = {"trainer": self.trainer.state_tensors(),
                   "window": {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v)
                              for k, v in self.window.state_dict().items()}}
        state = CheckpointState(self.trainer.step, self.total_before + self.summary.records_trained,
                                positions, self.cfg.to_dict(), tensors,
                                {"epoch": self.epoch, "source": self.cfg.data.source,
                                 # what the scaling rule made of cfg.optim for this batch size
                                 "resolved_optim": dataclasses.asdict(self.trainer.optim),
                                 "precision": self.trainer.precision, "dead_letter": dead_letter,
                                 **({"file": source_record} if source_record else {})})
        self.summary.checkpoint = str(save_checkpoint(self.ckpt_dir, state, self.cfg.train.keep_checkpoints))
        self.monitor.on_checkpoint(time.perf_counter() - t0, self.summary.checkpoint)
        if commit:
            self.input.commit()
        # Only now: it is durable. (A job publishes once its manifest names every rank's.)
        if self.publisher is not None and not self.job.is_job:
            self.publish(tensors, Path(self.summary.checkpoint), state)

    def publish(self, tensors: dict, where: Path, state: CheckpointState) -> None:
        """Publish the model of the durable checkpoint at `where` (--publish)."""
        self.publisher.publish(tensors, checkpoint_record(where, state.step, state.records_trained,
                                                          state.extra.get("epoch", 0), state.positions),
                               self.trainer.precision, self.trainer.store)

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: object) -> None:
        # A stream leaves its group (commits happen after checkpoints only); a pass a stop
        # cut short closes its file and read-ahead thread.
        self.summary.source_stats = self.input.close()

    def refuse_if_nothing_decoded(self) -> None:
        """Raise SourceError, before the final checkpoint, when this invocation trained
        nothing and rejected every record it read: a schema, encoding or source that does
        not fit the data (a JSON schema on a TSV file, a path that never matches). The
        resume point stays where it was, so a corrected rerun reads those records again;
        the dead-letter file keeps this attempt's rejects for diagnosis, and a rerun with
        --resume of a run without a checkpoint moves them aside (run_dir.set_aside_attempt)."""
        counts = self.dead_letter.counts
        if self.summary.records_trained or not counts:
            return
        # Run without a checkpoint: the rerun sets this attempt's files aside (set_aside_attempt).
        moved = ("; that run moves them to a no-checkpoint-* folder in it"
                 if not self.total_before
                 and str(self.dead_letter.path) == str(Path(self.cfg.train.run_dir) / "dead_letter.jsonl")
                 else "")
        raise SourceError(
            f"every record read from {self.cfg.data.source} was rejected "
            f"({sum(counts.values()):,}; {rejection_note(counts)}), nothing trained: the "
            f"schema or source does not fit the data. Nothing was checkpointed: fix the "
            f"schema or source and run again, with --resume {self.cfg.train.run_dir} to keep "
            f"this run directory (the rejects, with each record's field and value, are in "
            f"{self.dead_letter.path}{moved})")

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
        if self.input.held_out is not None:
            s.test = self.held_out()
            if s.test_per_epoch:
                s.test_per_epoch.append({"epoch": self.epoch, **s.test})
        self.monitor.close(s.as_dict())
        if self.publisher is not None:
            self.publisher.close()
        self.trainer.store.close()          # a tiered store waits for its I/O and closes LMDB
        return s


@dataclass
class JobParts:
    """What a run is part of: by default a single process. A distributed job's rank
    (distributed/run.py) is one of `world_size` processes, `local_world_size` of them
    on this host, and its job checkpoints, publishes and scores the holdout as one."""
    is_job: bool = False
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    merged_positions: Positions | None = None   # a job's positions over all ranks (a resume)

    @property
    def processes_per_host(self) -> int:        # they share the host's cores
        return self.local_world_size

    @property
    def first_on_host(self) -> bool:            # the one that prints a note about the host
        return self.local_rank == 0

    @property
    def stripe(self) -> tuple[int, int]:        # a file's records with offset % ranks == rank
        return self.rank, self.world_size

    def resume_positions(self, own: Positions) -> Positions:
        return own if self.merged_positions is None else self.merged_positions


def refuse_other_features(resume: str, saved: Config, cfg: Config, fmt) -> None:
    """A resume whose source decodes to other features than the checkpoint's model takes."""
    saved_fmt = source_format(saved)
    if features(saved_fmt) != features(fmt):
        raise ConfigError(f"--resume {resume}: the checkpoint's model was trained on "
                          f"{describe_features(saved_fmt)}, {cfg.data.source} decodes to "
                          f"{describe_features(fmt)}: their features do not match; resume "
                          "with the run's schema (omit --schema: the checkpoint holds it) or "
                          "train into a new --run-dir")


def refuse_changed_schema(resume: str, saved: Config, cfg: Config) -> None:
    """A resume under a --schema that decodes otherwise than the checkpoint's (a price
    taken raw where the model learned its ln, an id read from another path): the same
    features, so nothing else notices, but the weights would be read against other
    inputs. Refused, naming the fields, unless data.allow_schema_change."""
    if cfg.data.allow_schema_change or not saved.data.schema or cfg.data.schema == saved.data.schema:
        return
    from stream_ctr.connectors.schema import parse_schema
    old, new = parse_schema(saved.data.schema), parse_schema(cfg.data.schema)
    old_fields, new_fields = ({f.name: f for f in s.fields} for s in (old, new))
    changed = [name for name in {**old_fields, **new_fields}
               if old_fields.get(name) != new_fields.get(name)]
    if not changed and dataclasses.replace(old, fields=()) == dataclasses.replace(new, fields=()):
        return
    what = f"fields {', '.join(changed)}" if changed else "its encoding"
    raise ConfigError(f"--resume {resume}: --schema decodes otherwise than the schema the run trained "
                      f"with ({what} differ); the model's weights mean what the run's schema decoded. "
                      "Omit --schema to go on with the run's (the checkpoint holds it), train a new "
                      "--run-dir, or, if the log itself changed (a field renamed upstream), "
                      "--set data.allow_schema_change=true")


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
                  + (f" (what the earlier attempt wrote, its time series and dead letters, moved to "
                     f"{aside})" if aside else ""),
                  file=sys.stderr, flush=True)
        return _train(cfg, owner.resume, show_progress)


def _train(cfg: Config, resume: str | None, show_progress: bool) -> RunSummary:
    """`train` in a run directory this process owns (cfg.train.run_dir)."""
    run = Run(cfg, resume)
    point_latest(Path(cfg.train.run_dir))
    if run.finished:
        return finished_run(run)
    start_note(run, show_progress)
    progress = Progress("train", cfg.train.log_every_s, enabled=show_progress, total=run.records_left())
    every = cfg.train.checkpoint_every_batches
    with StopSignal() as stop, run:
        while run.wants_more and not stop.requested:
            completed = False
            # A tiered store prefetches the next batch's rows while this one trains.
            with contextlib.closing(run.events(stop, look_ahead=cfg.store.kind == "tiered")) as events:
                for event in events:
                    if isinstance(event, Revoked):
                        run.revoked(event)
                    if not isinstance(event, Ready):    # Idle: read on
                        continue
                    batch = run.input.owned(event.batch)    # a rebalance since it was read?
                    if not len(batch):
                        continue
                    # Step: its forward pass scores the batch before the update (prequential).
                    result = run.trainer.train_step(batch, event.upcoming)
                    if run.publisher is not None:   # its rows go in the next published delta
                        run.publisher.trained(batch, result.keys, event.read_at_s)
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
            run.end_pass(completed)
        acc = run.window.window()
        progress.update(run.summary.records_trained, run.summary.batches, acc.auc, acc.logloss, force=True,
                        window=run.window_label())
        progress.close()
        run.refuse_if_nothing_decoded()
        run.checkpoint()
        run.summary.stopped = stop.requested
        changed = run.input.changed_note()      # a file appended to while it trained
        if changed:
            print(changed, file=sys.stderr, flush=True)
    summary = run.finish(progress.elapsed_s())
    summary.empty_source = str(run.input.path) if run.empty else ""
    if run.input.at_damage:             # after the checkpoint: nothing trained is lost
        err = run.input.damaged(summary.checkpoint)
        err.summary = summary
        raise err
    return summary


def finished_run(run: Run, finish=None, checkpoint: str | None = None, speaks: bool = True) -> RunSummary:
    """A resume of a run that has done all its passes over its file: one line says so
    and what would train more, no checkpoint is written (each restart used to write one
    more, deleting an older), and the summary scores the held-out tail as before. Not
    an error: a supervisor that restarts a finished run must not loop on failures.
    A distributed job passes its own `finish` (a collective) and job checkpoint, and
    only its rank 0 `speaks`."""
    if speaks:
        print(f"stream-ctr: {run.finished}", file=sys.stderr, flush=True)
    with run:               # (its exit closes the input, as at the end of a run that trained)
        pass
    summary = (finish or run.finish)(0.0)
    summary.already_finished = run.finished
    summary.checkpoint = checkpoint or str(run.resumed_from)
    return summary


# Measured (docs/large-batches.md): 220 steps over an 8M-row pass learned DeepFM's
# interactions to within 0.7 point of batch 1,024; 55 steps learned none of them (and
# with the ramp's 256 steps of 8,192 first, 295 steps learned them to within 0.4 point).
FEW_STEPS = 100


def few_steps_note(run: Run) -> str:
    """A note when the scaling rule's large batch (--scale-from) leaves a run under
    FEW_STEPS steps, the ramp's counted: too few to learn feature interactions, whatever
    the optimizer settings. Empty otherwise (and for a stream, whose length is unknown)."""
    left, batch, base = run.records_left(), run.cfg.data.batch_size, run.cfg.optim.scale_from_batch
    if not base or batch <= base or left is None or left < batch:
        return ""
    steps = steps_for(run.trainer.optim, left)
    if steps >= FEW_STEPS:
        return ""
    return (f"stream-ctr: note: batch {batch:,} gives {steps:,} steps over the {left:,} records to "
            f"train; with under {FEW_STEPS} steps a model learned no feature interactions on the "
            "measured streams, only what logistic regression learns (docs/large-batches.md): a "
            "smaller --batch-size or more --epochs give it more steps")


def start_note(run: Run, show_progress: bool, speaks: bool = True) -> None:
    """What a run says before its first batch: an empty file, the optimizer, the model
    (in a job every rank calls it, the one that `speaks` prints). The summary keeps the
    resolved optimizer."""
    if run.empty and speaks:
        print(f"stream-ctr: warning: {run.input.path} holds no records (an empty file, an empty gzip or "
              "a header alone): nothing to train", file=sys.stderr, flush=True)
    if speaks:
        for warning in run.input.start_warnings():
            print(f"stream-ctr: warning: {warning}", file=sys.stderr, flush=True)
    run.summary.optim = dataclasses.asdict(run.trainer.optim)
    if show_progress and speaks:
        t = run.trainer
        if run.resumed:
            print(f"stream-ctr: {run.resumed}", file=sys.stderr, flush=True)
        print(describe_optim(t.optim), file=sys.stderr, flush=True)
        few = few_steps_note(run)
        if few:
            print(few, file=sys.stderr, flush=True)
        print(f"model: {run.cfg.model.name} on {t.device}, {t.precision} matmuls "
              f"(train.precision={run.cfg.train.precision})", file=sys.stderr, flush=True)


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
            raise ConfigError(f"the run of {checkpoint} trained on a Kafka topic ({own}); name a file "
                              f"to score: stream-ctr eval RUN_DIR {file_prefix(source_format(cfg))}:PATH")
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
