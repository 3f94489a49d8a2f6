"""Run a compiled CPU loop over parts of its rows on several threads.

The loops in `ops/` are numba functions compiled with `nogil=True`: while one
runs, the GIL is free, so plain Python threads run the parts in parallel.
Torch's own intra-op workers are idle meanwhile (the caller waits for the
loop), so the parts take torch's intra-op thread count: on the project's
2-vCPU VM a loop over 43K embedding rows took half the time on two.

A part writes only its own rows (the caller's contract: unique rows, or a
range of batch rows), so the parts need no locks; per-part sums (counts, a
ratio sum) go to per-part outputs that the caller adds up in a fixed order,
which keeps results independent of thread timing.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable

import torch


def part_bounds(n: int, min_rows_per_part: int) -> list[int]:
    """Boundaries [0, ..., n] of at most torch.get_num_threads() parts of at least
    `min_rows_per_part` rows each (one part when n is small: a hand-off costs ~20 us)."""
    parts = max(1, min(torch.get_num_threads(), n // max(1, min_rows_per_part)))
    return [n * k // parts for k in range(parts + 1)]


def run_parts(run_part: Callable[[int, int, int], None], bounds: list[int]) -> None:
    """`run_part(k, lo, hi)` for each part k of `bounds`; the last part on the calling
    thread, the others on the pool. Returns when all are done; re-raises a part's error."""
    n_parts = len(bounds) - 1
    futures = [_pool().submit(run_part, k, bounds[k], bounds[k + 1]) for k in range(n_parts - 1)]
    try:
        run_part(n_parts - 1, bounds[n_parts - 1], bounds[n_parts])
    finally:
        for f in futures:
            f.result()


_pool_of_pid: dict[int, object] = {}
_pool_lock = threading.Lock()


def _pool():
    # One pool per process: a child forked after the pool started inherits a pool whose
    # threads did not come with it, and work handed to it would never run. Its threads
    # start from the thread that first submits (after configure_torch in a run), so they
    # carry its flush-denormal setting.
    pid = os.getpid()
    with _pool_lock:
        if pid not in _pool_of_pid:
            from concurrent.futures import ThreadPoolExecutor
            _pool_of_pid.clear()
            _pool_of_pid[pid] = ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads() - 1),
                                                   thread_name_prefix="ops-cpu-part")
        return _pool_of_pid[pid]
