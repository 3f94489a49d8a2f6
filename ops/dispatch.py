"""Pick the Triton kernel or its pure-torch reference for a tensor.

Every op in `ops/` has two implementations beside each other: `<op>_triton`
and `<op>_reference`. The public dispatcher of an op asks `use_triton` which
one to run:

- CUDA tensors run the Triton kernel (the reference if triton is missing);
- CPU tensors run the op's compiled CPU loop where it has one (`use_cpu_loop`;
  numba, e.g. `cowclip_adam_cpu`), else the reference; `STREAM_CTR_FORCE_TRITON=1`
  runs the Triton kernel through Triton's CPU interpreter. The interpreter
  must be switched on with `TRITON_INTERPRET=1` before triton is first
  imported in the process (Triton's own `tl.sum` & co. are jit functions
  built at its import). Importing `ops` does not import triton, kernels are
  built on first use; tests set the variable in `tests/ops/conftest.py`.

`STREAM_CTR_FORCE_REFERENCE=1` (or the `force_reference()` context manager,
which sets it for a block) runs the torch references everywhere, CUDA
included, and wins over `STREAM_CTR_FORCE_TRITON`: `stream-ctr bench step`
uses it to time both paths in one process, and it is a switch to rule a
kernel out when hunting a numerical bug.

`kernel_path` names the path for benchmark tables and logs. Both functions
only read the tensor's device and the environment: no host-device sync.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch

FORCE_TRITON_ENV = "STREAM_CTR_FORCE_TRITON"
FORCE_REFERENCE_ENV = "STREAM_CTR_FORCE_REFERENCE"
INTERPRET_ENV = "TRITON_INTERPRET"

PATH_TRITON = "triton"
PATH_TRITON_INTERPRETER = "triton-interpreter"
PATH_REFERENCE = "torch-reference"
PATH_CPU_LOOPS = "cpu-loops"        # CPU: the ops' compiled loops where they have one


@cache
def triton_available() -> bool:
    """True when the `triton` package can be imported (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_forced() -> bool:
    """True when `STREAM_CTR_FORCE_TRITON=1`: run Triton kernels even on CPU tensors."""
    return os.environ.get(FORCE_TRITON_ENV) == "1"


def reference_forced() -> bool:
    """True when `STREAM_CTR_FORCE_REFERENCE=1`: run the torch references, even on CUDA."""
    return os.environ.get(FORCE_REFERENCE_ENV) == "1"


@contextmanager
def force_reference() -> Iterator[None]:
    """Run every op on its torch reference inside the block (CUDA included).

    Sets `STREAM_CTR_FORCE_REFERENCE=1` for the block and restores the previous
    value after it. The choice is made when an op is called (a gather's
    backward follows its forward), so a whole training step run inside the
    block takes the reference path. Process-wide, not thread-local.
    """
    previous = os.environ.get(FORCE_REFERENCE_ENV)
    os.environ[FORCE_REFERENCE_ENV] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(FORCE_REFERENCE_ENV, None)
        else:
            os.environ[FORCE_REFERENCE_ENV] = previous


def triton_interpreting() -> bool:
    """True when `TRITON_INTERPRET=1`: Triton kernels built from now on run on the CPU."""
    return os.environ.get(INTERPRET_ENV) == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on `t` should run its Triton kernel.

    True for a CUDA tensor (when triton is installed), or for any tensor when
    `STREAM_CTR_FORCE_TRITON=1`; always False when `STREAM_CTR_FORCE_REFERENCE=1`.
    Forcing Triton on a CPU tensor without `TRITON_INTERPRET=1` is a
    configuration error and raises, rather than failing later inside the
    kernel launch.
    """
    if reference_forced():
        return False
    if t.is_cuda:
        return triton_available()
    if not triton_forced():
        return False
    if not triton_available():
        raise RuntimeError(f"{FORCE_TRITON_ENV}=1 but the triton package is not installed")
    if not triton_interpreting():
        raise RuntimeError(
            f"{FORCE_TRITON_ENV}=1 on a {t.device} tensor needs {INTERPRET_ENV}=1 "
            "(Triton's CPU interpreter), set before triton is first imported"
        )
    return True


def use_cpu_loop(t: torch.Tensor) -> bool:
    """Whether an op with a compiled CPU loop should run it on `t`: a CPU tensor, neither
    Triton nor the reference forced."""
    return t.device.type == "cpu" and not reference_forced() and not use_triton(t)


def kernel_path(t: torch.Tensor) -> str:
    """Name of the path ops on `t` take: "triton", "triton-interpreter", "cpu-loops" (the
    compiled CPU loops of the ops that have one, the references for the others) or
    "torch-reference"."""
    if use_cpu_loop(t):
        return PATH_CPU_LOOPS
    if not use_triton(t):
        return PATH_REFERENCE
    return PATH_TRITON_INTERPRETER if triton_interpreting() else PATH_TRITON


def check_triton_device(t: torch.Tensor) -> None:
    """Raise unless a Triton kernel can run on `t` (CUDA, or CPU under the interpreter)."""
    if not triton_available():
        raise RuntimeError("the triton package is not installed")
    if not t.is_cuda and not triton_interpreting():
        raise RuntimeError(
            f"Triton kernels on {t.device} tensors need {INTERPRET_ENV}=1 "
            "(Triton's CPU interpreter), set before triton is first imported"
        )
