"""Job checkpoints of a distributed run: every rank's checkpoint plus one job manifest.

Layout of CHECKPOINT_DIR::

    LATEST_JOB                 name of the newest complete job (replaced atomically)
    job-00000007/
        rank-00000/ckpt-.../   rank 0's ordinary checkpoint (stream_ctr.train.checkpoint):
        rank-00001/ckpt-.../   its embedding shard, the dense model and optimizer
                               (identical on every rank: merged first), its offsets
        job.json               world size, lockstep step, each rank's checkpoint
                               path with the sha256 of its manifest, all offsets

Every rank writes its checkpoint (durable when `save_checkpoint` returns);
rank 0 writes job.json only after all of them reported back, then moves
LATEST_JOB. A crash at any point leaves the previous job complete and
LATEST_JOB pointing at it; a job directory without job.json is ignored and
pruned later.

Resuming needs the same world size: rows are sharded by `owner_of(key,
world_size)` and files are striped by offset % world_size, so a job of
another size would put rows and records on the wrong ranks.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stream_ctr.train.checkpoint import CheckpointError, CheckpointState, CorruptCheckpoint, load_checkpoint
from stream_ctr.config import Config, ConfigError

LATEST_JOB = "LATEST_JOB"
JOB_FILE = "job.json"
FORMAT_VERSION = 1
_JOB_RE = re.compile(r"^job-(\d{8})$")


@dataclass
class Job:
    path: Path
    manifest: dict[str, Any]


def job_dir(root: Path, seq: int) -> Path:
    return root / f"job-{seq:08d}"


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def _seqs(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _JOB_RE.match(p.name)))


def last_seq(root: Path) -> int:
    """Highest job number present, complete or not (new jobs never reuse a directory)."""
    seqs = _seqs(root)
    return seqs[-1] if seqs else 0


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_durable(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rank_entry(ckpt: Path, job: Path, rank: int, positions: dict[str, int], records: int,
               step: int) -> dict[str, Any]:
    """What rank `rank` reports about the checkpoint it just wrote at `ckpt`."""
    return {"rank": rank, "checkpoint": str(ckpt.relative_to(job)),
            "manifest_sha256": _sha256(ckpt / "manifest.json"), "positions": dict(positions),
            "records_trained": records, "trainer_step": step}


def write_manifest(job: Path, seq: int, global_step: int, entries: list[dict], cfg: Config,
                   keep: int) -> None:
    """Rank 0, after every rank's checkpoint is durable: job.json, then LATEST_JOB, then prune."""
    manifest = {"format": "stream_ctr job", "format_version": FORMAT_VERSION, "job": seq,
                "world_size": len(entries), "global_step": global_step,
                "records_trained": sum(e["records_trained"] for e in entries),
                "ranks": sorted(entries, key=lambda e: e["rank"]), "config": cfg.to_dict()}
    _write_durable(job / JOB_FILE, json.dumps(manifest, indent=1, sort_keys=True).encode())
    _write_durable(job.parent / LATEST_JOB, job.name.encode())
    _prune(job.parent, seq, keep)


def _prune(root: Path, current: int, keep: int) -> None:
    complete = [s for s in _seqs(root) if (job_dir(root, s) / JOB_FILE).exists()]
    kept = set(complete[-keep:]) | {current}
    for s in _seqs(root):
        if s < current and s not in kept:
            shutil.rmtree(job_dir(root, s), ignore_errors=True)


def find_job(path: str | Path) -> Path:
    """A job directory, a checkpoint root with LATEST_JOB, or a run directory."""
    p = Path(path)
    if (p / JOB_FILE).exists():
        return p
    for root in (p, p / "checkpoints"):
        if (root / LATEST_JOB).exists():
            return root / (root / LATEST_JOB).read_text().strip()
    if (p / "LATEST").exists() or (p / "manifest.json").exists() or (p / "checkpoints" / "LATEST").exists():
        raise ConfigError(f"{p} holds a single-process checkpoint, not a distributed job's; resume it "
                          "without torchrun (stream-ctr train --resume ...)")
    raise CheckpointError(f"no distributed job checkpoint at {p}: expected a job directory (with "
                          f"{JOB_FILE}), a checkpoint root (with {LATEST_JOB}) or a run directory")


def read_job_manifest(job: Path) -> dict[str, Any]:
    """The job manifest of job directory `job`, checked against the form `write_manifest`
    writes before anything else reads it (each rank's checkpoint is then verified by
    `load_checkpoint`). Raises CorruptCheckpoint naming the problem."""
    def corrupt(problem: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"corrupt checkpoint {job}: {problem}")
    try:
        manifest = json.loads((job / JOB_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise corrupt(f"{JOB_FILE} cannot be read ({e})") from None
    if not isinstance(manifest, dict):
        raise corrupt(f"{JOB_FILE} is not a JSON object")
    for key, kind in (("format_version", int), ("world_size", int), ("global_step", int),
                      ("records_trained", int), ("ranks", list), ("config", dict)):
        if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool):
            raise corrupt(f'{JOB_FILE} "{key}" is {manifest.get(key)!r}, not {"an integer" if kind is int else "a " + kind.__name__}')
    if manifest["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"{job}: job format version {manifest['format_version']} "
                              f"is not {FORMAT_VERSION}")
    ranks = manifest["ranks"]
    if manifest["world_size"] < 1 or len(ranks) != manifest["world_size"]:
        raise corrupt(f'{JOB_FILE} lists {len(ranks)} ranks for a world size of {manifest["world_size"]}')
    for r, entry in enumerate(ranks):
        fields = (("rank", int), ("checkpoint", str), ("manifest_sha256", str), ("positions", dict),
                  ("records_trained", int), ("trainer_step", int))
        if not isinstance(entry, dict) or entry.get("rank") != r or not all(
                isinstance(entry.get(k), kind) for k, kind in fields):
            raise corrupt(f"{JOB_FILE}: the entry of rank {r} is not the one written for it")
        ckpt = Path(entry["checkpoint"])
        if ckpt.is_absolute() or ".." in ckpt.parts or ckpt.parts[:1] != (rank_dir_name(r),):
            raise corrupt(f"{JOB_FILE}: rank {r}'s checkpoint {entry['checkpoint']!r} is not inside "
                          f"its {rank_dir_name(r)} directory")
    return manifest


def open_job(path: str | Path, world_size: int) -> Job:
    """Read a job manifest; refuses a job written by a different number of ranks."""
    job = find_job(path)
    manifest = read_job_manifest(job)
    n = manifest["world_size"]
    if n != world_size:
        raise ConfigError(
            f"{job} was written by {n} ranks but this job has {world_size}: embedding rows are "
            f"sharded and files striped by rank, so resume with exactly {n} ranks "
            f"(torchrun --nproc-per-node ... with {n} processes in all), or start a new run")
    return Job(job, manifest)


def rank_checkpoint(job: Job, rank: int) -> str:
    """Path of rank `rank`'s checkpoint in `job`, after checking it is the one job.json names."""
    entry = job.manifest["ranks"][rank]
    ckpt = job.path / entry["checkpoint"]
    manifest = ckpt / "manifest.json"
    if not manifest.exists():
        raise CorruptCheckpoint(f"corrupt checkpoint {job.path}: rank {rank}'s checkpoint {ckpt} is missing")
    if _sha256(manifest) != entry["manifest_sha256"]:
        raise CorruptCheckpoint(f"corrupt checkpoint {job.path}: rank {rank}'s checkpoint {ckpt} is not "
                                f"the one {JOB_FILE} names (its manifest changed)")
    return str(ckpt)


def merged_stream_positions(job: Job) -> dict[str, int]:
    """Kafka positions of the whole job: per partition the furthest any rank trained it
    (a partition's position only moves forward, whichever rank owns it), none marked
    given up; as a checkpoint's positions (what a rank's `restore` takes)."""
    from stream_ctr.connectors.kafka.positions import KafkaPositions
    return KafkaPositions.furthest(KafkaPositions.from_checkpoint(entry["positions"])
                                   for entry in job.manifest["ranks"]).to_checkpoint()


def is_job(path: str | Path) -> bool:
    p = Path(path)
    return (p / JOB_FILE).exists() or any((d / LATEST_JOB).exists() for d in (p, p / "checkpoints"))


def load_job_as_one(path: str | Path) -> CheckpointState:
    """A distributed job as one checkpoint, for evaluation: the shards' rows in one
    table, the dense model of rank 0 (every rank holds the same after the final merge)."""
    job = Job(find_job(path), {})
    job.manifest = read_job_manifest(job.path)
    states = [load_checkpoint(rank_checkpoint(job, r)) for r in range(job.manifest["world_size"])]
    first = states[0]
    shards = [s.tensors["trainer"]["store"] for s in states]
    if any("keys" not in shard for shard in shards):
        raise ConfigError(f"{job.path}: evaluating a distributed job needs store.kind = memory; this "
                          "job's rows live in per-rank tiered stores")
    import torch
    store = {name: torch.cat([shard[name] for shard in shards]) for name in shards[0]}
    trainer = dict(first.tensors["trainer"], store=store)
    return CheckpointState(first.step, job.manifest["records_trained"], first.positions, first.config,
                           dict(first.tensors, trainer=trainer), first.extra)


def load_any(checkpoint: str | Path) -> CheckpointState:
    """A checkpoint to score: a distributed job's shards as one table, or one run's checkpoint."""
    return load_job_as_one(checkpoint) if is_job(checkpoint) else load_checkpoint(checkpoint)
