"""`stream-ctr bench kernels`: time per call and effective bandwidth of each op in `ops/`.

Every op here is memory-bound, so the figure of merit is bandwidth: the bytes
a call must move (its compulsory traffic, below) divided by its median time
per call, set beside a plain `dst.copy_(src)` of the same number of bytes on
the same device (read + write counted), which is about the best a kernel that
streams memory can do. The issue's goal: fused CowClip + Adam at >= 70% of
the copy bandwidth for 1M rows of d=16 on an H100.

Kernels, each as its torch reference and its fast path side by side: the Triton
kernel on CUDA, the op's compiled loop on the CPU (where it has one):
- cowclip_adam: `cowclip_adam_reference` vs `cowclip_adam_triton` /
  `cowclip_adam_cpu`, on U touched rows (unique, random order) of a table of
  2U rows of d fp32 columns, all d columns clipped;
- gather_forward: `out[j] = unique_rows[inverse[j]]` for M = batch x fields
  slots over U unique rows (each used at least once, the rest skewed toward
  hot rows, like Zipf ids; random order);
- gather_backward_segment_sum / gather_backward_atomic: the gradient of the
  gather summed per unique row, timed through `torch.autograd.grad` on a kept
  graph; Triton by sorted segment sum (deterministic) or by atomic adds; the
  reference of both is `index_add_` (on the CPU a compiled loop of the same
  additions, `ops.cpu_rows`: the CPU has no second path here);
- hash_find: the stores' hash-map lookup (`ops.hash_probe`) of U present keys
  in random order, in a table of 4U slots holding them: the torch probe rounds
  vs the Triton kernel / the stores' compiled loop (`store.probe_cpu`); d is
  not used;
- unique_keys: a batch's unique keys, inverse and counts of M slots holding U
  distinct keys: `torch.unique` vs `ops.unique.unique_keys`'s hash map (CPU
  only; on CUDA both are torch.unique).

Times are medians of `--repeat` calls after `--warmup` calls; on CUDA each
call is bracketed by CUDA events on the current stream, on the CPU by
`time.perf_counter`. Sizes below the GPU's L2 cache (about 50 MB on an H100)
measure the cache, not memory. Triton's CPU interpreter is never timed: it is
far too slow.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:       # torch and ops are imported when a bench runs, not when the CLI parses
    import torch

FLOAT32_BYTES = 4
INT64_BYTES = 8
TABLE_ROWS_PER_TOUCHED_ROW = 2     # the CowClip table holds 2U rows, U of them touched
ADAM_KWARGS = dict(step=10, lr=1e-3, l2=1e-5, clip_r=1.0, clip_zeta=1e-5,
                   beta1=0.9, beta2=0.999, eps=1e-7)


def add_bench_kernels_parser(bsub: argparse._SubParsersAction, add_common) -> None:
    b = bsub.add_parser("kernels", help="ops/ kernels: ms per call and GB/s vs a device copy, "
                        "torch reference vs Triton (CUDA) or the compiled CPU loops", description=__doc__.split("\n\n")[0])
    b.add_argument("--rows", type=int, default=1_000_000, help="touched rows of CowClip + Adam, "
                   "and unique rows of the gather (default 1,000,000)")
    b.add_argument("--dims", default="16", help="embedding widths d, comma-separated (default 16; "
                   "e.g. 10,16,64,128)")
    b.add_argument("--batch-size", type=int, default=65536, help="gather: batch rows (default 65536)")
    b.add_argument("--fields", type=int, default=39, help="gather: slots per batch row (default 39)")
    b.add_argument("--device", default="auto", help="auto (CUDA if present, else cpu), cpu, cuda[:N]")
    b.add_argument("--repeat", type=int, default=20, help="timed calls per kernel, median kept (default 20)")
    b.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    b.add_argument("--threads", type=int, default=0, help="torch intra-op threads on the CPU "
                   "(0: torch default)")
    b.add_argument("--seed", type=int, default=0, help="seed of the generated inputs")
    b.add_argument("--cowclip-sweep", action="store_true",
                   help="CUDA: also time the Triton CowClip + Adam at several launches (rows per "
                        "program, warps) beside the default, for each width")
    add_common(b)
    b.set_defaults(func=cmd_bench_kernels)


def cmd_bench_kernels(args: argparse.Namespace) -> tuple[dict, str]:
    """The bench command: prints the table; returns (JSON summary, one line) for the CLI to emit."""
    from stream_ctr.config import ConfigError
    from stream_ctr.train.trainer import resolve_device
    dims = [int(x) for x in args.dims.split(",")]
    slots = args.batch_size * args.fields
    if args.rows < 1 or min(dims) < 1 or args.repeat < 1 or args.warmup < 0 or args.threads < 0:
        raise ConfigError("bench kernels: --rows, --dims and --repeat must be >= 1, "
                          "--warmup and --threads >= 0")
    if slots < args.rows:
        raise ConfigError(f"bench kernels: --batch-size x --fields ({slots:,} slots) must be at "
                          f"least --rows ({args.rows:,}): every unique row is used by a slot")
    device = resolve_device(args.device)
    if args.cowclip_sweep and (device.type != "cuda" or triton_unavailable_reason(device)):
        raise ConfigError(f"bench kernels: --cowclip-sweep times Triton launches on a CUDA device; "
                          f"Triton does not run on {device} here")
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    rows = bench_kernels(args.rows, dims, slots, device, args.repeat, args.warmup, args.seed,
                         show_progress=not args.quiet, cowclip_sweep=args.cowclip_sweep)
    if not args.json:
        print(format_kernels_table(rows))
    return ({"bench": "kernels", "device": str(device), "rows": rows},
         f"bench kernels: {len(rows)} kernels measured on {device}")


# -- bytes each call must move (fp32 values, int64 indices) ------------------------------

def cowclip_adam_bytes(rows: int, dim: int) -> int:
    """One fused CowClip + Adam call on `rows` touched rows of width `dim`: it reads
    w, m, v and the gradient (4 x rows x dim fp32), the row indices and counts
    (2 x rows int64), and writes w, m, v (3 x rows x dim fp32)."""
    return rows * (7 * dim * FLOAT32_BYTES + 2 * INT64_BYTES)


def gather_forward_bytes(slots: int, unique_rows: int, dim: int) -> int:
    """Gather forward: reads `inverse` (slots int64) and each unique row once
    (unique_rows x dim fp32), writes the output (slots x dim fp32)."""
    return slots * INT64_BYTES + (unique_rows + slots) * dim * FLOAT32_BYTES


def gather_backward_bytes(slots: int, unique_rows: int, dim: int) -> int:
    """Gather backward: reads the output gradient (slots x dim fp32) and `inverse`
    (slots int64), writes the per-row sums (unique_rows x dim fp32). The sort of
    the segment sum and the zeroing of the atomic accumulator are not counted:
    they are overheads of an algorithm, not traffic the result needs."""
    return slots * INT64_BYTES + (unique_rows + slots) * dim * FLOAT32_BYTES


def hash_find_bytes(keys: int) -> int:
    """A lookup of `keys` present keys: reads each key and its start slot (int64), the
    slot that holds it (key + value, int64 each), writes its value (int64)."""
    return keys * 5 * INT64_BYTES


def unique_keys_bytes(slots: int, unique: int) -> int:
    """Reads the slots' keys, writes each slot's index and the unique keys with their
    counts (int64 each)."""
    return (2 * slots + 2 * unique) * INT64_BYTES


# -- timing -------------------------------------------------------------------------------

def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_call_seconds(fn: Callable[[], object], device: torch.device, repeat: int,
                        warmup: int) -> float:
    """Median seconds of one `fn()` over `repeat` calls, after `warmup` untimed calls
    (which also build Triton kernels). CUDA: a pair of CUDA events on the current
    stream around each call, read after one synchronize at the end."""
    import torch
    for _ in range(warmup):
        fn()
    synchronize(device)
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
        for start, end in zip(starts, ends):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        seconds = [start.elapsed_time(end) / 1e3 for start, end in zip(starts, ends)]
    else:
        seconds = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def copy_bytes_per_s(total_bytes: int, device: torch.device, repeat: int, warmup: int) -> float:
    """Bandwidth of `dst.copy_(src)` on `device` moving `total_bytes` in all
    (fp32 buffers of total_bytes / 2 each: read src + write dst)."""
    import torch
    n = max(1, total_bytes // (2 * FLOAT32_BYTES))
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = median_call_seconds(lambda: dst.copy_(src), device, repeat, warmup)
    return 2 * n * FLOAT32_BYTES / seconds


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton path is not timed on `device` (None: it is). The CPU
    interpreter is never timed: it is orders of magnitude slower than a GPU."""
    from stream_ctr.ops import dispatch
    if device.type != "cuda":
        return "no CUDA"
    if not dispatch.triton_available():
        return "no triton"
    if dispatch.triton_interpreting():
        return f"{dispatch.INTERPRET_ENV}=1"
    return None


def fast_path_name(device: torch.device) -> tuple[str, bool]:
    """(name of the fast path on `device`, whether it runs): "triton" on CUDA, "cpu-loops"
    on the CPU; "n/a (...)" where Triton cannot run on CUDA."""
    from stream_ctr.ops import dispatch
    if device.type != "cuda":
        return dispatch.PATH_CPU_LOOPS, True
    reason = triton_unavailable_reason(device)
    return (f"n/a ({reason})", False) if reason else (dispatch.PATH_TRITON, True)


# -- inputs -------------------------------------------------------------------------------

def make_inverse(slots: int, unique_rows: int, device: torch.device, seed: int) -> torch.Tensor:
    """int64 [slots] into [0, unique_rows): every row used at least once, the other
    slots skewed toward a few hot rows (like Zipf ids), in random order."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    hot = (torch.rand(slots - unique_rows, generator=gen) ** 4 * unique_rows).long()
    inverse = torch.cat([torch.arange(unique_rows), hot.clamp_max(unique_rows - 1)])
    return inverse[torch.randperm(slots, generator=gen)].to(device)


Setup = Callable[[], Callable[[], object]]


@dataclass
class KernelCase:
    """One kernel at one shape. `reference` and `fast` are set-ups: each is called
    once, when its path is timed, and returns the call to time (a backward set-up
    runs its forward first, so nothing of a path that is skipped ever runs). `fast`
    is the kernel on the device's fast path (Triton on CUDA, the compiled loop on the
    CPU), None where the op has none there; `no_fast` then says why."""
    kernel: str
    dim: int
    shape: str
    bytes: int
    slots: int | None
    reference: Setup | None
    fast: Setup | None
    no_fast: str = ""


# (rows per program, warps) of the Triton CowClip + Adam launches `--cowclip-sweep` times.
COWCLIP_SWEEP = ((32, 2), (32, 4), (64, 2), (64, 4), (64, 8), (128, 4), (128, 8), (256, 8))


def cowclip_adam_case(rows: int, dim: int, device: torch.device, seed: int,
                      sweep: bool = False) -> list[KernelCase]:
    """CowClip + Adam on `rows` unique touched rows, random order, of a table of 2 x rows;
    with `sweep`, then the Triton kernel alone at each launch of COWCLIP_SWEEP (CUDA)."""
    import functools
    import torch
    from stream_ctr.ops.cowclip_adam import (cowclip_adam_cpu, cowclip_adam_reference, cowclip_adam_triton,
                                             launch_config)
    gen = torch.Generator().manual_seed(seed)
    table_rows = TABLE_ROWS_PER_TOUCHED_ROW * rows
    weight = (torch.randn(table_rows, dim, generator=gen) * 0.01).to(device)
    exp_avg = torch.zeros_like(weight)
    exp_avg_sq = torch.zeros_like(weight)
    touched = torch.randperm(table_rows, generator=gen)[:rows].to(device)
    grad = (torch.randn(rows, dim, generator=gen) * 1e-3).to(device)
    count = torch.randint(1, 100, (rows,), generator=gen).to(device)

    def setup(impl):
        return lambda: lambda: impl(weight, exp_avg, exp_avg_sq, touched, grad, count,
                                    clip_dims=dim, **ADAM_KWARGS)
    fast = cowclip_adam_triton if device.type == "cuda" else cowclip_adam_cpu
    shape = f"{rows:,} of {table_rows:,} rows x {dim}"
    cases = [KernelCase("cowclip_adam", dim, shape, cowclip_adam_bytes(rows, dim), None,
                        setup(cowclip_adam_reference), setup(fast))]
    if sweep:
        default = launch_config(dim)
        for block_rows, warps in COWCLIP_SWEEP:
            mark = " (default)" if (block_rows, warps) == default else ""
            launch = functools.partial(cowclip_adam_triton, block_rows=block_rows, num_warps=warps)
            cases.append(KernelCase(f"cowclip_adam {block_rows} rows/{warps} warps{mark}", dim, shape,
                                    cowclip_adam_bytes(rows, dim), None, None, setup(launch)))
    return cases


def gather_cases(slots: int, rows: int, dim: int, device: torch.device, seed: int) -> list[KernelCase]:
    """Gather forward and both backwards: `slots` slots over `rows` unique rows."""
    import torch
    from stream_ctr.ops.embedding_gather import gather_rows_reference, gather_rows_triton
    gen = torch.Generator().manual_seed(seed)
    inverse = make_inverse(slots, rows, device, seed)
    src = torch.randn(rows, dim, generator=gen).to(device)
    grad_out = torch.randn(slots, dim, generator=gen).to(device)

    def forward(gather):
        return lambda: lambda: gather(src, inverse)

    def backward(gather):
        def setup():
            # Forward once; each timed call is one backward through the kept graph.
            leaf = src.clone().requires_grad_(True)
            out = gather(leaf, inverse)
            return lambda: torch.autograd.grad(out, leaf, grad_out, retain_graph=True)
        return setup

    def gather_atomic(s, i):
        return gather_rows_triton(s, i, deterministic=False)
    shape = f"{slots:,} slots x {dim}, {rows:,} unique rows"
    forward_bytes = gather_forward_bytes(slots, rows, dim)
    backward_bytes = gather_backward_bytes(slots, rows, dim)
    cuda = device.type == "cuda"
    no_loop = "" if cuda else "n/a (no CPU loop)"
    return [
        KernelCase("gather_forward", dim, shape, forward_bytes, slots,
                   forward(gather_rows_reference), forward(gather_rows_triton) if cuda else None, no_loop),
        KernelCase("gather_backward_segment_sum", dim, shape, backward_bytes, slots,
                   backward(gather_rows_reference), backward(gather_rows_triton) if cuda else None, no_loop),
        KernelCase("gather_backward_atomic", dim, shape, backward_bytes, slots,
                   backward(gather_rows_reference), backward(gather_atomic) if cuda else None, no_loop),
    ]


def key_cases(slots: int, rows: int, device: torch.device, seed: int) -> list[KernelCase]:
    """The stores' hash-map lookup and a batch's unique keys, at `rows` distinct keys."""
    import torch
    from stream_ctr.ops import hash_probe
    from stream_ctr.ops.unique import unique_keys
    from stream_ctr.store import probe_cpu
    from stream_ctr.store.key_index import _slot_hash
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, 2**62, (rows,), generator=gen).unique()
    keys = keys[torch.randperm(keys.numel(), generator=gen)]
    cap = 1 << (4 * keys.numel() - 1).bit_length()
    table_keys = torch.full((cap,), -1, dtype=torch.int64)
    table_vals = torch.full((cap,), -1, dtype=torch.int64)
    probe_cpu.place(table_keys, table_vals, keys, torch.arange(keys.numel()), _slot_hash(keys, cap - 1))
    table_keys, table_vals, keys = table_keys.to(device), table_vals.to(device), keys.to(device)
    query = keys[torch.randperm(keys.numel(), generator=gen).to(device)]
    start = _slot_hash(query, cap - 1)

    def find(fn):
        return lambda: lambda: fn(table_keys, query, start, table_vals)
    fast_find = hash_probe.find_positions_triton if device.type == "cuda" else probe_cpu.find_positions
    slot_keys = keys[make_inverse(slots, keys.numel(), device, seed)]
    cuda = device.type == "cuda"
    return [
        KernelCase("hash_find", 0, f"{keys.numel():,} keys in {cap:,} slots", hash_find_bytes(keys.numel()),
                   None, find(hash_probe.find_positions_reference), find(fast_find)),
        KernelCase("unique_keys", 0, f"{slots:,} slots, {keys.numel():,} distinct keys",
                   unique_keys_bytes(slots, keys.numel()), slots,
                   lambda: lambda: torch.unique(slot_keys, return_inverse=True, return_counts=True),
                   None if cuda else (lambda: lambda: unique_keys(slot_keys)),
                   "n/a (torch.unique on CUDA)" if cuda else ""),
    ]


# -- the benchmark ------------------------------------------------------------------------

def bench_kernels(rows: int, dims: list[int], slots: int, device: torch.device, repeat: int,
                  warmup: int, seed: int = 0, show_progress: bool = False,
                  cowclip_sweep: bool = False) -> list[dict]:
    """One result row per (kernel, d) (hash_find and unique_keys once, d = 0): bytes
    moved, copy bandwidth, and per path (`reference_*`, `fast_*`) seconds per call,
    bytes/s and the ratio to the copy. `fast_path` names the fast path ("triton",
    "cpu-loops"); its numbers are None where it does not run, and `fast_path` says why.
    `cowclip_sweep` (CUDA) adds a row per Triton launch of COWCLIP_SWEEP after each
    width's cowclip_adam row, the Triton kernel alone (no reference)."""
    import torch
    from stream_ctr.ops import dispatch
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    fast_path, fast_runs = fast_path_name(device)
    copy_cache: dict[int, float] = {}
    results = []
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for dim in dims:
            cases = [*cowclip_adam_case(rows, dim, device, seed, cowclip_sweep),
                     *gather_cases(slots, rows, dim, device, seed)]
            if dim == dims[-1]:            # no width: once, after the last width's cases
                cases += key_cases(slots, rows, device, seed)
            for case in cases:
                if case.bytes not in copy_cache:
                    copy_cache[case.bytes] = copy_bytes_per_s(case.bytes, device, repeat, warmup)
                row = {"kernel": case.kernel, "dim": case.dim, "shape": case.shape, "rows": rows,
                       "slots": case.slots, "bytes": case.bytes,
                       "copy_bytes_per_s": copy_cache[case.bytes]}
                row.update(_time_path("reference", dispatch.PATH_REFERENCE, case.reference, row,
                                      device, repeat, warmup))
                runs = fast_runs and case.fast is not None
                row.update(_time_path("fast", fast_path if runs else (case.no_fast or fast_path),
                                      case.fast if runs else None, row, device, repeat, warmup))
                results.append(row)
                if show_progress:
                    print(f"bench kernels: {case.kernel} d={case.dim}: reference "
                          f"{_gb_per_s(row['reference_bytes_per_s'])}, {row['fast_path']} "
                          f"{_gb_per_s(row['fast_bytes_per_s'])}", file=sys.stderr, flush=True)
            del cases
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return results


def _gb_per_s(bytes_per_s: float | None) -> str:
    return "n/a" if bytes_per_s is None else f"{bytes_per_s / 1e9:.1f} GB/s"


def _time_path(prefix: str, path: str, setup: Callable[[], Callable[[], object]] | None,
               row: dict, device: torch.device, repeat: int, warmup: int) -> dict:
    """`{prefix}_path`, `_seconds_per_call`, `_bytes_per_s`, `_vs_copy` of one path;
    the numbers are None when `setup` is None (the path is not run)."""
    if setup is None:
        return {f"{prefix}_path": path, f"{prefix}_seconds_per_call": None,
                f"{prefix}_bytes_per_s": None, f"{prefix}_vs_copy": None}
    seconds = median_call_seconds(setup(), device, repeat, warmup)
    bytes_per_s = row["bytes"] / seconds
    return {f"{prefix}_path": path, f"{prefix}_seconds_per_call": seconds,
            f"{prefix}_bytes_per_s": bytes_per_s,
            f"{prefix}_vs_copy": bytes_per_s / row["copy_bytes_per_s"]}


def format_kernels_table(rows: list[dict]) -> str:
    def cells(r: dict, prefix: str) -> list[str]:
        if r[f"{prefix}_seconds_per_call"] is None:
            return ["-", "-", "-"]
        return [f"{r[f'{prefix}_seconds_per_call'] * 1e3:.3f}", f"{r[f'{prefix}_bytes_per_s'] / 1e9:.1f}",
                f"{r[f'{prefix}_vs_copy']:.0%}"]
    head = ["kernel", "d", "shape", "MB moved", "copy GB/s", "torch ms", "torch GB/s", "torch/copy",
            "fast path", "fast ms", "fast GB/s", "fast/copy"]
    table = [head] + [[r["kernel"], str(r["dim"] or "-"), r["shape"], f"{r['bytes'] / 1e6:,.1f}",
                       f"{r['copy_bytes_per_s'] / 1e9:.1f}", *cells(r, "reference"),
                       r["fast_path"], *cells(r, "fast")]
                      for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    lines = [" | ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    lines.append("ms: median time per call; GB/s: bytes the call must move / time; copy: "
                 "dst.copy_(src) moving the same bytes (read + write) on the same device")
    return "\n".join(lines)
