"""Fused CowClip + sparse Adam over the embedding rows present in a batch.

For each present row i (unique index `rows[i]` into the table, seen
`count[i]` times in the batch, gradient `grad[i]` of the MEAN batch loss):

    w, m, v  = weight[rows[i]], exp_avg[rows[i]], exp_avg_sq[rows[i]]
    g        = grad[i] + 2*l2*w                   # L2 on present rows (lazy)
    # CowClip on the first `clip_dims` columns (the d-dim embedding); the
    # columns after them (e.g. a 1-dim "linear" weight) get L2 and Adam only.
    lower    = clip_r * sqrt(clip_dims) * clip_zeta
    thr      = clip_scale * clip_r * count[i] * max(||w[:clip_dims]||, lower)
    gn       = ||g[:clip_dims]||
    g[:clip_dims] *= min(1, thr/gn)  if gn > 0   # no epsilon; zero stays zero
    # Adam (torch semantics), on the clipped gradient
    m = b1*m + (1-b1)*g ;  v = b2*v + (1-b2)*g*g
    lr_i = lr * row_lr_multiplier(count[i], count_lr_s)
    w = w - lr_i/(1-b1**step) * m / (sqrt(v)/sqrt(1-b2**step) + eps)

`clip_scale` = 1 is the repo's threshold on the mean-loss gradient; 1/batch
puts it in per-occurrence units (the sum-loss gradient is batch x the mean).
`row_lr_multiplier(c, s)` = s*(1-(1-1/s)**c) for s > 1, else 1: the expected
number of the s base-size batches a big batch replaces that hold at least one
of the row's c occurrences, i.e. how many Adam steps the row would have taken
at the base batch (1 for c = 1, ~c for c << s, -> s for c >> s).

Norms use the pre-update weights. The threshold is the one in the CowClip
authors' code; the paper's zeta is `clip_r**2 * sqrt(d) * clip_zeta`.
Rows not in `rows` are untouched: the lazy variant of sparse Adam (a row's
moments move only in the steps that hold it).

`cowclip_adam_reference` is pure torch; `cowclip_adam_triton` is one kernel,
one program per block of rows, one pass over w, m, v and the gradient;
`cowclip_adam_cpu` is the same single pass as a compiled CPU loop (numba).
`cowclip_adam_` picks Triton where `stream_ctr.ops.dispatch.use_triton` says
so, the CPU loop where `use_cpu_loop` does, else the reference. The reference on
the CPU gathers the rows of three tables, makes ~20 passes over them and
scatters them back; in `bench train`'s steps at batch 8,192 (43K rows) on the
project's 2-vCPU VM the update phase took 12.5 ms with it and 9.2 ms with the
loop. Rows spread over a table much larger than the cache cost both about the
same (~10 ms for 43K rows of a 1M-row table): there the misses dominate.

Importing this module does not import triton: the kernel is built on the
first Triton call. `TRITON_INTERPRET=1` (the CPU interpreter, for tests)
must be set before triton is first imported in the process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

from .cpu_parts import part_bounds, run_parts
from .dispatch import check_triton_device, use_cpu_loop, use_triton

# Bound by _build_kernel() on the first Triton call, not at import: Triton
# reads TRITON_INTERPRET when it is first imported (its own tl.sum & co. are
# jit functions), so importing ops must not import it.
triton = None
tl = None


# Buckets of the per-row ratio ||gradient|| / threshold (a row is clipped when it is
# > 1): powers of 4 from 4**-7 (~6e-5) to 4**3 = 64, because in mean-loss units the
# ratio sits near count/batch of a per-occurrence one (1e-4 at 32K) and in
# occurrence units near 1-100; one grid has to show both.
CLIP_RATIO_LOG2_EDGES = tuple(range(-14, 7, 2))
CLIP_RATIO_EDGES = tuple(2.0**k for k in CLIP_RATIO_LOG2_EDGES)


@dataclass(frozen=True)
class ClipStats:
    """CowClip diagnostics of one update (cowclip.md 6.10).

    `rows_clipped` (present rows whose gradient was scaled down) and
    `rows_at_floor` (present rows with `||w[:clip_dims]|| < lower`) are int64
    0-dim tensors on the table's device, so reading them is the caller's
    sync point, not the op's. Both are 0 when `cowclip=False`.
    `rows_present` is the number of rows updated (known on the host).
    `ratio_le[i]` counts the present rows whose ||g|| / threshold is <= CLIP_RATIO_EDGES[i]
    (int64 [len(CLIP_RATIO_EDGES)], cumulative as a Prometheus histogram's buckets) and
    `ratio_sum` is the sum of the ratios (float32 0-dim); None without cowclip.
    """

    rows_clipped: torch.Tensor
    rows_at_floor: torch.Tensor
    rows_present: int
    ratio_le: torch.Tensor | None = None
    ratio_sum: torch.Tensor | None = None

    def clipped_fraction(self) -> torch.Tensor:
        """Fraction of present rows that were clipped, a float32 0-dim tensor (0 when none present)."""
        return self.rows_clipped.float() / max(self.rows_present, 1)


def cowclip_adam_(
    weight: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    rows: torch.Tensor, grad: torch.Tensor, count: torch.Tensor, *,
    step: int, lr: float, l2: float, clip_r: float, clip_zeta: float, clip_dims: int,
    beta1: float, beta2: float, eps: float, cowclip: bool = True,
    clip_scale: float = 1.0, count_lr_s: float = 1.0,
) -> ClipStats:
    """CowClip + Adam update of the rows `rows` of an embedding table, IN PLACE.

    Args:
        weight, exp_avg, exp_avg_sq: float32 [N_table, D], contiguous, same
            device. The rows listed in `rows` are overwritten; no other row
            is read or written.
        rows: int64 [U], UNIQUE row indices into the table, any order (the
            result does not depend on it). Duplicates or out-of-range
            indices are not checked (that would need a host sync): the
            Triton path would race or read out of bounds.
        grad: float32 [U, D], gradient of the mean batch loss for each row,
            already summed over the row's occurrences. Not modified.
        count: integer [U], occurrences of each row in the batch (global over
            replicas when the gradient is a global mean).
        step: global Adam step (>= 1), for bias correction.
        lr, l2: learning rate and L2 coefficient (gradient `2*l2*w`).
        clip_r, clip_zeta: CowClip ratio r and per-coordinate floor zeta.
        clip_dims: number of leading columns that are clipped (1..D).
        beta1, beta2, eps: Adam constants.
        cowclip: False skips the clip (plain sparse Adam with L2).
        clip_scale: factor on the threshold (1/batch: per-occurrence units).
        count_lr_s: s of the per-row lr multiplier `row_lr_multiplier` (1: off).

    Returns:
        ClipStats of 0-dim device tensors; the op does not sync the host.

    Runs the Triton kernel on CUDA tensors (or when STREAM_CTR_FORCE_TRITON=1),
    the compiled CPU loop on CPU tensors, the torch reference under
    STREAM_CTR_FORCE_REFERENCE=1 (or where the loop does not apply).
    """
    if use_triton(weight):
        impl = cowclip_adam_triton
    elif use_cpu_loop(weight) and cpu_loop_usable(weight, rows, grad, count):
        impl = cowclip_adam_cpu
    else:
        impl = cowclip_adam_reference
    return impl(weight, exp_avg, exp_avg_sq, rows, grad, count, step=step, lr=lr, l2=l2,
                clip_r=clip_r, clip_zeta=clip_zeta, clip_dims=clip_dims,
                beta1=beta1, beta2=beta2, eps=eps, cowclip=cowclip,
                clip_scale=clip_scale, count_lr_s=count_lr_s)


def row_lr_multiplier(count: torch.Tensor, s: float) -> torch.Tensor:
    """s*(1-(1-1/s)**count) as float32 [U] (all ones for s <= 1); see the module doc."""
    c = count.to(torch.float32)
    if s <= 1.0:
        return torch.ones_like(c)
    return s * -torch.expm1(c * math.log1p(-1.0 / s))


def _check_args(weight, exp_avg, exp_avg_sq, rows, grad, count, step, clip_dims, cowclip) -> None:
    # Shape, dtype and device checks only: nothing here reads tensor values.
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N_table, D], got shape {tuple(weight.shape)}")
    d = weight.shape[1]
    u = rows.shape[0] if rows.dim() == 1 else -1
    for name, t in (("weight", weight), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32 or t.shape != weight.shape or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 {tuple(weight.shape)}, "
                             f"got {t.dtype} {tuple(t.shape)}")
    if rows.dtype != torch.int64 or rows.dim() != 1:
        raise ValueError(f"rows must be int64 [U], got {rows.dtype} {tuple(rows.shape)}")
    if grad.dtype != torch.float32 or tuple(grad.shape) != (u, d):
        raise ValueError(f"grad must be float32 [{u}, {d}], got {grad.dtype} {tuple(grad.shape)}")
    if count.dtype.is_floating_point or count.dtype == torch.bool or tuple(count.shape) != (u,):
        raise ValueError(f"count must be an integer [{u}] tensor, got {count.dtype} {tuple(count.shape)}")
    devices = {t.device for t in (weight, exp_avg, exp_avg_sq, rows, grad, count)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if step < 1:
        raise ValueError(f"step must be >= 1 (Adam bias correction), got {step}")
    if cowclip and not 1 <= clip_dims <= d:
        raise ValueError(f"clip_dims must be in [1, {d}], got {clip_dims}")


def _zero_stats(device: torch.device, rows_present: int) -> ClipStats:
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return ClipStats(zero, zero.clone(), rows_present)


def clip_rows_reference(
    w: torch.Tensor, g: torch.Tensor, count: torch.Tensor, *,
    clip_r: float, clip_zeta: float, clip_dims: int, clip_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CowClip of gathered rows (pure torch, out of place).

    `w`, `g`: float [U, D] pre-update weights and (L2-added) gradients;
    `count`: integer [U]; `clip_scale` multiplies the threshold. Returns `(g_clipped [U, D], clipped bool [U],
    at_floor bool [U])`; only the first `clip_dims` columns are scaled.
    """
    g_clipped, clipped, at_floor, _ = _clip_rows(w, g, count, clip_r=clip_r, clip_zeta=clip_zeta,
                                                 clip_dims=clip_dims, clip_scale=clip_scale)
    return g_clipped, clipped, at_floor


def clip_ratio_stats(ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(`ratio_le` int64 [edges], `ratio_sum` float32 0-dim) of per-row ratios [U].

    Compared in log2, as the kernel does, so both count a row on the same side of an edge."""
    log2r = torch.log2(ratio)
    edges = torch.tensor(CLIP_RATIO_LOG2_EDGES, dtype=ratio.dtype, device=ratio.device)
    return (log2r[:, None] <= edges[None, :]).sum(0), torch.where(ratio < math.inf, ratio, 0.0).sum()


def _clip_rows(w, g, count, *, clip_r, clip_zeta, clip_dims, clip_scale):
    """`clip_rows_reference` plus each row's ||g|| / threshold."""
    lower = clip_r * math.sqrt(clip_dims) * clip_zeta
    w_norm = torch.linalg.vector_norm(w[:, :clip_dims], dim=1)
    g_norm = torch.linalg.vector_norm(g[:, :clip_dims], dim=1)
    thr = clip_scale * clip_r * count.to(w.dtype) * torch.clamp_min(w_norm, lower)
    clipped = g_norm > thr  # implies g_norm > 0: a zero row is never scaled
    scale = torch.where(clipped, thr / torch.where(clipped, g_norm, 1.0), 1.0)
    g_clipped = g.clone()
    g_clipped[:, :clip_dims] *= scale[:, None]
    # thr is 0 only with zeta = 0 on an all-zero row: such a row with a gradient is cut to 0.
    ratio = torch.where(thr > 0, g_norm / torch.where(thr > 0, thr, 1.0),
                        torch.where(g_norm > 0, math.inf, 0.0))
    return g_clipped, clipped, w_norm < lower, ratio


def cowclip_adam_reference(
    weight: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    rows: torch.Tensor, grad: torch.Tensor, count: torch.Tensor, *,
    step: int, lr: float, l2: float, clip_r: float, clip_zeta: float, clip_dims: int,
    beta1: float, beta2: float, eps: float, cowclip: bool = True,
    clip_scale: float = 1.0, count_lr_s: float = 1.0,
) -> ClipStats:
    """Pure-torch `cowclip_adam_`: index_select the rows, compute, index_copy_ back.

    Same arguments, in-place effect and result as `cowclip_adam_`.
    """
    _check_args(weight, exp_avg, exp_avg_sq, rows, grad, count, step, clip_dims, cowclip)
    if rows.numel() == 0:
        return _zero_stats(weight.device, 0)
    w = weight.index_select(0, rows)
    m = exp_avg.index_select(0, rows)
    v = exp_avg_sq.index_select(0, rows)

    g = grad + (2.0 * l2) * w
    stats = _zero_stats(weight.device, rows.numel())
    if cowclip:
        g, clipped, at_floor, ratio = _clip_rows(
            w, g, count, clip_r=clip_r, clip_zeta=clip_zeta, clip_dims=clip_dims,
            clip_scale=clip_scale)
        stats = ClipStats(clipped.sum(), at_floor.sum(), rows.numel(), *clip_ratio_stats(ratio))

    step_size, bc2_sqrt = _bias_corrections(lr, beta1, beta2, step)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * (g * g)
    if count_lr_s > 1.0:
        step_size = step_size * row_lr_multiplier(count, count_lr_s)[:, None]
    w = w - step_size * (m / (v.sqrt() / bc2_sqrt + eps))

    weight.index_copy_(0, rows, w)
    exp_avg.index_copy_(0, rows, m)
    exp_avg_sq.index_copy_(0, rows, v)
    return stats


def _bias_corrections(lr: float, beta1: float, beta2: float, step: int) -> tuple[float, float]:
    # As torch.optim.Adam computes them, in double on the host.
    return lr / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step)


def cpu_loop_usable(weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor,
                    count: torch.Tensor) -> bool:
    """Whether `cowclip_adam_cpu` takes these tensors (CPU, float32 tables and gradient,
    int64 rows, an integer count; shapes are checked by the op itself)."""
    return (weight.device.type == "cpu" and rows.device.type == "cpu" and grad.device.type == "cpu"
            and count.device.type == "cpu" and weight.dtype == torch.float32
            and grad.dtype == torch.float32 and rows.dtype == torch.int64
            and not count.dtype.is_floating_point and count.dtype != torch.bool)


def cowclip_adam_cpu(
    weight: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    rows: torch.Tensor, grad: torch.Tensor, count: torch.Tensor, *,
    step: int, lr: float, l2: float, clip_r: float, clip_zeta: float, clip_dims: int,
    beta1: float, beta2: float, eps: float, cowclip: bool = True,
    clip_scale: float = 1.0, count_lr_s: float = 1.0,
) -> ClipStats:
    """Compiled-loop `cowclip_adam_` for CPU tensors: one pass, in float32, the rows
    split between threads (`cpu_parts`; rows are unique, so the parts write disjoint rows).

    Same arguments, in-place effect and result as `cowclip_adam_`, up to float32
    rounding (the norms are summed in another order than torch's, and torch's float32
    sqrt on the CPU is not always correctly rounded, the loop's is). Rows out of the
    table's range raise IndexError before any row is written; duplicate rows are
    not checked.
    """
    _check_args(weight, exp_avg, exp_avg_sq, rows, grad, count, step, clip_dims, cowclip)
    u, d = rows.numel(), weight.shape[1]
    if u == 0 or d == 0:
        return _zero_stats(weight.device, u)
    rows, grad, count = rows.contiguous(), grad.contiguous(), count.contiguous()
    if int(rows.min()) < 0 or int(rows.max()) >= weight.shape[0]:
        raise IndexError(f"cowclip_adam: a row index is outside the table of {weight.shape[0]} rows")
    step_size, bc2_sqrt = _bias_corrections(lr, beta1, beta2, step)
    # Each part of the rows gets a row of `counts` (clipped, at floor, the ratio buckets)
    # and a ratio sum; they are added up here, in a fixed order.
    bounds = part_bounds(u, _CPU_ROWS_PER_PART)
    counts = torch.zeros((len(bounds) - 1, 2 + len(CLIP_RATIO_LOG2_EDGES)), dtype=torch.int64)
    ratio_sums = torch.zeros(len(bounds) - 1, dtype=torch.float64)
    args = (weight.numpy(), exp_avg.numpy(), exp_avg_sq.numpy(), rows.numpy(), grad.numpy(),
            count.numpy(), clip_dims if cowclip else d, cowclip, 2.0 * l2, clip_scale * clip_r,
            clip_r * math.sqrt(clip_dims) * clip_zeta, beta1, beta2, step_size, bc2_sqrt, eps,
            float(count_lr_s), math.log1p(-1.0 / count_lr_s) if count_lr_s > 1.0 else 0.0,
            float(CLIP_RATIO_LOG2_EDGES[0]), float(CLIP_RATIO_LOG2_EDGES[1] - CLIP_RATIO_LOG2_EDGES[0]))
    kernel = _cpu_kernel()
    run_parts(lambda k, lo, hi: kernel(*args, lo, hi, counts[k].numpy(), ratio_sums[k:k + 1].numpy()),
              bounds)
    totals = counts.sum(0)
    if not cowclip:
        return ClipStats(totals[0], totals[1], u)
    return ClipStats(totals[0], totals[1], u, totals[2:], ratio_sums.sum().to(torch.float32))


_CPU_ROWS_PER_PART = 4096
# Rows gathered before they are computed: loads of independent rows overlap; one row at
# a time, each row's three cache misses were waited for in turn (43K rows of a 1M-row
# table: 15 ms a row at a time, 9.6 ms in blocks of 64, one thread, 2-vCPU EPYC).
_CPU_BLOCK_ROWS = 64


@cache
def _cpu_kernel():
    # Compiled on the first call (a few seconds; cached in __pycache__ after that).
    # Every scalar is made float32 first: numba would otherwise promote each product
    # with a Python float to float64, and the loop would not compute what the
    # reference and the Triton kernel compute.
    import numpy as np
    from numba import njit

    block = _CPU_BLOCK_ROWS

    @njit(nogil=True, cache=True)
    def update_rows(weight, exp_avg, exp_avg_sq, rows, grad, count,
                    clip_dims, cowclip, two_l2, thr_factor, lower, beta1, beta2,
                    step_size, bc2_sqrt, eps, count_lr_s, count_lr_log_keep, log2_lo, log2_step,
                    lo, hi, counts, ratio_sum):
        d = weight.shape[1]
        f32 = np.float32
        two_l2, thr_factor, lower = f32(two_l2), f32(thr_factor), f32(lower)
        b1, b2, one_b1, one_b2 = f32(beta1), f32(beta2), f32(1.0 - beta1), f32(1.0 - beta2)
        bc2, eps32 = f32(bc2_sqrt), f32(eps)
        n_edges = counts.shape[0] - 2
        w = np.empty((block, d), np.float32)
        m = np.empty((block, d), np.float32)
        v = np.empty((block, d), np.float32)
        g = np.empty(d, np.float32)
        total = 0.0
        for first in range(lo, hi, block):
            last = min(first + block, hi)
            for i in range(first, last):
                r = rows[i]
                for j in range(d):
                    w[i - first, j] = weight[r, j]
                    m[i - first, j] = exp_avg[r, j]
                    v[i - first, j] = exp_avg_sq[r, j]
            for i in range(first, last):
                k = i - first
                w_sq = f32(0.0)
                g_sq = f32(0.0)
                for j in range(d):
                    gj = grad[i, j] + two_l2 * w[k, j]
                    g[j] = gj
                    if j < clip_dims:
                        w_sq += w[k, j] * w[k, j]
                        g_sq += gj * gj
                cnt = f32(count[i])
                if cowclip:
                    w_norm, g_norm = np.sqrt(w_sq), np.sqrt(g_sq)
                    thr = thr_factor * cnt * max(w_norm, lower)
                    if g_norm > thr:        # implies g_norm > 0: a zero row is never scaled
                        counts[0] += 1
                        scale = thr / g_norm
                        for j in range(clip_dims):
                            g[j] *= scale
                    if w_norm < lower:
                        counts[1] += 1
                    # thr is 0 only with zeta = 0 on an all-zero row (cut to 0 with a gradient).
                    # float32 throughout, log2 included: a ratio one float32 step above an
                    # edge has a float32 log2 on the edge, and the reference counts it there.
                    if thr > 0:
                        ratio = g_norm / thr
                    else:
                        ratio = f32(np.inf) if g_norm > 0 else f32(0.0)
                    if ratio < np.inf:
                        total += ratio
                    log2r = np.log2(ratio)
                    for e in range(n_edges):
                        if log2r <= log2_lo + e * log2_step:
                            counts[2 + e] += 1
                size = f32(step_size)
                if count_lr_s > 1.0:        # row_lr_multiplier's float32 steps, then the product
                    size = size * (f32(count_lr_s) * -np.expm1(cnt * f32(count_lr_log_keep)))
                for j in range(d):
                    mj = b1 * m[k, j] + one_b1 * g[j]
                    vj = b2 * v[k, j] + one_b2 * (g[j] * g[j])
                    m[k, j] = mj
                    v[k, j] = vj
                    w[k, j] -= size * (mj / (np.sqrt(vj) / bc2 + eps32))
            for i in range(first, last):
                r = rows[i]
                for j in range(d):
                    weight[r, j] = w[i - first, j]
                    exp_avg[r, j] = m[i - first, j]
                    exp_avg_sq[r, j] = v[i - first, j]
        ratio_sum[0] = total
    return update_rows


def cowclip_adam_triton(
    weight: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    rows: torch.Tensor, grad: torch.Tensor, count: torch.Tensor, *,
    step: int, lr: float, l2: float, clip_r: float, clip_zeta: float, clip_dims: int,
    beta1: float, beta2: float, eps: float, cowclip: bool = True,
    clip_scale: float = 1.0, count_lr_s: float = 1.0,
    block_rows: int | None = None, num_warps: int | None = None,
) -> ClipStats:
    """Triton `cowclip_adam_`: one fused pass, one program per block of rows.

    Same arguments, in-place effect and result as `cowclip_adam_`. Runs on
    CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1. Each program
    writes its own clip counts and torch sums them, so the counts are exact
    and independent of the order of `rows`, and the ratio sum is the same
    from run to run. `block_rows` (a power of 2) and `num_warps` override the
    launch `launch_config` picks (`bench kernels --cowclip-sweep` times them);
    a row's numbers do not depend on them, the ratio sum's rounding may.
    """
    _check_args(weight, exp_avg, exp_avg_sq, rows, grad, count, step, clip_dims, cowclip)
    check_triton_device(weight)
    u, d = rows.numel(), weight.shape[1]
    if u == 0 or d == 0:
        return _zero_stats(weight.device, u)
    grad = grad.contiguous()
    count = count.contiguous()
    kernel = _build_kernel()
    step_size, bc2_sqrt = _bias_corrections(lr, beta1, beta2, step)
    block_d = triton.next_power_of_2(d)
    block_r, warps = launch_config(d)
    block_r, warps = block_rows or block_r, num_warps or warps
    if block_r & (block_r - 1):
        raise ValueError(f"cowclip_adam: block_rows must be a power of 2, got {block_r}")
    n_programs = triton.cdiv(u, block_r)
    # Each program writes its own counts (clipped, at floor, the ratio buckets) and ratio
    # sum; torch adds them up. Atomics on one address from every program serialised the
    # kernel: 16 of them per 64 rows held d=16 to a third of the copy bandwidth on an H200.
    n_counts = 2 + len(CLIP_RATIO_LOG2_EDGES)
    counts = torch.zeros((n_programs, n_counts), dtype=torch.int32, device=weight.device)
    ratio_sums = torch.zeros(n_programs, dtype=torch.float32, device=weight.device)
    kernel[(n_programs,)](
        weight, exp_avg, exp_avg_sq, rows.contiguous(), grad, count, counts, ratio_sums,
        u, d, clip_dims if cowclip else d,
        2.0 * l2, clip_scale * clip_r, clip_r * math.sqrt(clip_dims) * clip_zeta,
        beta1, 1.0 - beta1, beta2, 1.0 - beta2, step_size, bc2_sqrt, eps,
        float(count_lr_s), math.log1p(-1.0 / count_lr_s) if count_lr_s > 1.0 else 0.0,
        COWCLIP=cowclip, COUNT_LR=count_lr_s > 1.0, BLOCK_R=block_r, BLOCK_D=block_d,
        N_COUNTS=n_counts, RATIO_LOG2_LO=CLIP_RATIO_LOG2_EDGES[0],
        RATIO_LOG2_STEP=CLIP_RATIO_LOG2_EDGES[1] - CLIP_RATIO_LOG2_EDGES[0],
        num_warps=warps,
    )
    totals = counts.sum(0, dtype=torch.int64)
    if not cowclip:
        return ClipStats(totals[0], totals[1], u)
    return ClipStats(totals[0], totals[1], u, totals[2:], ratio_sums.sum())


def launch_config(d: int) -> tuple[int, int]:
    """(rows per program, warps per program) of the Triton kernel for rows of `d` floats:
    64 rows (fewer from d = 128 up, 4,096 values a program at most) and 4 warps, which
    gave 46-52% of a device copy at d = 16 and 15% at d = 10 on an H100/H200."""
    block_d = 1 << max(0, (d - 1).bit_length())
    return max(1, min(64, 4096 // block_d)), 4


def _cowclip_adam_kernel(
    w_ptr, m_ptr, v_ptr, rows_ptr, g_ptr, cnt_ptr, counts_ptr, ratio_sums_ptr,
    n_rows, D, clip_dims,
    two_l2, clip_r, lower, beta1, one_minus_beta1, beta2, one_minus_beta2,
    step_size, bc2_sqrt, eps, count_lr_s, count_lr_log_keep,
    COWCLIP: tl.constexpr, COUNT_LR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    N_COUNTS: tl.constexpr, RATIO_LOG2_LO: tl.constexpr, RATIO_LOG2_STEP: tl.constexpr,
):
    # clip_r here is clip_scale * r (the threshold's factor); lower uses the bare r.
    # Rows r of this program (int64: table offsets can pass 2**31), all columns.
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = r < n_rows
    mask = row_ok[:, None] & (cols < D)[None, :]
    idx = tl.load(rows_ptr + r, mask=row_ok, other=0)
    in_table = idx[:, None] * D + cols[None, :]
    in_batch = r[:, None] * D + cols[None, :]

    w = tl.load(w_ptr + in_table, mask=mask, other=0.0)
    m = tl.load(m_ptr + in_table, mask=mask, other=0.0)
    v = tl.load(v_ptr + in_table, mask=mask, other=0.0)
    g = tl.load(g_ptr + in_batch, mask=mask, other=0.0) + two_l2 * w
    cnt = tl.load(cnt_ptr + r, mask=row_ok, other=0).to(tl.float32)

    if COWCLIP:
        in_clip = (cols < clip_dims)[None, :]
        w_norm = tl.sqrt(tl.sum(tl.where(in_clip, w * w, 0.0), axis=1))
        g_norm = tl.sqrt(tl.sum(tl.where(in_clip, g * g, 0.0), axis=1))
        thr = clip_r * cnt * tl.maximum(w_norm, lower)
        clipped = g_norm > thr  # implies g_norm > 0; padded rows: 0 > 0 is False
        scale = tl.where(clipped, thr / tl.where(clipped, g_norm, 1.0), 1.0)
        g = tl.where(in_clip, g * scale[:, None], g)
        # This program's row of `counts`: clipped, at floor, then the cumulative ratio
        # buckets (like Prometheus buckets); padded rows count nowhere.
        out = counts_ptr + tl.program_id(0).to(tl.int64) * N_COUNTS
        tl.store(out, tl.sum(clipped.to(tl.int32), axis=0))
        tl.store(out + 1, tl.sum((row_ok & (w_norm < lower)).to(tl.int32), axis=0))
        # thr is 0 only with zeta = 0 on an all-zero row (cut to 0 if it has a gradient).
        ratio = tl.where(thr > 0, g_norm / tl.where(thr > 0, thr, 1.0),
                         tl.where(g_norm > 0, float("inf"), 0.0))
        ratio = tl.where(row_ok, ratio, 0.0)
        tl.store(ratio_sums_ptr + tl.program_id(0),
                 tl.sum(tl.where(ratio < float("inf"), ratio, 0.0), axis=0))
        log2r = tl.log2(ratio)
        for i in tl.static_range(N_COUNTS - 2):
            le = row_ok & (log2r <= RATIO_LOG2_LO + i * RATIO_LOG2_STEP)
            tl.store(out + 2 + i, tl.sum(le.to(tl.int32), axis=0))

    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * (g * g)
    if COUNT_LR:    # s*(1-(1-1/s)**cnt) = -s*expm1(cnt*log1p(-1/s)); 1-exp is fine in float32 here
        mult = count_lr_s * (1.0 - tl.exp(cnt * count_lr_log_keep))
        w = w - (step_size * mult)[:, None] * (m / (tl.sqrt(v) / bc2_sqrt + eps))
    else:
        w = w - step_size * (m / (tl.sqrt(v) / bc2_sqrt + eps))
    tl.store(w_ptr + in_table, w, mask=mask)
    tl.store(m_ptr + in_table, m, mask=mask)
    tl.store(v_ptr + in_table, v, mask=mask)


@cache
def _build_kernel():
    # First Triton use in this process: import triton now (binding the module
    # globals the kernel body reads) and jit the kernel once.
    global triton, tl
    import triton
    import triton.language as tl
    return triton.jit(_cowclip_adam_kernel)
