"""The serving bundle: one directory a predictor loads without the trainer's code or pickles.

Layout of a bundle directory::

    manifest.json   "format": "stream-ctr-bundle", "format_version", the model config,
                    n_fields, n_dense, the record format, the checkpoint it came from
                    (path, step, records trained, source positions), the run's held-out
                    lines, the precision it scores in, the initial-row rule, and the
                    size + sha256 of every file below
    dense.pt        the dense model's state_dict: plain tensors only
                    (torch.save; loaded with torch.load(weights_only=True))
    keys.npy        int64 [N], strictly increasing embedding keys
    rows.npy        float32 [N, dim + 1] their rows: the embedding, then the linear
                    weight (no Adam moments, no metadata)

keys.npy and rows.npy open with np.load(mmap_mode="r"): a table larger than RAM
is served from the page cache. They are written chunk by chunk (`BundleWriter.add`
with ascending keys): the header is a fixed-size block filled in at the end, so
the writer never needs the whole table. A key that is not in keys.npy scores with
its initial row, a pure function of (key, seed, init_std) (store/embedding.py
`init_rows`); the manifest's "init" says which.

A bundle is written into a temporary directory beside `out` and renamed into
place when complete: a reader never sees half a bundle.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stream_ctr.store.errors import StoreError

FORMAT = "stream-ctr-bundle"
FORMAT_VERSION = 1
FILES = ("dense.pt", "keys.npy", "rows.npy")
_NPY_HEADER_BYTES = 128          # fixed: room for any shape, a multiple of 64 (aligned data)


class BundleError(StoreError):
    """A bundle is missing, corrupt or of another format version; the message says which
    file. (A StoreError: the CLI exits with status 4, like a bad checkpoint.)"""


def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """A .npy version 1.0 header of exactly _NPY_HEADER_BYTES bytes."""
    text = repr({"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
                 "shape": shape}).encode("latin1")
    room = _NPY_HEADER_BYTES - 10
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", room) + text + b" " * (room - len(text) - 1) + b"\n"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class BundleWriter:
    """Writes a bundle: rows chunk by chunk in ascending key order, then `finish`."""

    def __init__(self, out: str | Path, cols: int) -> None:
        self.out = Path(out)
        if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
            raise FileExistsError(f"{self.out} exists and is not an empty directory: "
                                  "choose a new --out for the bundle")
        self.cols, self.count, self._last = cols, 0, -1
        self.tmp = self.out.parent / f".tmp-{self.out.name}-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self._keys = open(self.tmp / "keys.npy", "wb")
        self._rows = open(self.tmp / "rows.npy", "wb")
        for f in (self._keys, self._rows):
            f.write(b"\0" * _NPY_HEADER_BYTES)          # the real header once the count is known

    def add(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Append rows [n, cols] of keys [n], strictly above every key added before."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if rows.shape != (len(keys), self.cols):
            raise ValueError(f"rows of shape {rows.shape} for {len(keys)} keys of {self.cols} columns")
        if not len(keys):
            return
        if keys[0] <= self._last or (len(keys) > 1 and bool(np.any(np.diff(keys) <= 0))):
            raise ValueError("bundle rows must be added in strictly increasing key order")
        self._keys.write(keys.tobytes())
        self._rows.write(rows.tobytes())
        self.count += len(keys)
        self._last = int(keys[-1])

    def finish(self, dense: dict[str, torch.Tensor], manifest: dict[str, Any]) -> Path:
        """Write dense.pt and manifest.json, make every file durable, move the bundle to `out`."""
        for f, dtype, shape in ((self._keys, np.int64, (self.count,)),
                                (self._rows, np.float32, (self.count, self.cols))):
            f.seek(0)
            f.write(_npy_header(np.dtype(dtype), shape))
            f.flush()
            os.fsync(f.fileno())
            f.close()
        with open(self.tmp / "dense.pt", "wb") as f:
            torch.save({k: v.detach().cpu().contiguous() for k, v in dense.items()}, f)
            f.flush()
            os.fsync(f.fileno())
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest,
                    "files": {n: {"bytes": (self.tmp / n).stat().st_size, "sha256": _sha256(self.tmp / n)}
                              for n in FILES}}
        manifest["rows"] = {**manifest.get("rows", {}), "count": self.count, "cols": self.cols}
        with open(self.tmp / "manifest.json", "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if self.out.exists():
            self.out.rmdir()                            # empty (checked in __init__)
        os.rename(self.tmp, self.out)
        return self.out

    def abort(self) -> None:
        for f in (self._keys, self._rows):
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


@dataclass
class Bundle:
    path: Path
    manifest: dict[str, Any]
    dense: dict[str, torch.Tensor]
    keys: np.ndarray                # int64 [N] sorted, memory-mapped
    rows: np.ndarray                # float32 [N, dim + 1], memory-mapped

    @property
    def version(self) -> str:
        """The model version: the checkpoint it came from and its step; for a published
        version (published.py) prefixed by its number, e.g. "v12:ckpt-00000120@120"."""
        c = self.manifest["checkpoint"]
        published = self.manifest.get("publish")
        prefix = f"v{published['version']}:" if published else ""
        return f"{prefix}{c['name']}@{c['step']}"


def read_manifest(path: str | Path) -> dict[str, Any]:
    root = Path(path)
    try:
        manifest = json.loads((root / "manifest.json").read_text())
    except FileNotFoundError:
        if (root / "checkpoints").is_dir() or (root / "LATEST").is_file():
            raise BundleError(f"{root} is a training run, not a bundle: export it first "
                              f"(stream-ctr export {root} --out BUNDLE) and name BUNDLE") from None
        raise BundleError(f"no bundle at {root}: expected a directory with manifest.json "
                          "(written by `stream-ctr export`)") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{root}/manifest.json is unreadable (corrupt?): {e}") from None
    if isinstance(manifest, dict) and isinstance(manifest.get("checkpoint"), str):   # train/checkpoint.py's
        raise BundleError(f"{root} is a training checkpoint, not a bundle: export it first "
                          f"(stream-ctr export {root} --out BUNDLE) and name BUNDLE")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"{root}/manifest.json is not a {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise BundleError(f"{root}: bundle format version {manifest.get('format_version')!r}, this "
                          f"stream-ctr reads version {FORMAT_VERSION}: re-export it with this version")
    _check_fields(root, manifest)
    return manifest


# What the readers take from a manifest without looking (read_bundle, Scorer, Bundle.version,
# the server's status), and its JSON type: a manifest that parses but lacks one, or holds
# another type there (edited by hand, written by another tool), is refused here by name. Met
# later it was a KeyError or TypeError: a traceback, or a follower thread that died.
_REQUIRED: dict[tuple[str, ...], tuple[type, ...]] = {
    ("checkpoint", "name"): (str,), ("checkpoint", "step"): (int,), ("files",): (dict,),
    ("init", "seed"): (int,), ("init", "init_std"): (int, float), ("model", "name"): (str,),
    ("model", "embed_dim"): (int,),
    ("record_format", "name"): (str,), ("rows", "count"): (int,), ("rows", "cols"): (int,),
    ("n_fields",): (int,), ("n_dense",): (int,), ("precision",): (str,),
    **{("files", name, "bytes"): (int,) for name in FILES},
    **{("files", name, "sha256"): (str,) for name in FILES}}


def _check_fields(root: Path, manifest: dict[str, Any]) -> None:
    """BundleError naming the first field of `_REQUIRED` that is missing or of another type."""
    for path, types in _REQUIRED.items():
        value: Any = manifest
        for i, key in enumerate(path):
            if not isinstance(value, dict) or key not in value:
                where = ".".join(path[:i + 1])
                if path[0] == "files" and i == 1:
                    raise BundleError(f"{root}: file {key} missing from the manifest: re-export the "
                                      "bundle (stream-ctr export)")
                raise BundleError(f"{root}/manifest.json has no {where}: not a complete bundle manifest "
                                  "(edited, or written by another tool?): re-export the bundle "
                                  "(stream-ctr export)")
            value = value[key]
        if not isinstance(value, types) or isinstance(value, bool):
            raise BundleError(f"{root}/manifest.json: {'.'.join(path)} is {value!r}, not "
                              f"{' or '.join(t.__name__ for t in types)}: re-export the bundle "
                              "(stream-ctr export)")


def _load_npy(path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise BundleError(f"{path} is unreadable (corrupt?): {e}") from None
    if arr.dtype != dtype or arr.shape != shape:
        raise BundleError(f"{path} holds {arr.dtype} {arr.shape}, the manifest says {dtype} {shape}")
    return arr


def read_bundle(path: str | Path, verify: bool = True) -> Bundle:
    """Open a bundle: manifest, dense weights (weights_only), keys/rows memory-mapped.

    Every file's size is checked; with `verify` (the default) also its sha256, which
    reads the whole table once. Raises BundleError naming the file that is wrong."""
    root = Path(path)
    manifest = read_manifest(root)
    for name in FILES:
        want = manifest.get("files", {}).get(name)
        if want is None or not (root / name).is_file():
            raise BundleError(f"{root}: file {name} missing")
        if (root / name).stat().st_size != want["bytes"] or (verify and _sha256(root / name) != want["sha256"]):
            raise BundleError(f"{root}: file {name} does not match its checksum (corrupt)")
    try:
        dense = torch.load(root / "dense.pt", map_location="cpu", weights_only=True)
    except Exception as e:         # noqa: BLE001 - any unpickling failure is a bad file
        raise BundleError(f"{root}/dense.pt does not load as plain tensors: {e}") from None
    if not (isinstance(dense, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                            for k, v in dense.items())):
        raise BundleError(f"{root}/dense.pt holds a {type(dense).__name__}, not a state_dict of named "
                          "tensors: re-export the bundle (stream-ctr export)")
    n, cols = int(manifest["rows"]["count"]), int(manifest["rows"]["cols"])
    keys = _load_npy(root / "keys.npy", np.dtype(np.int64), (n,))
    rows = _load_npy(root / "rows.npy", np.dtype(np.float32), (n, cols))
    return Bundle(root, manifest, dense, keys, rows)


def model_config_fields(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest's model section with JSON lists back as tuples (ModelConfig's types)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in manifest["model"].items()}


__all__ = ["Bundle", "BundleError", "BundleWriter", "FORMAT_VERSION", "read_bundle", "read_manifest",
           "model_config_fields"]
