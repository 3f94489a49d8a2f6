"""Where a run's files go: one directory per run, `runs/latest` pointing at the one trained last.

Two runs never share a directory by accident: without `train.run_dir` (or
`--run-dir`) each run gets `runs/<UTC time>-<model>-<source>`; `--resume DIR`
without `--run-dir` keeps writing into the resumed run's directory; and a new
run (no `--resume`) into a directory that already holds a run is refused,
because its checkpoints, time series and dead letters would mix with the
other run's (a report would draw both as one line).

One process owns a run directory (`claim_run_dir`): it holds an exclusive
`flock` on RUN_DIR/.lock, and on the checkpoint root's .lock, from before it
writes anything there until it ends. A second trainer into either, new or
`--resume`, is refused at once, naming the owner's PID and host. The kernel drops
the lock of a process that dies, so a lock file left behind blocks nobody. With
the lock held no live process can be writing a temporary checkpoint there, so
whatever temporary files a killed writer left are removed at start.
A `stream-ctr report` only reads the run and writes its own report/ folder: it
takes no lock, so a running run can be reported on.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from stream_ctr.config import Config, ConfigError
from stream_ctr.connectors.dead_letter import dead_letter_start_name
from stream_ctr.train.checkpoint import CheckpointError

RUNS_ROOT = Path("runs")
LATEST = "latest"
# What makes a directory "a run": a checkpoint root, a distributed job, or a time series.
_RUN_MARKERS = ("checkpoints/LATEST", "checkpoints/LATEST_JOB", "LATEST_JOB", "timeseries.jsonl")


def holds_run(path: Path) -> bool:
    """True when `path` holds another run's checkpoints or time series."""
    return any((path / marker).exists() for marker in _RUN_MARKERS)


def run_dir_of(resume: str | Path) -> Path:
    """The run directory a `--resume` path belongs to (a run directory, its
    checkpoint root, or one checkpoint inside it)."""
    p = Path(resume)
    if (p / "manifest.json").exists() or (p / "job.json").exists():    # one checkpoint
        p = p.parent
    if p.name == "checkpoints":
        p = p.parent
    return p


def source_slug(source: str) -> str:
    """A short, path-safe name for a source: `criteo:sample` -> criteo-sample,
    `kafka://host:9092/clicks` -> kafka-clicks, `/data/day_0.gz` -> day_0."""
    s = source.strip()
    if s.lower().startswith("kafka://"):
        s = "kafka-" + s.rstrip("/").rsplit("/", 1)[-1].split("?")[0]
    elif ":" in s and not s.startswith("/"):
        fmt, _, rest = s.partition(":")
        s = f"{fmt}-{Path(rest).name}"
    else:
        s = Path(s).name
    for ext in (".gz", ".tsv", ".csv", ".txt"):
        s = s.removesuffix(ext)
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", s).strip("-.")[:48] or "run"


def choose_run_dir(cfg: Config, resume: str | None, now_s: float | None = None,
                   check_contents: bool = True) -> Path:
    """The directory this run writes to (see the module doc); does not create it.

    Raises ConfigError for a new run into a directory that holds another run
    (unless not `check_contents`: `claim_run_dir` checks that once it holds the lock)."""
    if cfg.train.run_dir:
        p = Path(cfg.train.run_dir)
        if p.name == LATEST and p.is_symlink() and resume is None:
            raise ConfigError(f"--run-dir {p} is the link to the newest run ({p.resolve()}); "
                              "resume it with --resume, or leave --run-dir out for a new run")
        if check_contents and resume is None:
            refuse_if_holds_run(p)
        return p
    if resume is not None:
        ckpt = Path(resume)
        if ((ckpt / "state.json").exists() and ckpt.parent.name != "checkpoints"
                and not (ckpt.parent / "LATEST").exists()):
            # A checkpoint copied out of its run: its parent is no run directory, and the
            # continued run would scatter its files there.
            raise ConfigError(f"--resume {resume} is a checkpoint outside any run directory: "
                              "say where the continued run writes with --run-dir DIR")
        return run_dir_of(resume)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now_s is None else now_s))
    base = f"{stamp}-{cfg.model.name}-{source_slug(cfg.data.source)}"
    p, n = RUNS_ROOT / base, 1
    while p.exists():                       # two runs started in the same second
        n += 1
        p = RUNS_ROOT / f"{base}-{n}"
    return p


def refuse_if_holds_run(p: Path) -> None:
    """ConfigError when `p` holds a run that a new run (no --resume) would mix with."""
    if holds_run(p):
        raise ConfigError(f"--run-dir {p} already holds a run: continue it with --resume {p}, "
                          "or train into another --run-dir (or none: every run gets its own)")


LOCK_FILE = ".lock"


class RunDirBusy(CheckpointError):
    """Another live process owns the run directory or its checkpoint root. (A
    CheckpointError: exit status 4, like every error about a run's stored state.)"""


@dataclass(frozen=True)
class Owner:
    """Who holds a directory's lock, as its lock file says (what a refusal names)."""
    pid: int
    host: str
    started: str            # UTC, ISO 8601

    @classmethod
    def me(cls) -> "Owner":
        return cls(os.getpid(), socket.gethostname(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    @classmethod
    def read(cls, path: Path) -> "Owner | None":
        """The owner a lock file names; None when it names none (being written, or foreign)."""
        try:
            raw = json.loads(path.read_text())
            return cls(int(raw["pid"]), str(raw["host"]), str(raw["started"]))
        except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError):
            return None


class DirLock:
    """An exclusive `flock` on DIR/.lock; the file holds the `Owner` as JSON.

    Held until `release` or this process's death: the kernel drops a dead process's
    flock, so the file it leaves behind blocks nobody. `release` deletes the lock file
    while it still holds it (a taker checks it locked the file still at that path),
    and DIR too when this lock created it and nothing else was written there (a run
    refused at start leaves no empty directory)."""

    def __init__(self, directory: Path, fd: int | None, created: bool) -> None:
        self.directory, self.fd, self.created = directory, fd, created

    @classmethod
    def take(cls, directory: Path, what: str, elsewhere: str) -> "DirLock":
        """Lock `directory` (created if missing) without waiting. Raises RunDirBusy,
        naming the owner, `what` the directory is to this run (e.g. "run directory")
        and `elsewhere` (how to train somewhere else); OSError when it cannot be created."""
        created = not directory.exists()
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / LOCK_FILE
        for _ in range(20):                 # bounded: each retry means an owner released meanwhile
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunDirBusy(busy_message(directory, what, elsewhere, Owner.read(path))) from None
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                print(f"stream-ctr: warning: {what} {directory} cannot be locked ({e.strerror}: its "
                      "filesystem has no flock): nothing stops a second trainer from writing there "
                      "at the same time", file=sys.stderr, flush=True)
                return cls(directory, None, created)
            try:
                here = os.stat(path)
            except FileNotFoundError:
                here = None
            mine = os.fstat(fd)
            if here is not None and (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino):
                os.ftruncate(fd, 0)
                os.write(fd, json.dumps(dataclasses.asdict(Owner.me())).encode())
                return cls(directory, fd, created)
            os.close(fd)                    # its owner released and deleted it: take the new file
        raise RunDirBusy(f"{what} {directory}: its lock file {path} keeps being replaced; is another "
                         f"process starting and stopping there? {elsewhere}")

    def release(self) -> None:
        """Give the directory up (idempotent)."""
        if self.fd is None:
            return
        with_lock = self.directory / LOCK_FILE
        try:
            with_lock.unlink(missing_ok=True)
            if self.created:
                self.directory.rmdir()      # only when empty
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


def busy_message(directory: Path, what: str, elsewhere: str, owner: Owner | None) -> str:
    """The one line refusing a second process: who holds `directory` and what to do."""
    if owner is None:
        return (f"{what} {directory} is in use by another process (its lock file "
                f"{directory / LOCK_FILE} is held, its owner not yet written): wait for it to end, "
                f"stop it, or {elsewhere}")
    here = owner.host == socket.gethostname()
    stop = f"kill {owner.pid}" if here else f"on {owner.host}: kill {owner.pid}"
    return (f"{what} {directory} is in use by another stream-ctr process, PID {owner.pid} on host "
            f"{owner.host}{' (this host)' if here else ''}, started {owner.started}: wait for it to "
            f"end, stop it ({stop}), or {elsewhere}")


@dataclass
class RunDirOwner:
    """What `claim_run_dir` holds: the run directory, its checkpoint root, their locks."""
    run_dir: Path
    checkpoint_root: Path
    resume: str | None                  # --resume with the runs/latest link resolved
    locks: list[DirLock]
    set_aside: Path | None = None       # where an attempt without a checkpoint moved

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()

    def __enter__(self) -> "RunDirOwner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def claim_run_dir(cfg: Config, resume: str | None, set_aside: bool = False) -> RunDirOwner:
    """Choose the run's directory (`choose_run_dir`), set cfg.train.run_dir to it and
    own it before anything is written there: lock it, then its checkpoint root
    (train.checkpoint_dir, else RUN_DIR/checkpoints: a checkpoint_dir shared by two
    runs is refused too). Under the locks: `set_aside_attempt` when `set_aside` (a
    --resume that found no checkpoint), then the check that a new run does not go
    into another run's directory, then the removal of dead writers' temporary files.

    The locks are held until `release` (or exit). A new run without --run-dir
    creates its time-stamped directory, so two started in the same second get two.
    Raises RunDirBusy when another live process holds either directory; ConfigError
    as `choose_run_dir` does."""
    made = False
    if not cfg.train.run_dir and resume is None:
        for _ in range(100):            # bounded: each failure is a directory another run just made
            p = choose_run_dir(cfg, None)
            try:
                p.mkdir(parents=True)
                made = True
                break
            except FileExistsError:
                continue
        else:
            raise ConfigError(f"cannot create a new run directory in {RUNS_ROOT}: every name "
                              "tried was taken meanwhile; pass --run-dir")
    else:
        p = choose_run_dir(cfg, resume, check_contents=False)
    p, resume = _through_latest(p, resume)
    owner = RunDirOwner(p, Path(cfg.train.checkpoint_dir or p / "checkpoints"), resume, [])
    try:
        owner.locks.append(DirLock.take(p, "run directory", "train into another --run-dir"))
        owner.locks[0].created |= made
        if cfg.train.checkpoint_dir:
            owner.locks.append(DirLock.take(owner.checkpoint_root, "train.checkpoint_dir",
                                            "set another train.checkpoint_dir"))
        else:
            owner.locks.append(DirLock.take(owner.checkpoint_root, "checkpoint directory",
                                            "train into another --run-dir"))
        if set_aside:
            # (a dead-letter file elsewhere, data.dead_letter_path, is the user's to keep)
            own_dead_letter = None if cfg.data.dead_letter_path else p / "dead_letter.jsonl"
            owner.set_aside = set_aside_attempt(p, own_dead_letter)
        if resume is None:
            refuse_if_holds_run(p)
        removed = remove_leftovers(p, owner.checkpoint_root)
    except BaseException:
        owner.release()
        raise
    if removed:
        print("stream-ctr: removed what writers that died left half-written: "
              + ", ".join(f"{path} ({size / 2**20:,.1f} MiB)" for path, size in removed),
              file=sys.stderr, flush=True)
    cfg.train.run_dir = str(p)
    return owner


def _through_latest(p: Path, resume: str | None) -> tuple[Path, str | None]:
    """`p` and `resume` with the runs/latest link replaced by the run it points at: a new
    run repointing the link meanwhile must not move this one's files."""
    if p.name != LATEST or not p.is_symlink():
        return p, resume
    real = p.parent / os.readlink(p)
    if resume is not None and Path(resume).parts[:len(p.parts)] == p.parts:
        resume = str(real.joinpath(*Path(resume).parts[len(p.parts):]))
    return real, resume


# What a writer that died leaves: half-written checkpoint directories (`.tmp-ckpt-*`
# in the checkpoint root, in each rank's directory of a distributed job), the LATEST
# files being replaced, a job manifest being written; the link being made in the run
# directory (`link_checkpoint_dir`).
_LEFTOVERS_IN_ROOT = (".tmp-*", ".LATEST.tmp", ".LATEST_JOB.tmp", "job-*/.job.json.tmp",
                      "job-*/rank-*/.tmp-*", "job-*/rank-*/.LATEST.tmp")
_LEFTOVERS_IN_RUN_DIR = (".checkpoints.*",)


def remove_leftovers(run_dir: Path, checkpoint_root: Path) -> list[tuple[Path, int]]:
    """Delete the temporary files of writers that died (see above); only safe while
    holding both directories' locks. Returns each path removed with its size in bytes."""
    found = [q for pattern in _LEFTOVERS_IN_ROOT for q in checkpoint_root.glob(pattern)]
    found += [q for pattern in _LEFTOVERS_IN_RUN_DIR for q in run_dir.glob(pattern)]
    removed = []
    for q in found:
        size = _size(q)
        if q.is_dir() and not q.is_symlink():
            shutil.rmtree(q, ignore_errors=True)
        else:
            q.unlink(missing_ok=True)
        if not q.exists() and not q.is_symlink():
            removed.append((q, size))
    return removed


def _size(path: Path) -> int:
    """Bytes of the files under `path` (0 for a link)."""
    if path.is_symlink() or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    total = 0
    for base, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except OSError:
                pass
    return total


def point_latest(run_dir: Path) -> None:
    """Make `runs/latest` a relative link to `run_dir` when it lives in `runs/` (other
    directories get no link beside them), and never over a real directory (a run
    written there by an older version stays where it is)."""
    link = run_dir.parent / LATEST
    if run_dir.parent.resolve() != RUNS_ROOT.resolve() or run_dir.name == LATEST \
            or (link.exists() and not link.is_symlink()):
        return
    tmp = run_dir.parent / f".{LATEST}.{os.getpid()}"
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(run_dir.name, target_is_directory=True)
        os.replace(tmp, link)               # atomic: readers see the old or the new run
    except OSError:                         # no symlinks here (some filesystems): skip
        tmp.unlink(missing_ok=True)


def set_aside_attempt(run_dir: Path, dead_letter: Path | None = None, now_s: float | None = None) -> Path | None:
    """A `--resume` of a run directory without a checkpoint (the run was killed before
    its first, or stopped because no record decoded): what that attempt wrote and no
    model state carries on moves to `RUN_DIR/no-checkpoint-<UTC time>/`, so the new
    start is one run, its report shows it alone and its dead letters are its own.
    That is the time series, and `dead_letter` (the run directory's dead-letter file;
    None when the run dead-letters elsewhere: a path of the user's choosing or a topic
    stays where it is) with the start mark that points into it
    (connectors/dead_letter.py, `start_mark`). Without the move, the rejects of a
    schema that fit no record stayed beside a corrected run that reported 0 rejected.
    The new attempt rejects again whatever it reads again, into a fresh file, so each
    record is still in the run's dead-letter file once. Returns that folder (None when
    there was nothing to move)."""
    moving = sorted(run_dir.glob("timeseries*.jsonl*")) if run_dir.is_dir() else []
    if dead_letter is not None and dead_letter.is_file():
        moving.append(dead_letter)
        mark = run_dir / dead_letter_start_name(dead_letter)
        if mark.is_file():
            moving.append(mark)
    if not moving:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now_s is None else now_s))
    aside = run_dir / f"no-checkpoint-{stamp}"
    aside.mkdir(exist_ok=True)
    for path in moving:
        path.rename(aside / path.name)
    return aside


def link_checkpoint_dir(run_dir: Path, checkpoint_dir: str) -> None:
    """With train.checkpoint_dir elsewhere (another disk), make `RUN_DIR/checkpoints` a
    link to it, so `--resume RUN_DIR` finds the checkpoints: without the link, a
    resume by run directory saw none and started the run afresh. Never replaces a
    real directory; a link to another place is repointed (the config says where)."""
    if not checkpoint_dir:
        return
    target, link = Path(checkpoint_dir).resolve(), run_dir / "checkpoints"
    if link.resolve() == target or (link.exists() and not link.is_symlink()):
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    target.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".checkpoints.{os.getpid()}"
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target, target_is_directory=True)
        os.replace(tmp, link)
    except OSError:                         # no symlinks here: --resume CHECKPOINT_DIR still works
        tmp.unlink(missing_ok=True)
