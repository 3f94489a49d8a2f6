"""The training run: source -> micro-batches -> prequential score + step -> checkpoint.

`train()` is the whole story of a run in one screen; every phase is one call.
"""
from __future__ import annotations

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
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def micro_batches(source: FileSource, batch_size: int, dead_letter: DeadLetterFile,
                  limit_records: int) -> Iterator[Batch]:
    """Full batches from `source` (the last one may be partial), at most `limit_records` rows."""
    batcher = MicroBatcher(batch_size)
    emitted = 0
    while not source.exhausted:
        chunk, rejected = source.read()
        dead_letter.write(rejected)
        for batch in batcher.add(chunk):
            if limit_records and emitted + len(batch) >= limit_records:
                yield batch.slice(0, limit_records - emitted)
                return
            emitted += len(batch)
            yield batch
    rest = batcher.flush()
    if rest is not None:
        yield rest.slice(0, limit_records - emitted) if limit_records else rest


def train(cfg: Config, resume: str | None = None, show_progress: bool = True) -> RunSummary:
    """Train on `cfg.data.source`; resume from a checkpoint when `resume` is given."""
    fmt, path = detect_format(cfg.data.source)
    run_dir = Path(cfg.train.run_dir)
    ckpt_dir = Path(cfg.train.checkpoint_dir or run_dir / "checkpoints")
    state = load_checkpoint(resume) if resume else None
    if state is not None:   # the model and optimizer settings are the checkpoint's
        saved = Config.from_dict(state.config, origin=f"{resume} (checkpoint config)")
        cfg.model, cfg.optim = saved.model, saved.optim
    validate(cfg)
    configure_torch(cfg)

    # Hold out the last fraction of the file, by data-line offset.
    n_total = count_records(path, fmt)
    train_end = n_total - int(round(n_total * cfg.data.holdout_fraction))
    trainer = Trainer(cfg, fmt.n_keys, fmt.n_dense)
    window = PrequentialWindow(cfg.train.eval_window_records)
    positions, epoch, total_before = {}, 0, 0
    if state is not None:
        trainer.load_state_tensors(state.tensors["trainer"])
        window.load_state_dict({k: (v.numpy() if torch.is_tensor(v) else v)
                                for k, v in state.tensors["window"].items()})
        positions, epoch = state.positions, state.extra.get("epoch", 0)
        total_before = state.records_trained
    dead_letter = DeadLetterFile(cfg.data.dead_letter_path or run_dir / "dead_letter.jsonl")
    progress = Progress("train", cfg.train.log_every_s, enabled=show_progress)
    summary = RunSummary(dead_letter_path=str(dead_letter.path))

    def checkpoint() -> str:
        tensors = {"trainer": trainer.state_tensors(),
                   "window": {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v)
                              for k, v in window.state_dict().items()}}
        return str(save_checkpoint(ckpt_dir, CheckpointState(
            trainer.step, total_before + summary.records_trained, positions, cfg.to_dict(),
            tensors, {"epoch": epoch, "source": cfg.data.source}), cfg.train.keep_checkpoints))

    remaining = cfg.data.limit_records
    while epoch < cfg.data.epochs and not (cfg.data.limit_records and remaining <= 0):
        start = positions.get("file:" + path.name, 0)
        with FileSource(path, fmt, start_offset=start, chunk_records=cfg.data.chunk_records,
                        stop_offset=train_end) as source:
            for batch in micro_batches(source, cfg.data.batch_size, dead_letter, remaining):
                # Step: its forward pass scores the batch before the update (prequential).
                result = trainer.train_step(batch)
                window.add(result.probs.cpu().numpy(), batch.labels)
                summary.skipped_batches += int(result.skipped)
                # Bookkeeping: the batch is in the model; its end is the resume point.
                positions.update(batch.positions_after())
                summary.records_trained += len(batch)
                summary.batches += 1
                remaining -= len(batch)
                acc = window.window()
                progress.update(summary.records_trained, summary.batches, acc.auc, acc.logloss)
                if cfg.train.checkpoint_every_batches and \
                        summary.batches % cfg.train.checkpoint_every_batches == 0:
                    summary.checkpoint = checkpoint()
        if source.exhausted:
            epoch, positions = epoch + 1, {}
    summary.seconds = progress.elapsed_s()
    acc = window.window()
    progress.update(summary.records_trained, summary.batches, acc.auc, acc.logloss, force=True)
    progress.close()
    summary.checkpoint = checkpoint()

    summary.records_trained_total = total_before + summary.records_trained
    summary.samples_per_s = summary.records_trained / max(summary.seconds, 1e-9)
    summary.window = acc.as_dict()
    summary.rejected_by_reason = dict(dead_letter.counts)
    summary.records_rejected = sum(dead_letter.counts.values())
    dead_letter.close()
    if train_end < n_total:
        summary.test = evaluate(trainer, path, fmt, train_end, None, cfg.data.chunk_records).as_dict()
    return summary


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
