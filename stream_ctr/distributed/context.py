"""Several replicas over torch.distributed: the process group and its collectives.

Dense replicas train on their own micro-batches and are
averaged every k steps (PaddleBox's k-step Adam; docs/distributed.md),
by flag with their Adam moments; sparse rows have one owner each and never
need merging (`stream_ctr.distributed.sharded_store`).

The process group comes from the torchrun environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_WORLD_SIZE): gloo for CPU tensors, NCCL for
CUDA ones. Every collective runs under the group's timeout and turns a lost
peer into `DistributedError` naming the operation, so a dead rank stops the
others with a clear message instead of a hang. Nothing here survives a crash:
after one, every rank restarts from the last job manifest.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
WAIT_BEFORE_SERVICE_S = 0.1     # agree(): how long to wait for the others before servicing a source


class DistributedError(RuntimeError):
    """A collective failed: another rank died, hung past the timeout or is unreachable."""


def launched_by_torchrun() -> bool:
    """True when the torchrun environment (RANK, WORLD_SIZE, MASTER_*) is set."""
    return all(v in os.environ for v in TORCHRUN_VARS)


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int       # ranks per node (torchrun starts the same number on each)
    backend: str
    timeout_s: float

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: torch.device, timeout_s: float, backend: str = "auto") -> DistContext:
    """Join the job described by the torchrun environment (blocks until all ranks joined,
    at most `timeout_s`). `auto` picks NCCL for a CUDA device, gloo otherwise."""
    from stream_ctr.config import ConfigError
    missing = [v for v in TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise ConfigError(f"distributed training needs the torchrun environment ({', '.join(missing)} "
                          "not set); launch with: torchrun --nproc-per-node=N -m stream_ctr train ...")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("distributed.backend nccl needs a CUDA device (train.device); use gloo on CPU")
    if device.type == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    # torch.distributed.nn.functional binds `group=group.WORLD` as its functions'
    # default when it is imported, and torch imports it lazily (Run's
    # use_deterministic_algorithms -> torch._inductor -> ... -> torch.distributed._shard).
    # Imported after init_process_group, those defaults pin the job's group for good:
    # destroy_process_group cannot free it, so gloo's worker threads live on into
    # interpreter exit, and one that drops the last collective's work there (its
    # tensors are Python objects: that needs the GIL) is killed mid-destructor ->
    # "terminate called without an active exception", SIGABRT. Imported first, the
    # defaults are None and `shutdown` really stops the group's threads.
    import torch.distributed.nn  # noqa: F401
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                    rank=rank, world_size=world)
        except (RuntimeError, ValueError) as e:
            raise DistributedError(f"rank {rank}: cannot join the job at {os.environ['MASTER_ADDR']}:"
                                   f"{os.environ['MASTER_PORT']} within {timeout_s:g} s ({_first_line(e)})") from e
    return DistContext(rank, world, local_rank, local_world, backend, timeout_s)


def shutdown() -> None:
    """Destroy the process group: its backend's threads are joined here, before the
    interpreter exits (see `init_distributed` for what must not keep it alive)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """Run collectives; a failure (peer gone, timeout) becomes a one-line DistributedError."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, DistributedError):
            raise
        rank = dist.get_rank() if dist.is_initialized() else -1
        raise DistributedError(
            f"rank {rank}: {what} failed, another rank stopped or is unreachable "
            f"({_first_line(e)}); the job stops here, restart all ranks with --resume "
            "to continue from the last complete job manifest") from e


def agree(flags: Sequence[int], group: dist.ProcessGroup | None = None,
          while_waiting: Callable[[], None] | None = None) -> list[int]:
    """Element-wise maximum of small integer flags over all ranks (one tiny all-reduce).

    `while_waiting` runs repeatedly until every rank has arrived: a Kafka
    consumer must keep polling there, since a group rebalance completes only
    when every member polls, and the rank we wait for may be inside one.
    """
    t = torch.tensor(list(flags), dtype=torch.int64, device=_comm_device(group))
    with collective("agreeing on the next step"):
        if while_waiting is None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        else:
            work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)
            # The others are usually a few ms behind: only a longer wait is worth
            # a poll (which may block for the source's poll timeout).
            patient_until = time.monotonic() + WAIT_BEFORE_SERVICE_S
            while not work.is_completed():
                if time.monotonic() < patient_until:
                    time.sleep(0.0002)
                else:
                    while_waiting()
            work.wait()
    return t.tolist()


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
