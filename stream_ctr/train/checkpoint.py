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
place under a name no existing directory has; only then does LATEST move, and
only after that are older directories deleted. A crash at any point leaves
LATEST naming a complete checkpoint: the previous one, or the new one. A step
saved again (the end-of-run checkpoint right after a periodic one on the same
step, a Kafka revoke) gets `ckpt-<step>-<n>`; the one it replaces is deleted
once LATEST has moved. `keep` counts checkpoints in the order they were saved
(`save_seq` in the manifest), not by step: a run resumed from an older
checkpoint saves smaller steps than the ones it abandoned. The source positions
inside are the offsets *after* the last trained record: resuming reads exactly
what follows.
A tiered embedding store keeps its rows in LMDB, not in tensors.pt: its
checkpoint is one LMDB transaction (a generation) committed just before these
files are written; resuming rolls LMDB back to that generation
(stream_ctr/store/lmdb_tier.py says why a crash anywhere in between is safe).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
# ckpt-<step>, or ckpt-<step>-<n> for the n-th re-save of a step.
_CKPT_RE = re.compile(r"^ckpt-(\d{8})(?:-(\d+))?$")


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
    """Write `state` as checkpoint `ckpt-<step>` (`ckpt-<step>-<n>` if that step was
    saved before) and point LATEST at it; returns its path.

    Blocks until the files are durable (fsync). Keeps the newest `keep` checkpoints.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    saved = _checkpoints(root)
    name = _new_name(root, state.step)
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with open(tmp / "tensors.pt", "wb") as f:
            try:
                torch.save(state.tensors, f)
            except RuntimeError as e:     # how torch's writer reports a failed write (disk full)
                raise OSError(errno.EIO, f"writing tensors.pt failed, is the disk full? "
                                         f"({str(e).splitlines()[0]})") from e
            f.flush()
            os.fsync(f.fileno())
        meta = {"format_version": FORMAT_VERSION, "step": state.step,
                "records_trained": state.records_trained, "positions": state.positions,
                "config": state.config, "extra": state.extra}
        _write_file(tmp / "state.json", json.dumps(meta, indent=1, sort_keys=True).encode())
        save_seq = 1 + max((seq for seq, _ in saved), default=0)
        manifest = {"checkpoint": name, "format_version": FORMAT_VERSION, "save_seq": save_seq,
                    "files": {n: _sha256(tmp / n) for n in ("tensors.pt", "state.json")}}
        store = state.tensors.get("trainer", {}).get("store", {}) if isinstance(state.tensors, dict) else {}
        if store.get("kind") == "tiered":
            # The LMDB generation this checkpoint committed (stream_ctr/store/lmdb_tier.py).
            manifest["embedding_store"] = {k: store[k] for k in ("store_dir", "store_id", "generation", "nonce")}
        _write_file(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
        os.rename(tmp, final)     # `name` is new: LATEST still names a complete checkpoint
        # The rename must be durable before LATEST names it.
        _fsync_dir(root)
        _write_file(root / ".LATEST.tmp", name.encode())
        os.replace(root / ".LATEST.tmp", root / "LATEST")
        _fsync_dir(root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)    # a partial checkpoint must not fill the disk
        previous = (f"the previous checkpoint, {saved[-1][1].name}, is still valid: free space and "
                    f"run again with --resume to continue from it" if saved else
                    "no earlier checkpoint exists here: a --resume starts the run afresh")
        raise CheckpointError(f"cannot write checkpoint in {root}: {e.strerror or e}; "
                              f"{_space_note(root, state.tensors)} (check free disk space and "
                              f"permissions, or point train.checkpoint_dir at a larger disk); "
                              f"{previous}") from e
    # Only now, with LATEST on the new one, may the ones it replaces go.
    for _, old in saved:
        if _step_of(old.name) == state.step:
            shutil.rmtree(old, ignore_errors=True)
    _prune(root, keep, current=final)
    return final


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor and numpy array in a nested dict/list/tuple (a checkpoint's
    size, give or take its pickled structure)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if hasattr(obj, "nbytes") and hasattr(obj, "dtype"):
        return int(obj.nbytes)
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _space_note(root: Path, tensors: Any) -> str:
    """'it needs about X MiB and the disk has Y MiB free' (what a full disk's user must know)."""
    need_mib = tensor_bytes(tensors) / 2**20
    try:
        free_mib = shutil.disk_usage(root).free / 2**20
    except OSError:
        return f"it needs about {need_mib:,.1f} MiB"
    return f"it needs about {need_mib:,.1f} MiB and the disk has {free_mib:,.1f} MiB free"


def _step_of(name: str) -> int | None:
    m = _CKPT_RE.match(name)
    return int(m.group(1)) if m else None


def _new_name(root: Path, step: int) -> str:
    """`ckpt-<step>`, or `ckpt-<step>-<n>` with n above every existing re-save of `step`
    (complete or not): never the name of a directory LATEST may point at."""
    base = f"ckpt-{step:08d}"
    taken = [m for p in root.glob(base + "*") if (m := _CKPT_RE.match(p.name))]
    if not taken:
        return base
    return f"{base}-{1 + max(int(m.group(2) or 0) for m in taken)}"


def _checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints as (save_seq, path), oldest save first. Checkpoints written
    before save_seq existed count as saved first, in step order."""
    out = []
    for p in root.glob("ckpt-*"):
        if _step_of(p.name) is None:
            continue
        try:
            manifest = json.loads((p / "manifest.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue            # incomplete (an interrupted delete): not a checkpoint
        out.append((int(manifest.get("save_seq", 0)), p))
    return sorted(out, key=lambda sp: (sp[0], _step_of(sp[1].name), sp[1].name))


def _prune(root: Path, keep: int, current: Path) -> None:
    """Delete all but the `keep` most recently saved checkpoints; never `current` (LATEST)."""
    for _, old in _checkpoints(root)[:-keep]:
        if old != current:
            shutil.rmtree(old, ignore_errors=True)


def holds_checkpoint(path: str | Path) -> bool:
    """Whether `path` (a checkpoint, a checkpoint root or a run directory) has a
    checkpoint to resume, good or bad; False for a missing or checkpoint-less directory."""
    p = Path(path)
    markers = ("manifest.json", "LATEST", "checkpoints/LATEST", "LATEST_JOB", "job.json",
               "checkpoints/LATEST_JOB", "checkpoints/job.json")
    return any((p / m).exists() for m in markers)


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
        raise CheckpointError(f"{p} holds a distributed job's checkpoint (stream_ctr/distributed/job_checkpoint.py): "
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
    if manifest.get("format") == "stream-ctr-bundle":      # serving/bundle.py writes these
        raise CheckpointError(f"{ckpt} is a serving bundle (stream-ctr export), not a run or "
                              "checkpoint: pass the run directory it was exported from, or score "
                              f"the bundle with stream-ctr predict {ckpt}")
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
