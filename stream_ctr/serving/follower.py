"""`stream-ctr serve --follow DIR`: keep a server on the newest version a trainer publishes.

A thread polls DIR/PUBLISHED.json (published.py) every `poll_s`. When it names a
newer version than the one answering:

* if the version answering is on the index's chain, the deltas after it are
  read and applied in order -- each must name the version before it as its base;
* otherwise (the server started from an exported bundle, a delta's base does
  not match, a version was pruned or is corrupt, or the trainer published a new
  full snapshot -- a resumed run does) the full snapshot is read and its chain
  applied.

The new model is built beside the one answering (a `RowTable` over the same
memory-mapped base, plus the rows the deltas replaced), then swapped in under
the predictor's brief lock: requests never wait for an update, and every answer
names the version that scored it. A poll that fails keeps the model answering,
counts a failure, says why on stderr (once, until it changes) and tries again at
the next poll; a PUBLISHED.json read once and gone later is such a failure.
"""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from stream_ctr.serving.bundle import BundleError, read_bundle
from stream_ctr.serving.metrics import FollowMetrics
from stream_ctr.serving.predictor import Predictor
from stream_ctr.serving.published import INDEX, PublishInfo, PublishedIndex, read_index, version_dir
from stream_ctr.serving.scorer import Scorer
from stream_ctr.serving.table import RowTable


class StaleBase(BundleError):
    """A delta does not apply on the version answering: reload the full snapshot."""


@dataclass(frozen=True)
class Applied:
    """One update a follower swapped in (kept for tests and `bench serve`)."""
    version: int
    kind: str                       # full (a snapshot and its chain) | delta
    apply_s: float                  # read + build, up to the swap
    swapped_s: float                # wall time of the swap
    freshness_s: float | None       # swapped_s minus the newest record's arrival at the trainer


class Follower:
    """Applies what a trainer publishes into `root` to `predictor`'s model."""

    def __init__(self, root: str | Path, predictor: Predictor, device: str = "cpu",
                 precision: str | None = None, poll_s: float = 0.5) -> None:
        self.root, self.predictor = Path(root), predictor
        self.device, self.precision, self.poll_s = device, precision, poll_s
        self.metrics = FollowMetrics(predictor.metrics.registry)
        self.applied: list[Applied] = []
        self.last_error = ""
        self._seen_index = False            # a PUBLISHED.json read: one gone later is said
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stream-ctr-follow", daemon=True)

    @property
    def version(self) -> int | None:
        """The published version answering now (None: a bundle from `stream-ctr export`)."""
        return self.predictor.model().published_version

    def start(self) -> "Follower":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.poll_s)

    def poll(self) -> bool:
        """Apply what is new, if anything; whether the model changed."""
        t0 = time.perf_counter()
        try:
            index = read_index(self.root)
            if index is None and self._seen_index:
                raise BundleError(f"{self.root / INDEX} is gone (the publish directory removed or "
                                  f"moved?): the model answering stays until a trainer's --publish "
                                  f"{self.root} publishes again")
            if index is None:               # nothing published yet (serving a bundle meanwhile)
                return False
            self._seen_index = True
            if index.latest == self.version:
                self.last_error = self.predictor.follow_error = ""   # a problem said before is over
                return False
            kind, scorer = self._build(index)
            apply_s = time.perf_counter() - t0
            self.predictor.swap(scorer)     # ValueError: a model of other records
        # Retried at the next poll. Any other error too: raised, it ended the follower's thread
        # and the server answered with this version for ever, saying so only once.
        except Exception as e:                               # noqa: BLE001
            reason = str(e) if isinstance(e, (BundleError, OSError, ValueError)) else f"{type(e).__name__}: {e}"
            if isinstance(e, BundleError) and ": re-export" in reason:
                # A bundle's remedy; a published version is replaced by the trainer instead.
                reason = (reason.split(": re-export")[0] + ": the trainer's next full snapshot "
                          "(serving.full_every publishes) replaces it")
            self.metrics.failures.inc()
            if reason != self.last_error:                    # say it once, not every poll
                print(f"stream-ctr serve: warning: cannot apply {self.root}: {reason}; still serving "
                      f"{self.predictor.model().version}", file=sys.stderr, flush=True)
            self.last_error = self.predictor.follow_error = reason      # and on /healthz
            return False
        self.last_error = self.predictor.follow_error = ""
        self.metrics.apply_seconds.observe(apply_s)
        self.metrics.updates.labels(kind).inc()
        fresh = (scorer.live_since_s - scorer.newest_arrival_s
                 if scorer.newest_arrival_s is not None else None)
        self.applied.append(Applied(int(scorer.bundle.manifest["publish"]["version"]), kind, apply_s,
                                    scorer.live_since_s, fresh))
        return True

    def _build(self, index: PublishedIndex) -> tuple[str, Scorer]:
        """(kind, the scorer of index.latest): deltas on the model answering, else from the full."""
        current = self.version
        deltas = index.after(current) if current is not None else None
        if deltas:
            try:
                return "delta", self._apply(self.predictor.current()[0], current, deltas)
            except (StaleBase, FileNotFoundError):
                pass                        # pruned or rebased under us: start from the full snapshot
        full = read_bundle(version_dir(self.root, index.full))
        info = PublishInfo.from_manifest(full.manifest, full.path)
        if info is None or info.kind != "full":
            raise BundleError(f"{full.path}: the index names it the full snapshot, its manifest does not")
        base = Scorer(full, self.device, self.precision)
        return "full", self._apply(base, index.full, index.chain) if index.chain else base

    def _apply(self, scorer: Scorer, version: int, deltas: list[int]) -> Scorer:
        """`scorer` (of published `version`) with `deltas` applied in order: a new scorer."""
        table = scorer.table
        arrival, event = scorer.newest_arrival_s, scorer.newest_event_ms
        for v in deltas:
            delta = read_bundle(version_dir(self.root, v))
            info = PublishInfo.from_manifest(delta.manifest, delta.path)
            if info is None or info.kind != "delta" or info.base_version != version:
                raise StaleBase(f"{delta.path} applies on version "
                                f"{info.base_version if info else None}, not on {version}")
            table = table.updated(delta.keys, delta.rows)
            version = v
            if info.newest_arrival_s is not None:
                arrival = max(arrival or 0.0, info.newest_arrival_s)
            if info.newest_event_ms is not None:
                event = max(event or 0, info.newest_event_ms)
        out = Scorer(delta, self.device, self.precision, table)     # the last delta's dense weights
        out.newest_arrival_s, out.newest_event_ms = arrival, event
        return out


def initial_bundle(path: str | Path) -> Path:
    """The bundle a server starts from: `path` itself, or for a publish directory the full
    snapshot it names (the follower applies the chain at its first poll)."""
    index = read_index(path) if (Path(path) / "PUBLISHED.json").exists() else None
    return version_dir(path, index.full) if index is not None else Path(path)


__all__ = ["Applied", "Follower", "initial_bundle"]
