"""How many threads a process computes with: the cores it may use, less the ones others keep busy.

torch's default intra-op pool has one OpenMP thread per online core, and its
threads spin while they wait for each other. When another CPU-bound process
shares the cores that pool collapses: on a loaded 2-core machine a 3,000-record
run took 20-25 s with 2 threads and 1.4-2.7 s with 1 (same AUC). So the
default counts what this process may use (CPU affinity, the cgroup CPU quota,
its share among the ranks on its host) and, when the machine is already busy,
fewer threads still.

Imports nothing from the package: the trainer and the decoder (connectors)
both use it.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
PROC_LOADAVG = Path("/proc/loadavg")
# The load (runnable processes outside this job) to assume instead of measuring it:
# a test, or a user whose machine's load is known to mislead, pins it.
LOAD_ENV = "STREAM_CTR_LOAD_AVG"


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op threads of one process and why.

    - ``threads``: the threads to compute with, >= 1.
    - ``usable``: the cores this process may use: its CPU affinity and cgroup quota,
      divided among the processes of its job on the host; >= 1.
    - ``load``: the runnable processes outside this job that the choice assumed;
      None when the thread count was configured (nothing was measured).
    - ``reason``: ``"configured"`` (train.threads / --threads), ``"usable"`` (every
      usable core) or ``"load"`` (fewer: the others keep the cores busy).
    """
    threads: int
    usable: int
    load: float | None
    reason: str

    @property
    def warning(self) -> str | None:
        """One line for stderr when the load took threads away, or more threads were
        configured than this process may use, else None."""
        if self.reason == "configured" and self.threads > self.usable:
            return (f"stream-ctr: warning: train.threads = {self.threads} is more than the {self.usable} "
                    f"core(s) this process may use: threads beyond the cores wait on each other and "
                    f"slow every step (0 chooses by the cores and the machine's load)")
        if self.reason != "load":
            return None
        return (f"stream-ctr: the machine's load ({self.load:.1f}) exceeds its free cores "
                f"({self.usable} usable): training with {self.threads} thread(s) (--threads sets it)")


def choose_threads(configured: int = 0, processes_per_host: int = 1, *, load: float | None = None,
                   cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP,
                   affinity: int | None = None, online: int | None = None) -> ThreadChoice:
    """The intra-op threads of a process of a job with `processes_per_host` processes on
    this host: `configured` when > 0; else its usable share (`usable_cores`), fewer when
    the others' `load` leaves fewer free cores: free = online cores - round(load), split
    among the job's processes, at least 1 thread.

    `load` defaults to `measured_load` (or $STREAM_CTR_LOAD_AVG). It is compared with
    the host's online cores (`online`, default os.cpu_count()), not with the usable
    ones: the load average counts the whole host, so a container allowed 2 of 64
    busy cores still has its 2. The other parameters are for tests (`usable_cores`).
    """
    usable = usable_cores(processes_per_host, cgroup_root=cgroup_root, proc_cgroup=proc_cgroup,
                          affinity=affinity)
    if configured > 0:
        return ThreadChoice(configured, usable, None, "configured")
    if load is None:
        load = measured_load(processes_per_host)
    online = online or os.cpu_count() or 1
    free = online - math.floor(load + 0.5)
    threads = max(1, min(usable, free // max(1, processes_per_host)))
    return ThreadChoice(threads, usable, load, "load" if threads < usable else "usable")


def usable_cores(processes_per_host: int = 1, *, cgroup_root: Path = CGROUP_ROOT,
                 proc_cgroup: Path = PROC_CGROUP, affinity: int | None = None) -> int:
    """The cores one of `processes_per_host` processes on this host may use: the CPUs
    of its affinity mask (`affinity`, default os.sched_getaffinity), capped by its
    cgroup's CPU quota (`cgroup_cpu_limit`), divided among the processes; >= 1."""
    if affinity is None:
        affinity = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                    else os.cpu_count() or 1)
    cores = affinity
    quota = cgroup_cpu_limit(cgroup_root, proc_cgroup)
    if quota is not None:
        # Rounded down: threads beyond the quota are throttled in the middle of an
        # operation, and spinning OpenMP threads then wait on the throttled one.
        cores = min(cores, max(1, math.floor(quota)))
    return max(1, cores // max(1, processes_per_host))


def cgroup_cpu_limit(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The cores the CPU quota of this process's cgroup allows (quota / period), the
    tightest along its cgroup path up to the root; None without a quota or cgroup files.

    Reads `proc_cgroup` (/proc/self/cgroup) for the process's cgroup paths, then under
    `cgroup_root` cgroup v2's ``cpu.max`` ("max 100000" or "200000 100000") or v1's
    ``cpu.cfs_quota_us`` (-1: none) and ``cpu.cfs_period_us`` in the cpu controller's
    folder (``cpu,cpuacct`` or ``cpu``).
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if not controllers:                       # v2: one unified hierarchy
            limits += [q for d in _cgroup_dirs(cgroup_root, path) if (q := _v2_quota(d)) is not None]
        elif "cpu" in controllers.split(","):
            base = next((b for b in (cgroup_root / controllers, cgroup_root / "cpu") if b.is_dir()), None)
            if base is not None:
                limits += [q for d in _cgroup_dirs(base, path) if (q := _v1_quota(d)) is not None]
    return min(limits) if limits else None


def _cgroup_dirs(base: Path, path: str) -> list[Path]:
    """The folder of cgroup `path` under `base` and its ancestors up to `base`: a parent's
    quota binds its children. In a container whose cgroup is mounted as the root
    without a namespace, the host path is absent and `base` itself is its cgroup."""
    parts = [p for p in path.strip("/").split("/") if p and p not in (".", "..")]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _v2_quota(folder: Path) -> float | None:
    text = _read(folder / "cpu.max")
    if not text:
        return None
    quota, _, period = text.partition(" ")
    try:
        return int(quota) / int(period or 100000) if quota != "max" else None
    except (ValueError, ZeroDivisionError):
        return None


def _v1_quota(folder: Path) -> float | None:
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    try:
        return int(quota) / int(period) if quota is not None and period and int(quota) > 0 else None
    except (ValueError, ZeroDivisionError):
        return None


def measured_load(processes_per_host: int = 1) -> float:
    """The runnable processes outside this job: $STREAM_CTR_LOAD_AVG when set, else the
    smaller of the 1-minute load average and the tasks runnable now (the median of a
    few reads of /proc/loadavg over ~40 ms) less this process's runnable threads and
    the job's other `processes_per_host` - 1 processes; >= 0.

    The 1-minute average alone lags: for a minute after a busy process ends (or after
    this job's own previous run) it still reads high, and the instant count does not;
    a process that keeps the cores busy is in both. Without /proc (not Linux), the
    load average alone.
    """
    pinned = os.environ.get(LOAD_ENV)
    if pinned:
        try:
            return max(0.0, float(pinned))
        except ValueError:
            raise ValueError(f"{LOAD_ENV} must be a number (the load to assume), got {pinned!r}") from None
    try:
        average = os.getloadavg()[0]
    except (AttributeError, OSError):         # no load average (Windows): assume none
        return 0.0
    now = _runnable_now()
    if now is None:
        return average
    return max(0.0, min(average, now - (max(1, processes_per_host) - 1)))


def _runnable_now(samples: int = 5, gap_s: float = 0.01) -> float | None:
    """The median count of runnable tasks on the host outside this process, or None."""
    counts = []
    for i in range(samples):
        if i:
            time.sleep(gap_s)
        text = _read(PROC_LOADAVG)              # "0.52 0.40 0.33 3/512 12345": 3 runnable now
        try:
            running = int(text.split()[3].split("/")[0])
        except (AttributeError, IndexError, ValueError):
            return None
        counts.append(running - _own_runnable_threads())
    return max(0.0, statistics.median(counts))


def _own_runnable_threads() -> int:
    """This process's threads in state R (running or waiting for a core), at least 1: the
    one reading."""
    n = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 1
    for tid in tasks:
        stat = _read(Path("/proc/self/task", tid, "stat"))
        # "tid (comm) S ...": the state follows the command name, which may hold spaces.
        if stat and stat[stat.rfind(")") + 2:].startswith("R"):
            n += 1
    return max(1, n)
