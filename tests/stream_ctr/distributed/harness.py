"""Start N real ranks (processes) on 127.0.0.1 with gloo and collect what each returns.

Each rank runs `target(rank, world, *args)` in its own process with the torchrun environment set (MASTER_ADDR/PORT, RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE). A rank that raises reports its traceback; a
rank that dies reports its exit code. Nothing is left running: ranks still
alive at the deadline are killed (only the processes started here).
"""
from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankOutcome:
    rank: int
    ok: bool
    value: Any = None          # what target returned
    error: str = ""            # traceback of an exception
    exitcode: int | None = None


def _entry(target: Callable, rank: int, world: int, port: int, local_world: int,
           args: tuple, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local_world),
                      LOCAL_WORLD_SIZE=str(local_world), OMP_NUM_THREADS="1")
    import torch
    torch.set_num_threads(1)
    try:
        results.put((rank, True, target(rank, world, *args), ""))
    except BaseException:        # report everything, the test decides
        results.put((rank, False, None, traceback.format_exc()))


def _context():
    # A fork server imports torch and stream_ctr once; each rank is then a cheap
    # fork of it (no thread pool has started there), instead of a fresh
    # interpreter importing torch (seconds per rank on a 2-core machine).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "stream_ctr.distributed.run",
                                "tests.stream_ctr.distributed.harness", "pytest"])
    return ctx


def run_ranks(target: Callable, world: int, *args: Any, timeout_s: float = 120.0,
              local_world: int | None = None) -> list[RankOutcome]:
    """Run `target` on `world` ranks; returns one outcome per rank (raises on a hang)."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(target, r, world, port, local_world or world, args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    outcomes: dict[int, RankOutcome] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(outcomes))} still running "
                                   f"after {timeout_s:.0f} s (hung?)")
            try:
                rank, ok, value, error = results.get(timeout=0.2)
                outcomes[rank] = RankOutcome(rank, ok, value, error)
            except queue.Empty:
                for r, p in enumerate(procs):       # a rank that died without reporting
                    if r not in outcomes and p.exitcode is not None:
                        try:                        # it may have reported just before exiting
                            rank, ok, value, error = results.get(timeout=0.5)
                            outcomes[rank] = RankOutcome(rank, ok, value, error)
                        except queue.Empty:
                            outcomes[r] = RankOutcome(r, False, error=f"exited with {p.exitcode}",
                                                      exitcode=p.exitcode)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    for r, p in enumerate(procs):
        outcomes[r].exitcode = p.exitcode
    return [outcomes[r] for r in range(world)]


def values(outcomes: list[RankOutcome]) -> list[Any]:
    """Each rank's return value; fails with the ranks' tracebacks if any rank failed."""
    bad = [o for o in outcomes if not o.ok]
    if bad:
        raise AssertionError("\n".join(f"rank {o.rank}: {o.error}" for o in bad))
    return [o.value for o in outcomes]


