"""A checkpoint -> a serving bundle (bundle.py), without loading a large table whole.

The rows come from the checkpoint's embedding store:

* in-memory table: the rows in the checkpoint itself, sorted by key;
* tiered store: the LMDB table as of the checkpoint's generation. After a
  checkpoint every row is in LMDB (the checkpoint flushes the dirty resident
  rows in its commit), so LMDB alone is the table. It is read in key order, in
  chunks of `chunk_rows`, inside one read transaction (a consistent snapshot even
  while a trainer goes on writing), with the rows changed since that generation
  taken from their undo logs (`GenerationView`): exactly what `peek` of a
  read-only store loaded from the checkpoint returns. Rows past their TTL at the
  checkpoint's clock are left out: `peek` treats them as absent (initial row),
  and so does the scorer for a key the bundle lacks.

Only the weights and the linear column go in (no Adam moments, no metadata).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from stream_ctr.config import Config
from stream_ctr.connectors.formats import RecordFormat
from stream_ctr.connectors.schema import Schema
from stream_ctr import __version__
from stream_ctr.serving.bundle import BundleWriter, read_manifest
from stream_ctr.store.errors import StoreError
from stream_ctr.store.generations import GenerationView
from stream_ctr.store.layout import META_FIELDS, RowLayout, decode_keys
from stream_ctr.store.lmdb_tier import LmdbTier
from stream_ctr.store.policies import expired

CHUNK_ROWS = 65536


def export_bundle(tensors: dict[str, Any], config: dict[str, Any], out: str | Path, fmt: RecordFormat | Schema,
                  checkpoint: dict[str, Any], precision: str, held_out: dict[str, Any] | None = None,
                  chunk_rows: int = CHUNK_ROWS, extra: dict[str, Any] | None = None,
                  tier: LmdbTier | None = None) -> dict[str, Any]:
    """Write the bundle of a loaded checkpoint (`tensors`, `config` as saved) to `out`;
    returns its manifest. `checkpoint` describes the source (`checkpoint_record`);
    `precision` is what the bundle scores in (fp32|bf16); `held_out` the run's
    held-out lines ({"source", "start", "stop"}) when known; `extra` more manifest
    sections (a published version's "publish"). `tier`: the tiered store's LMDB
    already open in this process (a trainer publishing), read instead of opening it
    again -- LMDB forbids opening one environment twice in a process."""
    cfg = Config.from_dict(config, origin="checkpoint config")
    trainer = tensors["trainer"]
    layout = RowLayout(cfg.model.embed_dim)
    writer = BundleWriter(out, layout.cols)
    try:
        store = trainer["store"]
        chunks = (tiered_rows(store, cfg, chunk_rows, tier) if store.get("kind") == "tiered"
                  else memory_rows(store, layout.cols, chunk_rows))
        for keys, rows in chunks:
            writer.add(keys, rows)
        manifest = {**bundle_manifest(cfg, fmt, checkpoint, precision, store.get("kind", "memory"), held_out),
                    **(extra or {})}
        # The averaged dense weights when the run kept them: the model its test AUC measured.
        writer.finish(dense_weights(tensors), manifest)
    except BaseException:
        writer.abort()
        raise
    return read_manifest(out)


def dense_weights(tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The dense model a bundle serves: the averaged weights when the run kept them (what
    its held-out AUC measured), else the live ones."""
    trainer = tensors["trainer"]
    return trainer.get("model_average", trainer["model"])


def bundle_manifest(cfg: Config, fmt: RecordFormat | Schema, checkpoint: dict[str, Any], precision: str,
                    store_kind: str, held_out: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of a bundle of `cfg`'s model (BundleWriter.finish adds rows and files)."""
    layout = RowLayout(cfg.model.embed_dim)
    return {
        "model": dataclasses.asdict(cfg.model), "n_fields": fmt.n_model_fields, "n_dense": fmt.n_dense,
        "record_format": {"name": fmt.name, "key_fields": list(fmt.key_fields),
                          "n_dense": fmt.n_dense, "has_header": fmt.has_header,
                          "delimiter": fmt.delimiter, "keys": "connectors/hashing.py (63-bit signs)",
                          # a declared schema (json:/csv: sources): how predict decodes records
                          "schema": cfg.data.schema},
        "checkpoint": checkpoint, "precision": precision,
        "precision_setting": cfg.train.precision,
        "init": {"rule": "stream_ctr.store.embedding.init_rows", "seed": cfg.train.seed,
                 "init_std": cfg.model.init_std},
        "rows": {"dim": layout.dim, "dtype": "float32",
                 "columns": f"embedding [0, {layout.dim}), linear weight [{layout.dim}]",
                 "store": store_kind},
        "run": {"source": cfg.data.source, "holdout_fraction": cfg.data.holdout_fraction,
                "held_out": held_out},
        "created_by": f"stream-ctr {__version__}",
    }


def checkpoint_record(where: str | Path, step: int, records_trained: int, epoch: int,
                      positions: dict[str, int]) -> dict[str, Any]:
    """The manifest's "checkpoint": which checkpoint a bundle holds the model of."""
    return {"path": str(Path(where).resolve()), "name": Path(where).name, "step": step,
            "records_trained": records_trained, "epoch": epoch,
            # the offsets after the last trained record ({} once a file's last pass ended)
            "positions": positions,
            # when the checkpoint became durable: the model age a server reports
            "time_s": checkpoint_time_s(Path(where))}


def checkpoint_time_s(where: Path) -> float:
    """When a checkpoint was written: its manifest's modification time (the file written
    last, once everything else was durable), else its directory's."""
    for p in (where / "manifest.json", where):
        if p.exists():
            return p.stat().st_mtime
    return Path(where).stat().st_mtime


def memory_rows(store: dict[str, torch.Tensor], cols: int,
                chunk_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """An in-memory table's (keys, rows) in key order, `chunk_rows` at a time."""
    keys = store["keys"].numpy()
    weight = store["weight"]
    if weight.shape != (len(keys), cols):
        raise StoreError(f"the checkpoint's embedding table has shape {tuple(weight.shape)}, "
                         f"expected ({len(keys)}, {cols})")
    order = np.argsort(keys, kind="stable")
    for lo in range(0, len(order), chunk_rows):
        idx = order[lo:lo + chunk_rows]
        yield keys[idx], weight[torch.from_numpy(idx)].numpy()


def tiered_rows(store: dict[str, Any], cfg: Config, chunk_rows: int,
                open_tier: LmdbTier | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """A tiered store's (keys, rows) as of the checkpoint's generation, in key order,
    at most about `chunk_rows` at a time; expired rows left out. `open_tier`: the
    store's LMDB when this process has it open already (left open)."""
    layout = RowLayout(cfg.model.embed_dim)
    tier = open_tier or LmdbTier(store["store_dir"], layout, cfg.store.disk_bytes, cfg.train.keep_checkpoints,
                                 read_only=True, mapped_bytes=cfg.store.mapped_bytes)
    try:
        if store["store_id"] != tier.store_id:
            raise StoreError(f"the checkpoint's rows live in LMDB store {store['store_dir']} "
                             f"(id {store['store_id']}), but the store there now is another "
                             f"(id {tier.store_id})")
        view = GenerationView(tier, int(store["generation"]), str(store["nonce"]))
        try:
            for keys, packed in _generation_chunks(tier, view, chunk_rows):
                live = ~_expired(packed, layout, cfg, store)
                yield keys[live], np.ascontiguousarray(
                    packed[live, :layout.float_bytes]).view(np.float32)[:, :layout.cols]
        finally:
            view.close()
    finally:
        if open_tier is None:
            tier.close()


def _expired(packed: np.ndarray, layout: RowLayout, cfg: Config, store: dict[str, Any]) -> np.ndarray:
    """Rows past their TTL at the checkpoint's clocks (the rule of `peek` and `prepare`)."""
    if not (cfg.store.ttl_steps or cfg.store.ttl_seconds):
        return np.zeros(len(packed), dtype=bool)
    meta = torch.from_numpy(np.ascontiguousarray(packed[:, layout.meta_off:]).view(np.int64)
                            .reshape(-1, META_FIELDS))
    by_steps, by_seconds = expired(meta, int(store["clock"]), int(store["newest_event_ms"]),
                                   cfg.store.ttl_steps, cfg.store.ttl_seconds)
    return (by_steps | by_seconds).numpy()


def _generation_chunks(tier: LmdbTier, view: GenerationView,
                       chunk_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(keys, packed rows) of the view's generation in key order: the current `rows`
    database read through the view's transaction, with every key logged since that
    generation replaced by its logged value (or dropped, if it was absent then)."""
    w = tier.layout.row_bytes
    cur = view.txn.cursor(db=tier.rows_db)
    more, start = cur.first(), None           # this chunk covers keys in [start, hi)
    while True:
        raw_keys, raw_rows = [], []
        while more and len(raw_keys) < chunk_rows:
            raw_keys.append(cur.key())
            raw_rows.append(cur.value())
            more = cur.next()
        keys = decode_keys(b"".join(raw_keys))
        rows = np.frombuffer(bytearray().join(raw_rows), np.uint8).reshape(len(keys), w)
        hi = int(decode_keys(cur.key())[0]) if more else None       # the next chunk starts there
        a = 0 if start is None else int(np.searchsorted(view.keys, start, side="left"))
        b = len(view.keys) if hi is None else int(np.searchsorted(view.keys, hi, side="left"))
        if b > a:                                # keys changed since the generation: logged values win
            lk, lp, lr = view.keys[a:b], view.present[a:b], view.rows[a:b]
            keep = ~np.isin(keys, lk)
            keys = np.concatenate([keys[keep], lk[lp]])
            rows = np.concatenate([rows[keep], lr[lp]])
            order = np.argsort(keys, kind="stable")
            keys, rows = keys[order], rows[order]
        tier.mapped.trim_if_over()
        if len(keys):
            yield keys, rows
        if hi is None:
            return
        start = hi
