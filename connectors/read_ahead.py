"""Read-ahead: a file source decoded on background threads while the trainer steps.

The decoder's compiled kernels release the GIL (decode_jit), so reading and
decoding the next chunks overlaps the current training step instead of
stalling it. One thread reads the file's lines in order; with
`decode_threads` > 1 the chunks are decoded on that many threads at once and
still handed out in file order. On a GPU machine one decoding thread was the
limit (0.6-0.75M Criteo records/s against 1.1-7.8M samples/s of training
steps on an H200, BENCHMARKS). Memory is bounded: at most
max(depth, decode_threads) chunks wait or are being decoded, and the reading
thread holds one more while it waits for room.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from stream_ctr.connectors.batch import Batch
from stream_ctr.threads import usable_cores

_END = object()


class ReadAhead:
    """The `FileSource` contract (`read`, `exhausted`, `close`, context manager) over a
    source that a background thread reads `depth` chunks ahead.

    - ``read()`` blocks until the next chunk is decoded (or the end is known) and
      returns what the wrapped source's ``read()`` returned, in the same order; an
      error the wrapped source raised is raised here, on the caller's thread.
    - ``exhausted`` is True once `read()` has handed out every chunk and then
      the end (one last empty read tells the caller): chunks read ahead but not taken
      (a run stopped by a signal or a limit) do not count as consumed, so an
      epoch is not over until the trainer has them. Positions come from the
      batches' own offsets, never from the wrapped source, so reading ahead
      moves no resume point.
    - ``close()`` stops the threads and closes the wrapped source.

    `decode_threads` > 1 needs a source with ``read_raw()`` and ``decode_raw(raw)``
    (`FileSource`, a rank's `StripedSource`); others are read on the one thread.
    `finish`, if given, maps each decoded chunk on the thread that decoded it (a GPU
    trainer's copy into pinned memory): its time is the pool's, not the trainer's.
    """

    def __init__(self, source: Any, depth: int = 2, decode_threads: int = 1,
                 finish: Callable[[Batch], Batch] | None = None) -> None:
        if depth < 1 or decode_threads < 1:
            raise ValueError(f"ReadAhead needs depth >= 1 and decode_threads >= 1, "
                             f"got {depth} and {decode_threads}")
        self.source = source
        self.partition = getattr(source, "partition", "")
        self._finish = finish
        self._pool = None
        if decode_threads > 1 and hasattr(source, "read_raw") and hasattr(source, "decode_raw"):
            self._pool = ThreadPoolExecutor(decode_threads, thread_name_prefix="stream-ctr-decode")
        self._chunks: queue.Queue = queue.Queue(maxsize=max(depth, decode_threads if self._pool else 1))
        self._closing = threading.Event()
        self._done = False                 # the end marker was taken
        self._thread = threading.Thread(target=self._produce, name="stream-ctr-read-ahead", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            while not self._closing.is_set() and not self.source.exhausted:
                if self._pool is not None:    # read in order here, decode on the pool
                    item = self._pool.submit(self._decode, self.source.read_raw())
                else:
                    item = self._finished(self.source.read())
                if not self._put(item):
                    return
        except BaseException as exc:       # handed to the consumer, raised on its thread
            self._put(exc)
            return
        self._put(_END)

    def _decode(self, raw: Any) -> tuple[Batch, list]:
        return self._finished(self.source.decode_raw(raw))

    def _finished(self, decoded: tuple[Batch, list]) -> tuple[Batch, list]:
        batch, rejected = decoded
        return (batch if self._finish is None or not len(batch) else self._finish(batch)), rejected

    def _put(self, item: object) -> bool:
        """Queue `item`, waiting for room unless `close()` is called (then False)."""
        while not self._closing.is_set():
            try:
                self._chunks.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read(self) -> tuple[Batch, list]:
        """The next decoded chunk and its rejected lines (empty at the end)."""
        if self._done:
            return self._empty(), []
        item = self._chunks.get()
        if item is _END:
            self._done = True
            return self._empty(), []
        if isinstance(item, Future):      # a decode error is raised here, in file order
            try:
                item = item.result()
            except BaseException:
                self._done = True
                raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item

    def _empty(self) -> Batch:
        fmt = self.source.fmt
        return Batch.empty(fmt.n_keys, fmt.n_dense, (self.partition,), fmt.pooling)

    @property
    def exhausted(self) -> bool:
        return self._done

    def close(self) -> None:
        self._closing.set()
        self._thread.join()
        if self._pool is not None:        # chunks decoding for nobody are dropped
            self._pool.shutdown(wait=True, cancel_futures=True)
        self.source.close()

    def __enter__(self) -> "ReadAhead":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def decode_threads(configured: int, processes_per_host: int = 1, gpu: bool = False) -> int:
    """The decoding threads of `data.decode_threads = configured`: as configured, or
    with 0 one per 4 of the cores this process may use (`stream_ctr.threads.usable_cores`:
    affinity and cgroup quota, shared by the ranks of a node), 1 to 8. A 2-core
    machine keeps one (its cores train); a 16-core host running one process gets 4.
    The machine's load is left to the training threads: below 8 usable cores there
    is one decoding thread anyway. A process training on a GPU (`gpu`) computes on the
    device, not on its cores: one per 2 cores, 1 to 8 (8 on a 16-core host), since a
    thread decodes 0.6-0.75M Criteo records/s and a GPU step at 131,072 takes several
    million a second."""
    if configured:
        return configured
    per = 2 if gpu else 4
    return max(1, min(8, usable_cores(processes_per_host) // per))
