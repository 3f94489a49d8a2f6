"""DeepFM's two uses of the field embeddings in one pass: the FM term and the DNN input.

From emb [B, F, d] (fp32) and dense [B, n] DeepFM makes

    fm = 0.5 * sum_k((sum_f e_fk)^2 - sum_f e_fk^2)          [B]      fp32
    x0 = concat(emb.flatten(1), dense)                        [B, F*d + n], bf16 under autocast

and in the backward the embeddings' gradient is the DNN's (x0's, bf16, made fp32)
plus the FM's, (s_k - e_fk) * g_b with s = sum_f e. Written as torch ops that is
a concat, a cast, the FM's sums, and backward a cast, the FM product and an add:
about eight passes over [B, F, d] (~10 ms at batch 8,192 x 39 fields x d=10 on the
project's 2-vCPU VM). `deepfm_input_cpu` does the forward in one compiled pass
and the backward in another, the batch rows split between threads (`cpu_parts`).

x0 is rounded to bf16 as torch rounds (to nearest, ties to even; a NaN stays a
NaN), so the DNN sees the bits it saw through autocast, and its gradient comes
back the same. The FM sums run over the fields in order, torch's do not: fm
differs from torch's in the last bits (and so do the scores, by rounding).

`deepfm_input_reference` is the torch expression (autograd differentiates it);
`deepfm_input` picks the compiled loop for CPU tensors (`dispatch.use_cpu_loop`),
the reference elsewhere.
"""
from __future__ import annotations

from functools import cache

import torch

from .cpu_parts import part_bounds, run_parts
from .dispatch import use_cpu_loop

_ROWS_PER_PART = 1024


def deepfm_input(emb: torch.Tensor, dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fm [B] fp32, x0 [B, F*d + n] bf16) of emb [B, F, d] and dense [B, n], both fp32;
    differentiable in emb and dense."""
    if (use_cpu_loop(emb) and emb.dim() == 3 and emb.dtype == torch.float32
            and dense.dtype == torch.float32 and dense.device.type == "cpu"
            and dense.dim() == 2 and dense.shape[0] == emb.shape[0]):
        return _DeepFMInput.apply(emb, dense)
    return deepfm_input_reference(emb, dense)


def deepfm_input_reference(emb: torch.Tensor, dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`deepfm_input` as torch ops."""
    s = emb.sum(dim=1)
    fm = 0.5 * (s.square() - emb.square().sum(dim=1)).sum(dim=1)
    flat = emb.flatten(1)
    x0 = torch.cat([flat, dense], dim=1) if dense.shape[1] else flat
    return fm, x0.to(torch.bfloat16)


class _DeepFMInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, emb: torch.Tensor, dense: torch.Tensor):
        b, n_fields, dim = emb.shape
        if dense.dim() != 2 or dense.shape[0] != b:      # the loop would read past dense
            raise ValueError(f"deepfm_input: dense {tuple(dense.shape)} does not match "
                             f"emb {tuple(emb.shape)} (need [{b}, n_dense])")
        emb_flat = emb.detach().contiguous().view(b, n_fields * dim)
        dense_c = dense.detach().contiguous()
        fm = torch.empty(b, dtype=torch.float32)
        s = torch.empty(b, dim, dtype=torch.float32)
        x0 = torch.empty(b, n_fields * dim + dense.shape[1], dtype=torch.bfloat16)
        if b:
            forward_rows = _kernels()[0]
            args = (emb_flat.numpy(), emb_flat.view(torch.int32).numpy(),
                    dense_c.view(torch.int32).numpy(), n_fields, fm.numpy(), s.numpy(),
                    x0.view(torch.int16).numpy())
            run_parts(lambda k, lo, hi: forward_rows(*args, lo, hi), part_bounds(b, _ROWS_PER_PART))
        ctx.save_for_backward(emb_flat, s)
        ctx.shape = (b, n_fields, dim, dense.shape[1])
        return fm, x0

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_fm: torch.Tensor | None, grad_x0: torch.Tensor | None):
        emb_flat, s = ctx.saved_tensors
        b, n_fields, dim, n_dense = ctx.shape
        n_emb = n_fields * dim
        if grad_fm is None:
            grad_fm = torch.zeros(b, dtype=torch.float32)
        if grad_x0 is None:
            grad_x0 = torch.zeros(b, n_emb + n_dense, dtype=torch.bfloat16)
        grad_x0 = grad_x0.to(torch.bfloat16).contiguous()
        grad_emb = torch.empty(b, n_emb, dtype=torch.float32)
        if b:
            backward_rows = _kernels()[1]
            args = (emb_flat.numpy(), s.numpy(), grad_fm.float().contiguous().numpy(),
                    grad_x0.view(torch.int16).numpy(), n_fields, grad_emb.numpy())
            run_parts(lambda k, lo, hi: backward_rows(*args, lo, hi), part_bounds(b, _ROWS_PER_PART))
        grad_dense = grad_x0[:, n_emb:].float() if ctx.needs_input_grad[1] else None
        return grad_emb.view(b, n_fields, dim), grad_dense


@cache
def _kernels():
    # Compiled on the first call (a few seconds; cached in __pycache__ after that).
    # bf16 is handled as its bits (int16): numba has no bf16 type. Scalars are float32,
    # as in torch's float32 kernels.
    import numpy as np
    from numba import njit

    @njit(nogil=True, cache=True)
    def forward_rows(emb, emb_bits, dense_bits, n_fields, fm, s, x0_bits, lo, hi):
        n_emb = emb.shape[1]
        dim = n_emb // n_fields
        n_dense = dense_bits.shape[1]
        squares = np.empty(dim, np.float32)
        # torch's vectorized float -> bf16: to nearest, ties to even; a NaN -> 0xFFFF.
        # (Written out twice: a jit helper in this closure would stop numba's cache.)
        half, one, abs_mask, inf = np.uint32(0x7FFF), np.uint32(1), np.uint32(0x7FFFFFFF), np.uint32(0x7F800000)
        sixteen = np.uint32(16)
        for b in range(lo, hi):
            for i in range(n_emb):
                u = np.uint32(emb_bits[b, i])
                r = np.int16((u + half + ((u >> sixteen) & one)) >> sixteen)
                x0_bits[b, i] = np.int16(-1) if (u & abs_mask) > inf else r
            for j in range(n_dense):
                u = np.uint32(dense_bits[b, j])
                r = np.int16((u + half + ((u >> sixteen) & one)) >> sixteen)
                x0_bits[b, n_emb + j] = np.int16(-1) if (u & abs_mask) > inf else r
            for k in range(dim):
                s[b, k] = np.float32(0.0)
                squares[k] = np.float32(0.0)
            for f in range(n_fields):
                for k in range(dim):
                    e = emb[b, f * dim + k]
                    s[b, k] += e
                    squares[k] += e * e
            total = np.float32(0.0)
            for k in range(dim):
                total += s[b, k] * s[b, k] - squares[k]
            fm[b] = np.float32(0.5) * total

    @njit(nogil=True, cache=True)
    def backward_rows(emb, s, grad_fm, grad_x0_bits, n_fields, grad_emb, lo, hi):
        n_emb = emb.shape[1]
        dim = n_emb // n_fields
        bits = np.empty(n_emb, np.uint32)
        values = bits.view(np.float32)
        for b in range(lo, hi):
            for i in range(n_emb):
                bits[i] = np.uint32(np.uint16(grad_x0_bits[b, i])) << np.uint32(16)
            g = grad_fm[b]
            for f in range(n_fields):
                for k in range(dim):
                    i = f * dim + k
                    grad_emb[b, i] = values[i] + (s[b, k] - emb[b, i]) * g

    return forward_rows, backward_rows
