"""The model, its embedding store and both optimizers, with one method per phase.

`train_step` trains one batch: one step (working set, gather, forward, mean
BCE, backward, dense Adam with warm-up, CowClip + sparse Adam on the rows
present), or during the scaling rule's ramp one such step per ramp_batch rows.
Each step's forward pass runs on its pre-update weights, so the scores it
returns are the prequential scores of the batch: no second forward needed.

`predict` (the test set, `stream-ctr eval`) and the exported bundle use
`eval_model`: the dense weights averaged over the last
train.average_dense_samples samples, with the live rows.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from stream_ctr.connectors.batch import Batch
from stream_ctr.config import Config, ResolvedOptim, ramp_optim, resolve_optim
from stream_ctr.store.embedding import EmbeddingStore
from stream_ctr.store import build_store
from stream_ctr.models.networks import build_model
from stream_ctr.models.field_inputs import FieldRows, model_fields
from stream_ctr.models.scoring import host_to_device, logits, probabilities, resolve_precision, working_set


def resolve_device(name: str) -> torch.device:
    """`auto` -> CUDA when a GPU is present, CPU otherwise."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        from stream_ctr.config import ConfigError
        raise ConfigError(f"train.device is {name!r} but torch sees no CUDA GPU; use --device auto or cpu")
    return torch.device(name)


@dataclass
class StepResult:
    probs: torch.Tensor          # [B] scores from the pre-update model (prequential)
    loss: torch.Tensor           # 0-dim mean BCE (without L2)
    skipped: torch.Tensor        # 0-dim bool: loss or gradients were not finite, no update
    rows_touched: int
    rows_clipped: torch.Tensor   # 0-dim
    rows_at_floor: torch.Tensor  # 0-dim
    # Wall seconds per phase (prepare, forward_backward, update). On CUDA they
    # measure launch time unless the caller synchronizes.
    phase_s: dict[str, float] = field(default_factory=dict)
    # CowClip's ||g|| / threshold histogram of this step (ops.cowclip_adam.ClipStats); None
    # without cowclip or update.
    clip_ratio_le: torch.Tensor | None = None
    clip_ratio_sum: torch.Tensor | None = None
    clip_rows: int = 0              # the rows the update saw (owned rows, when sharded)
    # The unique keys whose rows this step updated (on the step's device; None when skipped):
    # what a publisher puts in the next delta, without a second unique of the batch's keys.
    keys: torch.Tensor | None = None

    @staticmethod
    def concat(parts: list["StepResult"]) -> "StepResult":
        """One batch's result from its ramp sub-steps, in row order: the loss is the
        row-weighted mean, skipped only when every sub-step was."""
        rows = torch.tensor([len(p.probs) for p in parts], dtype=torch.float32, device=parts[0].loss.device)
        ratio = [p for p in parts if p.clip_ratio_le is not None]
        keys = [p.keys for p in parts if p.keys is not None]
        return StepResult(
            torch.cat([p.probs for p in parts]),
            (torch.stack([p.loss.float() for p in parts]) * rows).sum() / rows.sum().clamp_min(1),
            torch.stack([p.skipped for p in parts]).all(),
            sum(p.rows_touched for p in parts),
            sum(torch.as_tensor(p.rows_clipped) for p in parts), sum(torch.as_tensor(p.rows_at_floor) for p in parts),
            {k: sum(p.phase_s.get(k, 0.0) for p in parts) for k in parts[0].phase_s},
            sum(p.clip_ratio_le for p in ratio) if ratio else None,
            sum(p.clip_ratio_sum for p in ratio) if ratio else None,
            sum(p.clip_rows for p in parts),
            torch.unique(torch.cat(keys)) if keys else None)

    def clip_ratio(self) -> tuple[np.ndarray, float, int] | None:
        """(cumulative counts per edge, sum of ratios, rows) on the host, or None."""
        if self.clip_ratio_le is None:
            return None
        return self.clip_ratio_le.cpu().numpy(), float(self.clip_ratio_sum), self.clip_rows


class Trainer:
    def __init__(self, cfg: Config, n_fields: int, n_dense: int,
                 store: EmbeddingStore | None = None, read_only: bool = False,
                 keys_per_record: int | None = None, field_rows: FieldRows | None = None) -> None:
        """`n_fields`: the fields the model sees (key columns + multi-hot fields, the
        format's `n_model_fields`, each wide field counted k times: `model_fields`);
        `keys_per_record`: the most keys one record brings (`max_keys_per_record`;
        default n_fields), which sizes the store's working set; `field_rows`: the
        rows of each wide field (None: every field one row)."""
        self.cfg = cfg
        self.device = resolve_device(cfg.train.device)
        self.precision = resolve_precision(cfg.train.precision, self.device)
        self._sync_phases = cfg.train.sync_phases and self.device.type == "cuda"
        self.n_fields, self.n_dense, self.field_rows = n_fields, n_dense, field_rows
        torch.manual_seed(cfg.train.seed)
        self.model = build_model(cfg.model, n_fields, n_dense).to(self.device)
        # The configured store ([store] kind: memory, or tiered cache/RAM/LMDB);
        # read_only for evaluation, which must not move or roll back any row.
        self.store = store or build_store(cfg, keys_per_record or n_fields, self.device, read_only=read_only)
        # The next batch, its working set and its inputs, on the device while this one trains.
        self._next: tuple[Batch, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None = None
        # The settings this batch size trains with (scaling rule applied); every
        # update reads these, never cfg.optim.
        self.optim = o = resolve_optim(cfg)
        # The ramp's sub-step settings (None: no ramp).
        self.ramp: ResolvedOptim | None = ramp_optim(cfg, o)
        self.dense_opt = torch.optim.Adam(self.model.parameters(), lr=o.lr_dense,
                                          betas=(o.beta1, o.beta2), eps=o.eps, foreach=True)
        self.l2_params = self.model.l2_parameters()
        # The averaged dense weights for evaluation and export (None when off). Created
        # here, so every replica merges the same tensors; the first step overwrites them.
        self.average_model: torch.nn.Module | None = None
        self.average_updates = 0
        if cfg.train.average_dense_samples > 0:
            self.average_model = copy.deepcopy(self.model).requires_grad_(False)
        if cfg.train.compile:       # in place: parameters and state_dict keys stay the model's
            self.model.compile(dynamic=None, mode=cfg.train.compile_mode)
        # With CUDA graphs a graph's outputs are overwritten by its next replay: each step
        # tells torch that the last one's are done with.
        self._graph_steps = (cfg.train.compile and cfg.train.compile_mode == "reduce-overhead"
                             and self.device.type == "cuda")
        self.step = 0
        # Hierarchical replicas: called after backward with the records this step trained
        # (0 if skipped); makes the dense gradients the node's mean and returns the node's
        # records (DenseMerger.reduce_gradients). None: every replica steps on its own.
        self.reduce_dense_grads: Callable[[int], int] | None = None

    def _step_optim(self, step: int) -> ResolvedOptim:
        """The settings step `step` (1, 2, ...) trains with: the ramp's for its first steps."""
        return self.ramp if self.ramp is not None and step <= self.ramp.ramp_steps else self.optim

    def _dense_step(self, step: int) -> None:
        o = self._step_optim(step)
        for group in self.dense_opt.param_groups:
            group["lr"] = self.dense_lr(step)
            group["betas"] = (o.beta1, o.beta2)
        self.dense_opt.step()
        self._update_average(o.batch_size)

    @torch.no_grad()
    def _update_average(self, batch_size: int) -> None:
        """Move the average toward the live weights after update t (1, 2, ...) by
        max(1 - exp(-batch / average_dense_samples), 1 / t): an exponential average
        whose horizon is a number of samples whatever the batch (at a batch >= the
        horizon it is ~the live model), started as the plain mean of the weights
        after each update so far (Polyak-Ruppert; the first update copies the live
        weights).  The mean rules only while 1/t is the larger weight, the first
        ~horizon/batch updates; on a run that short (the bundled samples: ~200
        steps of 64) it beat the polynomial-decay start 2/(t+1) on 10 of 10
        paired seeds (Criteo sample +0.09 AUC points on average, BENCHMARKS.md)."""
        if self.average_model is None:
            return
        self.average_updates += 1
        t = self.average_updates
        weight = max(1.0 - math.exp(-batch_size / self.cfg.train.average_dense_samples),
                     1.0 / t)
        torch._foreach_lerp_(list(self.average_model.parameters()), list(self.model.parameters()), weight)

    @property
    def eval_model(self) -> torch.nn.Module:
        """The dense model that scores held-out rows and is exported: the average once
        a step has fed it, else the live weights."""
        return self.average_model if self.average_updates else self.model

    def idle_dense_step(self) -> None:
        """A hierarchical replica without a batch this step still takes its node's dense
        step (on the node's mean gradients), or the node's replicas would drift apart."""
        if self.reduce_dense_grads is None:
            return
        self.dense_opt.zero_grad(set_to_none=True)
        if self.reduce_dense_grads(0) > 0:
            self._dense_step(self.step + 1)

    def samples_at(self, step: int) -> int:
        """The samples `step` steps stand for: step x data.batch_size, the ramp's steps
        counted at its sub-batch. A function of the step count alone (the job's, in a
        job), so every replica, idle ones too, and a resumed run are at the same point."""
        if self.ramp is None:
            return step * self.optim.batch_size
        ramp = min(step, self.ramp.ramp_steps)
        return ramp * self.ramp.batch_size + (step - ramp) * self.optim.batch_size

    def dense_lr(self, step: int) -> float:
        """Linear warm-up to the step's lr_dense over optim.warmup_samples, then flat
        (as in the CowClip paper, the warm-up spans a number of samples whatever
        the batch); progress is `samples_at(step)`, this step's batch included. After
        a ramp the lr climbs again, linearly from the ramp's to the run's over the next
        warmup_samples: a jump to 4x the lr on a model of 128 small steps threw its
        calibration off (1.8 on a 2M-row stream at 128K, docs/large-batches.md)."""
        o = self._step_optim(step)
        warm = o.warmup_samples
        if warm <= 0:
            return o.lr_dense
        done = self.samples_at(step)
        ramp = self.ramp
        if ramp is None or step <= ramp.ramp_steps:
            return o.lr_dense * min(1.0, done / warm)
        after = done - self.samples_at(ramp.ramp_steps)
        return ramp.lr_dense + (o.lr_dense - ramp.lr_dense) * min(1.0, after / warm)

    def _init_bias(self, logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor | None) -> None:
        """Output bias <- the shift that makes the first batch's mean prediction its
        click rate (Laplace-smoothed; both weighted by the record weights, if any), so
        the model starts at the base rate instead of 0.5. `logits` are the first
        batch's scores with the current bias; the shift is solved (Newton on a
        monotone scalar function), not taken as logit(CTR), because the other terms'
        initial logits are not centred at 0."""
        w = torch.ones_like(labels, dtype=torch.float32) if weight is None else weight.float()
        total = w.sum().clamp_min(1e-12)
        mean = (lambda x: x.mean()) if weight is None else (lambda x: (w * x).sum() / total)
        # Laplace-smoothed: a tiny first batch (a stream flushed on its latency budget)
        # with no click must not start the model at p = 1e-4.
        ctr = ((w * labels.float()).sum() + 1) / (total + 2)
        z = logits
        shift = torch.log(ctr / (1 - ctr)) - mean(z)
        for _ in range(50):
            p = torch.sigmoid(z + shift)
            slope = mean(p * (1 - p)).clamp_min(1e-12)
            step = ((mean(p) - ctr) / slope).clamp(-4.0, 4.0)
            shift -= step
            if step.abs() < 1e-6:
                break
        if torch.isfinite(shift):           # non-finite first scores: keep the bias at 0
            self.model.linear.bias.add_(shift)

    def _inputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Dense features, labels and record weights (None: unweighted) on the device."""
        if self._next is not None and self._next[0] is batch:
            return self._next[2]
        weight = None if batch.weight is None else host_to_device(batch.weight, self.device)
        return host_to_device(batch.dense, self.device), host_to_device(batch.labels, self.device), weight

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        """The batch's log loss: the mean, or with record weights `w` the weighted mean
        sum(w * l) / sum(w).  Dividing by the weights' sum (not by B, as Keras does)
        keeps the step size independent of the weights' scale, so the tuned learning
        rates hold whether a negative weighs 1 or 1/rate."""
        if w is None:
            return F.binary_cross_entropy_with_logits(logits, labels)
        per_row = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
        return (per_row * w).sum() / w.sum().clamp_min(torch.finfo(w.dtype).tiny)

    @classmethod
    def for_format(cls, cfg: Config, fmt, **kwargs) -> "Trainer":
        """A Trainer for records of `fmt` (a RecordFormat or Schema): its fields, each
        wide one (a schema's per-field embed_dim) counted in rows, and its dense columns."""
        n_fields, keys_per_record, rows = model_fields(fmt, cfg.model.embed_dim)
        return cls(cfg, n_fields, fmt.n_dense, keys_per_record=keys_per_record, field_rows=rows, **kwargs)

    def _forward(self, rows: torch.Tensor, inverse: torch.Tensor, batch: Batch,
                 dense: torch.Tensor) -> torch.Tensor:
        """The live model's logits from unique rows [U, d+1] and each key's index into
        them (`models.scoring.logits`, which eval, predict and serve run too)."""
        return logits(self.model, rows, inverse, batch, dense, self.cfg.model.embed_dim, self.field_rows,
                      self.precision, self.device, n_inputs=self.n_fields)

    def _working_set(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        """Unique signs over the fixed keys and every multi-hot value, each key's index
        into them, and in-batch counts (CowClip's cnt: every occurrence of an id)."""
        if self._next is not None and self._next[0] is batch:
            return self._next[1]
        return working_set(batch, self.field_rows, self.device)

    def _clock(self) -> float:
        """A phase boundary. With train.sync_phases on CUDA the queued kernels finish
        first, so each phase is charged with its own GPU time, not with the launches
        of the one before (off by default: the sync stops the CPU from queuing the
        next phase's kernels while the GPU works)."""
        if self._sync_phases:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def ramp_pieces(self, rows: int, steps_before: int = 0) -> list[tuple[int, int]]:
        """How a batch of `rows` splits into steps when `steps_before` steps come before its
        first: ramp_batch rows each while the ramp lasts, the rest in one step; one piece
        without a ramp or after it. A distributed job splits its batches with this too."""
        ramp, step = self.ramp, self.step + steps_before
        if ramp is None or step >= ramp.ramp_steps or rows <= ramp.batch_size:
            return [(0, rows)]
        pieces, start = [], 0
        while start < rows:
            stop = rows if step >= ramp.ramp_steps else min(start + ramp.batch_size, rows)
            pieces.append((start, stop))
            start, step = stop, step + 1
        return pieces

    def train_step(self, batch: Batch, upcoming: Batch | None = None) -> StepResult:
        """Train `batch`: one step, or while the ramp lasts (optim.ramp_samples) one step
        per ramp_batch rows, in order (`ramp_pieces`). `upcoming` (the next batch, if
        known) is prefetched meanwhile."""
        pieces = self.ramp_pieces(len(batch))
        if len(pieces) == 1:
            return self._step(batch, upcoming)
        return StepResult.concat([self._step(batch.slice(a, b), upcoming if b == len(batch) else None)
                                  for a, b in pieces])

    def _step(self, batch: Batch, upcoming: Batch | None) -> StepResult:
        """One optimizer step on `batch`, with the settings of the step it is (`_step_optim`)."""
        t0 = time.perf_counter()
        if self._graph_steps:
            torch.compiler.cudagraph_mark_step_begin()
        b = len(batch)
        dense, labels, weight = self._inputs(batch)

        # Working set: the store makes every unique sign resident before the step
        # starts, and may fetch the next batch's while this one trains.
        uniq, inverse, counts = self._working_set(batch)
        if len(batch):
            self.store.observe_event_time(int(batch.event_time_ms.max()))
        slots = self.store.prepare(uniq)
        self._next = None
        if upcoming is not None and len(upcoming):
            self._next = (upcoming, self._working_set(upcoming), self._inputs(upcoming))
            self.store.prefetch(self._next[1][0])
        rows = self.store.weight[slots].requires_grad_()
        if self.step == 0 and self.optim.init_bias_from_data and b:
            with torch.no_grad():          # the forward and the in-place bias update
                self._init_bias(self._forward(rows, inverse, batch, dense), labels, weight)
        t1 = self._clock()

        # Forward on the pre-update weights (these are the prequential scores), backward.
        logits = self._forward(rows, inverse, batch, dense)
        loss = self._loss(logits, labels, weight)
        o = self._step_optim(self.step + 1)
        reg = sum((p.square().sum() for p in self.l2_params.get("linear", [])), torch.zeros((), device=self.device)) * o.l2 \
            + sum((p.square().sum() for p in self.l2_params.get("cross", [])), torch.zeros((), device=self.device)) * o.cross_l2
        self.dense_opt.zero_grad(set_to_none=True)
        (loss + reg).backward()
        t2 = self._clock()

        # A non-finite loss would poison Adam's moments for good: skip the update.
        skipped = ~torch.isfinite(loss)
        node_steps = False
        if self.reduce_dense_grads is not None:      # a node's replicas take one dense step
            node_steps = self.reduce_dense_grads(0 if bool(skipped) else b) > 0
        if bool(skipped):
            if node_steps:                           # the node's step, on its mean gradients
                self._dense_step(self.step + 1)
            zero = torch.zeros((), device=self.device)
            return StepResult(torch.sigmoid(logits.detach()), loss.detach(), skipped, 0, zero, zero)

        # Update: dense Adam with warm-up; CowClip + Adam on the rows present.
        self.step += 1
        self._dense_step(self.step)
        clip = self.store.update(slots, rows.grad, counts, self.step, o)
        t3 = self._clock()
        return StepResult(torch.sigmoid(logits.detach()), loss.detach(), skipped, int(uniq.numel()),
                          clip.rows_clipped, clip.rows_at_floor,
                          {"prepare": t1 - t0, "forward_backward": t2 - t1, "update": t3 - t2},
                          clip.ratio_le, clip.ratio_sum, clip.rows_present, uniq)

    def predict(self, batch: Batch) -> np.ndarray:
        """Scores without changing any state (absent keys score with their initial rows):
        the evaluated model (`eval_model`) on the live rows."""
        return probabilities(self.eval_model, self.store.peek, batch, self.cfg.model.embed_dim,
                             self.field_rows, self.precision, self.device, n_inputs=self.n_fields)

    def state_tensors(self) -> dict:
        out = {"model": self.model.state_dict(), "dense_opt": self.dense_opt.state_dict(),
               "store": self.store.state_dict(), "step": self.step}
        if self.average_updates:
            out["model_average"] = self.average_model.state_dict()
            out["average_updates"] = self.average_updates
        return out

    def load_state_tensors(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.average_updates = 0
        if "model_average" in state:        # absent: averaging off, or a checkpoint before it
            if self.average_model is None:  # a run that averaged, evaluated with it off
                self.average_model = copy.deepcopy(self.model).requires_grad_(False)
            self.average_model.load_state_dict(state["model_average"])
            self.average_updates = int(state["average_updates"])
        self.dense_opt.load_state_dict(state["dense_opt"])
        self.store.load_state_dict(state["store"])
        self.step = int(state["step"])
