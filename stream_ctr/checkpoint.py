"""Atomic checkpoints: one directory per checkpoint, one manifest, one epoch id.

Layout of CHECKPOINT_DIR::

    LATEST                 name of the newest complete checkpoint (replaced atomically)
    ckpt-00000012/
        tensors.pt         dense model, dense optimizer, embedding rows + moments,
                           prequential window (torch.save, loaded weights_only=True)
        state.json         step, records, source positions, resolved config, totals
        manifest.json      checkpoint id and the sha256 of each file above; with a
                           tiered store, the LMDB generation it committed

A checkpoint is written into a temporary directory, fsynced, then renamed into
place; only then does LATEST move. A crash at any point leaves the previous
checkpoint valid and LATEST pointing at it. The source positions inside are the
offsets *after* the last trained record: resuming reads exactly what follows.
A tiered embedding store keeps its rows in LMDB, not in tensors.pt: its
checkpoint is one LMDB transaction (a generation) committed just before these
files are written; resuming rolls LMDB back to that generation
(stream_ctr/store/lmdb_tier.py says why a crash anywhere in between is safe).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message says which file."""


@dataclass
class CheckpointState:
    step: int
    records_trained: int
    positions: dict[str, int]
    config: dict[str, Any]
    tensors: dict[str, Any]                 # nested dicts of tensors and plain numbers
    extra: dict[str, Any] = field(default_factory=dict)   # JSON-able totals, epoch, rejects...


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(directory: str | Path, state: CheckpointState, keep: int = 3) -> Path:
    """Write `state` as checkpoint `ckpt-<step>` and point LATEST at it; returns its path.

    Blocks until the files are durable (fsync). Keeps the newest `keep` checkpoints.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    name = f"ckpt-{state.step:08d}"
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with open(tmp / "tensors.pt", "wb") as f:
            torch.save(state.tensors, f)
            f.flush()
            os.fsync(f.fileno())
        meta = {"format_version": FORMAT_VERSION, "step": state.step,
                "records_trained": state.records_trained, "positions": state.positions,
                "config": state.config, "extra": state.extra}
        _write_file(tmp / "state.json", json.dumps(meta, indent=1, sort_keys=True).encode())
        manifest = {"checkpoint": name, "format_version": FORMAT_VERSION,
                    "files": {n: _sha256(tmp / n) for n in ("tensors.pt", "state.json")}}
        store = state.tensors.get("trainer", {}).get("store", {}) if isinstance(state.tensors, dict) else {}
        if store.get("kind") == "tiered":
            # The LMDB generation this checkpoint committed (stream_ctr/store/lmdb_tier.py).
            manifest["embedding_store"] = {k: store[k] for k in ("store_dir", "store_id", "generation", "nonce")}
        _write_file(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
        if final.exists():       # same step saved again (e.g. end of run right after a periodic one)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _write_file(root / ".LATEST.tmp", name.encode())
        os.replace(root / ".LATEST.tmp", root / "LATEST")
        _fsync_dir(root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write checkpoint in {root}: {e.strerror or e} "
                              "(check free disk space and permissions); the previous checkpoint "
                              "is still valid") from e
    _prune(root, keep)
    return final


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("ckpt-*") if (p / "manifest.json").exists())
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory itself, or the one LATEST names inside a checkpoint root."""
    p = Path(path)
    if (p / "manifest.json").exists():
        return p
    latest = p / "LATEST"
    if latest.exists():
        return p / latest.read_text().strip()
    if (p / "checkpoints" / "LATEST").exists():       # a run directory
        return resolve_checkpoint(p / "checkpoints")
    if any((d / "LATEST_JOB").exists() or (d / "job.json").exists() for d in (p, p / "checkpoints")):
        raise CheckpointError(f"{p} holds a distributed job's checkpoint (stream_ctr/job_checkpoint.py): "
                              "resume it with the same number of ranks, e.g. torchrun "
                              "--nproc-per-node=N -m stream_ctr train --resume ...")
    raise CheckpointError(f"no checkpoint at {p}: expected a checkpoint directory "
                          "(with manifest.json), a checkpoint root (with LATEST) or a run directory")


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> CheckpointState:
    """Load and verify (checksums) a checkpoint; see `resolve_checkpoint` for `path`."""
    ckpt = resolve_checkpoint(path)
    try:
        manifest = json.loads((ckpt / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{ckpt}/manifest.json unreadable: {e}") from None
    for name, digest in manifest["files"].items():
        if not (ckpt / name).exists():
            raise CheckpointError(f"{ckpt}: file {name} missing")
        if _sha256(ckpt / name) != digest:
            raise CheckpointError(f"{ckpt}: file {name} does not match its checksum (corrupt)")
    meta = json.loads((ckpt / "state.json").read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{ckpt}: format version {meta.get('format_version')} "
                              f"is not {FORMAT_VERSION}")
    tensors = torch.load(ckpt / "tensors.pt", map_location=map_location, weights_only=True)
    return CheckpointState(step=meta["step"], records_trained=meta["records_trained"],
                           positions=meta["positions"], config=meta["config"],
                           tensors=tensors, extra=meta.get("extra", {}))
