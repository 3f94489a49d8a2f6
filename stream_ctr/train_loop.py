"""The training run: source -> micro-batches -> prequential score + step -> checkpoint.

`train()` is the whole story of a run in one screen; every phase is one call.
"""
from __future__ import annotations

import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from connectors.batch import Batch
from connectors.dead_letter import DeadLetterFile
from connectors.files import FileSource, count_records, detect_format
from stream_ctr.batcher import MicroBatcher
from stream_ctr.checkpoint import CheckpointState, load_checkpoint, save_checkpoint
from stream_ctr.config import Config, ConfigError, validate
from stream_ctr.evaluation import Accuracy, PrequentialWindow, accuracy
from stream_ctr.progress import Progress
from stream_ctr.trainer import Trainer


@dataclass
class RunSummary:
    records_trained: int = 0            # in this invocation
    records_trained_total: int = 0      # since the first checkpoint of the run
    records_rejected: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    skipped_batches: int = 0
    # CowClip diagnostics (reference/cowclip.md 6.10): share of the embedding
    # rows present in a batch whose gradient was clipped, and at the norm floor.
    clipped_row_fraction: float = 0.0
    floor_row_fraction: float = 0.0
    seconds: float = 0.0
    samples_per_s: float = 0.0
    window: dict[str, float] = field(default_factory=dict)
    test: dict[str, float] = field(default_factory=dict)
    checkpoint: str = ""
    dead_letter_path: str = ""

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("window", "test")}
        out.update({f"window_{k}": v for k, v in self.window.items()})
        out.update({f"test_{k}": v for k, v in self.test.items()})
        return out


def configure_torch(cfg: Config) -> None:
    # Gradients of saturated units underflow to denormals, which x86 cores
    # process up to 100x slower (measured: a 4x slower DeepFM step); flush them.
    torch.set_flush_denormal(True)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def micro_batches(source: FileSource, batch_size: int, dead_letter: DeadLetterFile,
                  limit_records: int = -1) -> Iterator[Batch]:
    """Full batches from `source` (the last one may be partial); at most
    `limit_records` rows when it is >= 0."""
    batcher = MicroBatcher(batch_size)
    emitted = 0
    while not source.exhausted:
        chunk, rejected = source.read()
        dead_letter.write(rejected)
        for batch in batcher.add(chunk):
            if 0 <= limit_records <= emitted + len(batch):
                yield batch.slice(0, limit_records - emitted)
                return
            emitted += len(batch)
            yield batch
    rest = batcher.flush()
    if rest is not None:
        yield rest.slice(0, limit_records - emitted) if limit_records >= 0 else rest


class StopSignal:
    """SIGTERM / Ctrl-C ask the loop to finish its batch, checkpoint and exit."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: object) -> None:
        if self.requested:              # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Run:
    """What one `train` invocation holds: trainer, source plan, window, counters."""

    def __init__(self, cfg: Config, resume: str | None) -> None:
        state = load_checkpoint(resume) if resume else None
        if state is not None:   # the model and optimizer settings are the checkpoint's
            saved = Config.from_dict(state.config, origin=f"{resume} (checkpoint config)")
            cfg.model, cfg.optim = saved.model, saved.optim
        validate(cfg)
        configure_torch(cfg)
        self.cfg = cfg
        self.fmt, self.path = detect_format(cfg.data.source)
        # Hold out the last fraction of the file, by data-line offset.
        self.n_total = count_records(self.path, self.fmt)
        self.train_end = self.n_total - int(round(self.n_total * cfg.data.holdout_fraction))
        self.trainer = Trainer(cfg, self.fmt.n_keys, self.fmt.n_dense)
        self.window = PrequentialWindow(cfg.train.eval_window_records)
        self.positions: dict[str, int] = {}
        self.epoch, self.total_before = 0, 0
        if state is not None:
            self.trainer.load_state_tensors(state.tensors["trainer"])
            self.window.load_state_dict({k: (v.numpy() if torch.is_tensor(v) else v)
                                         for k, v in state.tensors["window"].items()})
            self.positions, self.epoch = state.positions, state.extra.get("epoch", 0)
            self.total_before = state.records_trained
        run_dir = Path(cfg.train.run_dir)
        self.ckpt_dir = Path(cfg.train.checkpoint_dir or run_dir / "checkpoints")
        self.dead_letter = DeadLetterFile(cfg.data.dead_letter_path or run_dir / "dead_letter.jsonl")
        self.summary = RunSummary(dead_letter_path=str(self.dead_letter.path))
        self.remaining = cfg.data.limit_records or -1      # -1: no limit
        self.rows_touched = self.rows_clipped = self.rows_at_floor = 0

    @property
    def limit_reached(self) -> bool:
        return self.remaining == 0

    def open_source(self) -> FileSource:
        start = self.positions.get(f"file:{self.path.name}", 0)
        return FileSource(self.path, self.fmt, start_offset=start,
                          chunk_records=self.cfg.data.chunk_records, stop_offset=self.train_end)

    def record(self, batch: Batch, result) -> None:
        """Prequential scores into the window; the batch's end becomes the resume point."""
        self.window.add(result.probs.cpu().numpy(), batch.labels)
        self.positions.update(batch.positions_after())
        self.summary.records_trained += len(batch)
        self.summary.batches += 1
        self.summary.skipped_batches += int(result.skipped)
        self.rows_touched += result.rows_touched
        self.rows_clipped += int(result.rows_clipped)
        self.rows_at_floor += int(result.rows_at_floor)
        if self.remaining > 0:
            self.remaining -= len(batch)

    def end_epoch(self, source: FileSource) -> None:
        # The epoch is over only when every record of it was trained, not
        # merely read: a limit may have stopped the loop with rows pending.
        if source.exhausted and not self.limit_reached:
            self.epoch, self.positions = self.epoch + 1, {}

    def checkpoint(self) -> None:
        tensors = {"trainer": self.trainer.state_tensors(),
                   "window": {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v)
                              for k, v in self.window.state_dict().items()}}
        state = CheckpointState(self.trainer.step, self.total_before + self.summary.records_trained,
                                self.positions, self.cfg.to_dict(), tensors,
                                {"epoch": self.epoch, "source": self.cfg.data.source})
        self.summary.checkpoint = str(save_checkpoint(self.ckpt_dir, state, self.cfg.train.keep_checkpoints))

    def finish(self, seconds: float) -> RunSummary:
        s = self.summary
        s.seconds = seconds
        s.records_trained_total = self.total_before + s.records_trained
        s.samples_per_s = s.records_trained / max(seconds, 1e-9)
        s.window = self.window.window().as_dict()
        s.clipped_row_fraction = self.rows_clipped / max(self.rows_touched, 1)
        s.floor_row_fraction = self.rows_at_floor / max(self.rows_touched, 1)
        s.rejected_by_reason = dict(self.dead_letter.counts)
        s.records_rejected = sum(self.dead_letter.counts.values())
        self.dead_letter.close()
        if self.train_end < self.n_total:
            s.test = evaluate(self.trainer, self.path, self.fmt, self.train_end, None,
                              self.cfg.data.chunk_records).as_dict()
        return s


def train(cfg: Config, resume: str | None = None, show_progress: bool = True) -> RunSummary:
    """Train on `cfg.data.source`; resume from a checkpoint when `resume` is given.

    Ends at the end of the data (all epochs), at `data.limit_records`, or on
    SIGTERM / Ctrl-C after finishing the current batch; always checkpoints.
    """
    run = Run(cfg, resume)
    progress = Progress("train", cfg.train.log_every_s, enabled=show_progress)
    every = cfg.train.checkpoint_every_batches
    with StopSignal() as stop:
        while run.epoch < cfg.data.epochs and not run.limit_reached and not stop.requested:
            with run.open_source() as source:
                for batch in micro_batches(source, cfg.data.batch_size, run.dead_letter, run.remaining):
                    # Step: its forward pass scores the batch before the update (prequential).
                    result = run.trainer.train_step(batch)
                    # Evaluate and advance the resume point past this batch.
                    run.record(batch, result)
                    acc = run.window.window()
                    progress.update(run.summary.records_trained, run.summary.batches, acc.auc, acc.logloss)
                    if every and run.summary.batches % every == 0:
                        run.checkpoint()
                    if stop.requested:
                        break
            run.end_epoch(source)
        acc = run.window.window()
        progress.update(run.summary.records_trained, run.summary.batches, acc.auc, acc.logloss, force=True)
        progress.close()
        run.checkpoint()
    return run.finish(progress.elapsed_s())


def evaluate(trainer: Trainer, path: Path, fmt, start_offset: int, stop_offset: int | None,
             chunk_records: int) -> Accuracy:
    """Score records [start_offset, stop_offset) without training on them."""
    probs, labels = [], []
    with FileSource(path, fmt, start_offset=start_offset, chunk_records=chunk_records,
                    stop_offset=stop_offset) as source:
        while not source.exhausted:
            chunk, _rejected = source.read()
            if len(chunk):
                probs.append(trainer.predict(chunk))
                labels.append(chunk.labels)
    if not probs:
        raise ConfigError(f"no records to evaluate in {path} from offset {start_offset}")
    return accuracy(np.concatenate(probs), np.concatenate(labels))


def evaluate_checkpoint(checkpoint: str, source: str, start: int = 0,
                        stop: int | None = None) -> dict:
    """`stream-ctr eval`: score a file with a checkpoint's model, no training."""
    state = load_checkpoint(checkpoint)
    cfg = Config.from_dict(state.config, origin=f"{checkpoint} (checkpoint config)")
    fmt, path = detect_format(source)
    saved_fmt, _ = detect_format(cfg.data.source)
    if saved_fmt.name != fmt.name:
        raise ConfigError(f"checkpoint was trained on {saved_fmt.name} records, "
                          f"{source} is {fmt.name}: their features do not match")
    configure_torch(cfg)
    trainer = Trainer(cfg, fmt.n_keys, fmt.n_dense)
    trainer.load_state_tensors(state.tensors["trainer"])
    acc = evaluate(trainer, path, fmt, start, stop, cfg.data.chunk_records)
    return {**acc.as_dict(), "checkpoint": str(checkpoint), "step": state.step}
