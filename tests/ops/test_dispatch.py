"""stream_ctr.ops.dispatch: which path an op takes, and lazy kernel building."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stream_ctr.ops.dispatch import (
    FORCE_TRITON_ENV, INTERPRET_ENV, PATH_CPU_LOOPS, PATH_REFERENCE, PATH_TRITON,
    PATH_TRITON_INTERPRETER, force_reference, kernel_path, use_cpu_loop, use_triton)
from tests.ops.conftest import needs_cuda, needs_interpreter

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_cpu_uses_its_loops_or_the_reference_when_forced():
    t = torch.zeros(2)
    assert not use_triton(t) and use_cpu_loop(t)
    assert kernel_path(t) == PATH_CPU_LOOPS
    with force_reference():
        assert not use_cpu_loop(t)
        assert kernel_path(t) == PATH_REFERENCE


@needs_interpreter
def test_forced_cpu_uses_interpreter(monkeypatch):
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    assert use_triton(torch.zeros(2)) and not use_cpu_loop(torch.zeros(2))
    assert kernel_path(torch.zeros(2)) == PATH_TRITON_INTERPRETER


def test_forced_cpu_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    monkeypatch.setenv(INTERPRET_ENV, "0")
    with pytest.raises(RuntimeError, match=INTERPRET_ENV):
        use_triton(torch.zeros(2))


@needs_cuda
def test_cuda_uses_triton(monkeypatch):
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    t = torch.zeros(2, device="cuda")
    assert use_triton(t)
    assert kernel_path(t) == PATH_TRITON


def test_interpreter_can_be_switched_on_after_import():
    """Importing ops does not import triton: TRITON_INTERPRET set later still takes effect."""
    script = f"""
import os, sys, torch
import stream_ctr.ops.cowclip_adam as ca, stream_ctr.ops.embedding_gather as eg
assert "triton" not in sys.modules
os.environ["{INTERPRET_ENV}"] = "1"
os.environ["{FORCE_TRITON_ENV}"] = "1"
w, m, v = torch.ones(4, 3), torch.zeros(4, 3), torch.zeros(4, 3)
stats = ca.cowclip_adam_(w, m, v, torch.tensor([2]), torch.ones(1, 3), torch.tensor([1]),
    step=1, lr=0.1, l2=0.0, clip_r=1.0, clip_zeta=0.0, clip_dims=3,
    beta1=0.9, beta2=0.999, eps=1e-7)
assert abs(w[2, 0].item() - 0.9) < 1e-6 and w[0, 0].item() == 1.0, w
out = eg.gather_rows(torch.arange(6.0).view(2, 3), torch.tensor([1, 1, 0]))
assert out[0, 0].item() == 3.0, out
"""
    env = {k: v for k, v in os.environ.items() if k not in (INTERPRET_ENV, FORCE_TRITON_ENV)}
    env["PYTHONPATH"] = str(REPO_ROOT)
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
