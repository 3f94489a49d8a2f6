"""Gather unique embedding rows to batch slots, with a segment-sum backward.

A batch looks up each unique id once (`unique_rows`, [U, D]) and expands
them to its M slots with `inverse` (from `torch.unique(..., return_inverse=True)`):

    out[j] = unique_rows[inverse[j]]                 forward,  [M, D]
    grad_unique[u] = sum_{j: inverse[j] == u} grad_out[j]   backward, [U, D]

`gather_rows_reference`: index_select forward, index_add_ backward (on the CPU
the same additions in a compiled loop, `cpu_rows`: bit for bit the same).
`gather_rows_triton`: a gather kernel forward; the backward is either a
deterministic segment sum (default: sort `inverse` once; one program per
piece of at most SEGMENT_PIECE_SLOTS slots of a row sums it in a fixed
order, then one program per row sums its pieces, so results are
bit-reproducible run to run) or a scatter with atomic adds
(`deterministic=False`: one pass, no sort, summation order varies on GPU).
`gather_rows` picks one with `stream_ctr.ops.dispatch.use_triton`.

Importing this module does not import triton: kernels are built on the
first Triton call. `TRITON_INTERPRET=1` (the CPU interpreter, for tests)
must be set before triton is first imported in the process.
"""

from __future__ import annotations

from functools import cache

import torch

from .cpu_rows import index_add_rows
from .dispatch import check_triton_device, use_triton

# Bound by _build_kernels() on the first Triton call, not at import: Triton
# reads TRITON_INTERPRET when it is first imported (its own tl.sum & co. are
# jit functions), so importing ops must not import it.
triton = None
tl = None


def gather_rows(unique_rows: torch.Tensor, inverse: torch.Tensor, *,
                deterministic: bool = True) -> torch.Tensor:
    """Expand unique rows to batch slots: `out[j] = unique_rows[inverse[j]]`.

    Args:
        unique_rows: [U, D] floating tensor, may require grad.
        inverse: int64 (or int32) [M], values in [0, U). Range is not
            checked on the Triton path (that would need a host sync).
        deterministic: Triton backward only; True sums each row's gradient
            in a fixed order (bit-reproducible), False uses atomic adds.

    Returns:
        A new [M, D] tensor. Its backward sums `grad_out` over the slots of
        each unique row into a [U, D] gradient (rows no slot uses get zero).

    Runs the Triton kernels on CUDA tensors (or when
    STREAM_CTR_FORCE_TRITON=1), the torch reference otherwise.
    """
    if use_triton(unique_rows):
        return gather_rows_triton(unique_rows, inverse, deterministic=deterministic)
    return gather_rows_reference(unique_rows, inverse)


def _check_args(unique_rows: torch.Tensor, inverse: torch.Tensor) -> None:
    if unique_rows.dim() != 2 or not unique_rows.dtype.is_floating_point:
        raise ValueError(f"unique_rows must be a floating [U, D] tensor, "
                         f"got {unique_rows.dtype} {tuple(unique_rows.shape)}")
    if inverse.dim() != 1 or inverse.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"inverse must be int64 [M], got {inverse.dtype} {tuple(inverse.shape)}")
    if inverse.device != unique_rows.device:
        raise ValueError(f"inverse is on {inverse.device}, unique_rows on {unique_rows.device}")
    if unique_rows.shape[0] == 0 and inverse.numel() > 0:
        raise ValueError(f"inverse has {inverse.numel()} slots but there are no unique rows")


class _GatherRowsReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, unique_rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.num_unique = unique_rows.shape[0]
        return unique_rows.index_select(0, inverse)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        # index_add_ itself, or on the CPU the same additions in the same order, compiled.
        return index_add_rows(grad_out, inverse, ctx.num_unique), None


def gather_rows_reference(unique_rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Pure-torch `gather_rows`: index_select forward, index_add_ backward.

    The backward is deterministic on CPU (on CUDA, index_add_ uses atomics).
    """
    _check_args(unique_rows, inverse)
    return _GatherRowsReference.apply(unique_rows, inverse)


class _GatherRowsTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, unique_rows: torch.Tensor, inverse: torch.Tensor,
                deterministic: bool) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.num_unique = unique_rows.shape[0]
        ctx.deterministic = deterministic
        return _gather_forward(unique_rows.contiguous(), inverse.contiguous())

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        reduce = _segment_sum if ctx.deterministic else _scatter_add
        return reduce(grad_out.contiguous(), inverse, ctx.num_unique), None, None


def gather_rows_triton(unique_rows: torch.Tensor, inverse: torch.Tensor, *,
                       deterministic: bool = True) -> torch.Tensor:
    """Triton `gather_rows` (same contract). Runs on CUDA tensors, or on CPU
    tensors under TRITON_INTERPRET=1. Backward: first-order only."""
    _check_args(unique_rows, inverse)
    check_triton_device(unique_rows)
    return _GatherRowsTriton.apply(unique_rows, inverse, deterministic)


def _blocks(d: int, max_rows: int = 64) -> tuple[int, int]:
    block_d = 1 << max(d - 1, 0).bit_length()  # next power of 2
    return max(1, min(max_rows, 4096 // block_d)), block_d


def _gather_forward(src: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    m, d = inverse.numel(), src.shape[1]
    out = src.new_empty((m, d))
    if m == 0 or d == 0:
        return out
    kernels = _build_kernels()
    block_m, block_d = _blocks(d)
    kernels["gather"][(triton.cdiv(m, block_m),)](
        src, inverse, out, m, d, BLOCK_M=block_m, BLOCK_D=block_d)
    return out


# Slots one program sums at most. A hot row (a field with a few values holds ~B/10 slots
# of one row) was one program's serial loop: 4.7 of a 35 ms step at batch 131,072 on an
# H200. Longer segments are cut into pieces of this many slots, summed in a second pass.
SEGMENT_PIECE_SLOTS = 1024


def _segment_sum(grad_out: torch.Tensor, inverse: torch.Tensor, num_unique: int) -> torch.Tensor:
    # Sort once; slots of unique row u are then order[starts[u]:starts[u+1]],
    # in ascending slot order (stable sort), which fixes the summation order.
    m, d = grad_out.shape
    out = grad_out.new_empty((num_unique, d))
    if num_unique == 0 or d == 0:
        return out
    # int32 keys when they fit: a radix sort makes one pass per key byte, so half the passes.
    keys = inverse.to(torch.int32) if num_unique < 2**31 else inverse
    sorted_inv, order = torch.sort(keys, stable=True)
    bounds = torch.arange(num_unique + 1, device=inverse.device, dtype=sorted_inv.dtype)
    starts = torch.searchsorted(sorted_inv, bounds)
    acc_dtype = torch.float64 if grad_out.dtype == torch.float64 else torch.float32
    # Pass 1: pieces of at most SEGMENT_PIECE_SLOTS slots, each row's pieces consecutive.
    # Their number is bounded without reading it on the host (that would be a sync): at
    # most one piece per row plus one per full SEGMENT_PIECE_SLOTS slots; spare ones are empty.
    piece_begin, piece_end, row_first_piece = _pieces(starts, m, SEGMENT_PIECE_SLOTS)
    partial = grad_out.new_empty((piece_begin.numel(), d), dtype=acc_dtype)
    _segment_sum_launch(grad_out, order, piece_begin, piece_end, partial)
    # Pass 2: each row sums its pieces, in order.
    _segment_sum_launch(partial, None, row_first_piece[:-1], row_first_piece[1:], out)
    return out


def _pieces(starts: torch.Tensor, m: int, piece: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(begin [P], end [P]) of the pieces that cut each segment [starts[u], starts[u+1]) into
    runs of at most `piece` slots, row after row, P = U + m // piece (the last ones empty);
    and row_first_piece [U + 1], where row u's pieces begin (its end is the next row's)."""
    starts = starts.long()
    n_unique = starts.numel() - 1
    lengths = starts[1:] - starts[:-1]
    n_pieces = torch.clamp_min((lengths + piece - 1) // piece, 1)   # an unused row: one empty piece
    row_first_piece = torch.zeros(n_unique + 1, dtype=torch.long, device=starts.device)
    torch.cumsum(n_pieces, 0, out=row_first_piece[1:])
    p = torch.arange(n_unique + m // piece, device=starts.device)
    row = torch.searchsorted(row_first_piece, p, right=True) - 1     # U for the spare pieces
    row = row.clamp_max(n_unique - 1)
    begin = starts[row] + (p - row_first_piece[row]) * piece
    end = torch.minimum(begin + piece, starts[row + 1])
    begin = torch.minimum(begin, end)                                 # spare pieces: empty
    return begin, end, row_first_piece


def _segment_sum_launch(src: torch.Tensor, order: torch.Tensor | None, begin: torch.Tensor,
                        end: torch.Tensor, out: torch.Tensor) -> None:
    """out[i] = sum of src[order[j]] (src[j] without order) for j in [begin[i], end[i]), in j order."""
    kernels = _build_kernels()
    block_j, block_d = _blocks(src.shape[1], max_rows=32)
    acc_dtype = tl.float64 if out.dtype == torch.float64 or src.dtype == torch.float64 else tl.float32
    kernels["segment_sum"][(begin.numel(),)](
        src, order if order is not None else begin, begin, end, out, src.shape[1],
        HAS_ORDER=order is not None, BLOCK_J=block_j, BLOCK_D=block_d, ACC_DTYPE=acc_dtype)


def _scatter_add(grad_out: torch.Tensor, inverse: torch.Tensor, num_unique: int) -> torch.Tensor:
    m, d = grad_out.shape
    acc_dtype = torch.float64 if grad_out.dtype == torch.float64 else torch.float32
    acc = torch.zeros((num_unique, d), dtype=acc_dtype, device=grad_out.device)
    if m > 0 and d > 0:
        kernels = _build_kernels()
        block_m, block_d = _blocks(d)
        kernels["scatter_add"][(triton.cdiv(m, block_m),)](
            grad_out, inverse.contiguous(), acc, m, d, BLOCK_M=block_m, BLOCK_D=block_d)
    return acc.to(grad_out.dtype)


def _gather_kernel(src_ptr, inv_ptr, out_ptr, M, D,
                   BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    row_ok = r < M
    mask = row_ok[:, None] & (cols < D)[None, :]
    idx = tl.load(inv_ptr + r, mask=row_ok, other=0).to(tl.int64)
    vals = tl.load(src_ptr + idx[:, None] * D + cols[None, :], mask=mask)
    tl.store(out_ptr + r[:, None] * D + cols[None, :], vals, mask=mask)


def _segment_sum_kernel(src_ptr, order_ptr, begin_ptr, end_ptr, out_ptr, D,
                        HAS_ORDER: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr,
                        ACC_DTYPE: tl.constexpr):
    # One program per output row; it reads the range [begin, end) of `order` (or of
    # src itself), BLOCK_J slots at a time, always in the same order.
    i = tl.program_id(0).to(tl.int64)
    start = tl.load(begin_ptr + i)
    end = tl.load(end_ptr + i)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    acc = tl.zeros([BLOCK_D], dtype=ACC_DTYPE)
    for j0 in range(start, end, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        j_ok = j < end
        if HAS_ORDER:
            slot = tl.load(order_ptr + j, mask=j_ok, other=0)
        else:
            slot = j
        tile = tl.load(src_ptr + slot[:, None] * D + cols[None, :],
                       mask=j_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.sum(tile.to(ACC_DTYPE), axis=0)
    tl.store(out_ptr + i * D + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def _scatter_add_kernel(grad_ptr, inv_ptr, acc_ptr, M, D,
                        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    row_ok = r < M
    mask = row_ok[:, None] & (cols < D)[None, :]
    idx = tl.load(inv_ptr + r, mask=row_ok, other=0).to(tl.int64)
    vals = tl.load(grad_ptr + r[:, None] * D + cols[None, :], mask=mask, other=0.0)
    tl.atomic_add(acc_ptr + idx[:, None] * D + cols[None, :],
                  vals.to(acc_ptr.dtype.element_ty), mask=mask)


@cache
def _build_kernels() -> dict:
    # First Triton use in this process: import triton now (binding the module
    # globals the kernel bodies read) and jit the kernels once.
    global triton, tl
    import triton
    import triton.language as tl
    return {
        "gather": triton.jit(_gather_kernel),
        "segment_sum": triton.jit(_segment_sum_kernel),
        "scatter_add": triton.jit(_scatter_add_kernel),
    }
