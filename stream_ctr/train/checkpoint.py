"""Atomic checkpoints: one directory per checkpoint, one manifest, one epoch id.

Layout of CHECKPOINT_DIR::

    LATEST                 name of the newest complete checkpoint (replaced atomically)
    ckpt-00000012/
        tensors.pt         dense model, dense optimizer, embedding rows + moments,
                           prequential window (torch.save, loaded weights_only=True)
        state.json         step, records, source positions, resolved config, totals
        manifest.json      checkpoint id, save_seq, and the sha256 ("files") and size
                           ("bytes") of every other file in the directory; with a
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

Nothing of a checkpoint is read before it is verified (`verify_checkpoint`): the
manifest must have the form written here and list exactly the files of its
directory, each with its size and sha256. A checkpoint that fails is corrupt
(`CorruptCheckpoint`); a `--resume` of a run or checkpoint root then falls back
to the newest valid checkpoint (`load_checkpoint(..., fall_back=True)`), while a
checkpoint directory named directly never does. Temporary files and directories
(`.tmp-*`, `.LATEST.tmp`) belong to a writer that died: the run directory's owner
removes them at start (stream_ctr/train/run_dir.py).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
# ckpt-<step>, or ckpt-<step>-<n> for the n-th re-save of a step.
_CKPT_RE = re.compile(r"^ckpt-(\d{8})(?:-(\d+))?$")


MANIFEST = "manifest.json"
# The files every checkpoint has besides its manifest.
CHECKPOINT_FILES = ("tensors.pt", "state.json")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message says which file."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint whose manifest is not the form `save_checkpoint` writes, or whose files
    do not match it (a damaged disk, a partial copy, a hand edit). The message starts
    with "corrupt checkpoint", names the directory, the file and the problem."""


@dataclass
class CheckpointState:
    step: int
    records_trained: int
    positions: dict[str, int]
    config: dict[str, Any]
    tensors: dict[str, Any]                 # nested dicts of tensors and plain numbers
    extra: dict[str, Any] = field(default_factory=dict)   # JSON-able totals, epoch, rejects...
    path: Path | None = None                # the checkpoint directory it was loaded from


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
        # "bytes" beside "files" (not inside it): version 0.13 and older read "files" as
        # name -> sha256, so they still resume these checkpoints.
        manifest = {"checkpoint": name, "format_version": FORMAT_VERSION, "save_seq": save_seq,
                    "files": {n: _sha256(tmp / n) for n in CHECKPOINT_FILES},
                    "bytes": {n: (tmp / n).stat().st_size for n in CHECKPOINT_FILES}}
        store = state.tensors.get("trainer", {}).get("store", {}) if isinstance(state.tensors, dict) else {}
        if store.get("kind") == "tiered":
            # The LMDB generation this checkpoint committed (stream_ctr/store/lmdb_tier.py).
            manifest["embedding_store"] = {k: store[k] for k in ("store_dir", "store_id", "generation", "nonce")}
        _write_file(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
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
    """Complete checkpoints as (save_seq, path), oldest save first. A manifest without a
    readable save_seq (a corrupt one) counts as saved first, in step order: the first
    pruned. Nothing here is verified; `verify_checkpoint` is."""
    out = []
    for p in root.glob("ckpt-*"):
        if _step_of(p.name) is None:
            continue
        try:
            manifest = json.loads((p / MANIFEST).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue            # incomplete (an interrupted delete): not a checkpoint
        seq = manifest.get("save_seq") if isinstance(manifest, dict) else None
        out.append((seq if isinstance(seq, int) and not isinstance(seq, bool) else 0, p))
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
    if (p / MANIFEST).exists():
        return p
    latest = p / "LATEST"
    if latest.exists():
        try:
            name = latest.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise CorruptCheckpoint(f"corrupt checkpoint root {p}: LATEST cannot be read ({e})") from None
        if _step_of(name) is None or not (p / name).is_dir():
            raise CorruptCheckpoint(f"corrupt checkpoint root {p}: LATEST names {name!r}, which is "
                                    "no checkpoint directory there")
        return p / name
    if (p / "checkpoints" / "LATEST").exists():       # a run directory
        return resolve_checkpoint(p / "checkpoints")
    if any((d / "LATEST_JOB").exists() or (d / "job.json").exists() for d in (p, p / "checkpoints")):
        raise CheckpointError(f"{p} holds a distributed job's checkpoint (stream_ctr/distributed/job_checkpoint.py): "
                              "resume it with the same number of ranks, e.g. torchrun "
                              "--nproc-per-node=N -m stream_ctr train --resume ...")
    lock = p / ".lock"                  # run_dir.LOCK_FILE: a run directory before its first checkpoint
    if lock.exists() or (p / "timeseries.jsonl").exists():
        try:
            pid = json.loads(lock.read_text() or "{}").get("pid")
        except (OSError, ValueError):
            pid = None
        running = f" (its trainer, PID {pid}, may still be running)" if pid else ""
        raise CheckpointError(f"no checkpoint yet in the run directory {p}{running}: a run writes one "
                              "every train.checkpoint_every_batches batches and at its end; wait for it, "
                              "or, if the run failed before its first, train it again")
    raise CheckpointError(f"no checkpoint at {p}: expected a checkpoint directory "
                          "(with manifest.json), a checkpoint root (with LATEST) or a run directory")


def read_manifest(ckpt: Path) -> dict[str, Any]:
    """The manifest of checkpoint directory `ckpt`, checked against the form
    `save_checkpoint` writes and against the directory: every file there is listed,
    every listed file is there with its listed size. Reads no other file (the
    checksums are `verify_checkpoint`'s). Raises CorruptCheckpoint naming the file
    and the problem; CheckpointError for a serving bundle or another format version.

    Manifests written before sizes were recorded (version 0.13 and older) have no
    "bytes": they are accepted, their files still checked against their sha256."""
    def corrupt(problem: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"corrupt checkpoint {ckpt}: {problem}")
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
    except FileNotFoundError:
        raise corrupt(f"{MANIFEST} is missing") from None
    except (OSError, UnicodeDecodeError) as e:
        raise corrupt(f"{MANIFEST} cannot be read ({e})") from None
    except json.JSONDecodeError as e:
        raise corrupt(f"{MANIFEST} is not JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise corrupt(f"{MANIFEST} holds {type(manifest).__name__}, not a JSON object")
    if manifest.get("format") == "stream-ctr-bundle":      # serving/bundle.py writes these
        raise CheckpointError(f"{ckpt} is a serving bundle (stream-ctr export), not a run or "
                              "checkpoint: pass the run directory it was exported from, or score "
                              f"the bundle with stream-ctr predict {ckpt}")
    for key, kind in (("checkpoint", str), ("format_version", int), ("save_seq", int), ("files", dict)):
        if key not in manifest:
            raise corrupt(f'{MANIFEST} has no "{key}"')
        if not isinstance(manifest[key], kind) or isinstance(manifest[key], bool):
            raise corrupt(f'{MANIFEST} "{key}" is {manifest[key]!r}, not {"an integer" if kind is int else "a " + kind.__name__}')
    if manifest["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"{ckpt}: format version {manifest['format_version']} is not "
                              f"{FORMAT_VERSION}: it was written by another version of stream-ctr")
    files, sizes = manifest["files"], manifest.get("bytes")
    for name in CHECKPOINT_FILES:
        if name not in files:
            raise corrupt(f'{MANIFEST} does not list {name} in "files"')
    for name, digest in files.items():
        if name in (".", "..", MANIFEST) or "/" in name or "\\" in name:
            raise corrupt(f'{MANIFEST} lists {name!r}, which is no file of a checkpoint')
        if not isinstance(digest, str) or not _SHA256_RE.match(digest):
            raise corrupt(f'{MANIFEST} gives {name} the sha256 {digest!r}, not 64 hex digits')
    if sizes is not None:
        if not isinstance(sizes, dict) or set(sizes) != set(files):
            raise corrupt(f'{MANIFEST} "bytes" does not list the same files as "files"')
        for name, size in sizes.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise corrupt(f'{MANIFEST} gives {name} the size {size!r}, not a byte count')
    try:
        present = {e.name: e for e in os.scandir(ckpt)}
    except OSError as e:
        raise corrupt(f"the directory cannot be listed ({e.strerror or e})") from None
    for name in sorted(present):
        if name != MANIFEST and name not in files:
            raise corrupt(f"{name} is in the directory but not listed in {MANIFEST}")
    for name in files:
        entry = present.get(name)
        if entry is None or not entry.is_file():
            raise corrupt(f"{name} is listed in {MANIFEST} but {'missing' if entry is None else 'not a file'}")
        if sizes is not None and entry.stat().st_size != sizes[name]:
            raise corrupt(f"{name} is {entry.stat().st_size:,} bytes, {MANIFEST} says {sizes[name]:,} "
                          "(truncated or overwritten)")
    return manifest


def verify_checkpoint(ckpt: str | Path) -> dict[str, Any]:
    """`read_manifest`, then every listed file against its sha256 (reads them all).
    Returns the manifest; raises CorruptCheckpoint naming the first file that fails."""
    ckpt = Path(ckpt)
    manifest = read_manifest(ckpt)
    for name, digest in manifest["files"].items():
        try:
            actual = _sha256(ckpt / name)
        except OSError as e:
            raise CorruptCheckpoint(f"corrupt checkpoint {ckpt}: {name} cannot be read "
                                    f"({e.strerror or e})") from None
        if actual != digest:
            raise CorruptCheckpoint(f"corrupt checkpoint {ckpt}: {name} does not match its sha256 "
                                    f"in {MANIFEST} (its bytes changed since it was written)")
    return manifest


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu",
                    fall_back: bool = False) -> CheckpointState:
    """Load a checkpoint after `verify_checkpoint`; see `resolve_checkpoint` for `path`.

    Raises CorruptCheckpoint for a checkpoint that fails verification. With
    `fall_back` (what --resume asks) and `path` a checkpoint root or run directory
    whose LATEST checkpoint is corrupt, loads the newest valid one there instead
    and says so on stderr; a checkpoint directory named itself never falls back."""
    p = Path(path)
    if not fall_back or (p / MANIFEST).exists():
        return _load(resolve_checkpoint(p), map_location)
    root = p if (p / "LATEST").exists() else p / "checkpoints"
    latest = None
    try:
        latest = resolve_checkpoint(p)
        return _load(latest, map_location)
    except CorruptCheckpoint as e:
        why = str(e)
    skipped = []
    for _, ckpt in reversed(_checkpoints(root)):
        if ckpt == latest:
            continue
        try:
            state = _load(ckpt, map_location)
        except CorruptCheckpoint as e:
            skipped.append(str(e))
            continue
        also = f" (also corrupt: {'; '.join(skipped)})" if skipped else ""
        print(f"stream-ctr: warning: {why}; --resume {path} continues from {ckpt.name} "
              f"(step {state.step:,}, {state.records_trained:,} records), the newest valid "
              f"checkpoint in {root}{also}", file=sys.stderr, flush=True)
        return state
    also = f" ({'; '.join(skipped)})" if skipped else ""
    raise CorruptCheckpoint(f"{why}; and {root} holds no other valid checkpoint{also}: train a "
                            "new run into another --run-dir (the corrupt files stay for inspection)")


def _load(ckpt: Path, map_location: str | torch.device) -> CheckpointState:
    """Verify, then read, the checkpoint directory `ckpt`."""
    verify_checkpoint(ckpt)

    def corrupt(problem: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"corrupt checkpoint {ckpt}: {problem}")
    try:
        meta = json.loads((ckpt / "state.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise corrupt(f"state.json cannot be read ({e})") from None
    if not isinstance(meta, dict):
        raise corrupt("state.json is not a JSON object")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{ckpt}: format version {meta.get('format_version')} "
                              f"is not {FORMAT_VERSION}")
    for key, kind in (("step", int), ("records_trained", int), ("positions", dict), ("config", dict)):
        if not isinstance(meta.get(key), kind):
            raise corrupt(f'state.json "{key}" is {meta.get(key)!r}, not {"an integer" if kind is int else "an object"}')
    if not isinstance(meta.get("extra", {}), dict):
        raise corrupt(f'state.json "extra" is {meta["extra"]!r}, not an object')
    try:
        tensors = torch.load(ckpt / "tensors.pt", map_location=map_location, weights_only=True)
    except Exception as e:     # any failure to unpickle: the file is not what save_checkpoint wrote
        raise corrupt(f"tensors.pt cannot be loaded ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return CheckpointState(step=meta["step"], records_trained=meta["records_trained"],
                           positions=meta["positions"], config=meta["config"],
                           tensors=tensors, extra=meta.get("extra", {}), path=ckpt)
