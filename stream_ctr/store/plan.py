"""The memory plan of a tiered store: rows per tier from byte budgets.

`make_plan` turns the `[store]` byte budgets into row capacities, with every
byte a row costs in its tier counted (embedding, Adam moments, metadata,
index), and refuses plans that cannot work, naming the option to change.
`StorePlan.describe()` is what the trainer prints before it starts.
"""
from __future__ import annotations

from dataclasses import dataclass

from stream_ctr.config import ConfigError, ModelConfig, StoreConfig
from stream_ctr.store.device_cache import DeviceCache
from stream_ctr.store.host_tier import HostTier
from stream_ctr.store.key_filter import filter_bits_log2
from stream_ctr.store.layout import RowLayout

PAGE = 4096
# Fraction of store.disk_bytes planned for live rows. The rest is for the
# B-tree's half-empty pages after random inserts, pages LMDB keeps free for
# copy-on-write of the last transactions, and the undo logs of retained
# checkpoints (see BENCHMARKS.md, "disk use per row").
DISK_ROWS_FRACTION = 0.5
SKETCH_MAX_WIDTH = 1 << 22
SPILL_INDEX_BYTES_PER_ROW = 8 + 1 + 64      # key, flag, SlotIndex (16 B x 4 entries)


def lmdb_bytes_per_row(layout: RowLayout) -> int:
    """Bytes of a row in a packed LMDB leaf page: node header 8 + key 8 + value,
    a 2-byte slot pointer, 16-byte page header; large values take overflow pages."""
    node = 8 + 8 + layout.row_bytes + 2
    per_page = (PAGE - 16) // node
    if per_page >= 2:
        return -(-PAGE // per_page)
    return -(-(layout.row_bytes + 16) // PAGE) * PAGE + 20


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@dataclass(frozen=True)
class StorePlan:
    dim: int
    row_bytes: int            # one packed row: w, m, v and metadata (RAM and LMDB value)
    cache_row_bytes: int      # per device slot, index included
    ram_row_bytes: int        # per RAM row, index included
    disk_row_bytes: int       # per LMDB row in a full leaf page
    cache_rows: int
    ram_rows: int
    disk_rows: int            # disk rows before the disk tier evicts
    spill_rows: int           # dirty rows on their way from RAM to LMDB (0: none)
    working_set_rows: int     # worst case: batch_size x n_fields
    cache_bytes: int
    ram_bytes: int
    disk_bytes: int
    spill_bytes: int
    sketch_bytes: int         # admission count-min sketch (device)
    transfer_bytes: int       # per-batch buffers of rows moving between tiers, worst case
    store_dir: str
    filter_bits_log2: int = 23  # the LMDB key filter (key_filter.py)

    @property
    def filter_bytes(self) -> int:
        return 1 << (self.filter_bits_log2 - 3)

    @property
    def resident_bytes(self) -> int:
        """Memory the store's tiers allocate (device cache + RAM tier + sketch)."""
        return (self.cache_rows * self.cache_row_bytes + self.ram_rows * self.ram_row_bytes
                + self.spill_index_bytes + self.sketch_bytes + self.filter_bytes)

    @property
    def spill_index_bytes(self) -> int:
        """RAM of the spill's key -> slot index (its rows are in a file)."""
        return self.spill_rows * SPILL_INDEX_BYTES_PER_ROW

    def describe(self) -> str:
        f = format_bytes
        return "\n".join([
            f"embedding store plan (tiered, {self.store_dir}): a row = {self.row_bytes} B "
            f"(embedding + linear weight {self.dim + 1} x float32, Adam m and v, 32 B metadata)",
            f"  device cache {self.cache_rows:>14,} rows x {self.cache_row_bytes} B "
            f"(incl. index) = {f(self.cache_rows * self.cache_row_bytes)} of {f(self.cache_bytes)}; "
            f"one batch needs <= {self.working_set_rows:,}",
            f"  host RAM     {self.ram_rows:>14,} rows x {self.ram_row_bytes} B "
            f"(incl. index) = {f(self.ram_rows * self.ram_row_bytes)} of {f(self.ram_bytes)}",
            f"  disk spill   {self.spill_rows:>14,} rows x {self.row_bytes} B = "
            f"{f(self.spill_rows * self.row_bytes)} file (dirty rows on their way to LMDB) + "
            f"{f(self.spill_index_bytes)} of RAM for its index",
            f"  LMDB disk    {self.disk_rows:>14,} rows x ~{self.disk_row_bytes} B "
            f"(packed pages; {DISK_ROWS_FRACTION:.0%} of {f(self.disk_bytes)}, the rest for "
            "B-tree slack and undo logs)",
            f"  plus per-batch transfer buffers <= {f(self.transfer_bytes)}, a filter of LMDB's keys "
            f"{f(self.filter_bytes)}"
            + (f", admission sketch {f(self.sketch_bytes)}" if self.sketch_bytes else ""),
        ])


def make_plan(store: StoreConfig, model: ModelConfig, batch_size: int, n_fields: int,
              store_dir: str) -> StorePlan:
    """Rows per tier from the byte budgets; ConfigError for a plan that cannot work."""
    layout = RowLayout(model.embed_dim)
    cache_row, ram_row = DeviceCache.bytes_per_row(layout), HostTier.bytes_per_row(layout)
    disk_row = lmdb_bytes_per_row(layout)
    cache_rows, ram_rows = store.cache_bytes // cache_row, store.ram_bytes // ram_row
    disk_rows = int(store.disk_bytes * DISK_ROWS_FRACTION) // disk_row
    spill_rows = store.spill_bytes // layout.row_bytes
    working = batch_size * n_fields
    f = format_bytes
    if cache_rows < working:
        raise ConfigError(
            f"store.cache_bytes (--cache-bytes) = {f(store.cache_bytes)} holds {cache_rows:,} rows "
            f"of {cache_row} B, fewer than one batch's worst-case working set of {working:,} rows "
            f"(data.batch_size {batch_size} x {n_fields} fields); use at least "
            f"{f(working * cache_row)} or a smaller batch")
    if disk_rows < cache_rows + ram_rows:
        need = (cache_rows + ram_rows) * disk_row / DISK_ROWS_FRACTION
        raise ConfigError(
            f"store.disk_bytes (--disk-bytes) = {f(store.disk_bytes)} plans room for {disk_rows:,} "
            f"rows, fewer than the device cache and RAM tiers hold ({cache_rows + ram_rows:,}): a "
            f"checkpoint writes every resident row to disk; use at least {f(need)}")
    sketch = 0
    if store.admission_min_count > 1:
        width = 1 << max(16, (2 * working - 1).bit_length())
        sketch = 4 * 4 * min(width, SKETCH_MAX_WIDTH)
    return StorePlan(dim=model.embed_dim, row_bytes=layout.row_bytes, cache_row_bytes=cache_row,
                     ram_row_bytes=ram_row, disk_row_bytes=disk_row, cache_rows=cache_rows,
                     ram_rows=ram_rows, disk_rows=disk_rows, spill_rows=spill_rows,
                     working_set_rows=working, spill_bytes=store.spill_bytes,
                     cache_bytes=store.cache_bytes, ram_bytes=store.ram_bytes,
                     disk_bytes=store.disk_bytes, sketch_bytes=sketch,
                     transfer_bytes=3 * working * layout.row_bytes, store_dir=store_dir,
                     filter_bits_log2=filter_bits_log2(disk_rows))
