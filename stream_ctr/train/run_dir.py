"""Where a run's files go: one directory per run, `runs/latest` pointing at the one trained last.

Two runs never share a directory by accident: without `train.run_dir` (or
`--run-dir`) each run gets `runs/<UTC time>-<model>-<source>`; `--resume DIR`
without `--run-dir` keeps writing into the resumed run's directory; and a new
run (no `--resume`) into a directory that already holds a run is refused,
because its checkpoints, time series and dead letters would mix with the
other run's (a report would draw both as one line).
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

from stream_ctr.config import Config, ConfigError

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


def choose_run_dir(cfg: Config, resume: str | None, now_s: float | None = None) -> Path:
    """The directory this run writes to (see the module doc); does not create it.

    Raises ConfigError for a new run into a directory that holds another run."""
    if cfg.train.run_dir:
        p = Path(cfg.train.run_dir)
        if p.name == LATEST and p.is_symlink() and resume is None:
            raise ConfigError(f"--run-dir {p} is the link to the newest run ({p.resolve()}); "
                              "resume it with --resume, or leave --run-dir out for a new run")
        if resume is None and holds_run(p):
            raise ConfigError(f"--run-dir {p} already holds a run: continue it with --resume {p}, "
                              "or train into another --run-dir (or none: every run gets its own)")
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


def set_aside_attempt(run_dir: Path, now_s: float | None = None) -> Path | None:
    """A `--resume` of a run directory without a checkpoint (the run was killed before
    its first): the time series of that attempt, which no model state carries on,
    moves to `RUN_DIR/no-checkpoint-<UTC time>/`, so the new start is one run and its
    report shows it alone. Returns that folder (None when there was nothing to move)."""
    series = sorted(run_dir.glob("timeseries*.jsonl*")) if run_dir.is_dir() else []
    if not series:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now_s is None else now_s))
    aside = run_dir / f"no-checkpoint-{stamp}"
    aside.mkdir(exist_ok=True)
    for path in series:
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
