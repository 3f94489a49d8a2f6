"""`stream-ctr bench kernels` and `bench step` through the CLI entry, at tiny sizes.

Structure and sanity of the numbers only (finite, positive, consistent with
each other, bytes that match the shapes): no timing assertions, the machines
that run the tests are noisy. The fast path is Triton on a CUDA machine and
the compiled CPU loops elsewhere; where a kernel has none, the row says why.
"""
import json
import math
import os

import pytest
import torch

from stream_ctr.ops import dispatch
from stream_ctr.cli import main

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
KERNELS = ["cowclip_adam", "gather_forward", "gather_backward_segment_sum", "gather_backward_atomic"]
KEY_KERNELS = ["hash_find", "unique_keys"]        # once, after the last width's


def fast_path_of(kernel: str) -> str | None:
    """The fast path a kernel's row names: None where it has none on this device."""
    if ON_CUDA:
        return None if kernel == "unique_keys" else dispatch.PATH_TRITON
    return dispatch.PATH_CPU_LOOPS if kernel in ("cowclip_adam", "hash_find", "unique_keys") else None


def run_json(capsys, *args: str) -> dict:
    assert main(list(args) + ["--device", DEVICE, "--json", "--quiet"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    return json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in the JSON summary"))


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_kernels_json(capsys):
    rows, dims, batch, fields = 500, [4, 16], 32, 39
    out = run_json(capsys, "bench", "kernels", "--rows", str(rows), "--dims", "4,16",
                   "--batch-size", str(batch), "--fields", str(fields), "--repeat", "2", "--warmup", "1")
    assert out["bench"] == "kernels" and out["device"].startswith(DEVICE)
    assert [(r["kernel"], r["dim"]) for r in out["rows"]] == \
        [(k, d) for d in dims for k in KERNELS] + [(k, 0) for k in KEY_KERNELS]
    slots = batch * fields
    for r in out["rows"]:
        d = r["dim"]
        fp32, int64 = 4, 8
        if r["kernel"] == "cowclip_adam":
            # reads w, m, v, grad + row ids + counts; writes w, m, v
            expected = 4 * rows * d * fp32 + 2 * rows * int64 + 3 * rows * d * fp32
            assert r["slots"] is None
        elif r["kernel"] == "hash_find":
            # reads key, start, the slot's key and value; writes the value
            expected = 5 * rows * int64
            assert r["slots"] is None
        elif r["kernel"] == "unique_keys":
            # reads the slots' keys; writes their indices, the unique keys and counts
            expected = (2 * slots + 2 * rows) * int64
            assert r["slots"] == slots
        else:
            # forward: inverse + each unique row in, slots rows out;
            # backward: inverse + slot gradients in, unique row sums out
            expected = slots * int64 + slots * d * fp32 + rows * d * fp32
            assert r["slots"] == slots
        assert r["rows"] == rows and r["bytes"] == expected
        assert positive(r["copy_bytes_per_s"])
        fast = fast_path_of(r["kernel"])
        for p in ["reference", "fast"] if fast else ["reference"]:
            assert positive(r[f"{p}_seconds_per_call"])
            assert r[f"{p}_bytes_per_s"] == pytest.approx(r["bytes"] / r[f"{p}_seconds_per_call"])
            assert r[f"{p}_vs_copy"] == pytest.approx(r[f"{p}_bytes_per_s"] / r["copy_bytes_per_s"])
        assert r["reference_path"] == dispatch.PATH_REFERENCE
        if fast:
            assert r["fast_path"] == fast
        else:
            assert r["fast_path"].startswith("n/a (")
            assert r["fast_seconds_per_call"] is None and r["fast_vs_copy"] is None


def test_bench_kernels_table(capsys):
    assert main(["bench", "kernels", "--rows", "100", "--dims", "8", "--batch-size", "8",
                 "--fields", "13", "--repeat", "1", "--warmup", "0", "--device", DEVICE, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "copy GB/s" in out and "fast/copy" in out
    for kernel in KERNELS + KEY_KERNELS:
        assert kernel in out
    assert (dispatch.PATH_CPU_LOOPS in out) != ON_CUDA
    assert out.strip().splitlines()[-1].startswith(f"bench kernels: 6 kernels measured on {DEVICE}")


def test_bench_kernels_too_few_slots_is_a_user_error(capsys):
    assert main(["bench", "kernels", "--rows", "1000", "--batch-size", "2", "--fields", "3",
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stream-ctr: error:") and "--rows" in err[0]


@pytest.mark.skipif(ON_CUDA, reason="the CPU's refusal")
def test_bench_kernels_cowclip_sweep_needs_cuda(capsys):
    assert main(["bench", "kernels", "--rows", "100", "--dims", "8", "--batch-size", "8",
                 "--fields", "13", "--device", "cpu", "--cowclip-sweep"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cowclip-sweep times Triton launches on a CUDA device" in err[0]


@pytest.mark.skipif(not ON_CUDA, reason="Triton launches are timed on CUDA only")
def test_bench_kernels_cowclip_sweep_times_each_launch(capsys):
    from stream_ctr.bench.kernels import COWCLIP_SWEEP
    out = run_json(capsys, "bench", "kernels", "--rows", "500", "--dims", "11", "--batch-size", "32",
                   "--fields", "39", "--repeat", "2", "--warmup", "1", "--cowclip-sweep")
    sweep = [r for r in out["rows"] if r["kernel"].startswith("cowclip_adam ")]
    assert len(sweep) == len(COWCLIP_SWEEP)
    assert sum("(default)" in r["kernel"] for r in sweep) == 1
    for r in sweep:
        assert r["reference_seconds_per_call"] is None and positive(r["fast_seconds_per_call"])
        assert r["fast_path"] == dispatch.PATH_TRITON and r["dim"] == 11


@pytest.fixture
def torch_global_state():
    """`bench step` configures torch as `train` does (denormals flushed, deterministic
    algorithms, threads), process-wide; put it back for the tests that follow (e.g.
    hypothesis refuses to draw floats while subnormals are flushed)."""
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.set_flush_denormal(False)
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.set_num_threads(threads)


def test_bench_step_json(capsys, torch_global_state):
    sizes, steps = [32, 64], 2
    out = run_json(capsys, "bench", "step", "--batch-sizes", "32,64", "--steps", str(steps))
    assert out["bench"] == "step"
    paths = [dispatch.PATH_REFERENCE, dispatch.PATH_TRITON if ON_CUDA else dispatch.PATH_CPU_LOOPS]
    assert [(r["batch_size"], r["precision"], r["path"]) for r in out["rows"]] == \
        [(b, prec, p) for b in sizes for prec in ("fp32", "bf16") for p in paths]
    for r in out["rows"]:
        assert r["model"] == "deepfm" and r["steps"] == steps and r["skipped_steps"] == 0
        assert positive(r["seconds"]) and positive(r["samples_per_s"]) and positive(r["seconds_per_step"])
        assert r["samples_per_s"] == pytest.approx(r["batch_size"] * steps / r["seconds"])
        assert r["seconds_per_step"] == pytest.approx(r["seconds"] / steps)
        # 39 Criteo keys per record: at least one unique row, at most one per key
        assert 1 <= r["unique_rows_per_step"] <= r["batch_size"] * 39
        assert positive(r["speedup_vs_reference"])
        assert r["triton_skipped"] == (None if ON_CUDA else "no CUDA")


def test_force_reference_switch(monkeypatch):
    """`force_reference()` wins over the Triton default (CUDA) or a forced Triton (CPU
    interpreter), and restores the variable as it was."""
    monkeypatch.setenv(dispatch.FORCE_REFERENCE_ENV, "0")
    t = torch.zeros(1, device=DEVICE)
    if not ON_CUDA:
        monkeypatch.setenv(dispatch.FORCE_TRITON_ENV, "1")
        monkeypatch.setenv(dispatch.INTERPRET_ENV, "1")
    triton_path = dispatch.kernel_path(t)
    assert triton_path != dispatch.PATH_REFERENCE
    with dispatch.force_reference():
        assert not dispatch.use_triton(t)
        assert dispatch.kernel_path(t) == dispatch.PATH_REFERENCE
    assert dispatch.kernel_path(t) == triton_path
    assert os.environ[dispatch.FORCE_REFERENCE_ENV] == "0"
