"""`train` with several replicas: lockstep steps, sharded rows, k-step merges, job manifests.

Launched by torchrun (one process per rank). A `Job` holds the rank's `Run`
(train/loop.py) and adds what a job needs around it, by composition: the same
input (train/inputs.py) reads the rank's share of the data -- a Kafka consumer
group splits partitions; a file is striped by record offset (rank r trains the
records with offset % world_size == r) -- and the Job adds the sharded store, the
merger and job checkpoints. `lockstep` is its loop. Per step:

    agree      one tiny all-reduce: does any rank have a batch, is any still
               reading, did any get SIGTERM? (steps are collectives, so all
               ranks step together; a rank without a batch takes an idle step)
    step       sparse rows from their owners, forward/backward, dense Adam,
               gradients back to the owners (`ShardedEmbeddingStore`)
    merge      every k steps the dense replicas are averaged (`DenseMerger`)
    checkpoint every N steps and at the end: merge, every rank writes its
               shard + dense model + offsets, then rank 0 writes the job
               manifest naming them all (`job_checkpoint`)

A rank that dies makes the others fail their next collective with a
`DistributedError` (within `distributed.timeout_s`); restarting every rank
with --resume continues from the last complete job manifest.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch.distributed as dist

from stream_ctr.connectors.batch import Batch
from stream_ctr.connectors.kafka.options import is_kafka_url
from stream_ctr.distributed import job_checkpoint as jobs
from stream_ctr.config import Config, ConfigError
from stream_ctr.distributed.context import (DistContext, DistributedError, agree, collective,
                                           init_distributed, shutdown)
from stream_ctr.distributed.merge import DenseMerger
from stream_ctr.train.evaluation import accuracy
from stream_ctr.telemetry.progress import Progress
from stream_ctr.distributed.sharded_store import ShardedEmbeddingStore
from stream_ctr.serving.export import checkpoint_record
from stream_ctr.train.batches import StopSignal
from stream_ctr.train.checkpoint import CheckpointError
from stream_ctr.train.inputs import Idle, Revoked
from stream_ctr.train.run_dir import RunDirOwner, claim_run_dir, point_latest
from stream_ctr.train.streaming import stream_url
from stream_ctr.train.loop import JobParts, Run, RunSummary, finished_run, start_note
from stream_ctr.train.trainer import resolve_device


@dataclass
class DistributedSummary(RunSummary):
    world_size: int = 1
    steps: int = 0                     # lockstep steps of this invocation
    merges: int = 0
    merge_sent_bytes: int = 0          # dense merges, per rank (ring all-reduce estimate)
    merge_seconds: float = 0.0         # rank 0's time in dense merges
    exchange_sent_bytes: int = 0       # sparse all-to-all, summed over ranks


def rank_config(cfg: Config, ctx: DistContext) -> Config:
    """A copy of `cfg` whose per-process paths (dead letters, LMDB store) are this rank's."""
    from stream_ctr.store import store_dir
    out = Config.from_dict(cfg.to_dict())
    run_dir = Path(cfg.train.run_dir)
    tag = f"rank-{ctx.rank:05d}"
    base = Path(cfg.data.dead_letter_path) if cfg.data.dead_letter_path else run_dir / "dead_letter.jsonl"
    out.data.dead_letter_path = str(base.with_name(f"{base.stem}.{tag}{base.suffix}"))
    out.store.store_dir = str(Path(store_dir(cfg)) / tag)
    return out


class Job:
    """One rank of a job: a `Run` (its share of the input, its trainer and window) with
    what a job adds around it: a sharded store, k-step dense merges, lockstep steps
    and job checkpoints that every rank writes together."""

    def __init__(self, cfg: Config, resume: str | None, ctx: DistContext) -> None:
        self.ctx = ctx
        refuse_deterministic_batches(cfg)
        root = Path(cfg.train.checkpoint_dir or Path(cfg.train.run_dir) / "checkpoints")
        job = jobs.open_job(resume, ctx.world_size) if resume else None
        # A partition may have moved between ranks: whoever gets it now starts where the
        # job last trained it (the largest position of any rank).
        merged = jobs.merged_stream_positions(job) if job is not None and is_kafka_url(cfg.data.source) else None
        parts = JobParts(is_job=True, rank=ctx.rank, world_size=ctx.world_size, local_rank=ctx.local_rank,
                         local_world_size=ctx.local_world_size, merged_positions=merged)
        self.run = run = Run(rank_config(cfg, ctx), jobs.rank_checkpoint(job, ctx.rank) if job else None, parts)
        self.cfg = run.cfg
        self.ckpt_root = root
        self.global_step = job.manifest["global_step"] if job else 0
        self.resumed_job = job.path if job is not None else None
        self.job_seq = _broadcast_int(jobs.last_seq(root) if ctx.is_main else 0)
        if cfg.data.limit_records:       # this rank's share of the records to train
            w, r = ctx.world_size, ctx.rank
            run.remaining = cfg.data.limit_records // w + (r < cfg.data.limit_records % w)
        self.store = ShardedEmbeddingStore(run.trainer.store, run.trainer.optim)
        run.trainer.store = self.store
        self.merger = self._merger()
        run.summary = DistributedSummary(dead_letter_path=run.summary.dead_letter_path, world_size=ctx.world_size)
        self.checkpoint_wanted = False    # a Kafka rebalance asks for a job checkpoint
        self._events = None               # the input's events of the current pass
        # During the rule's ramp a batch trains as several steps (`Trainer.ramp_pieces`):
        # each is a lockstep step of its own, so a rank with fewer pieces takes idle
        # steps while the others finish theirs, and a checkpoint between two pieces
        # records what was trained (the input's positions after the last trained row).
        self._pieces: collections.deque[Batch] = collections.deque()
        self._done = False
        # --publish: when this rank read its newest trained batch (wall s) and its newest
        # event time (ms, -1: none), since the last job checkpoint.
        self._read_at_s = 0.0
        self._newest: tuple[float | None, int] = (None, -1)
        if job is not None:        # a resumed job publishes the model it resumed from first
            self.publish_job(job.path)

    def _merger(self) -> DenseMerger:
        run, d, ctx = self.run, self.cfg.distributed, self.ctx
        merger = DenseMerger(run.trainer.model, run.trainer.dense_opt, d.merge_every_k_steps,
                             d.merge_moments, d.hierarchical, ctx.local_world_size,
                             on_merge=getattr(run.monitor.metrics, "observe_merge", None),
                             timeout_s=ctx.timeout_s, average=run.trainer.average_model)
        merger.broadcast_from(0)
        if merger.node_group is not None:      # hierarchical: synchronous inside a node
            run.trainer.reduce_dense_grads = merger.reduce_gradients
            if run.trainer.optim.init_bias_from_data:
                # Each rank's first batch has its own click rate, and a node's replicas
                # only ever average gradients, so different starting biases would never
                # meet. (k-step replicas are averaged at every merge: they keep it.)
                run.trainer.optim = dataclasses.replace(run.trainer.optim, init_bias_from_data=False)
                if ctx.is_main:
                    print("stream-ctr: optim.init_bias_from_data is off in hierarchical mode "
                          "(a node's replicas must start from the same output bias)", file=sys.stderr)
        return merger

    # -- this rank's share of the data -------------------------------------------------

    def next_batch(self, stop: StopSignal) -> Batch | None:
        """This rank's next batch (across passes), or None when it has none now: the
        input's events, taken without blocking for a full batch (the other ranks wait
        for this one in the next collective, and a group rebalance needs every rank to
        keep polling)."""
        run = self.run
        if self._pieces:
            return self._pieces.popleft()
        while not self._done:
            if self._events is None:
                if not run.wants_more:
                    self._done = True
                    break
                self._events = run.events(stop, look_ahead=False)
            event = next(self._events, None)
            if event is None:                   # the pass's batches ran out
                self._events = None
                run.end_pass(completed=True)
            elif isinstance(event, Revoked):    # its rows are gone; the job checkpoints at the next step
                self.checkpoint_wanted = self.checkpoint_wanted or not event.lost
            elif isinstance(event, Idle):
                return None
            else:
                batch = run.input.owned(event.batch)
                if len(batch):
                    self._read_at_s = event.read_at_s     # its freshness stamp, should it train
                    self._pieces.extend(batch.slice(a, b) for a, b in run.trainer.ramp_pieces(len(batch)))
                    return self._pieces.popleft()
        return None

    def keep_polling(self) -> None:
        """While this rank waits for the others (see `KafkaInput.poll_while_waiting`)."""
        if self._done:
            time.sleep(0.001)
            return
        self.run.input.poll_while_waiting(self.run.monitor, self.run.dead_letter)

    def exchange_positions(self) -> None:
        """A collective: every rank's hand-over positions (partitions it gave up in this
        run) go to every rank, whose newly assigned partitions then start no earlier
        than where any rank left them."""
        everyone: list = [None] * self.ctx.world_size
        with collective("exchanging Kafka positions"):
            dist.all_gather_object(everyone, self.run.input.handover_positions())
        self.run.input.give_peer_positions(everyone)

    @property
    def reading(self) -> bool:
        return not self._done

    # -- the step ------------------------------------------------------------------

    def step(self, batch: Batch | None) -> None:
        """One lockstep step: train `batch`, or serve the others' rows when None."""
        run = self.run
        self._count_job_steps()
        trained = 0
        if batch is None:
            # Hierarchical: the node's dense step all the same, where a training rank
            # reduces its gradients (after the sparse prepare, before the update).
            self.store.idle_step(between=run.trainer.idle_dense_step)
        else:
            result = run.trainer.train_step(batch)
            self.store.settle()           # a skipped (non-finite) step still answers the owners
            run.record_and_report(batch, result)
            trained = 0 if bool(result.skipped) else len(batch)   # its dense state did not move
            if trained:
                self._newest = (max(self._newest[0] or 0.0, self._read_at_s),
                                max(self._newest[1], int(batch.event_time_ms.max())))
        self.global_step += 1
        run.trainer.step = self.global_step     # what the rank checkpoints: the same everywhere
        self.merger.after_step(trained)

    def _count_job_steps(self) -> None:
        """The step count of the job, not of this rank, for the dense warm-up and for
        Adam's bias correction where its state is shared: the sparse rows (their owner
        updates them with every rank's gradients) and the dense moments when they are
        merged. A rank that sat idle (a quiet partition, a late assignment) would
        otherwise run behind, and an owner would update a row with whichever step
        count its senders had."""
        self.run.trainer.step = self.global_step
        if self.merger.merge_moments:
            for st in self.run.trainer.dense_opt.state.values():
                if "step" in st:
                    st["step"].fill_(float(self.global_step))

    def checkpoint(self) -> None:
        """Merge, write this rank's checkpoint, then (rank 0) the job manifest naming all;
        then (Kafka) commit this rank's offsets to the group.

        A collective: every rank calls it at the same step. Blocks until every
        rank's files and the manifest are durable. A crash before the manifest
        leaves the previous job manifest in force.
        """
        run = self.run
        self.merger.flush()
        self.job_seq += 1
        job_dir = jobs.job_dir(self.ckpt_root, self.job_seq)
        run.ckpt_dir = job_dir / jobs.rank_dir_name(self.ctx.rank)
        run.checkpoint(commit=False)
        entry = jobs.rank_entry(Path(run.summary.checkpoint), job_dir, self.ctx.rank,
                                run.input.snapshot().to_checkpoint(),
                                run.total_before + run.summary.records_trained, run.trainer.step)
        entries: list = [None] * self.ctx.world_size
        with collective("gathering the ranks' checkpoints"):
            dist.all_gather_object(entries, entry)
        if self.ctx.is_main:
            jobs.write_manifest(job_dir, self.job_seq, self.global_step, entries, self.cfg,
                                self.cfg.train.keep_checkpoints)
        with collective("waiting for the job manifest"):
            dist.barrier()
        run.summary.checkpoint = str(job_dir)
        self.checkpoint_wanted = False
        run.input.commit()
        if self.cfg.serving.publish:        # every rank's freshness stamps, to rank 0's publisher
            stamps: list = [None] * self.ctx.world_size
            with collective("gathering the ranks' freshness stamps"):
                dist.all_gather_object(stamps, self._newest)
            self._newest = (None, -1)
            if run.publisher is not None:
                for arrived_s, event_ms in stamps:
                    run.publisher.note_newest(arrived_s, event_ms)
        self.publish_job(job_dir)

    # -- publishing (--publish; rank 0 holds the publisher) ---------------------------

    def publish_job(self, job_dir: Path) -> None:
        """Rank 0: publish the job checkpoint at `job_dir` as one full snapshot (its shards
        as one table, the dense model every rank holds after the merge). Blocks rank 0
        while it writes; the other ranks wait at their next collective."""
        publisher = self.run.publisher
        if publisher is None:
            return
        state = jobs.load_job_as_one(job_dir)
        publisher.publish(state.tensors, checkpoint_record(job_dir, state.step, state.records_trained,
                                                           state.extra.get("epoch", 0), state.positions),
                          self.run.trainer.precision, None)

    def publish_due(self) -> bool:
        """Whether serving.publish_every_s has passed on rank 0 (a job checkpoint is due)."""
        return self.run.publisher is not None and self.run.publisher.due()

    def finish(self, seconds: float) -> RunSummary:
        run = self.run
        s = run.finish(seconds)          # the holdout evaluation is collective: all ranks run it
        window = run.window.state_dict()
        mine = {"s": dataclasses.asdict(s), "probs": window["probs"], "labels": window["labels"],
                "touched": run.rows_touched, "clipped": run.rows_clipped, "floor": run.rows_at_floor,
                "exchange": self.store.stats.sent_bytes}
        everyone: list = [None] * self.ctx.world_size
        with collective("gathering the run summaries"):
            dist.all_gather_object(everyone, mine)
        return _combine(s, everyone, self)


def refuse_deterministic_batches(cfg: Config) -> None:
    """`kafka.deterministic_batches` promises batches that are a function of offsets alone,
    cut by one process with its journal in the run directory; a job's partitions move
    between ranks, which share that directory."""
    url = stream_url(cfg)
    if url is not None and url.options.deterministic_batches:
        raise ConfigError("kafka.deterministic_batches is for single-process runs: a distributed "
                          "job's ranks share the run directory its cut journal lives in, and its "
                          "partitions move between ranks; drop it, or train in one process")


def _combine(s: DistributedSummary, everyone: list[dict], run: Job) -> DistributedSummary:
    out = dataclasses.replace(s)
    per = [e["s"] for e in everyone]
    for name in ("records_trained", "records_trained_total", "records_rejected", "batches",
                 "skipped_batches"):
        setattr(out, name, sum(p[name] for p in per))
    reasons: dict[str, int] = {}
    for p in per:
        for k, v in p["rejected_by_reason"].items():
            reasons[k] = reasons.get(k, 0) + v
    out.rejected_by_reason = reasons
    out.seconds = max(p["seconds"] for p in per)
    out.samples_per_s = out.records_trained / max(out.seconds, 1e-9)
    touched = max(sum(e["touched"] for e in everyone), 1)
    out.clipped_row_fraction = sum(e["clipped"] for e in everyone) / touched
    out.floor_row_fraction = sum(e["floor"] for e in everyone) / touched
    probs = np.concatenate([e["probs"] for e in everyone])
    labels = np.concatenate([e["labels"] for e in everyone])
    out.window = accuracy(probs, labels).as_dict() if len(labels) else s.window
    out.steps = run.global_step
    out.merges = run.merger.stats.merges
    out.merge_sent_bytes = run.merger.stats.sent_bytes
    out.merge_seconds = run.merger.stats.seconds
    out.exchange_sent_bytes = sum(e["exchange"] for e in everyone)
    return out


def _broadcast_int(value: int) -> int:
    box = [value]
    with collective("agreeing on the checkpoint sequence"):
        dist.broadcast_object_list(box, src=0)
    return int(box[0])


def agree_run_dir(cfg: Config, resume: str | None, ctx: DistContext) -> tuple[str, RunDirOwner | None]:
    """Rank 0 chooses the job's run directory and owns it for the job (train/run_dir.py:
    the ranks of one job share it, a second job is refused); every rank takes the
    name: a time-stamped one would differ between ranks. A refusal is raised on every
    rank. Returns the directory and, on rank 0, what holds its locks."""
    choice: list = [None, None]
    owner = None
    if ctx.is_main:
        try:
            owner = claim_run_dir(cfg, resume)
            choice[0] = cfg.train.run_dir
        except (ConfigError, CheckpointError, OSError) as e:   # e.g. another job owns it
            choice[1] = e
    with collective("agreeing on the run directory"):
        dist.broadcast_object_list(choice, src=0)
    if choice[1] is not None:
        raise choice[1]
    return choice[0], owner


def train_distributed(cfg: Config, resume: str | None = None,
                      show_progress: bool = True) -> DistributedSummary:
    """Train as one rank of the torchrun job; every rank returns the job's summary.

    Ends when every rank's share is trained (all epochs, or its part of
    `data.limit_records`), or on SIGTERM / Ctrl-C at any rank after the
    current step; always merges and writes a job checkpoint.
    """
    ctx = init_distributed(resolve_device(cfg.train.device), cfg.distributed.timeout_s,
                           cfg.distributed.backend)
    failed = False
    owner = None
    try:
        cfg.train.run_dir, owner = agree_run_dir(cfg, resume, ctx)
        job = Job(cfg, resume, ctx)
        if ctx.is_main:
            point_latest(Path(cfg.train.run_dir))
        return lockstep(job, show_progress)
    except DistributedError:
        failed = True
        raise
    finally:
        if owner is not None:
            owner.release()
        if not failed:
            shutdown()


def lockstep(job: Job, show_progress: bool) -> DistributedSummary:
    """The job's loop: each step, the ranks agree whether anyone has a batch, is still
    reading, was asked to stop or wants a checkpoint; then all step (a rank without a
    batch takes an idle step) and checkpoint together."""
    run, ctx = job.run, job.ctx
    (anyone_has_more,) = agree([not run.finished])
    if not anyone_has_more:       # every rank did its passes: no step, no job checkpoint
        return finished_run(run, job.finish, str(job.resumed_job), speaks=ctx.is_main)
    start_note(run, show_progress, speaks=ctx.is_main)
    label = f"train ({ctx.world_size} ranks, rank 0 shown)"
    progress = Progress(label, run.cfg.train.log_every_s, enabled=show_progress and ctx.is_main)
    every = run.cfg.train.checkpoint_every_batches
    polling = job.keep_polling if run.input.keeps_polling else None
    with StopSignal() as stop, run:
        while True:
            batch = None if stop.requested else job.next_batch(stop)
            # Agree: steps are collectives, so either every rank steps or none.
            anyone_has, anyone_reading, anyone_stops, rebalanced, handover = agree(
                [batch is not None, job.reading, stop.requested,
                 job.checkpoint_wanted or job.publish_due(), run.input.peers_wanted], while_waiting=polling)
            if handover:              # a rank got partitions: where did the others leave them?
                job.exchange_positions()
            if anyone_stops or not (anyone_has or anyone_reading):
                break                 # (stop) a batch read but not trained is re-read on resume
            if anyone_has:
                if batch is not None:
                    batch = run.input.owned(batch)     # a rebalance while we waited?
                job.step(batch if batch is not None and len(batch) else None)
                acc = run.window.latest()
                progress.update(run.summary.records_trained, run.summary.batches, acc.auc, acc.logloss)
            if rebalanced or (anyone_has and every and job.global_step % every == 0):
                job.checkpoint()
        progress.close()
        job.checkpoint()
    return job.finish(progress.elapsed_s())


def launch_local(nproc: int, argv: list[str]) -> int:
    """`stream-ctr train --distributed` without torchrun: start `nproc` ranks on this
    machine through torchrun's launcher (loopback rendezvous); blocks until they end."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun
    if nproc < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {nproc}")
    # The ranks share this machine's cores (torchrun would warn and pick 1).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    try:
        torchrun(["--standalone", f"--nproc-per-node={nproc}", "--module", "stream_ctr", *argv])
    except ChildFailedError as e:
        print(f"stream-ctr: error: {len(e.failures)} of {nproc} ranks failed, their errors are "
              "above", file=sys.stderr)
        return 1
    return 0
