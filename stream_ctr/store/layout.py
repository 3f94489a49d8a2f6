"""The byte layout of one embedding row, the same in every tier.

A row of an embedding of dimension d has `cols = d + 1` float32 columns (the
d-dim embedding and the 1-dim linear weight, see stream_ctr/store/embedding.py),
their Adam moments, and four int64 metadata fields::

    offset 0            w     float32[cols]   weights
           4*cols       m     float32[cols]   Adam first moment (exp_avg)
           8*cols       v     float32[cols]   Adam second moment (exp_avg_sq)
           12*cols      (zero padding to a multiple of 8)
           meta_off     count       int64   occurrences in trained batches
           meta_off+8   last_step   int64   store clock (batches prepared) when last seen
           meta_off+16  event_ms    int64   event time of the batch it was last seen in (-1: none)
           meta_off+24  write_gen   int64   LMDB generation its disk copy was written in (-1: none)

Host RAM rows and LMDB values are exactly these bytes (native little-endian);
the device cache keeps the same fields as separate tensors, because the fused
CowClip + Adam kernel needs w, m and v each as its own contiguous table.
LMDB keys are the 8-byte big-endian encoding of the key, so that byte order
(LMDB's order) is numeric order and sorted key arrays are sorted LMDB keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

COUNT, LAST_STEP, EVENT_MS, WRITE_GEN = range(4)
META_FIELDS = 4


@dataclass(frozen=True)
class RowLayout:
    dim: int

    @property
    def cols(self) -> int:
        return self.dim + 1

    @property
    def float_bytes(self) -> int:
        return 12 * self.cols

    @property
    def meta_off(self) -> int:
        return (self.float_bytes + 7) // 8 * 8

    @property
    def row_bytes(self) -> int:
        return self.meta_off + 8 * META_FIELDS

    def fingerprint(self) -> str:
        """Identifies the layout in an LMDB store's metadata."""
        return f"row-v1 dim={self.dim} row_bytes={self.row_bytes}"

    def empty(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros(n, self.row_bytes, dtype=torch.uint8, device=device)

    def floats(self, packed: torch.Tensor) -> torch.Tensor:
        """View [n, 3*cols] float32 of packed rows (w | m | v), no copy."""
        return packed[:, : self.float_bytes].view(torch.float32)

    def meta(self, packed: torch.Tensor) -> torch.Tensor:
        """View [n, 4] int64 of the metadata of packed rows, no copy."""
        return packed[:, self.meta_off:].view(torch.int64)

    def pack(self, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
             meta: torch.Tensor) -> torch.Tensor:
        """Rows [n, row_bytes] uint8 from w, m, v [n, cols] float32 and meta [n, 4] int64."""
        out = self.empty(w.shape[0], w.device)
        f, c = self.floats(out), self.cols
        f[:, :c], f[:, c:2 * c], f[:, 2 * c:] = w, m, v
        self.meta(out)[:] = meta
        return out

    def unpack(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w, m, v, meta) as new contiguous tensors from packed rows."""
        f, c = self.floats(packed), self.cols
        return (f[:, :c].contiguous(), f[:, c:2 * c].contiguous(), f[:, 2 * c:].contiguous(),
                self.meta(packed).contiguous())


def row_records(rows: np.ndarray) -> np.ndarray:
    """A 1-D view of C-contiguous rows [n, w] as n fixed-size records (numpy `V<w>`):
    numpy then indexes and assigns whole rows, one memcpy each, not byte by byte.
    Rows that are not contiguous are copied first, so assign only into contiguous ones."""
    return np.ascontiguousarray(rows).view(f"V{rows.shape[1]}").reshape(rows.shape[0])


def gather_rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """`table[idx]` (a copy) for a 2-D table and int64 row indices or a bool mask.

    Why not `table[idx]`: torch's advanced indexing copies a row element by
    element, about 9x slower than `index_select`'s row copies on 236-byte
    packed rows; rows move between tiers by the tens of thousands a step."""
    if idx.dtype == torch.bool:
        idx = torch.nonzero(idx).view(-1)
    return table.index_select(0, idx)


def scatter_rows(table: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """`table[idx] = src` for a 2-D table, distinct int64 row indices and rows [n, w].

    On the CPU a contiguous table takes the rows through numpy's fixed-size
    void view: one memcpy a row (torch's `index_put_` and `index_copy_` copy
    element by element, 5-7x slower on packed uint8 rows)."""
    if idx.numel() == 0:
        return
    if table.device.type == "cpu" and table.is_contiguous() and table.dim() == 2:
        src = src.to(table.dtype).contiguous()
        row_records(table.numpy().view(np.uint8))[idx.numpy()] = row_records(src.numpy().view(np.uint8))
    else:
        table.index_copy_(0, idx, src.to(table.dtype))


def new_meta(n: int, step: int, event_ms: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Metadata of rows created now: never counted, seen at `step`, no disk copy."""
    meta = torch.zeros(n, META_FIELDS, dtype=torch.int64, device=device)
    meta[:, LAST_STEP] = step
    meta[:, EVENT_MS] = event_ms
    meta[:, WRITE_GEN] = -1
    return meta


def refuse_negative_keys(keys: torch.Tensor) -> None:
    """ValueError if a key is negative. LMDB keys are big-endian unsigned bytes, so a
    negative int64 would sort after every positive one and break the sorted reads and
    scans; real keys are 63-bit hashes (connectors/hashing.py), never negative."""
    if keys.numel() and bool((keys < 0).any()):
        raise ValueError(f"embedding keys must be non-negative (63-bit feature hashes, see "
                         f"connectors/hashing.py): got negative key {int(keys.min())}")


def encode_keys(keys: np.ndarray) -> list[bytes]:
    """LMDB keys (8-byte big-endian) for int64 keys, in the given order."""
    return np.ascontiguousarray(keys, dtype=np.int64).astype(">u8").view("V8").tolist()


def decode_keys(blob: bytes) -> np.ndarray:
    """int64 keys from concatenated 8-byte big-endian LMDB keys."""
    return np.frombuffer(blob, dtype=">u8").astype(np.int64)


def items(keys: np.ndarray, rows: np.ndarray) -> list[tuple[bytes, bytes]]:
    """(key, value) pairs for `putmulti` from keys [n] and rows [n, W] uint8.

    numpy builds the tuples in C (a structured void array's tolist), about
    4x faster than slicing bytes in a Python loop.
    """
    n, w = rows.shape
    rec = np.empty(n, dtype=np.dtype([("k", "V8"), ("v", f"V{w}")]))
    rec["k"] = np.ascontiguousarray(keys, dtype=np.int64).astype(">u8").view("V8")
    rec["v"] = np.ascontiguousarray(rows).view(f"V{w}").reshape(n)
    return rec.tolist()
