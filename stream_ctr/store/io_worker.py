"""One background thread for LMDB work: write-behind, disk sweeps and prefetch.

Jobs run one at a time in submission order, so a prefetch submitted after a
write-back reads what that write-back committed. `wait()` blocks until every
submitted job (or every one up to a given job) is done, re-raises the first
error a job raised (a StoreError from a full disk reaches the trainer at a
following `prepare`), and returns the seconds it blocked: the part of the
LMDB work the step did not hide.

On a GPU the jobs' device work (cache lookups, evictions ahead of the next
batch) runs on a CUDA stream of its own. On the training stream it would queue
behind the step's forward and backward, launched meanwhile, and each of the
job's reads back to the host would wait for them: the job's host work (RAM,
the spill, LMDB) would start only when the GPU is done, not while it computes.
The ordering is by events, both ways: a job starts on the device after what
the submitting thread had queued when it submitted (the `prepare` whose
cache it reads), and after `wait()` the waiting thread's stream runs after
everything the finished jobs queued. Device tensors crossing streams are
recorded on the stream that uses them (`record_stream`), so the allocator
never hands their memory to one stream while the other still reads it.
Nothing here survives a crash: an unfinished job's transaction is simply not
committed.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch


class IoWorker:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-io")
        self._pending: list[Future] = []
        device = torch.device(device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._caller: torch.cuda.Stream | None = None   # the running job's submitter's stream

    def submit(self, fn: Callable[..., object], *args: object) -> Future:
        """Run `fn(*args)` on the I/O thread after the jobs before it. On a GPU it runs on
        the I/O stream, after the submitting thread's device work queued so far; the
        device tensors in `args` are recorded on the I/O stream."""
        job = fn if self.stream is None else self._on_stream(fn, args)
        f = self._pool.submit(job, *args)
        self._pending.append(f)
        return f

    def _on_stream(self, fn: Callable[..., object], args: tuple) -> Callable[..., object]:
        stream = self.stream
        caller = torch.cuda.current_stream(stream.device)
        ready = caller.record_event()
        # (recorded here, while the caller still holds them: freed later with the job's
        # kernels still queued, their memory waits for those kernels)
        for a in args:
            if isinstance(a, torch.Tensor) and a.is_cuda:
                a.record_stream(stream)

        def job(*a: object) -> object:
            self._caller = caller
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                return fn(*a)
        return job

    def hand_over(self, t: torch.Tensor) -> torch.Tensor:
        """`t`, made by the running job, goes to the stream of the thread that submitted
        the job (which waits for it before reading `t`); returns `t`. Call it on the I/O
        thread. A no-op without a GPU."""
        if self._caller is not None and t.is_cuda:
            t.record_stream(self._caller)
        return t

    @property
    def busy(self) -> bool:
        return any(not f.done() for f in self._pending)

    def wait(self, upto: Future | None = None) -> float:
        """Block until every job is done, or with `upto` every job up to and including
        that one (later ones keep running); returns the seconds spent blocked. On a GPU
        the calling thread's stream then waits for the device work those jobs queued."""
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
        if self.stream is not None and pending:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        waited = time.perf_counter() - t0
        if error is not None:
            raise error
        return waited

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
