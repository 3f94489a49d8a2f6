"""Where a run's batches come from: one protocol, a file or a Kafka topic behind it.

The training loop (loop.py, and a distributed job's, distributed/run.py) sees
only this contract, never the kind of source:

- `events(...)` yields what happens at the source, on the loop's own thread:
  `Ready(batch, upcoming, read_at_s)` when a batch is ready to train,
  `Revoked(partitions, lost)` after a rebalance took partitions away (their
  untrained rows are already dropped), `Idle` after a read that left no batch
  ready (only a caller that must not block, a distributed rank, needs it). The
  iterator ends at the end of a pass (a file), when the stream goes idle for
  `kafka.stop_when_idle_s`, at the record limit, or on a stop signal.
- `trained(batch)` after a batch trained; `snapshot()` the positions after
  everything trained, typed per kind (`FilePosition`: the next data line of the
  file; `KafkaPositions`: per partition the next offset to read and the rows of
  a split packed message already trained, and the partitions given up,
  connectors/kafka/positions.py); a checkpoint stores their `to_checkpoint()`
  dict and `restore` (a resume) takes it back. Nothing else reads or writes
  that dict: the Kafka source, the commit and a job's position exchange take
  the typed positions. `source_record()` is what the checkpoint keeps beside
  them to recognise the source on resume (a file's name and fingerprint; {} for
  a topic), handed back to `restore`.
- `commit()` after a durable checkpoint (Kafka: the group's offsets; a file has
  none); `owned(batch)` drops rows a rebalance took after the batch was handed
  out; `end_pass(completed)` after the iterator ends.

Rebalances reach the loop as `Revoked` events on its own thread. The revoked
partitions' offsets must be committed before the group hands them to their next
owner (who starts at the committed offset), and the model trained from them must
be durable before that. The consumer polls on a thread of its own
(`KafkaSource`); its rebalance listener waits inside that poll while the loop's
thread, back from `read()`, takes the revocation in: the input drops the
partitions' untrained rows from everything it holds and yields `Revoked`; the
loop checkpoints; when it asks for the next event the input acknowledges, the
listener commits and the rebalance goes on. A distributed job's checkpoint is a
collective that cannot wait inside one rank's rebalance: its input acknowledges
as soon as the rows are dropped and the job checkpoints at the next step all
ranks agree on (its manifest, not the group offsets, is what a resume trusts).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from stream_ctr.config import Config, ConfigError
from stream_ctr.connectors.batch import Batch, Positions, Rejected
from stream_ctr.connectors.errors import SourceError
from stream_ctr.connectors.files import (SCHEMA_ENCODINGS, DamagedFile, FilePosition, FileSource, detect_format,
                                        source_file_name, survey_file)
from stream_ctr.connectors.formats import FORMATS
from stream_ctr.connectors.kafka.options import KafkaUrl, default_group_warning, parse_kafka_url
from stream_ctr.connectors.kafka.positions import KafkaPositions, filter_partitions
from stream_ctr.connectors.read_ahead import ReadAhead, decode_threads
from stream_ctr.train.batches import LookAhead, dead_letter_or_stop, micro_batches
from stream_ctr.train.events import IDLE, Event, Idle, Ready, Revoked
from stream_ctr.train.offset_batches import OffsetOrderBatcher, offset_ordered_batches
from stream_ctr.train.streaming import StreamBatcher, declared_schema, new_stream_batcher

if TYPE_CHECKING:     # kafka-python is imported only by runs that read a topic
    from stream_ctr.connectors.kafka.source import KafkaSource, Revocation
    from stream_ctr.telemetry.monitor import RunMonitor
    from stream_ctr.train.batches import StopSignal


def held_out_start(n_total: int, holdout_fraction: float) -> int:
    """The data-line offset where a file's held-out tail starts."""
    return n_total - int(round(n_total * holdout_fraction))


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
            batch = batch.take(np.flatnonzero(mine))       # multi-hot (jagged) fields included
        return batch, [r for r in rejected if r.offset % self.world == self.rank]

    def __getattr__(self, name: str):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __enter__(self) -> "StripedSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.close()


def pin_on_gpu(cfg: Config) -> Callable[[Batch], Batch] | None:
    """For a run on a GPU, what its decoding threads apply to each chunk: a copy into
    pinned memory (`models.scoring.pinned`), which the step copies to the device without
    a copy of its own on the training thread. None on the CPU."""
    from stream_ctr.models.scoring import pinned
    from stream_ctr.train.trainer import resolve_device
    return pinned if resolve_device(cfg.train.device).type == "cuda" else None


def decoded_ahead(source, cfg: Config, processes_per_host: int = 1) -> tuple[object, int]:
    """`source` decoded ahead as `train` reads a file (`data.read_ahead_chunks`; on a GPU
    into pinned memory, on more threads), and its decoding threads; `source` itself and
    0 without read-ahead."""
    d = cfg.data
    if not d.read_ahead_chunks:
        return source, 0
    pin = pin_on_gpu(cfg)
    threads = decode_threads(d.decode_threads, processes_per_host, gpu=pin is not None)
    return ReadAhead(source, d.read_ahead_chunks, threads, finish=pin), threads


def ready_events(items: Iterator[Batch | Idle | Revoked], look_ahead: LookAhead | None) -> Iterator[Event]:
    """`Ready` events of the batches among `items` (other events passed on); with
    `look_ahead`, each batch is handed out once the one after it is read, and names it."""
    for item in items:
        if not isinstance(item, Batch):
            yield item
        elif look_ahead is None:
            yield Ready(item, None, time.time())
        else:
            held = look_ahead.swap(item)        # a rebalance during this read discarded from it
            if held is not None:
                yield Ready(held, item, time.time())
    last = look_ahead.swap(None) if look_ahead is not None else None
    if last is not None:
        yield Ready(last, None, time.time())


class FileInput:
    """A file: `data.epochs` passes over its lines before the held-out tail (the last
    `data.holdout_fraction`), from the resume position; a distributed rank reads its
    stripe. A damaged file (a truncated gzip) is trained up to its damage: the pass
    then stops, unfinished (`at_damage`), and a resume with the repaired file goes on."""

    def __init__(self, cfg: Config, processes_per_host: int = 1, stripe: tuple[int, int] = (0, 1)) -> None:
        self.cfg = cfg
        self.fmt, self.path = detect_format(cfg.data.source, cfg.data.schema)
        # Appending to a file being trained is not supported (`changed_note` says why):
        # its size before it is counted tells a run that it changed under it.
        self.size_at_start = _file_size(self.path)
        # (the fingerprint: what a resume checks the file against, see `restore`)
        self.n_total, self.damage, self.fingerprint = survey_file(self.path, self.fmt)
        self.train_end = held_out_start(self.n_total, cfg.data.holdout_fraction)
        self.key = f"file:{self.path.name}"
        self.processes_per_host, self.stripe = processes_per_host, stripe
        self.source: FileSource | StripedSource | ReadAhead | None = None    # the pass's reader
        self.at_damage = False
        self.another_file = False       # a resume on a file other than the checkpoint's
        self.grew_since = False         # the checkpoint's file holds more data now
        self._line = 0                  # the next line to train in this pass

    # A file needs no polling while a rank waits for its peers, and no positions from them.
    keeps_polling = False
    peers_wanted = False

    def start_warnings(self) -> list[str]:
        """Lines a run prints at its start (a file's empty-file warning is `empty`'s)."""
        return []

    def handover_positions(self) -> None:
        return None

    def give_peer_positions(self, every_rank: list) -> None:
        """A rank's stripe is its own: nothing to take from the others."""

    # -- what the run asks before it starts --------------------------------------------

    @property
    def empty(self) -> bool:
        """The file holds no records (an empty file, an empty gzip, a header alone)."""
        return self.n_total == 0 and self.damage is None

    @property
    def held_out(self) -> tuple[Path, int, int] | None:
        """(file, first line, end) of the held-out tail, or None."""
        return (self.path, self.train_end, self.n_total) if self.train_end < self.n_total else None

    def restore(self, positions: Positions, resume: str | None = None, saved: Config | None = None,
                file_record: dict | None = None) -> None:
        """Start at a checkpoint's positions (`file_record`: the checkpoint's record of its
        file, `FilePosition.file_record`). A file of another name than the checkpoint's is
        another file: the run goes on with it from its first line (`another_file`: its
        passes count from 0). The checkpoint's own file, which the run may already have
        trained up to some line, must still be that file: one replaced under the same
        name (other first bytes), or truncated, is refused (SourceError), as it would
        skip lines never trained; one that grew is the same file. A checkpoint without a
        fingerprint (an older version) is not checked. Then refuse a holdout that would
        now train lines the run held out (`resume`, `saved`: the checkpoint and its
        config, for the messages)."""
        ran_on = (file_record or {}).get("name") or (source_file_name(saved.data.source) if saved else None)
        self.another_file = ran_on is not None and ran_on != self.path.name
        position = FilePosition.from_checkpoint(positions, self.path.name, file_record)
        done = position.line
        why = (position.fingerprint.changed_in(self.path, self.fingerprint)
               if position.fingerprint and self.fingerprint else "")
        if not why and done > self.n_total:
            if self.damage is not None:     # its own error: where the readable lines end, and why
                raise self.damage
            why = (f"it has {self.n_total:,} lines, the run trained it up to line {done:,}: it was "
                   "truncated or changed")
        if why:
            raise self.changed_error(why, done)
        self.grew_since = bool(position.fingerprint and self.fingerprint
                               and self.fingerprint.size > position.fingerprint.size)
        if done > self.train_end:
            raise ConfigError(
                f"--resume {resume}: the run already trained {self.path.name} up to line "
                f"{done:,}, past where data.holdout_fraction = {self.cfg.data.holdout_fraction:g} "
                f"starts the held-out lines ({self.train_end:,}); resume with the run's holdout "
                f"({saved.data.holdout_fraction if saved else 0:g}) or train into a new --run-dir")
        self._line = done

    def changed_error(self, why: str, done: int) -> SourceError:
        """The refusal of a resume on a file that is not the one the checkpoint trained
        under its name: the ways on (a new run, or the file under a name of its own,
        which a resume continues on from its first line)."""
        run_dir = self.cfg.train.run_dir
        prefix = self.cfg.data.source.partition(":")[0]
        spec = f"{prefix}:OTHER_NAME" if prefix.lower() in (*FORMATS, *SCHEMA_ENCODINGS) else "OTHER_NAME"
        trained = f"lines 0-{done - 1:,} of another file" if done else "another file of that name"
        return SourceError(
            f"{self.path} changed since the checkpoint ({why}): the run trained {trained}; train "
            f"it with a new --run-dir, or give it another name to continue the run on it from its "
            f"first line (`stream-ctr train {spec} --resume {run_dir}`, see docs/training.md)")

    def wants_more(self, epoch: int) -> bool:
        return epoch < self.cfg.data.epochs and not self.at_damage and not self.empty

    def records_left(self, epoch: int) -> int | None:
        """Records (lines: a few may not decode) still to train in this and later passes."""
        rank, world = self.stripe
        if epoch >= self.cfg.data.epochs:
            return 0
        lines = max(self.train_end - self._line, 0) + max(self.cfg.data.epochs - epoch - 1, 0) * self.train_end
        return lines // world

    # -- a pass -------------------------------------------------------------------------

    def events(self, limit_records: int, stop: "StopSignal", dead_letter, monitor: "RunMonitor",
               look_ahead: bool) -> Iterator[Event]:
        """One pass from the resume position; closes its reader when it ends or is closed."""
        d = self.cfg.data
        chunk = d.chunk_records
        if d.read_ahead_chunks and pin_on_gpu(self.cfg) is not None:
            # whole batches a chunk: a batch is a slice of one pinned chunk
            chunk = -(-max(chunk, d.batch_size) // d.batch_size) * d.batch_size
        source = FileSource(self.path, self.fmt, start_offset=self._line, chunk_records=chunk,
                            stop_offset=self.train_end)
        rank, world = self.stripe
        if world > 1:
            source = StripedSource(source, rank, world)
        source, _ = decoded_ahead(source, self.cfg, self.processes_per_host)
        self.source = source
        try:
            batches = micro_batches(source, d.batch_size, dead_letter, limit_records, monitor)
            yield from ready_events(batches, LookAhead() if look_ahead else None)
        finally:
            source.close()

    def owned(self, batch: Batch) -> Batch:
        return batch

    def trained(self, batch: Batch) -> None:
        self._line = batch.positions_after().get(self.key, self._line)

    def snapshot(self) -> FilePosition:
        return FilePosition(self.path.name, self._line, self.fingerprint)

    def source_record(self) -> dict:
        """What a checkpoint keeps beside the positions: the file's name and fingerprint."""
        return self.snapshot().file_record()

    def commit(self) -> None:
        """A file keeps no offsets but the checkpoint's."""

    def where(self) -> str:
        """Where the next batch starts, for a person."""
        return f"line {self._line:,} of {self.path.name}"

    def end_pass(self, completed: bool, limit_reached: bool) -> bool:
        """After `events` ended; `completed`: its batches ran out (all trained), not a stop.
        True when the pass over the file is finished (the next starts at its first line)."""
        if not completed or limit_reached:
            return False
        if self.damage is not None:
            self.at_damage = True       # not the file's end: a resume with the repaired file goes on
            return False
        self._line = 0
        return True

    def finished(self, epoch: int) -> str:
        """Why a resumed run has nothing left to train ("" when it has): it did its
        `data.epochs` passes over the file (a checkpoint at the end of a run)."""
        if epoch < self.cfg.data.epochs or self.at_damage or self.empty:
            return ""
        passes = f"{epoch} pass{'es' if epoch != 1 else ''}"
        grew = (" (it grew since the checkpoint: lines appended to a file after its passes are not "
                "trained, see docs/training.md)" if self.grew_since else "")
        return (f"the run finished its {passes} over {self.path.name}{grew}: nothing left to train; raise "
                f"--epochs (data.epochs = {self.cfg.data.epochs}) to train more passes, or name another "
                "file to continue the run on it")

    def changed_note(self) -> str:
        """A warning when the file's size changed while this run trained it ("" if not).

        Appending to a file being trained is not supported: a run's passes end at the
        lines it counted when it started (they also place the holdout), so lines
        appended later are not trained by it, and a last line still being written when
        the reader reached it (no newline yet) is read as it was then: a record cut
        short, dead-lettered, its completion never trained. Whether a last line without
        a newline is finished cannot be told from the file (many files simply end so),
        so nothing is held back: the run says what happened instead."""
        now = _file_size(self.path)
        if now is None or self.size_at_start is None or now == self.size_at_start:
            return ""
        how = "grew" if now > self.size_at_start else "changed size"
        return (f"stream-ctr: warning: {self.path} {how} while this run trained it ({self.size_at_start:,} "
                f"-> {now:,} bytes): the run trained the {self.n_total:,} lines it counted at its start, "
                "and a last line being written then may have been dead-lettered incomplete; appending "
                "to a file being trained is not supported: feed a growing log through a Kafka topic "
                "(docs/kafka.md), or train each file once it is complete (docs/training.md)")

    def lag(self, epoch: int) -> dict[str, int]:
        """Records of the training range not yet trained."""
        if epoch >= self.cfg.data.epochs:
            return {self.key: 0}
        return {self.key: max(self.train_end - self._line, 0)}

    def damaged(self, checkpoint: str) -> DamagedFile:
        """The error that ends a run whose pass stopped at the damage of its file, after
        its checkpoint: what was trained, and how a resume goes on."""
        d, held = self.damage, self.n_total - self.train_end
        done = (f"were read: the first {self.train_end:,} trained, the last {held:,} held out and scored"
                if held else "were trained")
        then = (f"re-copy it, then `stream-ctr train --resume {self.cfg.train.run_dir}` goes on from line "
                f"{self._line:,} (checkpoint {checkpoint})")
        return DamagedFile(d.path, d.lines, d.cause, d.cut_bytes, done, then)

    def close(self) -> dict:
        if self.source is not None:
            self.source.close()
        return {}


def _file_size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


class KafkaInput:
    """A Kafka topic: one long pass that ends when the stream stays idle for
    `kafka.stop_when_idle_s` (or at the limit, or on a stop). Batches are cut by fetch
    order with a latency budget, or by offsets alone (`kafka.deterministic_batches`).
    The consumer joins the group on the first `events` call and leaves it on `close`."""

    held_out = None
    empty = False
    at_damage = False

    def __init__(self, cfg: Config, url: KafkaUrl, trained_records: Callable[[], int],
                 checkpoints_revocations: bool, wait_for_peers: bool = False) -> None:
        """`checkpoints_revocations`: the loop checkpoints when a `Revoked` event reaches
        it, and the revoked partitions' offsets are committed once it asks for the next
        event (a single process).  False: they are committed as soon as their rows are
        dropped, and the caller checkpoints later (a job, at the next step its ranks
        agree on; its manifest, not the group offsets, is what a resume trusts)."""
        self.cfg, self.url = cfg, url
        self.fmt = declared_schema(cfg) or url.options.record_format
        self.batcher: StreamBatcher | OffsetOrderBatcher = new_stream_batcher(cfg, url, trained_records)
        self.checkpoints_revocations, self.wait_for_peers = checkpoints_revocations, wait_for_peers
        self.source: KafkaSource | None = None
        self.ended = False
        self._positions = KafkaPositions({})
        self._ready: list[Batch] = []           # full batches cut, not yet handed out
        self._look_ahead: LookAhead | None = None
        self._revoked: list[Revoked] = []       # events for the loop
        self._taken: "Revocation | None" = None  # the source's revocation last taken in
        self._gone_since_handout: set[str] = set()
        self._last_ready = time.monotonic()     # when a batch was last handed out
        self._said_waiting = False
        self._next_join_note = 0.0              # a wait for the group's assignment: said again then
        self._switch = ""                       # a resume's other topic or group, for a person

    another_file = False

    def restore(self, positions: Positions, resume: str | None = None, saved: Config | None = None,
                file_record: dict | None = None) -> None:
        """Start at a checkpoint's positions.  A resume may name another topic or group
        than the checkpoint's (as a file run may name another file): accepted, and said
        in the resumed run's start line (`where`)."""
        self._positions = KafkaPositions.from_checkpoint(positions)
        self._switch = switched_source(saved, self.url) if saved is not None else ""

    def start_warnings(self) -> list[str]:
        """Lines a run prints at its start, whatever its verbosity: the default group."""
        warning = default_group_warning(self.url)
        return [warning] if warning else []

    def source_record(self) -> dict:
        """A topic's positions say it all."""
        return {}

    # A rank waiting for its peers keeps polling (`poll_while_waiting`): a group rebalance
    # completes only when every member polls.
    keeps_polling = True

    @property
    def peers_wanted(self) -> bool:
        """This rank's consumer holds new partitions until the ranks exchange positions."""
        return self.source is not None and self.source.peers_wanted

    def handover_positions(self) -> KafkaPositions:
        """Where this rank left the partitions it gave up in this run."""
        return self.source.handover_positions() if self.source is not None else KafkaPositions({})

    def give_peer_positions(self, every_rank: list[KafkaPositions]) -> None:
        """Every rank's hand-over positions: newly assigned partitions start no earlier
        than where any rank left them (connectors/kafka/source.py, "Ranks of a
        distributed job")."""
        if self.source is not None:
            self.source.give_peer_positions(every_rank)

    def wants_more(self, epoch: int) -> bool:
        return not self.ended

    def records_left(self, epoch: int) -> int | None:
        """Unknown: a stream has no end."""
        return None

    def finished(self, epoch: int) -> str:
        """A stream is never finished."""
        return ""

    def changed_note(self) -> str:
        """A topic grows by design."""
        return ""

    def open(self) -> "KafkaSource":
        """The consumer (joining the group at the restored positions), opened once."""
        if self.source is None:
            from stream_ctr.connectors.kafka.source import KafkaSource
            self.source = KafkaSource(self.url, positions=self._positions, hold_revocations=True,
                                      chunk_records=self.cfg.data.chunk_records,
                                      wait_for_peers=self.wait_for_peers, schema=declared_schema(self.cfg))
        return self.source

    def _read(self, max_records: int | None = None) -> tuple[Batch, list[Rejected]]:
        """`source.read`, then the revocation it may have taken, before anything else
        sees the rows."""
        chunk, rejected = self.source.read(max_records)
        revocation = self.source.revocation
        if revocation is not None and revocation is not self._taken:    # (read again before its ack)
            self._taken = revocation
            self._take_revocation(revocation)
        return chunk, rejected

    def _take_revocation(self, revocation: "Revocation") -> None:
        """A rebalance took `revocation.partitions` (the group waits): drop their
        untrained rows from everything that holds them (the next owner reads them; if
        that is this member again, it continues at the trained position and reads them
        again) and queue the `Revoked` event for the loop."""
        partitions = list(revocation.partitions)
        gone = set(partitions)
        self.batcher.discard(partitions)
        self._ready = [b for b in (filter_partitions(b, gone) for b in self._ready) if len(b)]
        if self._look_ahead is not None:
            self._look_ahead.discard(partitions)
        self._gone_since_handout |= gone
        self._revoked.append(Revoked(revocation.partitions, revocation.lost))
        if not self.checkpoints_revocations and self.source is not None:
            self.source.acknowledge(durable=True)

    # -- the stream ---------------------------------------------------------------------

    def events(self, limit_records: int, stop: "StopSignal", dead_letter, monitor: "RunMonitor | None",
               look_ahead: bool) -> Iterator[Event]:
        """The stream's events until it goes idle, the limit or a stop (see the module)."""
        source = self.open()
        if isinstance(self.batcher, OffsetOrderBatcher):
            batches = offset_ordered_batches(source, self._read, self.batcher, dead_letter, limit_records,
                                             self.cfg.data.max_batch_delay_s, stop, monitor)
        else:
            batches = self._fetch_order_batches(dead_letter, limit_records, stop, monitor)
        self._look_ahead = LookAhead() if look_ahead else None
        for event in ready_events(self._with_revocations(batches), self._look_ahead):
            if isinstance(event, Ready):
                self._gone_since_handout = set()
                self._note_ready()
            elif isinstance(event, Idle):
                self._note_waiting()
            yield event

    # A run that idles says so once per quiet spell, after this long without a batch; one
    # waiting for the group to assign it partitions says so every this long.
    WAITING_NOTE_S = 30.0

    def _note_waiting(self) -> None:
        now = time.monotonic()
        joining = self.source.unassigned_s
        if joining is not None:
            # Records may well be in the topic: the group has not handed this member its
            # partitions yet (a join or rebalance), and the idle end does not count this.
            if joining >= self.WAITING_NOTE_S and now >= self._next_join_note:
                self._next_join_note = now + self.WAITING_NOTE_S
                o = self.url.options
                print(f"stream-ctr: waiting for group {o.group!r} to assign partitions of "
                      f"{', '.join(self.url.topics)} ({joining:.0f} s so far): a join or rebalance, "
                      f"which a member that did not leave the group (a killed trainer) holds up until "
                      f"kafka.session_timeout_ms = {o.session_timeout_ms / 1000:g} s drops it; "
                      f"kafka.stop_when_idle_s does not count this wait", file=sys.stderr, flush=True)
            return
        self._next_join_note = 0.0
        quiet = now - self._last_ready
        if self._said_waiting or quiet < self.WAITING_NOTE_S:
            return
        self._said_waiting = True
        idle = self.url.options.stop_when_idle_s
        ends = (f"the run ends after kafka.stop_when_idle_s = {idle:g} s without records" if idle else
                "it waits until records arrive (kafka.stop_when_idle_s = 0: never ends on its own)")
        print(f"stream-ctr: waiting for records from {', '.join(self.url.topics)}: no batch for {quiet:.0f} s "
              f"({self.batcher.pending_rows:,} rows pending of a {self.cfg.data.batch_size:,}-row batch); "
              f"{ends}", file=sys.stderr, flush=True)

    def _note_ready(self) -> None:
        if self._said_waiting and not self.source.exhausted:     # (not the idle end's last batch)
            print(f"stream-ctr: records again after {time.monotonic() - self._last_ready:.0f} s",
                  file=sys.stderr, flush=True)
        self._said_waiting = False
        self._last_ready = time.monotonic()

    def _with_revocations(self, batches: Iterator[Batch | Idle]) -> Iterator[Batch | Idle | Revoked]:
        for item in batches:
            yield from self._revocations()
            yield item
        yield from self._revocations()

    def _revocations(self) -> Iterator[Revoked]:
        """The queued `Revoked` events.  The loop handles each (a checkpoint) before it
        asks for the next event; only then are the partitions' offsets committed (a
        loop that stops there instead commits none: no checkpoint holds them)."""
        while self._revoked:
            event = self._revoked.pop(0)
            handled = False
            try:
                yield event
                handled = True
            finally:
                if self.checkpoints_revocations and self.source is not None:
                    self.source.acknowledge(durable=handled)

    def _fetch_order_batches(self, dead_letter, limit_records: int, stop: "StopSignal",
                             monitor: "RunMonitor") -> Iterator[Batch | Idle]:
        """Micro-batches by fetch order; at most `limit_records` rows when it is >= 0. A
        partial batch trains once its oldest row waited `data.max_batch_delay_s`, at the
        limit, and when the stream goes idle; a stop leaves pending rows untrained (no
        checkpoint covers them: a restart reads them again)."""
        batcher, source, max_delay_s = self.batcher, self.source, self.cfg.data.max_batch_delay_s
        emitted = 0
        while not source.exhausted and not stop.requested:
            if not self._ready:
                t0 = time.perf_counter()
                # Just what the next batch needs: the source is polled once per batch
                # (heartbeats, rebalances) and keeps the rest of a fetch buffered.
                chunk, rejected = self._read(max(1, batcher.batch_size - batcher.pending_rows))
                if monitor is not None:
                    monitor.on_read(chunk, rejected, time.perf_counter() - t0)
                if not dead_letter_or_stop(dead_letter, rejected, stop):
                    return
                source.rejects_written()
                self._ready += batcher.add(chunk)
                pending = batcher.pending_rows
                if pending and (
                        # every row up to the limit is here: the last batch of the run is partial
                        0 <= limit_records <= emitted + sum(map(len, self._ready)) + pending
                        # the latency budget is spent: train what is there
                        or (not self._ready and batcher.oldest_wait_s() >= max_delay_s)):
                    self._ready.append(batcher.flush())
            if not self._ready:
                yield IDLE
            while self._ready:
                batch = self._ready.pop(0)
                if 0 <= limit_records <= emitted + len(batch):
                    yield batch.slice(0, limit_records - emitted)
                    return
                emitted += len(batch)
                yield batch
        if stop.requested:
            return
        rest = batcher.flush()                      # the stream went idle: train the tail
        if rest is not None:
            yield rest.slice(0, limit_records - emitted) if limit_records >= 0 else rest

    def poll_while_waiting(self, monitor: "RunMonitor", dead_letter) -> None:
        """One read while the caller waits (a rank for its peers: a group rebalance needs
        every member to poll); what it reads waits for `events`, up to
        `kafka.max_buffered_records` rows."""
        if self.source is None or self.source.exhausted:
            time.sleep(0.001)
            return
        if sum(map(len, self._ready)) + self.batcher.pending_rows >= self.source.options.max_buffered_records:
            time.sleep(0.01)
            return
        t0 = time.perf_counter()
        chunk, rejected = self._read()
        monitor.on_read(chunk, rejected, time.perf_counter() - t0)
        dead_letter.write(rejected)
        self.source.rejects_written()
        ready = self.batcher.add(chunk)
        self._ready += ready or []          # the offset-ordered batcher keeps its rows queued

    def owned(self, batch: Batch) -> Batch:
        """`batch` without rows of partitions a rebalance took since it was handed out (even
        if they came straight back: they are read again from the trained position)."""
        if self._gone_since_handout:
            batch = filter_partitions(batch, self._gone_since_handout)
        return self.source.owned_rows(batch) if self.source is not None else batch

    def trained(self, batch: Batch) -> None:
        # Packed messages may straddle batches: the source folds the trained rows.
        self.source.trained(batch)

    def snapshot(self) -> KafkaPositions:
        if self.source is None:
            return self._positions
        return self.source.trained_positions

    def commit(self) -> None:
        if self.source is not None:
            self.source.commit(self.snapshot())

    def where(self) -> str:
        """Where the next batch starts, for a person: the first partitions' offsets (and,
        on a resume that names another topic or group, which ones this run reads)."""
        return self.snapshot().describe() + (f"; {self._switch}" if self._switch else "")

    def end_pass(self, completed: bool, limit_reached: bool) -> bool:
        """A stream is never finished: it ends (idle), it never starts over."""
        self.ended = self.source is not None and self.source.exhausted
        return False

    def lag(self, epoch: int) -> dict[str, int]:
        return self.source.lag() if self.source is not None else {}

    def close(self) -> dict:
        """Leave the group (commits happen after checkpoints only); the source's stats."""
        if self.source is None:
            return {}
        stats = self.source.stats.as_dict()
        self.source.close()
        return stats


def switched_source(saved: Config, url: KafkaUrl) -> str:
    """What a person must know when a resume reads another topic or group than its
    checkpoint ("" when it reads the same).  Like a file run naming another file, it
    is allowed: a topic the checkpoint read goes on from the checkpoint's offsets
    (committed to this run's group from now on), any other topic from this run's
    group's committed offsets, else kafka.start; the checkpoint's offsets of a topic
    this run does not read are not used."""
    try:
        before = parse_kafka_url(saved.data.source, saved.kafka)
    except SourceError:                 # not a Kafka run (or a URL this version refuses)
        return ""
    old_topics, new_topics = set(before.topics), set(url.topics)
    old_group, new_group = before.options.group, url.options.group
    if old_topics == new_topics and old_group == new_group:
        return ""

    def named(topics: set[str]) -> str:
        return ("topic " if len(topics) == 1 else "topics ") + ", ".join(sorted(topics))
    said = [f"the checkpoint read {named(old_topics)} (group {old_group!r}); this run reads "
            f"{named(new_topics)} (group {new_group!r})"]
    if old_topics & new_topics:
        said.append(f"{named(old_topics & new_topics)} from the checkpoint's offsets")
    if new_topics - old_topics:
        said.append(f"{named(new_topics - old_topics)} from the committed offsets of group {new_group!r} "
                    f"(else kafka.start = {url.options.start})")
    if old_topics - new_topics:
        said.append(f"the checkpoint's offsets of {named(old_topics - new_topics)} are not used")
    return ": ".join(said[:2]) + "".join(f", {part}" for part in said[2:])
