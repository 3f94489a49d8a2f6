"""A checkpoint disk that fills up: a size-capped tmpfs the chaos trainers checkpoint to.

The fault fills it to within a few KiB, so the trainer's next checkpoint
write fails; the trainer must stop with one clear error naming the path and
the space needed (exit status 4) and leave the previous checkpoint whole.
Then the filler goes and the same command line resumes.  Mounting needs root.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

FILLER = "chaos-filler.bin"
LEFT_FREE_BYTES = 64 << 10


class DiskError(RuntimeError):
    pass


class SmallDisk:
    """``with SmallDisk(path, size_mib) as disk: ... disk.fill() ... disk.free()``."""

    def __init__(self, path: Path, size_mib: int) -> None:
        self.path, self.size_mib = Path(path), size_mib
        self._mounted = False

    def __enter__(self) -> "SmallDisk":
        if os.geteuid() != 0:
            raise DiskError("a disk-full fault mounts a size-capped tmpfs: it needs root "
                            "(or run chaos with --disk-fulls 0)")
        self.path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mib}m", "tmpfs", str(self.path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise DiskError(f"cannot mount a tmpfs at {self.path}: {done.stderr.strip()}")
        self._mounted = True
        return self

    def fill(self) -> int:
        """Fill the disk to within `LEFT_FREE_BYTES`; returns the bytes written."""
        room = shutil.disk_usage(self.path).free - LEFT_FREE_BYTES
        written = 0
        with open(self.path / FILLER, "wb") as f:
            block = bytes(1 << 20)
            while written < room:
                try:
                    written += f.write(block[:min(len(block), room - written)])
                except OSError:
                    break
        return written

    def free(self) -> None:
        (self.path / FILLER).unlink(missing_ok=True)

    def __exit__(self, *exc: object) -> None:
        if self._mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
            self._mounted = False


def wait_for_exit(proc: subprocess.Popen | None, timeout_s: float) -> int | None:
    """The exit status of `proc` within `timeout_s`, else None."""
    deadline = time.monotonic() + timeout_s
    while proc is not None and time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            return code
        time.sleep(0.05)
    return None
