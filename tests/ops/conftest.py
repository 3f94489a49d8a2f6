"""Fixtures for the ops tests.

Without a GPU, Triton kernels run on CPU tensors through Triton's interpreter.
`TRITON_INTERPRET=1` must be set before a kernel is built; ops builds kernels
lazily on first use, so setting it here, when pytest loads this file, is early
enough. With a GPU the variable is left alone: the "cuda" cases run the
compiled kernels and the "cpu" Triton cases are skipped.
"""

import os

import pytest
import torch

from stream_ctr.ops.dispatch import FORCE_TRITON_ENV, INTERPRET_ENV

if not torch.cuda.is_available():
    os.environ.setdefault(INTERPRET_ENV, "1")

INTERPRETING = os.environ.get(INTERPRET_ENV) == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETING, reason=f"Triton on CPU tensors needs {INTERPRET_ENV}=1")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(autouse=True)
def _no_forced_triton(monkeypatch):
    # Tests that want the forced path set it themselves.
    monkeypatch.delenv(FORCE_TRITON_ENV, raising=False)


@pytest.fixture(params=[pytest.param("cpu", marks=needs_interpreter),
                        pytest.param("cuda", marks=needs_cuda)])
def triton_device(request) -> torch.device:
    """Device on which to run a Triton kernel: CPU (interpreter) or CUDA."""
    return torch.device(request.param)
