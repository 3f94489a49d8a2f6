"""Mixed precision: the dtype the dense model's matrix products run in.

bf16 keeps fp32's exponent range, so it needs no loss scaling. Only the model's
forward runs under `torch.autocast`, which casts matmul-like ops (the DNN's and
cross nets' Linear layers) to bf16 and leaves element-wise work in its input
dtype: the FM term and the linear logit, on fp32 embedding rows, stay fp32. The
master weights, embedding rows, Adam moments, CowClip and the loss are fp32.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

PRECISIONS = ("auto", "fp32", "bf16")


def cpu_runs_bf16_fast() -> bool:
    """True where the CPU has bf16 dot-product instructions (AMX-BF16 or AVX512-BF16):
    there a bf16 matmul beats fp32 (measured: DeepFM's MLP 2.6x on AVX512-BF16);
    elsewhere oneDNN emulates bf16 and it is slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_precision(name: str, device: torch.device) -> str:
    """`auto` -> bf16 where the hardware runs it fast (a CUDA GPU of compute capability
    8.0+ or a CPU with AMX/AVX512-BF16), fp32 elsewhere; "fp32"/"bf16" as asked."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bf16" if torch.cuda.get_device_capability(device) >= (8, 0) else "fp32"
    return "bf16" if cpu_runs_bf16_fast() else "fp32"


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context the model's forward runs in for `precision` ("fp32": none)."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
