"""What a run's input tells its loop (train/inputs.py): a batch is ready, partitions were
revoked, or a read left nothing ready."""
from __future__ import annotations

from dataclasses import dataclass

from stream_ctr.connectors.batch import Batch


@dataclass(frozen=True)
class Ready:
    """A batch to train, the one read after it (None: none, or no look-ahead) for a
    tiered store to prefetch, and when it was handed out (wall s: freshness)."""
    batch: Batch
    upcoming: Batch | None
    read_at_s: float


@dataclass(frozen=True)
class Revoked:
    """A rebalance took `partitions` (lost: the membership was gone, nothing could be
    committed). Their untrained rows are gone from the input."""
    partitions: tuple[str, ...]
    lost: bool


@dataclass(frozen=True)
class Idle:
    """A read that left no batch ready."""


IDLE = Idle()
Event = Ready | Revoked | Idle
