"""CowClip + Adam: torch.optim.Adam parity, dispatch, argument checks, clip properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_ctr.ops.cowclip_adam import (
    CLIP_RATIO_EDGES, ClipStats, clip_rows_reference, cowclip_adam_, cowclip_adam_cpu,
    cowclip_adam_reference, cowclip_adam_triton)
from stream_ctr.ops.dispatch import FORCE_TRITON_ENV, force_reference
from tests.ops.conftest import needs_cuda, needs_interpreter
from tests.ops.test_cowclip_adam import HPARAMS, make_batch, make_table, run


@pytest.mark.parametrize("impl", [
    pytest.param(cowclip_adam_reference, id="reference"),
    pytest.param(cowclip_adam_cpu, id="cpu-loop"),
    pytest.param(cowclip_adam_triton, id="triton-interpreter", marks=needs_interpreter),
])
@pytest.mark.parametrize("cowclip", [False, True])
def test_matches_torch_adam_when_nothing_is_clipped(impl, cowclip):
    """All rows present, clip never binding: three steps equal torch.optim.Adam
    with weight_decay = 2*l2 (Keras l2 has no 1/2 factor)."""
    n, d, l2, lr = 20, 11, 1e-3, 1e-2
    gen = torch.Generator().manual_seed(2)
    w0 = torch.randn(n, d, generator=gen) * 0.03
    param = torch.nn.Parameter(w0.clone())
    adam = torch.optim.Adam([param], lr=lr, betas=(0.9, 0.999), eps=1e-7,
                            weight_decay=2 * l2, foreach=False)
    w, m, v = w0.clone(), torch.zeros(n, d), torch.zeros(n, d)
    for step in range(1, 4):
        grad = torch.randn(n, d, generator=gen) * 1e-2
        rows = torch.randperm(n, generator=gen)
        param.grad = grad.clone()
        adam.step()
        impl(w, m, v, rows, grad[rows], torch.ones(n, dtype=torch.int64), step=step, lr=lr,
             l2=l2, clip_r=1e6, clip_zeta=0.0, clip_dims=d, beta1=0.9, beta2=0.999,
             eps=1e-7, cowclip=cowclip)
    state = adam.state[param]
    torch.testing.assert_close(w, param.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(m, state["exp_avg"], rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(v, state["exp_avg_sq"], rtol=1e-5, atol=1e-12)


def test_dispatcher_uses_the_cpu_loop_on_cpu_and_the_reference_when_forced(monkeypatch):
    table = make_table(30, 10, seed=1)
    batch = make_batch(30, 12, 10, seed=1)
    calls = []
    monkeypatch.setattr("stream_ctr.ops.cowclip_adam.cowclip_adam_triton",
                        lambda *a, **k: calls.append("triton"))
    *out, _ = run(cowclip_adam_, table, batch, clip_dims=10)
    *loop, _ = run(cowclip_adam_cpu, table, batch, clip_dims=10)
    assert calls == [] and all(torch.equal(x, y) for x, y in zip(out, loop))
    with force_reference():
        *forced, _ = run(cowclip_adam_, table, batch, clip_dims=10)
    *ref, _ = run(cowclip_adam_reference, table, batch, clip_dims=10)
    assert all(torch.equal(x, y) for x, y in zip(forced, ref))
    # A table the loop does not take (float64 gradient is refused by both; an int32 row
    # index is not the loop's) goes to the reference's argument check.
    w, m, v = (t.clone() for t in table)
    with pytest.raises(ValueError, match="rows"):
        cowclip_adam_(w, m, v, batch[0].int(), batch[1], batch[2], clip_dims=10, **HPARAMS)


def test_cpu_loop_refuses_rows_outside_the_table_before_writing():
    table = make_table(30, 10, seed=1)
    rows, grad, count = make_batch(30, 12, 10, seed=1)
    rows[-1] = 30
    w, m, v = (t.clone() for t in table)
    with pytest.raises(IndexError, match="outside the table"):
        cowclip_adam_cpu(w, m, v, rows, grad, count, clip_dims=10, **HPARAMS)
    assert all(torch.equal(x, y) for x, y in zip((w, m, v), table))


@needs_interpreter
def test_dispatcher_forced_triton_on_cpu(monkeypatch):
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    table = make_table(30, 10, seed=1)
    batch = make_batch(30, 12, 10, seed=1)
    *out, _ = run(cowclip_adam_, table, batch, clip_dims=10)
    *tri, _ = run(cowclip_adam_triton, table, batch, clip_dims=10)
    assert all(torch.equal(x, y) for x, y in zip(out, tri))


@needs_cuda
def test_dispatcher_uses_triton_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr("stream_ctr.ops.cowclip_adam.cowclip_adam_triton",
                        lambda *a, **k: calls.append("triton"))
    table = make_table(30, 10, seed=1, device="cuda")
    run(cowclip_adam_, table, make_batch(30, 12, 10, seed=1, device="cuda"), clip_dims=10)
    assert calls == ["triton"]


@pytest.mark.parametrize("impl", [
    pytest.param(cowclip_adam_reference, id="reference"),
    pytest.param(cowclip_adam_cpu, id="cpu-loop"),
    pytest.param(cowclip_adam_triton, id="triton-interpreter", marks=needs_interpreter),
])
def test_stats_are_device_scalars_and_count_dtype_is_free(impl):
    table = make_table(50, 10, seed=4)
    rows, grad, count = make_batch(50, 40, 10, seed=4)
    *a, sa = run(impl, table, (rows, grad, count), clip_zeta=1e-3, clip_dims=10)
    *b, sb = run(impl, table, (rows, grad, count.int()), clip_zeta=1e-3, clip_dims=10)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert isinstance(sa, ClipStats) and sa.rows_present == 40
    for t in (sa.rows_clipped, sa.rows_at_floor):
        assert t.dim() == 0 and t.dtype == torch.int64
    assert sa.clipped_fraction().item() == pytest.approx(sa.rows_clipped.item() / 40)
    assert sa.rows_clipped.item() == sb.rows_clipped.item()


@pytest.mark.parametrize("change, message", [
    (dict(weight=torch.zeros(8, 4, dtype=torch.float64)), "weight"),
    (dict(exp_avg=torch.zeros(4, 8).t()), "exp_avg"),  # right shape, not contiguous
    (dict(rows=torch.arange(3, dtype=torch.int32)), "rows"),
    (dict(grad=torch.zeros(3, 5)), "grad"),
    (dict(count=torch.ones(3)), "count"),
    (dict(step=0), "step"),
    (dict(clip_dims=5), "clip_dims"),
    (dict(clip_dims=0), "clip_dims"),
])
def test_bad_arguments_name_the_argument(change, message):
    args = dict(weight=torch.zeros(8, 4), exp_avg=torch.zeros(8, 4), exp_avg_sq=torch.zeros(8, 4),
                rows=torch.arange(3), grad=torch.zeros(3, 4), count=torch.ones(3, dtype=torch.int64))
    kw = {**HPARAMS, "clip_dims": 4}
    for key, value in change.items():
        (args if key in args else kw)[key] = value
    with pytest.raises(ValueError, match=message):
        cowclip_adam_reference(*args.values(), **kw)


@settings(max_examples=60, deadline=None)
@given(
    w_norm=st.floats(0.0, 1.0), g_norm=st.floats(0.0, 10.0), count=st.integers(1, 1000),
    r=st.floats(0.1, 4.0), zeta=st.sampled_from([0.0, 1e-5, 1e-4, 1e-3]),
    d=st.integers(1, 16), seed=st.integers(0, 2**16),
)
def test_clip_property(w_norm, g_norm, count, r, zeta, d, seed):
    """6.1-6.3 for any inputs: ||g'|| = min(||g||, thr), same direction, finite."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.nn.functional.normalize(torch.randn(1, d, generator=gen), dim=1) * w_norm
    g = torch.nn.functional.normalize(torch.randn(1, d, generator=gen), dim=1) * g_norm
    g_clip, clipped, at_floor = clip_rows_reference(
        w.double(), g.double(), torch.tensor([count]), clip_r=r, clip_zeta=zeta, clip_dims=d)
    lower = r * math.sqrt(d) * zeta
    thr = r * count * max(w.double().norm().item(), lower)
    g_norm = g.double().norm().item()
    assert torch.isfinite(g_clip).all()
    assert g_clip.norm().item() == pytest.approx(min(g_norm, thr), rel=1e-12, abs=1e-300)
    if g_norm > 0 and thr > 0:
        assert torch.allclose(g_clip / g_clip.norm(), g.double() / g_norm, atol=1e-12)
    assert clipped.item() == (g_norm > thr)
    assert at_floor.item() == (w.double().norm().item() < lower)


@pytest.mark.parametrize("impl", [
    pytest.param(cowclip_adam_reference, id="reference"),
    pytest.param(cowclip_adam_cpu, id="cpu-loop"),
    pytest.param(cowclip_adam_triton, id="triton-interpreter", marks=needs_interpreter),
])
@pytest.mark.parametrize("clip_scale", [1.0, 1 / 64])
def test_ratio_histogram_counts_each_row_against_its_threshold(impl, clip_scale):
    """ratio_le is cumulative over CLIP_RATIO_EDGES; its rows above 1 are the clipped ones,
    and the sum is that of ||g|| / threshold computed here from the inputs."""
    table = make_table(300, 10, seed=7)
    rows, grad, count = make_batch(300, 250, 10, seed=7)
    grad = grad * torch.logspace(-4, 2, 250)[:, None]       # ratios across the whole grid
    w = table[0].index_select(0, rows)
    g = grad + 2 * HPARAMS["l2"] * w
    thr = clip_scale * count.float() * torch.clamp_min(torch.linalg.vector_norm(w, dim=1),
                                                        math.sqrt(10) * 1e-3)
    ratio = torch.linalg.vector_norm(g, dim=1) / thr
    *_, stats = run(impl, table, (rows, grad, count), clip_zeta=1e-3, clip_dims=10, clip_scale=clip_scale)
    le = stats.ratio_le.tolist()
    assert le == sorted(le) and le[-1] <= 250 and le[0] >= 0
    expect = [int((ratio <= edge * (1 + 1e-5)).sum()) for edge in CLIP_RATIO_EDGES]
    assert all(abs(a - b) <= int(((ratio - edge).abs() < edge * 1e-5).sum())
               for a, b, edge in zip(le, expect, CLIP_RATIO_EDGES))
    one = CLIP_RATIO_EDGES.index(1.0)
    assert 250 - le[one] == stats.rows_clipped.item() > 0 and le[one] > 0
    assert stats.ratio_sum.item() == pytest.approx(float(ratio.sum()), rel=1e-4)


def test_ratio_histogram_is_absent_without_cowclip():
    table = make_table(30, 10, seed=1)
    *_, stats = run(cowclip_adam_reference, table, make_batch(30, 12, 10, seed=1), clip_dims=10,
                    cowclip=False)
    assert stats.ratio_le is None and stats.ratio_sum is None


def test_cpu_loop_in_parts_matches_one_part(monkeypatch):
    """The rows split between threads: every row gets what one pass gives it, and the
    counts and ratio sum add up to one pass's."""
    import stream_ctr.ops.cowclip_adam as module
    table = make_table(3000, 11, seed=3)
    batch = make_batch(3000, 2500, 11, seed=3)
    kw = dict(clip_zeta=1e-3, clip_dims=10, clip_scale=1 / 8, count_lr_s=4.0)
    monkeypatch.setattr(module, "_CPU_ROWS_PER_PART", 10**9)
    *one, one_stats = run(cowclip_adam_cpu, table, batch, **kw)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(module, "_CPU_ROWS_PER_PART", 100)
        *parts, parts_stats = run(cowclip_adam_cpu, table, batch, **kw)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(x, y) for x, y in zip(one, parts))
    assert 0 < one_stats.rows_clipped.item() < 2500
    for name in ("rows_clipped", "rows_at_floor", "ratio_le"):
        assert torch.equal(getattr(parts_stats, name), getattr(one_stats, name)), name
    torch.testing.assert_close(parts_stats.ratio_sum, one_stats.ratio_sum, rtol=1e-6, atol=0)


@pytest.mark.parametrize("edge_log2", [-14, -2, 0, 2])
def test_cpu_loop_counts_a_ratio_next_to_an_edge_as_the_reference(edge_log2):
    """A ratio one float32 step above an edge has a float32 log2 on the edge: both
    paths count it there (the loop once compared in float64 and did not)."""
    above = torch.nextafter(torch.tensor(2.0**edge_log2), torch.tensor(1e9))
    table = [torch.tensor([[1.0]]), torch.zeros(1, 1), torch.zeros(1, 1)]
    batch = [torch.tensor([0]), above.view(1, 1), torch.tensor([1])]
    kw = dict(clip_zeta=0.0, clip_dims=1, clip_r=1.0)
    *_, ref = run(cowclip_adam_reference, table, batch, **kw)
    *_, loop = run(cowclip_adam_cpu, table, batch, **kw)
    assert torch.equal(loop.ratio_le, ref.ratio_le)
