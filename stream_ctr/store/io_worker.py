"""One background thread for LMDB work: write-behind, disk sweeps and prefetch.

Jobs run one at a time in submission order, so a prefetch submitted after a
write-back reads what that write-back committed. `wait()` blocks until every
submitted job (or every one up to a given job) is done, re-raises the first
error a job raised (a StoreError from a full disk reaches the trainer at a
following `prepare`), and returns the seconds it blocked: the part of the
LMDB work the step did not hide.
Nothing here survives a crash: an unfinished job's transaction is simply not
committed.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


class IoWorker:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-io")
        self._pending: list[Future] = []

    def submit(self, fn: Callable[..., object], *args: object) -> Future:
        f = self._pool.submit(fn, *args)
        self._pending.append(f)
        return f

    @property
    def busy(self) -> bool:
        return any(not f.done() for f in self._pending)

    def wait(self, upto: Future | None = None) -> float:
        """Block until every job is done, or with `upto` every job up to and including
        that one (later ones keep running); returns the seconds spent blocked."""
        if not self._pending:
            return 0.0
        t0 = time.perf_counter()
        if upto is None:
            n = len(self._pending)
        else:                           # not pending: a wait already covered it
            n = self._pending.index(upto) + 1 if upto in self._pending else 0
        pending, self._pending = self._pending[:n], self._pending[n:]
        error: BaseException | None = None
        for f in pending:
            e = f.exception()
            if e is not None and error is None:
                error = e
        waited = time.perf_counter() - t0
        if error is not None:
            raise error
        return waited

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
