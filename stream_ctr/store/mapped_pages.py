"""Keep the LMDB pages this process has mapped below a budget.

LMDB reads through a read-only shared memory map of data.mdb. Every page a
read touches stays mapped into the process until the map is closed, and the
kernel counts it in the process's RSS (RssFile): on a 20 GB table a long run
reaches an RSS of the whole file although none of it is private memory (the
pages are the OS page cache, reclaimable at any time). Container memory
limits and `ps` see that RSS, so it is bounded here.

`MappedPages.trim_if_over()` reads the process's resident shared pages
(/proc/self/statm: file-backed + shmem) and, when they exceed the baseline at
open plus `budget_bytes`, drops the mapping's page-table entries with
madvise(MADV_DONTNEED). That is safe on a shared file mapping at any moment,
even while another thread reads through it: the next access faults the page
back in from the page cache (a minor fault when it is still cached), and
nothing is written (LMDB writes with pwrite, `writemap=False`). The data stays
cached by the OS; only the process's accounting of it is released.

Linux only; elsewhere (no /proc) it does nothing.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
from pathlib import Path

log = logging.getLogger("stream_ctr.store")

MADV_DONTNEED = 4
_PAGE_BYTES = mmap.PAGESIZE


def resident_shared_bytes() -> int:
    """The process's resident file-backed + shared pages (statm field 3), 0 without /proc."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[2]) * _PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0


def mapping_ranges(path: Path) -> list[tuple[int, int]]:
    """(start, end) addresses of this process's mappings of the file at `path`."""
    target = str(path.resolve())
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if line.rstrip("\n").endswith(target):
                    lo, hi = line.split(None, 1)[0].split("-")
                    out.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return out


class MappedPages:
    """Unmaps LMDB's resident pages from this process when they pass `budget_bytes`."""

    def __init__(self, data_file: Path, budget_bytes: int) -> None:
        self.data_file, self.budget_bytes = data_file, budget_bytes
        self.baseline_bytes = resident_shared_bytes()
        self.trims = 0
        self._madvise = None
        if budget_bytes > 0 and os.path.exists("/proc/self/maps"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                self._madvise = libc.madvise
                self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                self._madvise.restype = ctypes.c_int
            except (OSError, AttributeError):
                self._madvise = None

    def allow(self, nbytes: int) -> None:
        """Another map of this process that is never trimmed and holds at most `nbytes`
        (the spill file, whose pages are written every step): the budget counts every
        shared page, so LMDB keeps its own `budget_bytes` on top of it. Trimming the spill
        too cost ~10% of a tiered run's speed in page faults."""
        if self.budget_bytes > 0:
            self.budget_bytes += nbytes

    def trim_if_over(self) -> bool:
        """Drop the mapping's resident pages if over budget; True if it did. Cheap when under
        (one read of /proc/self/statm)."""
        if self._madvise is None:
            return False
        if resident_shared_bytes() - self.baseline_bytes <= self.budget_bytes:
            return False
        for lo, hi in mapping_ranges(self.data_file):
            if self._madvise(lo, hi - lo, MADV_DONTNEED) != 0:
                err = ctypes.get_errno()
                log.warning("store: madvise(DONTNEED) on the LMDB map failed (%s); its pages stay "
                            "counted in RSS", os.strerror(err))
                self._madvise = None
                return False
        self.trims += 1
        return True
