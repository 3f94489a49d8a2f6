"""Pool the embedding rows of jagged (multi-hot) keys into one row per bag, with its backward.

A multi-hot field gives each of B rows a bag of keys (`Batch.jagged`: values
cut by offsets). The batch looks up each unique key once (`unique_rows`,
[U, D]); `index` [N] says which unique row each of the N values is, and
`offsets` [B+1] cut the values into bags:

    out[b] = scale[b] * sum_{j in offsets[b]:offsets[b+1]} unique_rows[index[j]]   [B, D]
    scale[b] = 1 (sum) or 1 / max(1, offsets[b+1] - offsets[b]) (mean)
    grad_unique[u] = sum_{j: index[j] == u} scale[bag(j)] * grad_out[bag(j)]      [U, D]

An empty bag pools to zeros (sum and mean alike) and passes no gradient.

`jagged_pool_reference`: index_select + index_add_ (autograd does the rest).
`jagged_pool_triton`: one program per bag sums its values' rows in a fixed
order (forward); the backward spreads each bag's scaled gradient to its
values and sums them per unique row with the deterministic segment sum of
`embedding_gather` (bit-reproducible run to run).
`jagged_pool` picks one with `stream_ctr.ops.dispatch.use_triton`.

Importing this module does not import triton (see embedding_gather).
"""

from __future__ import annotations

from functools import cache

import torch

from . import embedding_gather
from .cpu_rows import pool_rows
from .dispatch import check_triton_device, use_triton

triton = None
tl = None


def jagged_pool(unique_rows: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor,
                mean: bool = False) -> torch.Tensor:
    """Pooled rows [B, D] of bags of unique rows (see the module docstring).

    Args:
        unique_rows: [U, D] floating tensor, may require grad.
        index: int64 [N], each value's row in `unique_rows` (not range-checked on Triton).
        offsets: int64 [B+1], non-decreasing, offsets[0] = 0, offsets[B] = N.
        mean: divide each bag's sum by its length (an empty bag stays zero).
    """
    if use_triton(unique_rows):
        return jagged_pool_triton(unique_rows, index, offsets, mean)
    return jagged_pool_reference(unique_rows, index, offsets, mean)


def _check_args(unique_rows: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor) -> None:
    if unique_rows.dim() != 2 or not unique_rows.dtype.is_floating_point:
        raise ValueError(f"unique_rows must be a floating [U, D] tensor, "
                         f"got {unique_rows.dtype} {tuple(unique_rows.shape)}")
    for name, t in (("index", index), ("offsets", offsets)):
        if t.dim() != 1 or t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64 and 1-D, got {t.dtype} {tuple(t.shape)}")
        if t.device != unique_rows.device:
            raise ValueError(f"{name} is on {t.device}, unique_rows on {unique_rows.device}")
    if offsets.numel() < 1:
        raise ValueError("offsets needs B + 1 >= 1 entries")


def _bag_scale(offsets: torch.Tensor, mean: bool, dtype: torch.dtype) -> torch.Tensor:
    lengths = (offsets[1:] - offsets[:-1]).to(dtype)
    return 1.0 / lengths.clamp_min(1) if mean else torch.ones_like(lengths)


def jagged_pool_reference(unique_rows: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor,
                          mean: bool = False) -> torch.Tensor:
    """Torch `jagged_pool`: gather the values' rows, index_add them into their bags (on the
    CPU the row adds of both, forward and backward, run as `cpu_rows`' loop: the same bits)."""
    _check_args(unique_rows, index, offsets)
    b = offsets.numel() - 1
    bag = torch.repeat_interleave(torch.arange(b, device=offsets.device), offsets[1:] - offsets[:-1])
    # index_select and index_add, each with its gradient, whose row adds (the pooling here,
    # the gather's backward) run as the compiled loop on the CPU: the same bits.
    summed = pool_rows(embedding_gather.gather_rows_reference(unique_rows, index), bag, b)
    return summed * _bag_scale(offsets, mean, unique_rows.dtype)[:, None] if mean else summed


class _JaggedPoolTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, unique_rows: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor,
                mean: bool) -> torch.Tensor:
        scale = _bag_scale(offsets, mean, unique_rows.dtype)
        ctx.save_for_backward(index, offsets, scale)
        ctx.num_unique = unique_rows.shape[0]
        return _pool_forward(unique_rows.contiguous(), index.contiguous(), offsets.contiguous(), scale)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        index, offsets, scale = ctx.saved_tensors
        per_value = _spread(grad_out.contiguous(), offsets, scale, index.numel())
        grad = embedding_gather._segment_sum(per_value, index, ctx.num_unique) if ctx.num_unique else \
            per_value.new_zeros((0, grad_out.shape[1]))
        return grad, None, None, None


def jagged_pool_triton(unique_rows: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor,
                       mean: bool = False) -> torch.Tensor:
    """Triton `jagged_pool` (same contract). CUDA tensors, or CPU under TRITON_INTERPRET=1."""
    _check_args(unique_rows, index, offsets)
    check_triton_device(unique_rows)
    return _JaggedPoolTriton.apply(unique_rows, index, offsets, mean)


def _pool_forward(rows: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor,
                  scale: torch.Tensor) -> torch.Tensor:
    b, d = offsets.numel() - 1, rows.shape[1]
    out = rows.new_empty((b, d))
    if b == 0 or d == 0:
        return out
    kernels = _build_kernels()
    block_j, block_d = embedding_gather._blocks(d, max_rows=32)
    acc_dtype = tl.float64 if rows.dtype == torch.float64 else tl.float32
    kernels["pool"][(b,)](rows, index, offsets, scale, out, d,
                          BLOCK_J=block_j, BLOCK_D=block_d, ACC_DTYPE=acc_dtype)
    return out


def _spread(grad_out: torch.Tensor, offsets: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    b, d = grad_out.shape
    out = grad_out.new_empty((n, d))
    if n == 0 or d == 0:
        return out
    kernels = _build_kernels()
    block_j, block_d = embedding_gather._blocks(d, max_rows=32)
    kernels["spread"][(b,)](grad_out, offsets, scale, out, d, BLOCK_J=block_j, BLOCK_D=block_d)
    return out


def _pool_kernel(rows_ptr, index_ptr, offsets_ptr, scale_ptr, out_ptr, D,
                 BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr, ACC_DTYPE: tl.constexpr):
    # One program per bag: its values are a contiguous range of `index`, summed in order.
    bag = tl.program_id(0).to(tl.int64)
    start = tl.load(offsets_ptr + bag)
    end = tl.load(offsets_ptr + bag + 1)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    acc = tl.zeros([BLOCK_D], dtype=ACC_DTYPE)
    for j0 in range(start, end, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        j_ok = j < end
        row = tl.load(index_ptr + j, mask=j_ok, other=0)
        tile = tl.load(rows_ptr + row[:, None] * D + cols[None, :],
                       mask=j_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.sum(tile.to(ACC_DTYPE), axis=0)
    acc = acc * tl.load(scale_ptr + bag).to(ACC_DTYPE)
    tl.store(out_ptr + bag * D + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def _spread_kernel(grad_ptr, offsets_ptr, scale_ptr, out_ptr, D,
                   BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per bag: every value of the bag gets the bag's scaled gradient.
    bag = tl.program_id(0).to(tl.int64)
    start = tl.load(offsets_ptr + bag)
    end = tl.load(offsets_ptr + bag + 1)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    g = tl.load(grad_ptr + bag * D + cols, mask=col_ok, other=0.0)
    g = g * tl.load(scale_ptr + bag).to(g.dtype)
    for j0 in range(start, end, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        j_ok = j < end
        tile = tl.zeros([BLOCK_J, BLOCK_D], dtype=out_ptr.dtype.element_ty) + g[None, :]
        tl.store(out_ptr + j[:, None] * D + cols[None, :], tile,
                 mask=j_ok[:, None] & col_ok[None, :])


@cache
def _build_kernels() -> dict:
    global triton, tl
    import triton
    import triton.language as tl
    embedding_gather._build_kernels()          # binds its module's triton/tl for _segment_sum
    return {"pool": triton.jit(_pool_kernel), "spread": triton.jit(_spread_kernel)}
