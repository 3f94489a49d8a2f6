"""Dead letters: rejected records, each stored once per run, in a JSON-lines file or a topic.

Each line of the dead-letter file is one rejected record::

    {"partition": "file:day_0.gz", "offset": 41, "line": 42,
     "reason": "bad_integer", "raw": "0\\t1\\tx\\t..."}

Schema decoders add a "detail" (e.g. "price = 'abc': expected a number").

`offset` is the record's offset in its partition (for a file, the 0-based
data-line number); `line` is ``offset + 1``, the 1-based data-line number a
person would look up (for a file with a header, the file line is ``line + 1``).
`raw` is the record decoded as UTF-8 with undecodable bytes replaced; a record
that is not valid UTF-8 also gets `raw_b64`, its exact bytes in base64.  A
record longer than `data.dead_letter_max_bytes` keeps only its first bytes
there, with ``"raw_truncated": true``, ``"raw_bytes"`` (the whole record's
length) and ``"raw_sha256"`` (the whole record's hash); `detail` is cut at
`DETAIL_LIMIT_CHARS`.  The whole record stays in its source at its
partition/offset.  Records rejected in a run's second or later pass over a
file carry ``"epoch"`` (the 0-based pass): the file holds each bad line once
per pass.

Exactly once across restarts (`ExactlyOnceDeadLetter`): a resumed run reads
again the records after its checkpoint's positions, and rejects the bad ones
again.  Every checkpoint records a `DeadLetterMark`: where the sink ended
(flushed and fsynced) and which records the sink already held at or past the
checkpoint's positions (read ahead of training).  On resume, those records and
the ones the sink holds past the recorded end (written after the checkpoint,
before the crash) are not written again when they are rejected again.  A run
killed before its first checkpoint is marked at its start
(`DEAD_LETTER_START`).
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from stream_ctr.connectors.batch import Positions, Rejected
from stream_ctr.connectors.kafka.positions import KafkaPositions

log = logging.getLogger("stream_ctr.connectors")
RAW_LIMIT_BYTES = 64 << 10        # of a rejected record kept in its dead-letter entry (the default)
DETAIL_LIMIT_CHARS = 1024         # of its detail (decoders keep theirs short; this is the cap)
# In the run directory, per sink (a rank of a distributed job has its own file): where
# the sink ended when the run started, for a restart of a run killed before its first checkpoint.
DEAD_LETTER_START = "dead_letter_start-{sink}.json"

Entry = tuple[str, int, int]      # a record's identity: (source partition, offset, epoch)


def raw_fields(raw: bytes, limit_bytes: int | None = None) -> dict[str, str]:
    """`raw` as text; a record that is not UTF-8 also as base64 (`raw_b64`), so it can be
    replayed byte for byte (the text shows its bad bytes as U+FFFD).  With `limit_bytes`,
    only the record's first bytes are kept (a UTF-8 character the cut splits is dropped
    from the text; it does not make the record look like one that is not UTF-8)."""
    kept = raw if limit_bytes is None else raw[:limit_bytes]
    try:
        raw.decode("utf-8")
        return {"raw": kept.decode("utf-8", errors="ignore")}
    except UnicodeDecodeError:
        return {"raw": kept.decode("utf-8", errors="replace"), "raw_b64": base64.b64encode(kept).decode()}


def record_fields(r: Rejected, max_raw_bytes: int) -> dict:
    """What every sink stores of a rejected record: reason, detail, the raw record (its
    first `max_raw_bytes` only, with its size and hash, when it is longer).  One oversized
    bad line must not make a dead-letter entry of its size (JSON escaping grows a line up
    to sixfold): a topic refuses such a message, and a file would copy it whole."""
    out: dict = {"reason": r.reason}
    if r.detail:
        out["detail"] = r.detail[:DETAIL_LIMIT_CHARS]
    out.update(raw_fields(r.raw, max_raw_bytes))
    if len(r.raw) > max_raw_bytes:
        out.update(raw_truncated=True, raw_bytes=len(r.raw), raw_sha256=hashlib.sha256(r.raw).hexdigest())
    return out


class DeadLetterFile:
    """Append-only JSON-lines file of rejected records, flushed after every write."""

    def __init__(self, path: str | Path, max_raw_bytes: int = RAW_LIMIT_BYTES) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.name = str(self.path.resolve())
        self.max_raw_bytes = max_raw_bytes
        self._file = open(self.path, "ab")
        self.counts: Counter[str] = Counter()      # reason -> records written by this sink

    def write(self, rejected: list[Rejected], stop=None, epoch: int = 0) -> None:
        """Append the records and flush; counts them by reason.  (`stop`: as the
        dead-letter topic's; a file write does not wait on anyone.)  `epoch`: the pass
        over the file that read them, stored from the second pass on."""
        if not rejected:
            return
        if self._file is None:
            raise ValueError(f"dead-letter file {self.path} is closed")
        lines = [json.dumps({"partition": r.partition, "offset": r.offset, "line": r.offset + 1,
                             **record_fields(r, self.max_raw_bytes), **({"epoch": epoch} if epoch else {})},
                            ensure_ascii=False)
                 for r in rejected]
        # One write: a kill leaves whole lines, or a torn last one that `entries_since` cuts.
        try:
            self._file.write(("\n".join(lines) + "\n").encode("utf-8", errors="replace"))
            self._file.flush()
        except OSError as e:        # a full disk says which file, not just "No space left"
            raise OSError(e.errno, e.strerror, str(self.path)) from None
        self.counts.update(r.reason for r in rejected)

    def position(self) -> dict[str, int]:
        """The file's length once everything written is on disk (flushed and fsynced)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        return {"bytes": os.fstat(self._file.fileno()).st_size}

    def entries_since(self, position: dict[str, int]) -> list[Entry]:
        """The records the file holds past `position` (a `position()` of an earlier run).
        A last line a kill tore (no line feed) is cut off: its record was not stored, and
        the resumed run writes it again."""
        start, out = int(position.get("bytes", 0)), []
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if start > size:            # the file was replaced or cut since: nothing of it is past
                return []
            f.seek(start)
            at = start
            for line in f:
                if not line.endswith(b"\n"):
                    log.warning("dead-letter file %s: cutting its last line, torn by a kill "
                                "(%d bytes at byte %d); that record is written again", self.path, len(line), at)
                    os.truncate(self.path, at)
                    break
                at += len(line)
                try:
                    entry = json.loads(line)
                    out.append((str(entry["partition"]), int(entry["offset"]), int(entry.get("epoch", 0))))
                except (ValueError, KeyError, TypeError):
                    continue            # not one of ours: nothing to skip for it
        return out

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "DeadLetterFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class DeadLetterMark:
    """Where a run's dead-letter sink stood at a checkpoint (or at the run's start): what
    a resumed run needs to dead-letter each record once.  Stored in the checkpoint."""
    sink: str                       # the sink's name: the file's resolved path, or the topic's kafka:// address
    position: dict[str, int]        # its end: file {"bytes": N}; topic {"<partition>": end offset}
    # Records the sink held at or past the checkpoint's positions (read ahead of training):
    # the resumed run reads and rejects them again.
    ahead: list[Entry] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"sink": self.sink, "position": dict(self.position), "ahead": [list(e) for e in self.ahead]}

    @classmethod
    def from_dict(cls, d: dict | None) -> "DeadLetterMark | None":
        """None for a checkpoint without one (written by 0.13 or earlier) or a damaged one."""
        if not isinstance(d, dict):
            return None
        try:
            return cls(str(d["sink"]), {str(k): int(v) for k, v in d["position"].items()},
                       [(str(p), int(o), int(e)) for p, o, e in d.get("ahead", [])])
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


def resume_points(positions: Positions) -> dict[str, int]:
    """Per partition, the first offset whose rejected records a run resumed at `positions`
    (a checkpoint's) reads (and rejects) again.  A Kafka position inside a packed message
    (rows_done > 0) continues that message without its rejects (its source skips them:
    they were read with its first rows), so the point is the message after it.  A
    given-up partition counts where it was left."""
    out = {name: int(offset) for name, offset in positions.items() if name.startswith("file:")}
    for name, (offset, rows_done) in KafkaPositions.from_checkpoint(positions).partitions.items():
        out[name] = offset + 1 if rows_done else offset
    return out


class ExactlyOnceDeadLetter:
    """A dead-letter sink (`DeadLetterFile` or the Kafka dead-letter topic) that stores each
    rejected record once per run across restarts, given the `DeadLetterMark` of the
    checkpoint the run resumed from (see the module doc), and across the re-reads of a
    running process (a rebalance hands a partition back at its trained position: the
    records read after it come again).  The run calls `mark` for each checkpoint, and
    sets `epoch` when a pass over a file starts.

    A record is known by (partition, offset, epoch); the lines of a packed message share
    one, so the sink holds as many entries of it as the message has bad lines: a read
    that rejects more of them than the sink holds writes the rest.

    What survives a crash: every record rejected before a checkpoint is in the sink (the
    mark flushes and fsyncs it); records rejected after it may be, and a resumed run that
    rejects them again finds them there and writes them no second time.
    """

    def __init__(self, sink, resume: DeadLetterMark | None = None, epoch: int = 0) -> None:
        self.sink = sink
        self.path = sink.path
        self.epoch = epoch
        self.counts: Counter[str] = Counter()    # reason -> records rejected by this process
        self.already = 0                         # ... of which the sink held already (a re-read)
        # In the sink, at or past the trained positions: a re-read rejects them again.
        self._held: Counter[Entry] = Counter()
        if resume is not None and resume.sink == sink.name:
            self._held.update(resume.ahead)
            self._held.update(sink.entries_since(resume.position))
        elif resume is not None:
            log.warning("dead letters go to %s, the checkpoint's went to %s: records rejected again "
                        "after the checkpoint are written again", sink.name, resume.sink)

    def write(self, rejected: list[Rejected], stop=None) -> None:
        """Dead-letter the records the sink does not hold yet (`stop`: as the sink's write)."""
        seen: Counter[Entry] = Counter()
        fresh = []
        for r in rejected:
            entry = (r.partition, r.offset, self.epoch)
            seen[entry] += 1
            if seen[entry] > self._held[entry]:
                fresh.append(r)
        self.already += len(rejected) - len(fresh)
        if fresh:       # on DeadLetterUnsent none is held: a resume reads back those that landed
            self.sink.write(fresh, stop, **({"epoch": self.epoch} if self.epoch else {}))
            for entry, n in seen.items():
                self._held[entry] = max(self._held[entry], n)
        self.counts.update(r.reason for r in rejected)

    def mark(self, positions: Positions, epoch: int) -> DeadLetterMark:
        """The mark of a checkpoint at `positions` in pass `epoch`: the sink flushed (and
        fsynced), its end, and the records it holds that a resume from there rejects again.
        Records behind the positions are forgotten: nothing reads them again."""
        position = self.sink.position()
        points = resume_points(positions)

        def behind(e: Entry) -> bool:
            return e[2] < epoch or (e[2] == epoch and e[0] in points and e[1] < points[e[0]])
        self._held = Counter({e: n for e, n in self._held.items() if not behind(e)})
        return DeadLetterMark(self.sink.name, position, sorted(self._held.elements()))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def close(self) -> None:
        self.sink.close()

    def __enter__(self) -> "ExactlyOnceDeadLetter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def dead_letter_start_name(sink: str | Path) -> str:
    """The name of the start-mark file of the sink named `sink` (a file's resolved path,
    or a topic's name), in the run directory."""
    name = str(Path(sink).resolve()) if isinstance(sink, Path) else sink
    return DEAD_LETTER_START.format(sink=hashlib.sha256(name.encode()).hexdigest()[:16])


def start_mark(run_dir: Path, sink) -> DeadLetterMark:
    """The mark of a run's start, for a run without a checkpoint: the one an earlier
    attempt of this run (killed before its first checkpoint) left in `run_dir`, else
    the sink's end now, left there for a later attempt."""
    path = Path(run_dir) / dead_letter_start_name(sink.name)
    try:
        mark = DeadLetterMark.from_dict(json.loads(path.read_text()))
        if mark is not None and mark.sink == sink.name:
            return mark
    except (OSError, ValueError):
        pass
    mark = DeadLetterMark(sink.name, sink.position())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(mark.as_dict(), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return mark


def rejection_note(counts: dict[str, int], top: int = 3) -> str:
    """'missing:site 4,500, bad_json 2' for the most common dead-letter reasons."""
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return ", ".join(f"{reason} {n:,}" for reason, n in ranked)
