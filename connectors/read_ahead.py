"""Read-ahead: a file source decoded on a background thread while the trainer steps.

The decoder's compiled kernels release the GIL (decode_jit), so reading and
decoding the next chunks overlaps the current training step instead of
stalling it. Memory is bounded: at most `depth` decoded chunks wait.
"""
from __future__ import annotations

import queue
import threading
from typing import Any

from stream_ctr.connectors.batch import Batch

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
    - ``close()`` stops the thread and closes the wrapped source.
    """

    def __init__(self, source: Any, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"ReadAhead needs depth >= 1, got {depth}")
        self.source = source
        self.partition = getattr(source, "partition", "")
        self._chunks: queue.Queue = queue.Queue(maxsize=depth)
        self._closing = threading.Event()
        self._done = False                 # the end marker was taken
        self._thread = threading.Thread(target=self._produce, name="stream-ctr-read-ahead", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            while not self._closing.is_set() and not self.source.exhausted:
                if not self._put(self.source.read()):
                    return
        except BaseException as exc:       # handed to the consumer, raised on its thread
            self._put(exc)
            return
        self._put(_END)

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
        self.source.close()

    def __enter__(self) -> "ReadAhead":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
