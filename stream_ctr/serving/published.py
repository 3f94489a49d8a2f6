"""The publish directory: what a training run publishes and a predict server follows.

Layout of DIR (`stream-ctr train --publish DIR`, `stream-ctr serve --follow DIR`)::

    PUBLISHED.json    the index, replaced atomically: {"format": "stream-ctr-published",
                      "format_version": 1, "latest": 12, "full": 9, "chain": [10, 11, 12]}
    v-00000009/       a full snapshot: a bundle (bundle.py) holding every row
    v-00000010/       a delta: a bundle holding the rows touched since v9 and the dense
    v-00000011/       weights; its manifest's "publish" section (`PublishInfo`) names
    ...               the version it applies on (`base_version`)

**Versions** are integers, increasing across every run that publishes into DIR
(a resumed run goes on above the highest one there). A version is the model of
one durable checkpoint: it is published only after that checkpoint's LATEST
moved, so a crash never takes back a published version.
**The chain**: `full` is the newest full snapshot; `chain` the deltas after it, in
order, each on the one before it (the first on `full`). The model of version
`latest` is the full snapshot with every delta of the chain applied. A delta
replaces rows (values, not increments) and the whole dense model: applying one
twice gives the same model.
**Atomicity**: a version's bundle is written under a temporary name and renamed
into place (bundle.py); only then does PUBLISHED.json name it (write, fsync,
rename). A reader that follows PUBLISHED.json never sees half a version; a
directory that PUBLISHED.json does not name is a leftover of a crash and is
deleted by the next publisher.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stream_ctr.serving.bundle import BundleError

FORMAT = "stream-ctr-published"
FORMAT_VERSION = 1
INDEX = "PUBLISHED.json"
_VERSION_RE = re.compile(r"^v-(\d{8,})$")
KINDS = ("full", "delta")


@dataclass(frozen=True)
class PublishInfo:
    """The "publish" section of a published bundle's manifest."""
    version: int
    kind: str                           # full | delta
    base_version: int | None            # a delta applies on this version; None for a full one
    created_s: float                    # wall time the trainer started writing it
    # The newest arrival at the trainer (wall time, s) and event time (ms) of the records
    # this version trained on and its base did not: what freshness is measured from.
    # None when unknown (a resumed run's first snapshot covers records of an earlier process).
    newest_arrival_s: float | None = None
    newest_event_ms: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_manifest(manifest: dict[str, Any], where: str | Path) -> "PublishInfo | None":
        raw = manifest.get("publish")
        if raw is None:
            return None
        try:
            info = PublishInfo(**raw)
        except TypeError as e:
            raise BundleError(f"{where}: manifest's publish section is not understood: {e}") from None
        if not all(isinstance(v, int) and not isinstance(v, bool)
                   for v in (info.version, *([info.base_version] if info.base_version is not None else []))):
            raise BundleError(f"{where}: publish section {raw}: version and base_version must be integers")
        if info.kind not in KINDS or (info.kind == "delta") != (info.base_version is not None):
            raise BundleError(f"{where}: publish section {raw} is inconsistent (kind, base_version)")
        return info


@dataclass
class PublishedIndex:
    """PUBLISHED.json: the newest version and how to build it (see the module docstring)."""
    latest: int
    full: int
    chain: list[int] = field(default_factory=list)

    def versions(self) -> list[int]:
        """The full snapshot, then the deltas, in the order they apply."""
        return [self.full, *self.chain]

    def after(self, version: int) -> list[int] | None:
        """The deltas that bring `version` to `latest`, or None if `version` is not on the
        current chain (a follower must reload the full snapshot)."""
        versions = self.versions()
        return versions[versions.index(version) + 1:] if version in versions else None


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v-{version:08d}"


def version_dirs(root: str | Path) -> dict[int, Path]:
    """Every v-NNNNNNNN directory under `root` (named in the index or not)."""
    out = {}
    for p in Path(root).glob("v-*"):
        m = _VERSION_RE.match(p.name)
        if m and p.is_dir():
            out[int(m.group(1))] = p
    return out


def read_index(root: str | Path) -> PublishedIndex | None:
    """The index of a publish directory; None while nothing is published there yet."""
    path = Path(root) / INDEX
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{path} is unreadable (corrupt?): {e}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise BundleError(f"{path} is not a {FORMAT} index")
    if raw.get("format_version") != FORMAT_VERSION:
        raise BundleError(f"{path}: format version {raw.get('format_version')!r}, this stream-ctr "
                          f"reads version {FORMAT_VERSION}")
    try:
        index = PublishedIndex(int(raw["latest"]), int(raw["full"]), [int(v) for v in raw["chain"]])
    except (KeyError, TypeError, ValueError) as e:
        raise BundleError(f"{path}: malformed index ({e})") from None
    if index.versions()[-1] != index.latest or sorted(set(index.versions())) != index.versions():
        raise BundleError(f"{path}: the chain {index.versions()} does not end at latest {index.latest}")
    return index


def write_index(root: str | Path, index: PublishedIndex) -> None:
    """Replace the index atomically and durably."""
    root = Path(root)
    tmp = root / f".{INDEX}.tmp"
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "format_version": FORMAT_VERSION, **asdict(index)}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / INDEX)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["INDEX", "PublishInfo", "PublishedIndex", "read_index", "version_dir", "version_dirs",
           "write_index"]
