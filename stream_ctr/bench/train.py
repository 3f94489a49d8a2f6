"""`stream-ctr bench train`: training throughput and peak memory per batch size.

Each batch size runs in its own process so that its peak RSS is its own.
Two numbers per configuration:
  * excluding decoding: all batches are decoded first, then only steps are timed;
  * including decoding: the file is read, decoded, micro-batched and trained,
    as `stream-ctr train` does (chunks decoded ahead on a thread, --read-ahead).
The phase split (prepare / forward+backward / update) shows where time goes.

With `stores=("memory", "tiered")` each batch size runs once per store and
repeat, alternating (memory, tiered, memory, tiered, ...), each in its own
process; a tiered row carries its ratio to the memory row just before it (the
same minute on a shared machine) and the store's counters: hit rates per tier,
how long `prepare` blocked on the I/O thread, LMDB reads and writes, and how
many of the cache's evictions were made during the step before. Steps run as
`train` runs them: a tiered store is told the next batch, so its I/O thread
stages that batch's rows during the step. `evict_ahead` modes of the tiered
store (`--evict-ahead on,off`) and train.compile's modes (`--compile
off,reduce-overhead`; "off": eager) are alternated like stores; a row after
the first of its repeat carries its ratio to that first one.

Beside them, in the same process and minute, a bare torch MLP of the model's
deep part (input F*d + n_dense, the configured hidden layers, one output):
forward, BCE, backward and Adam on random dense input, in fp32 and in bf16
(autocast). It has no embeddings, no sparse update, no data: it is this
machine's ceiling for the dense work, so "vs bare fp32" says how close the
whole trainer comes to it on this machine, whatever the machine.  It is
measured right before and right after the decode-included pass, and the mean
is the figure: on a shared machine whose load drifts, a single measurement
after the pass moved the ratio by up to 20%.
"""
from __future__ import annotations

import multiprocessing as mp
from queue import Empty
import resource
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from stream_ctr.bench.data import bench_source, decoded_batches
from stream_ctr.connectors.batch import Batch
from stream_ctr.connectors.files import FileSource, detect_format
from stream_ctr.train.batcher import MicroBatcher
from stream_ctr.train.inputs import decoded_ahead
from stream_ctr.config import Config


@dataclass(frozen=True)
class StoreChoice:
    """The embedding store a bench run trains with: memory, or tiered with these budgets
    (None: the configured defaults); each trainer gets a fresh LMDB directory under `root`."""
    kind: str = "memory"
    cache_bytes: int | None = None
    ram_bytes: int | None = None
    spill_bytes: int | None = None
    evict_ahead: str = "auto"       # store.evict_ahead of a tiered store

    @property
    def label(self) -> str:
        if self.kind != "tiered" or self.evict_ahead == "auto":
            return self.kind
        return f"tiered, evict_ahead {self.evict_ahead}"


def _bench_config(model: str, batch_size: int, threads: int, precision: str = "auto",
                  read_ahead_chunks: int = 2, compile_mode: str = "off",
                  store: StoreChoice = StoreChoice()) -> Config:
    cfg = Config()
    cfg.store.kind = store.kind
    if store.cache_bytes is not None:
        cfg.store.cache_bytes = store.cache_bytes
    if store.ram_bytes is not None:
        cfg.store.ram_bytes = store.ram_bytes
    if store.spill_bytes is not None:
        cfg.store.spill_bytes = store.spill_bytes
    cfg.store.evict_ahead = store.evict_ahead
    cfg.train.precision = precision
    cfg.train.compile = compile_mode != "off"
    if cfg.train.compile:
        cfg.train.compile_mode = compile_mode
    cfg.data.read_ahead_chunks = read_ahead_chunks
    cfg.model.name = model
    cfg.data.batch_size = batch_size
    cfg.train.threads = threads
    cfg.train.device = "auto"
    return cfg


def bare_mlp_samples_per_s(in_features: int, hidden: tuple[int, ...], batch_size: int,
                           precision: str, device: torch.device, min_seconds: float = 1.0) -> float:
    """Samples/s of forward + BCE + backward + Adam for a bare MLP (ReLU, one output)."""
    from stream_ctr.models.scoring import autocast
    torch.manual_seed(0)
    dims = (in_features, *hidden)
    layers: list[torch.nn.Module] = []
    for a, b in zip(dims, dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    mlp = torch.nn.Sequential(*layers, torch.nn.Linear(dims[-1], 1)).to(device)
    opt = torch.optim.Adam(mlp.parameters(), lr=1e-3, foreach=True)
    x = torch.randn(batch_size, in_features, device=device)
    y = (torch.rand(batch_size, device=device) < 0.2).float()

    def step() -> None:
        with autocast(precision, device):
            logits = mlp(x).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(3):                   # warm-up: allocator, oneDNN / cuBLAS plans
        step()
    steps, t0 = 0, time.perf_counter()
    while True:
        step()
        steps += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        if steps >= 3 and time.perf_counter() - t0 >= min_seconds:
            break
    return steps * batch_size / (time.perf_counter() - t0)


def _warm_up(trainer, batch: Batch, new_trainer) -> None:
    """Two steps on the first batch before the clock starts, on every device: the
    first step compiles the Triton kernels (CUDA) and loads the compiled CPU loops,
    the second runs what was built. Inside the clock, that cold start made a CUDA run's
    decode-excluded pass read slower than its decode-included one (BENCHMARKS, H100).
    The steps go to a throwaway trainer (the kernels are the process's), so the timed
    one starts with an empty store; with train.compile the timed trainer itself is
    warmed, since its compiled graph is its own."""
    warm = trainer if trainer.cfg.train.compile else new_trainer()
    for _ in range(2):
        warm.train_step(batch)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)


def steps_as_trained(trainer, batches: Iterable[Batch]) -> Iterator:
    """Train `batches` as `stream-ctr train` does: a tiered store is told the next batch
    (the loop's look-ahead) so its I/O thread stages that batch's rows during the step;
    yields each step's result."""
    from stream_ctr.train.batches import LookAhead
    from stream_ctr.train.inputs import ready_events
    look = LookAhead() if trainer.cfg.store.kind == "tiered" else None
    for event in ready_events(iter(batches), look):
        yield trainer.train_step(event.batch, event.upcoming)


def _all_threads():
    """The profiler's option to record every thread (a tiered store's I/O thread too), on
    the torch versions that have it; None elsewhere (the training thread only)."""
    from torch._C._profiler import _ExperimentalConfig
    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        return None


def profile_steps(trainer, batches: list[Batch]) -> str:
    """torch.profiler's table of the ops of `batches`' steps, the 15 heaviest by their own
    time (on the GPU for CUDA, else on the CPU): where a step's time goes, by op."""
    from torch.profiler import ProfilerActivity, profile
    cuda = trainer.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, experimental_config=_all_threads()) as prof:
        for _ in steps_as_trained(trainer, batches):
            pass
        if cuda:
            torch.cuda.synchronize(trainer.device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    text = (f"profile of {len(batches)} steps at batch {len(batches[0]):,} on {trainer.device} "
            f"(sorted by {key}):\n"
            + prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=55))
    parts = sorted((e for e in prof.key_averages() if e.key.startswith("store.")),
                   key=lambda e: -e.cpu_time_total)
    if parts:       # a tiered store: where its host time goes (store.io.*: the I/O thread's)
        text += ("\nthe tiered store's parts, host time with what they call (store.io.*: on the "
                 "I/O thread, beside the step):\n" + "\n".join(
                     f"  {e.key:<26} {e.count:>6} calls {e.cpu_time_total / 1e3:>10.1f} ms" for e in parts))
    return text


def _store_counters(trainer) -> dict | None:
    """A tiered store's counters after a pass (None for the memory store)."""
    counters = getattr(trainer.store, "counters", None)
    if counters is None:
        return None
    c = counters.as_dict()
    hit = {t: r["hit"] / max(1, r["hit"] + r["miss"]) for t, r in c["lookups"].items()}
    return {"hit_rate": hit, "prefetch_wait_s": c["prefetch_wait_seconds"],
            "lmdb_read_rows": c["lmdb_read_rows"], "lmdb_read_s": c["lmdb_read_seconds"],
            "lmdb_written_rows": c["lmdb_written_rows"], "lmdb_write_s": c["lmdb_write_seconds"],
            "rows_written_back": c["rows_written_back"], "rows_spilled": c["rows_spilled"],
            "spill_hits": c["spill_hits"], "rows_evicted_ahead": c["rows_evicted_ahead"],
            "rows_uploaded_ahead": c["rows_uploaded_ahead"],
            "cache_evictions": c["evictions"]["cache_to_ram"]}


def _worker(source: str, schema: str, model: str, batch_size: int, threads: int, precision: str,
            read_ahead: int, compile_mode: str, profile: int, store: StoreChoice,
            queue: mp.Queue) -> None:
    from stream_ctr.train.trainer import Trainer
    from stream_ctr.train.loop import configure_torch
    cfg = _bench_config(model, batch_size, threads, precision, read_ahead, compile_mode, store)
    configure_torch(cfg)
    fmt, _ = detect_format(source, schema)
    root = tempfile.TemporaryDirectory(prefix="stream_ctr_bench_store_")
    made = [0]

    def new_trainer() -> Trainer:
        """A trainer with an empty store (a tiered one in a directory of its own)."""
        made[0] += 1
        cfg.train.run_dir = str(Path(root.name) / f"run{made[0]}")
        return Trainer.for_format(cfg, fmt)

    # Excluding decoding: decode everything first, then time only the steps.
    t0 = time.perf_counter()
    batches = decoded_batches(source, schema, batch_size)
    decode_s = time.perf_counter() - t0
    records = sum(len(b) for b in batches)
    trainer = new_trainer()
    phases = {"prepare": 0.0, "forward_backward": 0.0, "update": 0.0}
    warm = batches[0]
    _warm_up(trainer, warm, new_trainer)
    t0 = time.perf_counter()
    for result in steps_as_trained(trainer, batches):
        for k, v in result.phase_s.items():
            phases[k] += v
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t0
    store_counters = _store_counters(trainer)
    # After the clock: more steps of the same trainer (its rows are in the store now).
    profile_text = profile_steps(trainer, batches[:profile]) if profile else None
    del batches

    # Including decoding: a fresh model on the file, the way `train` runs; the bare MLP
    # right before and right after it.
    trainer = new_trainer()
    in_features = trainer.n_fields * cfg.model.embed_dim + fmt.n_dense

    def bare_mlp() -> dict[str, float]:
        return {p: bare_mlp_samples_per_s(in_features, cfg.model.mlp_dims, batch_size, p, trainer.device)
                for p in ("fp32", "bf16")}
    bare_before = bare_mlp()
    _warm_up(trainer, warm, new_trainer)
    t0 = time.perf_counter()
    fmt, p = detect_format(source, schema)
    batcher = MicroBatcher(batch_size)
    src = FileSource(p, fmt, chunk_records=max(65536, batch_size))
    src, threads_decoding = decoded_ahead(src, cfg)  # decoded while the steps run, as in train
    def read() -> Iterator[Batch]:
        while not src.exhausted:
            yield from batcher.add(src.read()[0])
    with src:
        for _ in steps_as_trained(trainer, read()):
            pass
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    total_s = time.perf_counter() - t0
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    bare_after = bare_mlp()
    bare = {p: (bare_before[p] + bare_after[p]) / 2 for p in ("fp32", "bf16")}
    queue.put({"model": model, "batch_size": batch_size, "records": records,
               "device": str(trainer.device), "threads": torch.get_num_threads(),
               "precision": trainer.precision, "read_ahead_chunks": cfg.data.read_ahead_chunks,
               "decode_threads": threads_decoding,
               "compile": compile_mode,
               "bare_mlp_fp32_samples_per_s": bare["fp32"], "bare_mlp_bf16_samples_per_s": bare["bf16"],
               "bare_mlp_fp32_before_after": (bare_before["fp32"], bare_after["fp32"]),
               "vs_bare_fp32": (records / total_s) / bare["fp32"],
               "samples_per_s_excl_decode": records / train_s,
               "samples_per_s_incl_decode": records / total_s,
               "decode_records_per_s": records / decode_s,
               "prepare_pct": 100 * phases["prepare"] / train_s,
               "fwd_bwd_pct": 100 * phases["forward_backward"] / train_s,
               "update_pct": 100 * phases["update"] / train_s,
               "peak_rss_mb": peak_rss_mb, "profile": profile_text,
               "store": store.label, "store_counters": store_counters})
    trainer.store.close()
    root.cleanup()


def _in_process(ctx, target, *args) -> dict:
    """Run `target(*args, queue)` in a fresh process (its own peak RSS, its own torch state)
    and return the row it puts. A ConfigError there (a budget too small for the batch) is
    raised here; a process that dies without a row (an error, the OOM killer) is a
    RuntimeError, not a wait for ever."""
    from stream_ctr.config import ConfigError
    results = ctx.Queue()
    proc = ctx.Process(target=_report_config_errors, args=(target, *args, results))
    proc.start()
    while True:
        try:
            row = results.get(timeout=1.0)
            break
        except Empty:
            if not proc.is_alive() and results.empty():
                proc.join()
                raise RuntimeError(f"bench train: the measuring process ended without a result "
                                   f"(exit code {proc.exitcode}); its error, if any, is printed above")
    proc.join()
    if "error" in row:
        raise ConfigError(row["error"])
    return row


def _report_config_errors(target, *args) -> None:
    """`target(*args)` in a measuring process; a ConfigError goes back to the parent as a row."""
    from stream_ctr.config import ConfigError
    try:
        target(*args)
    except ConfigError as exc:
        args[-1].put({"error": str(exc)})


def bench_train(records: int, batch_sizes: list[int], model: str = "deepfm",
                data: str | None = None, threads: int = 0, show_progress: bool = True,
                precision: str = "auto", read_ahead: int = 2, compile_modes: tuple[str, ...] = ("off",),
                peer: str | None = None, repeats: int = 1, schema: str = "",
                profile: int = 0, stores: tuple[StoreChoice, ...] = (StoreChoice(),)) -> list[dict]:
    """One row per batch size and repeat.  With `peer="deepctr"` each of our runs is
    followed by deepctr-torch's DeepFM on the same rows (bench/peer.py), so the pair is
    measured in the same minute (A, B, A, B with repeats >= 2) and the row carries the
    ratio: on a shared machine only such ratios compare. `profile` > 0 profiles that many
    steps after the decode-excluded pass (`profile_steps`; the row's "profile"). Several
    `stores`, and for each several `compile_modes` ("off", or train.compile_mode's),
    alternate within each repeat; a row after the repeat's first carries its ratio to
    it ("vs_first_store_excl_decode", "..._incl_decode")."""
    import sys
    from stream_ctr.connectors.synth import write_synthetic_criteo
    if peer not in (None, "deepctr"):
        raise ValueError(f"bench train --peer: only 'deepctr' is known, got {peer!r}")
    if peer:
        from stream_ctr.bench.peer import check_installed
        check_installed()                    # fail before generating data if it is not installed
    tmp = None
    if data is None:
        tmp = tempfile.TemporaryDirectory(prefix="stream_ctr_bench_")
        data = str(Path(tmp.name) / "synth.tsv")
        write_synthetic_criteo(data, records, seed=0)
    source = bench_source(data)
    ctx = mp.get_context("spawn")
    rows = []

    def measure(bs: int, store: StoreChoice, mode: str) -> dict:
        row = _in_process(ctx, _worker, source, schema, model, bs, threads, precision,
                          read_ahead, mode, profile, store)
        if peer:
            from stream_ctr.bench.peer import _peer_worker
            other = _in_process(ctx, _peer_worker, source, schema, bs, threads)
            row["peer"] = other["peer"]
            row["peer_samples_per_s"] = other["samples_per_s"]
            row["vs_peer_excl_decode"] = row["samples_per_s_excl_decode"] / other["samples_per_s"]
            row["vs_peer_incl_decode"] = row["samples_per_s_incl_decode"] / other["samples_per_s"]
        if show_progress:
            extra = (f"; {row['peer']} {row['peer_samples_per_s']:,.0f}" if peer else "")
            compiled = "" if mode == "off" else f", compile {mode}"
            print(f"bench train: batch {bs:,}, {store.label} store{compiled}: "
                  f"{row['samples_per_s_excl_decode']:,.0f} "
                  f"samples/s (excl. decode){extra}", flush=True, file=sys.stderr)
        return row

    try:
        for bs in batch_sizes:
            for _ in range(max(1, repeats)):
                first = None
                for store, mode in ((s, m) for s in stores for m in compile_modes):
                    row = measure(bs, store, mode)
                    if first is None:
                        first = row
                    else:
                        for k in ("excl_decode", "incl_decode"):
                            row[f"vs_first_store_{k}"] = (row[f"samples_per_s_{k}"]
                                                          / first[f"samples_per_s_{k}"])
                    rows.append(row)
    finally:
        if tmp is not None:
            tmp.cleanup()
    return rows


def format_table(rows: list[dict]) -> str:
    cols = [("batch_size", "batch", "{:,}"), ("records", "records", "{:,}"),
            ("samples_per_s_excl_decode", "samples/s excl. decode", "{:,.0f}"),
            ("samples_per_s_incl_decode", "samples/s incl. decode", "{:,.0f}"),
            ("decode_records_per_s", "decode rec/s", "{:,.0f}"),
            ("prepare_pct", "prepare %", "{:.0f}"), ("fwd_bwd_pct", "fwd+bwd %", "{:.0f}"),
            ("update_pct", "update %", "{:.0f}"), ("peak_rss_mb", "peak RSS MB", "{:,.0f}"),
            ("bare_mlp_fp32_samples_per_s", "bare MLP fp32/s", "{:,.0f}"),
            ("bare_mlp_bf16_samples_per_s", "bare MLP bf16/s", "{:,.0f}"),
            ("vs_bare_fp32", "incl. decode vs bare fp32", "{:.2f}x")]
    stores_vary = len({r.get("store", "memory") for r in rows}) > 1
    compiles_vary = len({r.get("compile", "off") for r in rows}) > 1
    if compiles_vary:
        cols.insert(1, ("compile", "compile", "{}"))
    if stores_vary:
        cols.insert(1, ("store", "store", "{}"))
    if stores_vary or compiles_vary:
        first = " ".join(([rows[0]["store"]] if stores_vary else [])
                         + ([f"compile {rows[0]['compile']}"] if compiles_vary else []))
        cols += [("vs_first_store_excl_decode", f"excl. decode vs {first}", "{:.2f}x"),
                 ("vs_first_store_incl_decode", f"incl. decode vs {first}", "{:.2f}x")]
    if rows and "peer" in rows[0]:
        cols += [("peer_samples_per_s", f"{rows[0]['peer']}/s", "{:,.0f}"),
                 ("vs_peer_excl_decode", "excl. decode vs peer", "{:.2f}x"),
                 ("vs_peer_incl_decode", "incl. decode vs peer", "{:.2f}x")]
    table = [[title for _, title, _ in cols]]
    table += [[fmt.format(r[key]) if key in r else "" for key, _, fmt in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    device = rows[0]["device"] if rows else "?"
    precision = rows[0].get("precision", "fp32") if rows else "?"
    modes = {r.get("compile", "off") for r in rows}
    compiled = f" (torch.compile {modes.pop()})" if len(modes) == 1 and "off" not in modes else ""
    return (f"model {rows[0]['model'] if rows else '?'} on {device}, trainer in {precision}{compiled}; "
            f"bare MLP = the deep part alone, same process, mean of before and after the "
            f"decode-included pass\n" + "\n".join(lines))
