"""`stream-ctr train --publish DIR`: the trainer's side of a publish directory (published.py).

After each durable checkpoint the run calls `Publisher.publish` with the
checkpoint's tensors, and a new version appears in DIR:

* the **first publish of every invocation is a full snapshot** (export.py, the
  table streamed in chunks; a tiered store's LMDB read through the trainer's own
  environment). A resumed run publishes one at once, of the checkpoint it resumed
  from, above every version there: a version built on state that the crash rolled
  back (trained after the checkpoint) was never published, and whatever a follower
  serves is replaced by the resumed model before it trains a batch;
* every later one is a **delta**: the rows of every key the run trained on since
  the previous version (values read with `store.peek`, no Adam moments) and the
  dense weights the bundle serves (the averaged ones), on the previous version.

What survives a crash: every published version is the model of a checkpoint
whose LATEST had moved before the version was written, so no published version
is ever rolled back. A crash while publishing leaves a directory PUBLISHED.json
does not name; the next publisher deletes it.

Freshness: `stamp` wraps the run's batch iterator and notes the wall time each
batch is handed to the trainer -- right after its newest record was read (with
a tiered store's look-ahead, before the batch ahead of it is read). Each
version carries the newest such time, and the newest event time, of the records
it trained on that its base did not.

With `--publish kafka://HOST:PORT/TOPIC` the versions are written into
RUN_DIR/published as above and then sent to the topic (kafka_publish.py).

A distributed job (store.kind = memory) publishes from rank 0 after each job
checkpoint's manifest is durable: every version is a **full snapshot**, the
ranks' shards read back from the job checkpoint as one table (`full_only`;
deltas would need every rank's touched rows on rank 0). The other ranks wait at
their next collective meanwhile (at most distributed.timeout_s), so a large table
wants a long `serving.publish_every_s`. A version's freshness stamps are the newest of
every rank's (each rank stamps a batch when it has read it), gathered at the checkpoint.

Costs: each step's unique keys (the trainer's working set, no second unique) kept
until the next publish (the touched set, compacted when it grows), and a checkpoint + a write of the
touched rows per publish. One publisher per directory (an flock).
"""
from __future__ import annotations

import fcntl
import os
import shutil
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Iterator

import torch

from stream_ctr.config import Config, ConfigError
from stream_ctr.connectors.batch import Batch
from stream_ctr.connectors.formats import RecordFormat
from stream_ctr.connectors.schema import Schema
from stream_ctr.serving.bundle import BundleError, BundleWriter
from stream_ctr.serving.kafka_publish import KafkaSink, is_kafka_target
from stream_ctr.serving.export import CHUNK_ROWS, bundle_manifest, dense_weights, export_bundle
from stream_ctr.serving.published import (PublishInfo, PublishedIndex, read_index, version_dir,
                                          version_dirs, write_index)
from stream_ctr.store.embedding import EmbeddingStore
from stream_ctr.store.errors import StoreError
from stream_ctr.store.layout import RowLayout

COMPACT_KEYS = 1 << 22          # touched keys held uncompacted before one torch.unique of them all


class Publisher:
    """Publishes a run's model into `root` (a directory) after its checkpoints."""

    def __init__(self, root: str | Path, cfg: Config, fmt: RecordFormat | Schema,
                 sink: "KafkaSink | None" = None, full_only: bool = False) -> None:
        """`sink`: also send every version to a Kafka topic (kafka_publish.py); `full_only`:
        every version a full snapshot (a distributed job's), published only when the
        checkpoint's records_trained moved."""
        self.root, self.sink, self.full_only = Path(root), sink, full_only
        self._published_records: int | None = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.root / ".publisher.lock", "w")
        except OSError as e:
            raise ConfigError(f"--publish {root}: cannot use it as the publish directory: "
                              f"{e.strerror or e}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise ConfigError(f"--publish {root}: another trainer is publishing into it "
                              "(one publisher per directory)") from None
        self.index = read_index(self.root)
        for leftover in self.root.glob(".tmp-v-*"):      # a crash while writing a version
            shutil.rmtree(leftover, ignore_errors=True)
        self.cfg, self.fmt = cfg, fmt
        self.every_s, self.full_every = cfg.serving.publish_every_s, cfg.serving.full_every
        self._base: int | None = None       # the version this process published last
        self._deltas_since_full = 0
        self._touched: list[torch.Tensor] = []
        self._touched_count = 0
        self._arrivals: deque[float] = deque()
        self._newest_arrival_s: float | None = None
        self._newest_event_ms: int | None = None
        self._last_publish = time.monotonic()

    # ---- while training ------------------------------------------------------------
    def stamp(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        """`batches`, noting when each was handed on: its newest record's arrival (about)."""
        self._arrivals.clear()              # a new pass: nothing stamped is pending
        for batch in batches:
            self._arrivals.append(time.time())
            yield batch

    def arrival(self) -> float:
        """The stamp of the next batch the loop takes (call once per batch, in order)."""
        return self._arrivals.popleft() if self._arrivals else time.time()

    def trained(self, batch: Batch, keys: torch.Tensor | None, arrived_s: float) -> None:
        """`batch` (stamped `arrived_s`) was trained, updating the rows of `keys` (the step's
        unique keys, `StepResult.keys`; None for a skipped step): they go in the next delta."""
        if keys is None:
            keys = torch.zeros(0, dtype=torch.int64)
        keys = keys.cpu()
        self._touched.append(keys)
        self._touched_count += keys.numel()
        if self._touched_count > COMPACT_KEYS and len(self._touched) > 1:
            self._touched = [torch.unique(torch.cat(self._touched))]
            self._touched_count = self._touched[0].numel()
        self.note_newest(arrived_s, int(batch.event_time_ms.max()) if len(batch) else None)

    def note_newest(self, arrived_s: float | None, event_ms: int | None) -> None:
        """Records that arrived at `arrived_s` (wall time) with event times up to `event_ms`
        (< 0: none) were trained: the next version carries the newest stamps. A distributed
        job's rank 0 calls it with every rank's stamps, gathered at the job checkpoint."""
        if arrived_s is not None:
            self._newest_arrival_s = max(self._newest_arrival_s or 0.0, arrived_s)
        if event_ms is not None and event_ms >= 0:
            self._newest_event_ms = max(self._newest_event_ms or 0, event_ms)

    def due(self) -> bool:
        """Whether publish_every_s has passed since the last publish (checkpoint now)."""
        return bool(self.every_s) and time.monotonic() - self._last_publish >= self.every_s

    # ---- at a checkpoint -----------------------------------------------------------
    def publish(self, tensors: dict[str, Any], checkpoint: dict[str, Any], precision: str,
                store: EmbeddingStore | None) -> PublishInfo | None:
        """Publish the model of the durable checkpoint `checkpoint` (`export.checkpoint_record`)
        whose tensors are `tensors` and whose rows `store` holds right now (None with
        `full_only`: the tensors hold every row). None when nothing was trained since the
        last version, or when writing failed (said on stderr; training goes on, and the
        next publish carries these rows too)."""
        self._last_publish = time.monotonic()
        trained = (checkpoint["records_trained"] != self._published_records if self.full_only
                   else bool(self._touched))
        if self._base is not None and not trained:
            return None
        try:
            info = self._write(tensors, checkpoint, precision, store)
        except (OSError, BundleError, StoreError) as e:
            print(f"stream-ctr: warning: publishing into {self.root} failed ({e}); training goes "
                  "on, the next checkpoint publishes again", file=sys.stderr, flush=True)
            return None
        self._touched, self._touched_count = [], 0
        self._newest_arrival_s = self._newest_event_ms = None
        self._published_records = checkpoint["records_trained"]
        if self.sink is not None:
            try:
                self.sink.send(self.root, self.index)
            except OSError as e:
                print(f"stream-ctr: warning: {e}; training goes on, the next publish sends what the "
                      "topic lacks", file=sys.stderr, flush=True)
        return info

    def _write(self, tensors: dict[str, Any], checkpoint: dict[str, Any], precision: str,
               store: EmbeddingStore | None) -> PublishInfo:
        version = 1 + max([self.index.latest if self.index else 0, *version_dirs(self.root)])
        full = (self.full_only or self._base is None
                or (self.full_every and self._deltas_since_full + 1 >= self.full_every))
        info = PublishInfo(version, "full" if full else "delta", None if full else self._base, time.time(),
                           self._newest_arrival_s, self._newest_event_ms)
        out = version_dir(self.root, version)
        if full:
            tier = getattr(store, "disk", None)         # a tiered store's LMDB, open in this process
            export_bundle(tensors, self.cfg.to_dict(), out, self.fmt, checkpoint, precision,
                          extra={"publish": info.as_dict()}, tier=tier)
            index = PublishedIndex(version, version, [])
        else:
            self._write_delta(out, tensors, checkpoint, precision, store, info)
            index = PublishedIndex(version, self.index.full, [*self.index.chain, version])
        write_index(self.root, index)
        previous, self.index, self._base = self.index, index, version
        self._deltas_since_full = 0 if full else self._deltas_since_full + 1
        self._prune(previous)
        return info

    def _write_delta(self, out: Path, tensors: dict[str, Any], checkpoint: dict[str, Any], precision: str,
                     store: EmbeddingStore, info: PublishInfo) -> None:
        keys = torch.unique(torch.cat(self._touched))           # sorted
        writer = BundleWriter(out, RowLayout(self.cfg.model.embed_dim).cols)
        try:
            for lo in range(0, keys.numel(), CHUNK_ROWS):
                chunk = keys[lo:lo + CHUNK_ROWS]
                rows = store.peek(chunk.to(store.device))       # the checkpoint's values: no step since
                writer.add(chunk.numpy(), rows.detach().cpu().numpy())
            kind = tensors["trainer"]["store"].get("kind", "memory")
            manifest = {**bundle_manifest(self.cfg, self.fmt, checkpoint, precision, kind),
                        "publish": info.as_dict()}
            writer.finish(dense_weights(tensors), manifest)
        except BaseException:
            writer.abort()
            raise

    def _prune(self, previous: PublishedIndex | None) -> None:
        """Delete versions a follower no longer needs: all but the current chain and, after a
        new full snapshot, the chain before it (a follower may be reading it right now)."""
        keep = set(self.index.versions())
        if previous is not None and self.index.full != previous.full:
            keep |= set(previous.versions())
        for version, path in version_dirs(self.root).items():
            if version not in keep:
                shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
        self._lock.close()              # releases the flock


def open_publisher(cfg: Config, fmt: RecordFormat | Schema) -> Publisher | None:
    """The run's publisher when serving.publish names a directory, else None."""
    if not cfg.serving.publish:
        return None
    job = int(os.environ.get("WORLD_SIZE", "1")) > 1      # a rank of a torchrun job
    if job:
        if cfg.store.kind != "memory":
            raise ConfigError("--publish (serving.publish) in a distributed job needs store.kind = "
                              "memory: rank 0 publishes the job checkpoint's shards as one table, and "
                              "a tiered store's rows stay in each rank's own LMDB")
        if int(os.environ.get("RANK", "0")) != 0:       # rank 0 publishes the whole job
            return None
    if is_kafka_target(cfg.serving.publish):            # staged in the run directory, then sent
        sink = KafkaSink(cfg.serving.publish)
        return Publisher(Path(cfg.train.run_dir) / "published", cfg, fmt, sink, full_only=job)
    return Publisher(cfg.serving.publish, cfg, fmt, full_only=job)


__all__ = ["Publisher", "open_publisher"]
