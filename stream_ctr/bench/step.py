"""`stream-ctr bench step`: whole DeepFM steps per second, torch reference vs Triton/CPU loops.

A step is `Trainer.train_step`, as `stream-ctr train` runs it: working set
(unique keys and counts), store lookup, gather, forward, mean BCE, backward,
dense Adam, CowClip + Adam on the rows present; torch configured by
`configure_torch` as in `train` (deterministic algorithms, denormals flushed).
Every embedding row is resident on the training device: the in-memory store
(one table on the device, which is the device cache when nothing spills).
The tiered store's movement of rows is measured by `bench store`.

Data: synthetic Criteo records from `stream_ctr.connectors.synth` (Zipf ids), decoded
into 4 distinct batches per batch size before anything is timed. One
untimed pass over them creates every row (no row is new in a timed step),
builds the Triton kernels and warms the allocator; then `--steps` timed steps
cycle through them (no `upcoming` batch: the train loop passes one only to a
tiered store). The device is synchronized before and after the timed steps;
samples/s = batch x steps / seconds.

Each batch size runs twice, in a fresh trainer each time: with the torch
references forced (`stream_ctr.ops.dispatch.force_reference`) and with the
default dispatch: Triton on CUDA, the ops' compiled CPU loops on the CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from stream_ctr.bench.kernels import synchronize, triton_unavailable_reason

if TYPE_CHECKING:       # torch is imported when the bench runs, not when the CLI parses
    import torch

    from stream_ctr.connectors.batch import Batch

DISTINCT_BATCHES = 4
CUDA_BATCH_SIZES = "8192,65536,131072"
CPU_BATCH_SIZES = "1024,8192"
CUDA_STEPS = 20
CPU_STEPS = 5


def add_bench_step_parser(bsub: argparse._SubParsersAction, add_common) -> None:
    b = bsub.add_parser("step", help="DeepFM training steps: samples/s and ms/step per batch size, "
                        "torch reference vs Triton (CUDA) or the compiled CPU loops",
                        description=__doc__.split("\n\n")[0])
    b.add_argument("--batch-sizes", help=f"comma-separated (default {CUDA_BATCH_SIZES} on CUDA, "
                   f"{CPU_BATCH_SIZES} on the CPU, where a 131072 step takes seconds)")
    b.add_argument("--steps", type=int, help=f"timed steps per batch size and path (default "
                   f"{CUDA_STEPS} on CUDA, {CPU_STEPS} on the CPU)")
    b.add_argument("--model", default="deepfm", choices=["deepfm", "wdl", "dcn", "dcnv2"], help="model to time")
    b.add_argument("--device", default="auto", help="auto (CUDA if present, else cpu), cpu, cuda[:N]")
    b.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    b.add_argument("--precisions", default="fp32,bf16",
                   help="comma-separated, of fp32 and bf16 (train.precision: the dense model's matmuls)")
    add_common(b)
    b.set_defaults(func=cmd_bench_step)


def cmd_bench_step(args: argparse.Namespace) -> tuple[dict, str]:
    """The bench command: prints the table; returns (JSON summary, one line) for the CLI to emit."""
    from stream_ctr.config import ConfigError
    from stream_ctr.train.trainer import resolve_device
    device = resolve_device(args.device)
    on_cuda = device.type == "cuda"
    sizes = [int(x) for x in (args.batch_sizes or (CUDA_BATCH_SIZES if on_cuda else CPU_BATCH_SIZES)).split(",")]
    steps = args.steps if args.steps is not None else (CUDA_STEPS if on_cuda else CPU_STEPS)
    if min(sizes) < 1 or steps < 1:
        raise ConfigError("bench step: --batch-sizes and --steps must be >= 1")
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if not precisions or set(precisions) - {"fp32", "bf16"}:
        raise ConfigError(f"bench step: --precisions takes fp32 and/or bf16, got {args.precisions!r}")
    rows = bench_step(sizes, steps, device, args.model, args.threads, show_progress=not args.quiet,
                      precisions=precisions)
    if not args.json:
        print(format_step_table(rows))
    return ({"bench": "step", "device": str(device), "rows": rows},
         f"bench step: {len(rows)} configurations measured on {device}")


def synthetic_batches(batch_sizes: list[int]) -> tuple[dict[int, list[Batch]], int, int]:
    """DISTINCT_BATCHES decoded batches per batch size, cut from one synthetic
    Criteo file of DISTINCT_BATCHES x max(batch_sizes) records; and the format's
    number of key fields and dense features."""
    from stream_ctr.connectors.batch import Batch
    from stream_ctr.connectors.files import FileSource, detect_format
    from stream_ctr.connectors.synth import write_synthetic_criteo
    records = DISTINCT_BATCHES * max(batch_sizes)
    with tempfile.TemporaryDirectory(prefix="stream_ctr_bench_step_") as tmp:
        path = Path(tmp) / "synth.tsv"
        write_synthetic_criteo(path, records, seed=0)
        fmt, p = detect_format(f"criteo:{path}")
        chunks = []
        with FileSource(p, fmt, chunk_records=65536) as src:
            while not src.exhausted:
                chunks.append(src.read()[0])
    data = Batch.concat(chunks)
    batches = {bs: [data.slice(i * bs, (i + 1) * bs) for i in range(DISTINCT_BATCHES)]
               for bs in batch_sizes}
    return batches, fmt.n_model_fields, fmt.n_dense


def bench_step(batch_sizes: list[int], steps: int, device: torch.device, model: str = "deepfm",
               threads: int = 0, show_progress: bool = False,
               precisions: tuple[str, ...] | list[str] = ("fp32",)) -> list[dict]:
    """One result row per (batch size, precision, kernel path): samples/s, ms/step, unique
    rows per step; "vs reference" compares paths at the same precision."""
    from stream_ctr.ops import dispatch
    from stream_ctr.config import Config
    from stream_ctr.train.loop import configure_torch
    skip_triton = triton_unavailable_reason(device)
    if device.type == "cpu":
        paths = [dispatch.PATH_REFERENCE, dispatch.PATH_CPU_LOOPS]
    else:
        paths = [dispatch.PATH_REFERENCE] + ([] if skip_triton else [dispatch.PATH_TRITON])
    batches, n_fields, n_dense = synthetic_batches(batch_sizes)
    results = []
    for bs, precision in ((bs, p) for bs in batch_sizes for p in precisions):
        cfg = Config()
        cfg.model.name = model
        cfg.data.batch_size = bs
        cfg.train.device = str(device)
        cfg.train.threads = threads
        cfg.train.precision = precision
        cfg.store.kind = "memory"
        configure_torch(cfg)
        reference_samples_per_s = 0.0
        for path in paths:             # the reference first
            forced = dispatch.force_reference() if path == dispatch.PATH_REFERENCE else contextlib.nullcontext()
            with forced:
                row = _time_steps(cfg, batches[bs], n_fields, n_dense, steps)
            if path == dispatch.PATH_REFERENCE:
                reference_samples_per_s = row["samples_per_s"]
            row.update(model=model, batch_size=bs, precision=precision, device=str(device),
                       triton_skipped=skip_triton,
                       speedup_vs_reference=row["samples_per_s"] / reference_samples_per_s)
            results.append(row)
            if show_progress:
                print(f"bench step: batch {bs:,} {precision} {row['path']}: {row['samples_per_s']:,.0f} samples/s",
                      file=sys.stderr, flush=True)
    return results


def _time_steps(cfg, batches: list[Batch], n_fields: int, n_dense: int, steps: int) -> dict:
    import torch
    from stream_ctr.ops import dispatch
    from stream_ctr.train.trainer import Trainer
    trainer = Trainer(cfg, n_fields, n_dense)
    path = dispatch.kernel_path(trainer.store.weight)
    n = len(batches)

    # Warm-up (untimed): one pass creates every row and builds the kernels.
    for i in range(n):
        trainer.train_step(batches[i])
    synchronize(trainer.device)

    # Timed: whole steps on resident rows; the device is idle at both ends.
    unique_rows, skipped_flags = 0, []
    t0 = time.perf_counter()
    for i in range(steps):
        result = trainer.train_step(batches[i % n])
        unique_rows += result.rows_touched
        skipped_flags.append(result.skipped)     # read after the clock stops: no extra sync
    synchronize(trainer.device)
    seconds = time.perf_counter() - t0
    skipped = int(torch.stack(skipped_flags).sum())

    samples = steps * len(batches[0])
    del trainer
    gc.collect()
    if cfg.train.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"path": path, "steps": steps, "seconds": seconds, "samples_per_s": samples / seconds,
            "seconds_per_step": seconds / steps, "unique_rows_per_step": unique_rows / steps,
            "skipped_steps": skipped}


def format_step_table(rows: list[dict]) -> str:
    head = ["batch", "precision", "path", "samples/s", "ms/step", "unique rows/step", "vs reference", "steps"]
    table = [head] + [[f"{r['batch_size']:,}", r.get("precision", "fp32"), r["path"], f"{r['samples_per_s']:,.0f}",
                       f"{r['seconds_per_step'] * 1e3:.2f}", f"{r['unique_rows_per_step']:,.0f}",
                       f"{r['speedup_vs_reference']:.2f}x", str(r["steps"])] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(line, widths)) for line in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    model = rows[0]["model"] if rows else "?"
    device = rows[0]["device"] if rows else "?"
    skipped = rows[0]["triton_skipped"] if rows else None
    note = f"; triton: n/a ({skipped})" if skipped else ""
    return (f"model {model} on {device}, all rows resident in the device store{note}\n"
            + "\n".join(lines))
