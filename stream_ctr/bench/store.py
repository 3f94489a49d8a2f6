"""`stream-ctr bench store`: the tiered embedding store on a synthetic Zipf key stream.

1. populate: every one of `distinct` keys gets a row on disk (bulk load in key
   order), then a checkpoint commits generation 1 so that, as in a long run,
   every later write logs its old value (the crash-safety cost is measured);
2. warm-up batches fill the device cache and RAM;
3. measured batches: `prepare` (made resident), then CowClip + Adam on every
   row of the working set (so each is dirty, as in training), and the next
   batch's disk rows prefetched. Per-tier hit rates, prepare lookups/s, LMDB
   rows/s read and written by the store;
4. raw LMDB beside each measured batch: the rows the store writes back are
   put with the same bytes and transaction size, and the next batch's disk
   reads are done with a plain getmulti, straight through py-lmdb on the same
   environment; raw goes first on even batches and second on odd ones, so
   neither side always finds the pages in the page cache.

Batch keys are drawn from a bounded Zipf law over ranks 1..distinct (the
continuous inverse-CDF approximation, exponent `zipf`), and rank r maps to key
((a*r + b) mod distinct) * stride + 1: hot keys are spread over the whole
key space, and the sorted key order is cheap to enumerate for the bulk load.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np



def add_bench_store_parser(bsub: argparse._SubParsersAction, add_common, byte_size) -> None:
    b = bsub.add_parser("store", help="tiered embedding store: hit rates, lookups/s, LMDB rows/s, RSS",
                        description=__doc__.split("\n\n")[0])
    b.add_argument("--distinct", type=lambda s: int(float(s)), default=10**8,
                   help="distinct keys, all on disk before the measured batches (default 1e8)")
    b.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the key stream")
    b.add_argument("--batch-size", type=int, default=65536, help="records per simulated batch")
    b.add_argument("--fields", type=int, default=39, help="keys per record")
    b.add_argument("--dim", type=int, default=10, help="embedding dimension d")
    b.add_argument("--batches", type=int, default=20, help="measured batches")
    b.add_argument("--warmup", type=int, default=5, help="batches before measuring")
    b.add_argument("--cache-bytes", type=byte_size, help="device cache (default: one batch's "
                   "worst-case working set)")
    b.add_argument("--ram-bytes", type=byte_size, default=2 << 30, help="host RAM tier (default 2GiB)")
    b.add_argument("--disk-bytes", type=byte_size, help="LMDB cap (default: room for every key)")
    b.add_argument("--mapped-bytes", type=byte_size, default=256 << 20,
                   help="LMDB pages kept mapped, counted in RSS (store.mapped_bytes; default 256MiB)")
    b.add_argument("--store-dir", help="LMDB directory (default: a temporary one under /tmp)")
    b.add_argument("--keep", action="store_true", help="keep the LMDB store afterwards")
    b.add_argument("--reuse", action="store_true", help="with --store-dir: reuse a store kept by "
                   "an earlier run with --keep (rolled back to its populated generation)")
    b.add_argument("--seed", type=int, default=0, help="seed of the generated keys")
    b.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: "
                   "the store's ops are small, and thread wake-ups cost more than they save)")
    add_common(b)
    b.set_defaults(func=cmd_bench_store)


def cmd_bench_store(args: argparse.Namespace) -> tuple[dict, str]:
    """The bench command: prints the table; returns (JSON summary, one line) for the CLI to emit."""
    result = bench_store(args)
    if not args.json:
        print(format_store_table(result))
    return ({"bench": "store", **result},
         f"bench store: {result['distinct']:,} rows on disk, prepare {result['prepare_lookups_per_s']:,.0f} "
         f"lookups/s, disk tier at {result['read_vs_raw']:.0%} (read) / {result['write_vs_raw']:.0%} "
         f"(write) of raw LMDB, peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB")


class _Sampler:
    """Peak anonymous (non-file) RSS, sampled; VmHWM also counts LMDB's mapped pages."""

    def __init__(self) -> None:
        self.peak_anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak_anon = max(self.peak_anon, _status()["RssAnon"])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if rest.strip().endswith("kB"):
                out[name] = int(rest.split()[0]) * 1024
    return out


class KeyStream:
    def __init__(self, distinct: int, exponent: float, seed: int) -> None:
        self.n, self.s = distinct, exponent
        self.rng = np.random.default_rng(seed)
        self.stride = (1 << 62) // distinct
        a = int(distinct * 0.6180339887) | 1
        while np.gcd(a, distinct) != 1:
            a += 2
        self.a, self.b = a, distinct // 3

    def sorted_keys(self, lo: int, hi: int) -> np.ndarray:
        """Keys with positions lo..hi in key order (position j -> j * stride + 1)."""
        return np.arange(lo, hi, dtype=np.int64) * self.stride + 1

    def draw(self, n: int) -> np.ndarray:
        u = self.rng.random(n)
        e = 1.0 - self.s
        ranks = np.floor((1.0 + u * (self.n ** e - 1.0)) ** (1.0 / e)).astype(np.int64)
        ranks = np.clip(ranks, 1, self.n)
        return self.keys_of(ranks)

    def keys_of(self, ranks: np.ndarray) -> np.ndarray:
        # (a * r + b) mod n without overflow: split a into 2**20-sized limbs.
        r = ranks % self.n
        lo, hi = self.a & ((1 << 20) - 1), self.a >> 20
        j = (r * lo + (((r * hi) % self.n) << 20) % self.n + self.b) % self.n
        return j.astype(np.int64) * self.stride + 1


def _config(args: argparse.Namespace, store_dir: str):
    from stream_ctr.config import Config
    from stream_ctr.store.device_cache import DeviceCache
    from stream_ctr.store.layout import RowLayout
    from stream_ctr.store.plan import DISK_ROWS_FRACTION, lmdb_bytes_per_row
    cfg = Config()
    cfg.model.embed_dim = args.dim
    cfg.data.batch_size = args.batch_size
    cfg.train.device = "auto"
    cfg.store.kind = "tiered"
    cfg.store.store_dir = store_dir
    layout = RowLayout(args.dim)
    cfg.store.cache_bytes = args.cache_bytes or args.batch_size * args.fields * DeviceCache.bytes_per_row(layout)
    cfg.store.ram_bytes = args.ram_bytes
    cfg.store.mapped_bytes = args.mapped_bytes
    cfg.store.disk_bytes = args.disk_bytes or int(1.2 * args.distinct * lmdb_bytes_per_row(layout)
                                                  / DISK_ROWS_FRACTION) + (1 << 30)
    return cfg


def bench_store(args: argparse.Namespace) -> dict:
    import torch
    from stream_ctr.store.generations import rollback
    from stream_ctr.store import build_store
    from stream_ctr.train.trainer import resolve_device

    base = args.store_dir or tempfile.mkdtemp(prefix="stream_ctr_bench_store_", dir="/tmp")
    store_dir = str(Path(base) / "lmdb")
    cfg = _config(args, store_dir)
    Path(base).mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(Path(base)).free
    need = int(args.distinct * 1.4 * 200)
    log = (lambda *a: print("bench store:", *a, file=sys.stderr, flush=True)) if not args.quiet else (lambda *a: None)
    if free < need:
        from stream_ctr.store.errors import StoreError
        raise StoreError(f"bench store needs about {need / 2**30:.1f} GiB free under {base} for "
                         f"{args.distinct:,} rows, only {free / 2**30:.1f} GiB are; lower --distinct")
    sampler = _Sampler()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device("auto")
    store = build_store(cfg, args.fields, device, announce=not args.quiet)
    stream = KeyStream(args.distinct, args.zipf, args.seed)
    out: dict = {"distinct": args.distinct, "zipf": args.zipf, "batch_size": args.batch_size,
                 "fields": args.fields, "dim": args.dim, "device": str(device),
                 "cache_rows": store.plan.cache_rows, "ram_rows": store.plan.ram_rows,
                 "cache_bytes": cfg.store.cache_bytes, "ram_bytes": cfg.store.ram_bytes,
                 "store_dir": store_dir, "cpus": os.cpu_count()}
    try:
        # 1. populate, in key order, then commit generation 1
        t0 = time.perf_counter()
        if args.reuse and store.disk.generation >= 1 and store.disk.entries() >= args.distinct:
            rollback(store.disk, 1, store.disk.nonce(1))      # undo an earlier bench's writes
            log(f"reusing the {store.disk.entries():,} rows in {store_dir}")
        else:
            _populate(store, stream, args, log)
            out["populate_rows_per_s"] = args.distinct / (time.perf_counter() - t0)
        store._started = True
        out["disk_bytes_per_row_populated"] = store.disk.file_bytes() / args.distinct
        log(f"ready in {time.perf_counter() - t0:.0f} s, "
            f"{out['disk_bytes_per_row_populated']:.0f} B/row on disk")

        # 2-4. warm-up, then measured batches with the same LMDB work done raw beside them
        out.update(_measure(store, stream, args, device, log))
        out["disk_rows"] = store.disk.entries()         # bulk-loaded rows included
        out["disk_file_bytes"] = store.disk.file_bytes()
        out["disk_bytes_per_row"] = store.disk.file_bytes() / max(out["disk_rows"], 1)
        ratio = lambda a, b: a / b if b else float("nan")  # noqa: E731
        out["read_vs_raw"] = ratio(out["store_read_rows_per_s"], out["raw_read_rows_per_s"])
        out["write_vs_raw"] = ratio(out["store_write_rows_per_s"], out["raw_write_rows_per_s"])
    finally:
        sampler.stop()
        st = _status()
        out["peak_rss_bytes"] = st.get("VmHWM", 0)
        out["peak_anon_rss_bytes"] = max(sampler.peak_anon, st.get("RssAnon", 0))
        out["store_resident_bytes"] = store.plan.resident_bytes
        out["mapped_bytes"] = cfg.store.mapped_bytes
        out["map_trims"] = store.disk.mapped.trims
        store.close()
        if not args.keep:
            shutil.rmtree(base if not args.store_dir else store_dir, ignore_errors=True)
    return out


def _populate(store, stream: KeyStream, args: argparse.Namespace, log) -> None:
    import torch
    from stream_ctr.store.generations import rollback
    from stream_ctr.store.embedding import init_rows
    from stream_ctr.store.generations import commit_checkpoint
    from stream_ctr.store.lmdb_tier import WriteBatch
    if store.disk.generation or store.disk.entries():
        rollback(store.disk, 0)
    layout, chunk = store.layout, 1 << 20
    for lo in range(0, args.distinct, chunk):
        keys = stream.sorted_keys(lo, min(lo + chunk, args.distinct))
        w = init_rows(torch.from_numpy(keys), args.dim, 0.01, 0)
        z = torch.zeros_like(w)
        meta = torch.zeros(len(keys), 4, dtype=torch.int64)
        meta[:, 3] = -1
        store.disk.bulk_load(keys, layout.pack(w, z, z, meta).numpy())
        if lo // chunk % 10 == 0:
            log(f"populated {lo + len(keys):,} / {args.distinct:,} rows")
    commit_checkpoint(store.disk, WriteBatch())


def _measure(store, stream: KeyStream, args: argparse.Namespace, device, log) -> dict:
    """Warm-up and measured batches. Per measured batch the same LMDB work is done raw:
    the rows the store writes back are put with the same bytes and transaction size,
    before the store's write on even batches and after it on odd ones; the next
    batch's disk reads likewise around the store's prefetch. So neither side always
    finds the pages already in the page cache."""
    import torch
    from stream_ctr.config import OptimConfig
    written: list[np.ndarray] = []
    apply = store.disk.apply
    raw = {"read_rows": 0, "read_s": 0.0, "write_rows": 0, "write_s": 0.0, "measuring": False,
           "even": False, "not_store_s": 0.0}

    def traced_apply(batch):          # runs on the store's I/O thread, alone (prepare returned)
        keys = np.asarray(batch.put_keys)
        written.append(keys)
        t0 = time.perf_counter()
        if raw["measuring"] and raw["even"]:
            _raw_write(store, batch, raw)
        t1 = time.perf_counter()
        apply(batch)
        t2 = time.perf_counter()
        if raw["measuring"] and not raw["even"]:
            _raw_write(store, batch, raw)
        # The store's own timer runs around this whole call: keep what was not its work.
        raw["not_store_s"] += (t1 - t0) + (time.perf_counter() - t2)
    store.disk.apply = traced_apply
    optim, n_keys = OptimConfig(), args.batch_size * args.fields
    nxt = torch.unique(torch.from_numpy(stream.draw(n_keys)).to(device), return_counts=True)
    t_prep = t_io = t_store = 0.0
    uniq_total = 0
    for i in range(args.warmup + args.batches):
        measuring = i >= args.warmup
        if i == args.warmup:
            base_stats = store.stats()
        uniq, counts = nxt
        written.clear()
        raw["measuring"], raw["even"] = measuring, i % 2 == 0
        t0 = time.perf_counter()
        slots = store.prepare(uniq)
        dt = time.perf_counter() - t0
        nxt = torch.unique(torch.from_numpy(stream.draw(n_keys)).to(device), return_counts=True)
        # The store's I/O thread now writes back this batch's demoted rows; let it run
        # alone (no GIL or core shared) so that its rates compare with the raw ones.
        t1, raw_w0 = time.perf_counter(), raw["not_store_s"]
        store.io.wait()
        wb_s = time.perf_counter() - t1
        cand = _disk_candidates(store, nxt[0])
        if measuring and i % 2 == 0:
            _raw_read(store, cand, raw)
        t2 = time.perf_counter()
        store.prefetch(nxt[0])
        store._wait_keep_staged()
        io_s = time.perf_counter() - t2
        if measuring and i % 2 == 1:
            _raw_read(store, cand, raw)
        t3 = time.perf_counter()
        grad = torch.full((uniq.numel(), args.dim + 1), 1e-3, device=device)
        store.update(slots, grad, counts, i + 1, optim)
        if measuring:
            t_prep += dt
            t_io += io_s
            t_store += dt + wb_s + io_s + time.perf_counter() - t3 - (raw["not_store_s"] - raw_w0)
            uniq_total += uniq.numel()
        log(f"batch {i + 1}/{args.warmup + args.batches}: {uniq.numel():,} unique keys, "
            f"prepare {dt:.2f} s, prefetch {io_s:.2f} s, {sum(map(len, written)):,} rows written")
    store.io.wait()
    raw["measuring"] = False
    after = store.stats()
    after["lmdb_write_seconds"] -= raw["not_store_s"]     # see traced_apply
    out = _rates(base_stats, after, t_prep, t_store, uniq_total, args.batches)
    out["prefetch_seconds_per_batch"] = t_io / args.batches
    out["raw_read_rows_per_s"] = raw["read_rows"] / max(raw["read_s"], 1e-9)
    out["raw_write_rows_per_s"] = raw["write_rows"] / max(raw["write_s"], 1e-9)
    out["raw_read_rows"], out["raw_written_rows"] = raw["read_rows"], raw["write_rows"]
    return out


def _disk_candidates(store, keys) -> np.ndarray:
    """What `prefetch` reads: the keys in neither the device cache nor RAM, sorted."""
    cpu = keys.cpu()
    absent = (store.cache.lookup(keys).cpu() < 0) & (store.ram.index.lookup(cpu) < 0)
    return np.sort(cpu[absent].numpy())


def _raw_read(store, keys: np.ndarray, acc: dict) -> None:
    from stream_ctr.store.layout import encode_keys
    from stream_ctr.store.lmdb_tier import MAP_TRIM_KEYS, gc_paused   # as the store does: a fair comparison
    t0 = time.perf_counter()
    chunk = MAP_TRIM_KEYS
    with store.disk.env.begin(db=store.disk.rows_db) as txn, gc_paused():
        for lo in range(0, len(keys), chunk):    # in chunks, unmapping pages, as the store does
            res = txn.cursor().getmulti(encode_keys(keys[lo:lo + chunk]))
            b"".join([v for _, v in res])
            store.disk.mapped.trim_if_over()
    acc["read_s"] += time.perf_counter() - t0
    acc["read_rows"] += len(keys)


def _raw_write(store, batch, acc: dict) -> None:
    """Put the batch's rows, with the very bytes the store writes (so the content ends the
    same whichever goes first), in transactions of the store's size; no reads."""
    from stream_ctr.store.layout import items
    from stream_ctr.store.lmdb_tier import MAP_TRIM_KEYS, gc_paused
    disk, chunk = store.disk, store.disk.chunk_rows
    keys = np.asarray(batch.put_keys)
    t0 = time.perf_counter()
    def put(lo: int) -> None:
        rows = np.array(batch.put_rows[lo:lo + chunk], copy=True)
        rows[:, disk.layout.meta_off + 24:].view(np.int64)[:, 0] = disk.open_generation
        with disk.env.begin(write=True, db=disk.rows_db) as txn, gc_paused():
            cur = txn.cursor()
            for at in range(0, len(rows), MAP_TRIM_KEYS):     # unmapping pages, as the store does
                cur.putmulti(items(keys[lo + at:lo + at + MAP_TRIM_KEYS], rows[at:at + MAP_TRIM_KEYS]))
                disk.mapped.trim_if_over()
    for lo in range(0, len(keys), chunk):
        disk._retry(lambda: put(lo))          # grows the map like the store (rarely)
        disk.mapped.trim_if_over()
    disk.note_put(keys)                       # the store's reads must find these rows
    acc["write_s"] += time.perf_counter() - t0
    acc["write_rows"] += len(keys)


def _rates(a: dict, b: dict, t_prep: float, t_all: float, uniq: int, batches: int) -> dict:
    d = lambda k: b[k] - a[k]  # noqa: E731
    lk = {t: {r: b["lookups"][t][r] - a["lookups"][t][r] for r in ("hit", "miss")}
          for t in ("cache", "ram", "disk")}
    total = lk["cache"]["hit"] + lk["cache"]["miss"]
    return {
        "unique_keys_per_batch": uniq / batches,
        "hit_rate_cache": lk["cache"]["hit"] / total,
        "hit_rate_ram": lk["ram"]["hit"] / total,
        "hit_rate_disk": lk["disk"]["hit"] / total,
        "new_rows_rate": lk["disk"]["miss"] / total,
        "prepare_seconds_per_batch": t_prep / batches,
        "prepare_lookups_per_s": uniq / t_prep,
        "end_to_end_lookups_per_s": uniq / t_all,
        "prefetch_wait_seconds_per_batch": d("prefetch_wait_seconds") / batches,
        "store_read_rows": d("lmdb_read_rows"),
        "store_read_rows_per_s": d("lmdb_read_rows") / max(d("lmdb_read_seconds"), 1e-9),
        "store_written_rows": d("lmdb_written_rows"),
        "store_write_rows_per_s": d("lmdb_written_rows") / max(d("lmdb_write_seconds"), 1e-9),
    }


def format_store_table(r: dict) -> str:
    gib = 2 ** 30
    rows = [
        ("distinct keys (all on disk)", f"{r['distinct']:,}"),
        ("batch x fields, d", f"{r['batch_size']:,} x {r['fields']}, d={r['dim']} "
                              f"({r['unique_keys_per_batch']:,.0f} unique keys/batch)"),
        ("device cache / RAM rows", f"{r['cache_rows']:,} / {r['ram_rows']:,}"),
        ("hit rate cache / RAM / disk / new", f"{r['hit_rate_cache']:.1%} / {r['hit_rate_ram']:.1%} / "
                                              f"{r['hit_rate_disk']:.1%} / {r['new_rows_rate']:.1%}"),
        ("prepare lookups/s (unique keys)", f"{r['prepare_lookups_per_s']:,.0f}"),
        ("store lookups/s incl. write-back, prefetch, update", f"{r['end_to_end_lookups_per_s']:,.0f}"),
        ("prepare s/batch; prefetch s/batch", f"{r['prepare_seconds_per_batch']:.2f}; "
                                              f"{r['prefetch_seconds_per_batch']:.2f}"),
        ("LMDB read rows/s: store / raw", f"{r['store_read_rows_per_s']:,.0f} / {r['raw_read_rows_per_s']:,.0f} "
                                          f"({r['read_vs_raw']:.0%})"),
        ("LMDB write rows/s: store / raw", f"{r['store_write_rows_per_s']:,.0f} / "
                                           f"{r['raw_write_rows_per_s']:,.0f} ({r['write_vs_raw']:.0%})"),
        ("populate (bulk load) rows/s", f"{r.get('populate_rows_per_s', float('nan')):,.0f}"),
        ("disk bytes/row: populated / after run", f"{r['disk_bytes_per_row_populated']:.0f} / "
                                                  f"{r['disk_bytes_per_row']:.0f}"),
        ("peak RSS (VmHWM, incl. mapped LMDB pages)", f"{r['peak_rss_bytes'] / gib:.2f} GiB"),
        ("budgets: store tiers + mapped LMDB pages", f"{r['store_resident_bytes'] / gib:.2f} GiB + "
                                                     f"{r['mapped_bytes'] / gib:.2f} GiB "
                                                     f"({r['map_trims']:,} trims)"),
        ("peak RSS over the budgets (fixed overhead)", f"{(r['peak_rss_bytes'] - r['store_resident_bytes'] - r['mapped_bytes']) / gib:.2f} GiB"),
        ("peak anonymous RSS", f"{r['peak_anon_rss_bytes'] / gib:.2f} GiB"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(w)} | {v}" for k, v in rows)
