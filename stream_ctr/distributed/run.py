"""`train` with several replicas: lockstep steps, sharded rows, k-step merges, job manifests.

Launched by torchrun (one process per rank). Each rank reads its share of the
data: a Kafka consumer group splits partitions; a file is striped by record
offset (rank r trains the records with offset % world_size == r). Per step:

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

import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch.distributed as dist

from stream_ctr.connectors.batch import Batch, Rejected
from stream_ctr.connectors.files import FileSource
from stream_ctr.connectors.kafka.positions import filter_partitions
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
from stream_ctr.train.run_dir import RunDirOwner, claim_run_dir, point_latest
from stream_ctr.train.loop import Run, RunSummary
from stream_ctr.train.trainer import resolve_device


def take_rows(batch: Batch, idx: np.ndarray) -> Batch:
    return batch.take(idx)       # multi-hot (jagged) fields included


class StripedSource:
    """A file source as one rank of `world` sees it: the records with offset % world == rank.

    Offsets keep their meaning, so the rank's resume position (after its last
    trained record) reopens the file where its stripe continues.
    """

    def __init__(self, inner: FileSource, rank: int, world: int) -> None:
        self.inner, self.rank, self.world = inner, rank, world

    def read(self, max_records: int | None = None) -> tuple[Batch, list[Rejected]]:
        return self._mine(*self.inner.read(max_records))

    def decode_raw(self, raw) -> tuple[Batch, list[Rejected]]:
        """The stripe's share of a chunk from `read_raw` (which reads the whole file's)."""
        return self._mine(*self.inner.decode_raw(raw))

    def _mine(self, batch: Batch, rejected: list[Rejected]) -> tuple[Batch, list[Rejected]]:
        mine = batch.offset % self.world == self.rank
        if not mine.all():
            batch = take_rows(batch, np.flatnonzero(mine))
        return batch, [r for r in rejected if r.offset % self.world == self.rank]

    def __getattr__(self, name: str):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __enter__(self) -> "StripedSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.close()


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


class DistributedRun(Run):
    """A `Run` that is one rank of a job: its share of the source, sharded store, merger,
    job checkpoints."""

    # Scoring the holdout is collective (sharded rows), and ranks end their passes at
    # different steps: only the end of the run, which every rank reaches together, scores it.
    EVALUATES_EACH_PASS = False

    def __init__(self, cfg: Config, resume: str | None, ctx: DistContext) -> None:
        self.ctx = ctx
        root = Path(cfg.train.checkpoint_dir or Path(cfg.train.run_dir) / "checkpoints")
        job = jobs.open_job(resume, ctx.world_size) if resume else None
        super().__init__(rank_config(cfg, ctx), jobs.rank_checkpoint(job, ctx.rank) if job else None)
        if job is not None and self.stream is not None:
            # A partition may have moved between ranks: whoever gets it now starts
            # where the job last trained it (the largest position of any rank).
            self.positions = jobs.merged_stream_positions(job)
        self.ckpt_root = root
        self.global_step = job.manifest["global_step"] if job else 0
        self.job_seq = _broadcast_int(jobs.last_seq(root) if ctx.is_main else 0)
        if cfg.data.limit_records:       # this rank's share of the records to train
            w, r = ctx.world_size, ctx.rank
            self.remaining = cfg.data.limit_records // w + (r < cfg.data.limit_records % w)
        self.store = ShardedEmbeddingStore(self.trainer.store, self.trainer.optim)
        self.trainer.store = self.store
        d = self.cfg.distributed
        self.merger = DenseMerger(self.trainer.model, self.trainer.dense_opt, d.merge_every_k_steps,
                                  d.merge_moments, d.hierarchical, ctx.local_world_size,
                                  on_merge=getattr(self.monitor.metrics, "observe_merge", None),
                                  timeout_s=ctx.timeout_s, average=self.trainer.average_model)
        self.merger.broadcast_from(0)
        if self.merger.node_group is not None:      # hierarchical: synchronous inside a node
            self.trainer.reduce_dense_grads = self.merger.reduce_gradients
            if self.trainer.optim.init_bias_from_data:
                # Each rank's first batch has its own click rate, and a node's replicas
                # only ever average gradients, so different starting biases would never
                # meet. (k-step replicas are averaged at every merge: they keep it.)
                self.trainer.optim = dataclasses.replace(self.trainer.optim, init_bias_from_data=False)
                if ctx.is_main:
                    print("stream-ctr: optim.init_bias_from_data is off in hierarchical mode "
                          "(a node's replicas must start from the same output bias)", file=sys.stderr)
        self.summary = DistributedSummary(dead_letter_path=self.summary.dead_letter_path,
                                          world_size=ctx.world_size)
        self.checkpoint_wanted = False    # a Kafka rebalance asks for a job checkpoint
        self._feed = None
        self._ready: list[Batch] = []      # stream batches cut but not yet trained
        self.in_hand: Batch | None = None   # the batch of the step the ranks are agreeing on
        # --publish: when this rank read its newest trained batch (wall s) and its newest
        # event time (ms, -1: none), since the last job checkpoint.
        self._read_at_s = 0.0
        self._newest: tuple[float | None, int] = (None, -1)
        if job is not None:        # a resumed job publishes the model it resumed from first
            self.publish_job(job.path)
        self._done = False

    # -- this rank's share of the data -------------------------------------------------

    def open_source(self):
        if self.stream is not None and self.source is None:
            from stream_ctr.connectors.kafka.source import KafkaSource
            from stream_ctr.train.streaming import declared_schema
            self.source = KafkaSource(self.stream, positions=self.positions, on_revoke=self._on_revoke,
                                      chunk_records=self.cfg.data.chunk_records, wait_for_peers=True,
                                      schema=declared_schema(self.cfg))
        return super().open_source()

    @property
    def processes_per_host(self) -> int:       # ranks of a node share its cores
        return self.ctx.local_world_size

    @property
    def first_on_host(self) -> bool:
        return self.ctx.local_rank == 0

    def file_share(self, source: FileSource):
        return StripedSource(source, self.ctx.rank, self.ctx.world_size) if self.ctx.world_size > 1 else source

    def _on_revoke(self, partitions: list[str], lost: bool) -> None:
        """Rebalance (inside this rank's poll): drop the revoked partitions' untrained
        rows. A checkpoint is a collective, so it cannot run here: the job writes one
        at the next step all ranks agree on. The source then commits the revoked
        partitions' trained offsets for their next owner; should the job crash before
        its checkpoint, a resume starts every partition from the last job manifest
        (`merged_stream_positions`), so nothing trained after it is lost or repeated.

        Every untrained row of those partitions goes: the batcher's, the cut batches'
        and the batch in hand's (this runs while the ranks agree on its step).  If
        the partitions come straight back to this rank, they continue at the trained
        position and those rows are read again."""
        gone = set(partitions)
        self.batcher.discard(partitions)
        self._ready = [b for b in (filter_partitions(b, gone) for b in self._ready) if len(b)]
        if self.in_hand is not None:
            self.in_hand = filter_partitions(self.in_hand, gone)
        self.positions = self.source.trained_positions
        self.checkpoint_wanted = self.checkpoint_wanted or not lost

    def next_batch(self, stop: StopSignal) -> Batch | None:
        """This rank's next batch (across epochs), or None when it has none now."""
        batch = self._read_batch(stop)
        if batch is not None:
            self._read_at_s = time.time()     # its freshness stamp, should it train
        return batch

    def _read_batch(self, stop: StopSignal) -> Batch | None:
        if self.stream is not None:
            return self._next_stream_batch()
        while not self._done:
            if self._feed is None:
                if not self.wants_more:
                    self._done = True
                    break
                self._opened = self.open_source()
                self._source = self._opened.__enter__()
                self._feed = iter(self.batches(self._source, stop))
            batch = next(self._feed, None)
            if batch is not None:
                batch = self.owned(batch)         # a rebalance while it was read?
                if len(batch):
                    return batch
                continue
            self._opened.__exit__(None, None, None)
            self.end_epoch(self._source, completed=True)     # its batches ran out
            self._feed = None
        return None

    def _next_stream_batch(self) -> Batch | None:
        """One read of the stream and a batch if one is ready; never waits for more.

        Unlike the single-process loop, a rank must not block until its batch
        is full: the others wait for it in the next collective, and a consumer
        group rebalance needs every rank to keep polling.
        """
        if self._done:
            return None
        if self.source is None:
            self.open_source()               # joins the consumer group
        source = self.source
        while self._ready and not self.limit_reached:
            batch = self.owned(self._ready.pop(0))       # a rebalance since it was cut?
            if len(batch):
                return self._within_limit(batch)
        if self.limit_reached or source.exhausted:     # idle for kafka.stop_when_idle_s
            self.end_epoch(source, completed=True)
            self._done = True
            rest = self.batcher.flush()      # the tail trains (at the limit it is dropped)
            return self._within_limit(rest) if rest is not None and not self.limit_reached else None
        t0 = time.perf_counter()
        chunk, rejected = source.read()
        self.monitor.on_read(chunk, rejected, time.perf_counter() - t0)
        self.dead_letter.write(rejected)
        self._ready.extend(self.batcher.add(chunk))
        if not self._ready and self.batcher.pending_rows \
                and self.batcher.oldest_wait_s() >= self.cfg.data.max_batch_delay_s:
            self._ready.append(self.batcher.flush())     # latency budget spent
        while self._ready:
            batch = self.owned(self._ready.pop(0))
            if len(batch):
                return self._within_limit(batch)
        return None

    def keep_polling(self) -> None:
        """While this rank waits for the others: keep its consumer polling (a group
        rebalance needs every member to poll); what it reads waits in `_ready`, up to
        `kafka.max_buffered_records` rows."""
        if self.source is None or self._done:
            time.sleep(0.001)
            return
        if sum(map(len, self._ready)) + self.batcher.pending_rows >= self.source.options.max_buffered_records:
            time.sleep(0.01)
            return
        t0 = time.perf_counter()
        chunk, rejected = self.source.read()
        self.monitor.on_read(chunk, rejected, time.perf_counter() - t0)
        self.dead_letter.write(rejected)
        self._ready.extend(self.batcher.add(chunk))

    @property
    def positions_wanted(self) -> bool:
        """This rank's consumer holds new partitions until the ranks exchange positions."""
        return self.stream is not None and self.source is not None and self.source.peers_wanted

    def exchange_positions(self) -> None:
        """A collective: every rank's hand-over positions (partitions it gave up in this
        run) go to every rank, whose newly assigned partitions then start no earlier
        than where any rank left them (see connectors/kafka/source.py, "Ranks of a
        distributed job")."""
        mine = self.source.handover_positions() if self.source is not None else {}
        everyone: list = [None] * self.ctx.world_size
        with collective("exchanging Kafka positions"):
            dist.all_gather_object(everyone, mine)
        if self.source is not None:
            self.source.give_peer_positions(everyone)

    def _within_limit(self, batch: Batch) -> Batch:
        return batch.slice(0, self.remaining) if 0 <= self.remaining < len(batch) else batch

    @property
    def reading(self) -> bool:
        return not self._done

    # -- the step ------------------------------------------------------------------

    def step(self, batch: Batch | None) -> None:
        """One lockstep step: train `batch`, or serve the others' rows when None."""
        self._count_job_steps()
        trained = 0
        if batch is None:
            # Hierarchical: the node's dense step all the same, where a training rank
            # reduces its gradients (after the sparse prepare, before the update).
            self.store.idle_step(between=self.trainer.idle_dense_step)
        else:
            result = self.trainer.train_step(batch)
            self.store.settle()           # a skipped (non-finite) step still answers the owners
            self.record_and_report(batch, result)
            trained = 0 if bool(result.skipped) else len(batch)   # its dense state did not move
            if trained:
                self._newest = (max(self._newest[0] or 0.0, self._read_at_s),
                                max(self._newest[1], int(batch.event_time_ms.max())))
        self.global_step += 1
        self.trainer.step = self.global_step     # what the rank checkpoints: the same everywhere
        self.merger.after_step(trained)

    def _count_job_steps(self) -> None:
        """The step count of the job, not of this rank, for the dense warm-up and for
        Adam's bias correction where its state is shared: the sparse rows (their owner
        updates them with every rank's gradients) and the dense moments when they are
        merged. A rank that sat idle (a quiet partition, a late assignment) would
        otherwise run behind, and an owner would update a row with whichever step
        count its senders had."""
        self.trainer.step = self.global_step
        if self.merger.merge_moments:
            for st in self.trainer.dense_opt.state.values():
                if "step" in st:
                    st["step"].fill_(float(self.global_step))

    def checkpoint(self, commit: bool = True) -> None:
        """Merge, write this rank's checkpoint, then (rank 0) the job manifest naming all;
        then (Kafka) commit this rank's offsets to the group.

        A collective: every rank calls it at the same step. Blocks until every
        rank's files and the manifest are durable. A crash before the manifest
        leaves the previous job manifest in force.
        """
        self.merger.flush()
        self.job_seq += 1
        job_dir = jobs.job_dir(self.ckpt_root, self.job_seq)
        self.ckpt_dir = job_dir / jobs.rank_dir_name(self.ctx.rank)
        super().checkpoint(commit=False)
        entry = jobs.rank_entry(Path(self.summary.checkpoint), job_dir, self.ctx.rank, self.positions,
                                self.total_before + self.summary.records_trained, self.trainer.step)
        entries: list = [None] * self.ctx.world_size
        with collective("gathering the ranks' checkpoints"):
            dist.all_gather_object(entries, entry)
        if self.ctx.is_main:
            jobs.write_manifest(job_dir, self.job_seq, self.global_step, entries, self.cfg,
                                self.cfg.train.keep_checkpoints)
        with collective("waiting for the job manifest"):
            dist.barrier()
        self.summary.checkpoint = str(job_dir)
        self.checkpoint_wanted = False
        if commit and self.stream is not None and self.source is not None:   # None: not joined yet
            self.source.commit(self.positions)
        if self.cfg.serving.publish:        # every rank's freshness stamps, to rank 0's publisher
            stamps: list = [None] * self.ctx.world_size
            with collective("gathering the ranks' freshness stamps"):
                dist.all_gather_object(stamps, self._newest)
            self._newest = (None, -1)
            if self.publisher is not None:
                for arrived_s, event_ms in stamps:
                    self.publisher.note_newest(arrived_s, event_ms)
        self.publish_job(job_dir)

    # -- publishing (--publish; rank 0 holds the publisher) ---------------------------

    def publish(self, tensors: dict, where: Path, state) -> None:
        """Not per rank: a rank's checkpoint holds its shard of the rows only. The job
        publishes once its manifest is durable (`publish_job`)."""

    def publish_job(self, job_dir: Path) -> None:
        """Rank 0: publish the job checkpoint at `job_dir` as one full snapshot (its shards
        as one table, the dense model every rank holds after the merge). Blocks rank 0
        while it writes; the other ranks wait at their next collective."""
        if self.publisher is None:
            return
        state = jobs.load_job_as_one(job_dir)
        self.publisher.publish(state.tensors, checkpoint_record(job_dir, state.step, state.records_trained,
                                                                state.extra.get("epoch", 0), state.positions),
                               self.trainer.precision, None)

    def publish_due(self) -> bool:
        """Whether serving.publish_every_s has passed on rank 0 (a job checkpoint is due)."""
        return self.publisher is not None and self.publisher.due()

    def finish(self, seconds: float) -> RunSummary:
        s = super().finish(seconds)          # the holdout evaluation is collective: all ranks run it
        window = self.window.state_dict()
        mine = {"s": dataclasses.asdict(s), "probs": window["probs"], "labels": window["labels"],
                "touched": self.rows_touched, "clipped": self.rows_clipped, "floor": self.rows_at_floor,
                "exchange": self.store.stats.sent_bytes}
        everyone: list = [None] * self.ctx.world_size
        with collective("gathering the run summaries"):
            dist.all_gather_object(everyone, mine)
        return _combine(s, everyone, self)


def _combine(s: DistributedSummary, everyone: list[dict], run: DistributedRun) -> DistributedSummary:
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
        run = DistributedRun(cfg, resume, ctx)
        if ctx.is_main:
            point_latest(Path(cfg.train.run_dir))
        label = f"train ({ctx.world_size} ranks, rank 0 shown)"
        progress = Progress(label, cfg.train.log_every_s, enabled=show_progress and ctx.is_main)
        every = cfg.train.checkpoint_every_batches
        with StopSignal() as stop, run:
            while True:
                run.in_hand = None if stop.requested else run.next_batch(stop)
                # Agree: steps are collectives, so either every rank steps or none.
                anyone_has, anyone_reading, anyone_stops, rebalanced, handover = agree(
                    [run.in_hand is not None, run.reading, stop.requested,
                     run.checkpoint_wanted or run.publish_due(), run.positions_wanted],
                    while_waiting=run.keep_polling if run.stream is not None else None)
                batch, run.in_hand = run.in_hand, None    # a rebalance meanwhile has filtered it
                if handover:              # a rank got partitions: where did the others leave them?
                    run.exchange_positions()
                if anyone_stops or not (anyone_has or anyone_reading):
                    break                 # (stop) a batch read but not trained is re-read on resume
                if anyone_has:
                    if batch is not None:
                        batch = run.owned(batch)     # a rebalance while we waited?
                    run.step(batch if batch is not None and len(batch) else None)
                    acc = run.window.latest()
                    progress.update(run.summary.records_trained, run.summary.batches, acc.auc, acc.logloss)
                if rebalanced or (anyone_has and every and run.global_step % every == 0):
                    run.checkpoint()
            progress.close()
            run.checkpoint()
        return run.finish(progress.elapsed_s())
    except DistributedError:
        failed = True
        raise
    finally:
        if owner is not None:
            owner.release()
        if not failed:
            shutdown()


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
