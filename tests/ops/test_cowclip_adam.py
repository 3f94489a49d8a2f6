"""CowClip + sparse Adam: Triton and the CPU loop vs reference, and the spec checks of
cowclip.md section 6."""

import functools
import math

import pytest
import torch

from stream_ctr.ops.cowclip_adam import (
    clip_rows_reference, cowclip_adam_cpu, cowclip_adam_reference, cowclip_adam_triton)
from tests.ops.conftest import needs_cuda, needs_interpreter

B1, B2 = 0.9, 0.999
HPARAMS = dict(step=1, lr=1e-3, l2=0.0, clip_r=1.0, clip_zeta=1e-5,
               beta1=B1, beta2=B2, eps=1e-7)


def make_table(n, d, seed, device="cpu"):
    """Weights of mixed norms (some rows below the CowClip floor), nonzero moments."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, d, generator=gen) * 0.03
    w[torch.rand(n, generator=gen) < 0.2] *= 1e-3
    m = torch.randn(n, d, generator=gen) * 1e-3
    v = torch.rand(n, d, generator=gen) * 1e-5
    return [t.to(device) for t in (w, m, v)]


def make_batch(n, u, d, seed, device="cpu"):
    """Unique rows, gradients with norms spread over 1e-4..1e-1, counts 1..5."""
    gen = torch.Generator().manual_seed(seed + 1)
    rows = torch.randperm(n, generator=gen)[:u]
    scale = 10 ** (-4 + 3 * torch.rand(u, 1, generator=gen))
    grad = torch.randn(u, d, generator=gen) * scale
    count = torch.randint(1, 6, (u,), generator=gen)
    return [t.to(device) for t in (rows, grad, count)]


def run(impl, table, batch, **overrides):
    """Apply `impl` to copies of the table; return (w, m, v, stats)."""
    w, m, v = (t.clone() for t in table)
    stats = impl(w, m, v, *batch, **{**HPARAMS, **overrides})
    return w, m, v, stats


def clipped_grad(m_after):
    """With m = 0 before one step, Adam's m is (1 - b1) * the clipped gradient."""
    return m_after / (1 - B1)


@pytest.fixture(params=[
    pytest.param((cowclip_adam_reference, "cpu"), id="reference"),
    pytest.param((cowclip_adam_cpu, "cpu"), id="cpu-loop"),
    pytest.param((cowclip_adam_triton, "cpu"), id="triton-interpreter", marks=needs_interpreter),
    pytest.param((cowclip_adam_triton, "cuda"), id="triton-cuda", marks=needs_cuda),
])
def impl_device(request):
    return request.param


# --- Triton vs reference ------------------------------------------------------

@pytest.mark.parametrize("u", [0, 1, 7, 300])
@pytest.mark.parametrize("d", [10, 11, 16, 17, 64])
@pytest.mark.parametrize("linear_cols", [0, 1])
def test_triton_matches_reference(triton_device, u, d, linear_cols):
    _matches_reference(cowclip_adam_triton, triton_device, u, d, linear_cols)


@pytest.mark.parametrize("d", [11, 16])
@pytest.mark.parametrize("block_rows,num_warps", [(16, 2), (256, 8)])
def test_triton_launch_overrides_compute_the_same_rows(triton_device, d, block_rows, num_warps):
    """`bench kernels --cowclip-sweep`'s launches: blocks of another size and warp count
    update every row as the reference does, the counts exact."""
    _matches_reference(functools.partial(cowclip_adam_triton, block_rows=block_rows,
                                         num_warps=num_warps), triton_device, 300, d, 1)


def test_triton_launch_refuses_a_block_that_is_not_a_power_of_two(triton_device):
    table = make_table(20, 11, seed=1, device=triton_device)
    with pytest.raises(ValueError, match="block_rows must be a power of 2"):
        run(functools.partial(cowclip_adam_triton, block_rows=48), table,
            make_batch(20, 10, 11, seed=1, device=triton_device), clip_dims=10)


@pytest.mark.parametrize("u", [0, 1, 7, 300])
@pytest.mark.parametrize("d", [10, 11, 16, 17, 64])
@pytest.mark.parametrize("linear_cols", [0, 1])
def test_cpu_loop_matches_reference(u, d, linear_cols):
    _matches_reference(cowclip_adam_cpu, "cpu", u, d, linear_cols)


def _matches_reference(impl, device, u, d, linear_cols):
    n = u + 13
    table = make_table(n, d, seed=u * 100 + d, device=device)
    batch = make_batch(n, u, d, seed=u * 100 + d, device=device)
    kw = dict(step=7, l2=1e-3, clip_zeta=1e-3, clip_dims=d - linear_cols)
    *ref, ref_stats = run(cowclip_adam_reference, table, batch, **kw)
    *out, out_stats = run(impl, table, batch, **kw)
    for name, r, o, atol in zip("wmv", ref, out, (1e-6, 1e-8, 1e-11)):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=atol, msg=f"{name} differs")
    assert out_stats.rows_clipped.item() == ref_stats.rows_clipped.item()
    assert out_stats.rows_at_floor.item() == ref_stats.rows_at_floor.item()
    if u == 300:  # the data exercises both regimes
        assert 0 < ref_stats.rows_clipped.item() < u and ref_stats.rows_at_floor.item() > 0
    if u:
        assert torch.equal(out_stats.ratio_le, ref_stats.ratio_le)
        torch.testing.assert_close(out_stats.ratio_sum, ref_stats.ratio_sum, rtol=1e-5, atol=0)
    untouched = torch.ones(n, dtype=torch.bool, device=device)
    untouched[batch[0]] = False
    for before, after in zip(table, out):
        assert torch.equal(after[untouched], before[untouched])


@pytest.mark.parametrize("d", [11, 17])
def test_triton_matches_reference_without_cowclip(triton_device, d):
    table = make_table(40, d, seed=3, device=triton_device)
    batch = make_batch(40, 25, d, seed=3, device=triton_device)
    kw = dict(step=2, l2=1e-2, clip_dims=d, cowclip=False)
    *ref, ref_stats = run(cowclip_adam_reference, table, batch, **kw)
    *out, out_stats = run(cowclip_adam_triton, table, batch, **kw)
    for r, o in zip(ref, out):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-8)
    assert out_stats.rows_clipped.item() == ref_stats.rows_clipped.item() == 0


# --- cowclip.md section 6, on every implementation -----------------------------

def test_worked_example(impl_device):
    """6.1: d=10, r=1, zeta=1e-5; ||w||=0.02, c=3 -> thr 0.06; ||w||=0, c=2 -> thr 6.325e-5."""
    impl, device = impl_device
    gen = torch.Generator().manual_seed(0)
    unit = torch.nn.functional.normalize(torch.randn(4, 10, generator=gen), dim=1)
    w = torch.zeros(6, 10)
    w[3], w[0] = 0.02 * unit[0], 0.02 * unit[0]          # w[4] stays 0
    grad = torch.stack([0.09 * unit[1], 0.05 * unit[2], 1e-3 * unit[3]])
    table = [t.to(device) for t in (w, torch.zeros(6, 10), torch.zeros(6, 10))]
    batch = [t.to(device) for t in (torch.tensor([3, 0, 4]), grad, torch.tensor([3, 3, 2]))]
    # lr large enough that post-update norms differ a lot: thr must use pre-update w.
    _, m, _, stats = run(impl, table, batch, lr=1e-2, clip_dims=10)
    g = clipped_grad(m[batch[0]]).cpu()
    torch.testing.assert_close(g[0], grad[0] * (2 / 3), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(g[0].norm(), torch.tensor(0.06), rtol=1e-5, atol=0)
    torch.testing.assert_close(g[1], grad[1], rtol=1e-5, atol=1e-9)
    thr_floor = 2 * math.sqrt(10) * 1e-5
    assert abs(thr_floor - 6.325e-5) < 1e-8
    torch.testing.assert_close(g[2].norm(), torch.tensor(thr_floor), rtol=1e-5, atol=0)
    assert stats.rows_clipped.item() == 2 and stats.rows_at_floor.item() == 1


@pytest.mark.parametrize("r", [0.5, 2.0])
def test_paper_equivalence(impl_device, r):
    """6.2: thr = cnt * max(r*||w||, zeta_paper) with zeta_paper = r^2 * sqrt(d) * zeta_code."""
    impl, device = impl_device
    d, u, zeta_code = 10, 64, 1e-3
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(u, d, generator=gen) * 10 ** (-5 + 5 * torch.rand(u, 1, generator=gen))
    grad = torch.randn(u, d, generator=gen) * 10 ** (-5 + 5 * torch.rand(u, 1, generator=gen))
    count = torch.randint(1, 5, (u,), generator=gen)
    table = [t.to(device) for t in (w, torch.zeros(u, d), torch.zeros(u, d))]
    batch = [t.to(device) for t in (torch.arange(u), grad, count)]
    _, m, _, stats = run(impl, table, batch, clip_r=r, clip_zeta=zeta_code, clip_dims=d)

    zeta_paper = r**2 * math.sqrt(d) * zeta_code
    thr = count * torch.maximum(r * w.norm(dim=1), torch.tensor(zeta_paper))
    expected = grad * torch.clamp(thr / grad.norm(dim=1), max=1.0)[:, None]
    torch.testing.assert_close(clipped_grad(m).cpu(), expected, rtol=1e-5, atol=1e-12)
    assert 0 < stats.rows_clipped.item() < u and 0 < stats.rows_at_floor.item() < u


def test_direction_preserved_and_norm_is_min(impl_device):
    """6.3: g' is parallel to g and ||g'|| = min(||g||, thr)."""
    impl, device = impl_device
    table = make_table(80, 12, seed=11, device=device)
    table[1].zero_()
    rows, grad, count = make_batch(80, 50, 12, seed=11, device=device)
    _, m, _, _ = run(impl, table, (rows, grad, count), clip_zeta=1e-3, clip_dims=12)
    g, g_clip = grad.cpu(), clipped_grad(m[rows]).cpu()
    w = table[0][rows].cpu()
    thr = count.cpu() * torch.clamp_min(w.norm(dim=1), math.sqrt(12) * 1e-3)
    torch.testing.assert_close(g_clip.norm(dim=1), torch.minimum(g.norm(dim=1), thr),
                               rtol=1e-5, atol=1e-12)
    cosine = torch.nn.functional.cosine_similarity(g_clip, g, dim=1)
    torch.testing.assert_close(cosine, torch.ones(50), rtol=0, atol=1e-6)


def test_zero_gradient_row(impl_device):
    """6.3: a zero gradient row stays zero, no NaN; w moves only by L2 and Adam."""
    impl, device = impl_device
    l2, lr = 1e-2, 1e-3
    w = torch.zeros(3, 10)
    w[0] = 0.02
    table = [t.to(device) for t in (w, torch.zeros(3, 10), torch.zeros(3, 10))]
    batch = [t.to(device) for t in (torch.tensor([0, 1]), torch.zeros(2, 10), torch.tensor([1, 4]))]
    # clip_zeta=0 makes thr = 0 for the zero row: 0/0 must not appear.
    w1, m1, v1, stats = run(impl, table, batch, l2=l2, lr=lr, clip_zeta=0.0, clip_dims=10)
    w1, m1, v1 = w1.cpu(), m1.cpu(), v1.cpu()
    for t in (w1, m1, v1):
        assert torch.isfinite(t).all()
    g = 2 * l2 * w[0]  # row 0: only the L2 gradient, below thr = ||w||
    torch.testing.assert_close(m1[0], (1 - B1) * g)
    torch.testing.assert_close(v1[0], (1 - B2) * g * g)
    torch.testing.assert_close(w1[0], w[0] - lr * g / (g.abs() + 1e-7))
    assert torch.equal(w1[1:], torch.zeros(2, 10)) and torch.equal(m1[1], torch.zeros(10))
    assert stats.rows_clipped.item() == 0


def test_only_first_clip_dims_columns_are_clipped(impl_device):
    """6.5: the trailing linear column is neither clipped nor part of the norms."""
    impl, device = impl_device
    w = torch.zeros(1, 11)
    w[0, :10], w[0, 10] = 0.01 / math.sqrt(10), 100.0   # ||w[:10]|| = 0.01
    grad = torch.full((1, 11), 3.0)
    table = [t.to(device) for t in (w, torch.zeros(1, 11), torch.zeros(1, 11))]
    batch = [t.to(device) for t in (torch.tensor([0]), grad, torch.tensor([1]))]
    _, m, _, stats = run(impl, table, batch, clip_dims=10)
    g = clipped_grad(m).cpu()[0]
    torch.testing.assert_close(g[:10].norm(), torch.tensor(0.01), rtol=1e-5, atol=0)
    torch.testing.assert_close(g[10], torch.tensor(3.0))
    assert stats.rows_clipped.item() == 1


def test_clip_runs_before_adam(impl_device):
    """6.5: Adam's m and v see the clipped gradient; the step uses them."""
    impl, device = impl_device
    table = make_table(30, 10, seed=5, device=device)
    table[1].zero_()  # fresh moments: after one step m = (1-b1) g, v = (1-b2) g^2
    table[2].zero_()
    rows, grad, count = make_batch(30, 20, 10, seed=5, device=device)
    w1, m1, v1, stats = run(impl, table, (rows, grad, count), clip_zeta=1e-3, clip_dims=10)
    assert stats.rows_clipped.item() > 0
    w0 = table[0][rows].cpu()
    g_clip, _, _ = clip_rows_reference(w0, grad.cpu(), count.cpu(),
                                       clip_r=1.0, clip_zeta=1e-3, clip_dims=10)
    torch.testing.assert_close(m1[rows].cpu(), (1 - B1) * g_clip, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(v1[rows].cpu(), (1 - B2) * g_clip**2, rtol=1e-5, atol=1e-15)
    step = HPARAMS["lr"] * g_clip / (g_clip.abs() + 1e-7)   # bias-corrected m/sqrt(v) at step 1
    torch.testing.assert_close(w1[rows].cpu(), w0 - step, rtol=1e-5, atol=1e-8)


def test_untouched_rows_and_row_order(impl_device):
    """Rows not listed keep w, m, v bit for bit; permuting `rows` changes nothing."""
    impl, device = impl_device
    table = make_table(200, 17, seed=9, device=device)
    rows, grad, count = make_batch(200, 60, 17, seed=9, device=device)
    perm = torch.randperm(60, generator=torch.Generator().manual_seed(1)).to(device)
    *a, sa = run(impl, table, (rows, grad, count), step=4, l2=1e-3, clip_zeta=1e-3, clip_dims=16)
    *b, sb = run(impl, table, (rows[perm], grad[perm], count[perm]),
                 step=4, l2=1e-3, clip_zeta=1e-3, clip_dims=16)
    untouched = torch.ones(200, dtype=torch.bool, device=device)
    untouched[rows] = False
    for before, x, y in zip(table, a, b):
        assert torch.equal(x, y)
        assert torch.equal(x[untouched], before[untouched])
    assert sa.rows_clipped.item() == sb.rows_clipped.item() > 0


def test_empty_rows(impl_device):
    impl, device = impl_device
    table = make_table(5, 10, seed=0, device=device)
    batch = make_batch(5, 0, 10, seed=0, device=device)
    *out, stats = run(impl, table, batch, clip_dims=10)
    assert all(torch.equal(x, y) for x, y in zip(out, table))
    assert stats.rows_clipped.item() == 0 and stats.rows_present == 0


# --- per-occurrence threshold units and per-row count learning rates -------------

@pytest.mark.parametrize("cowclip", [True, False])
@pytest.mark.parametrize("count_lr_s", [1.0, 4.0, 32.0])
def test_triton_matches_reference_with_scale_and_count_lr(triton_device, cowclip, count_lr_s):
    _matches_reference_with_scale_and_count_lr(cowclip_adam_triton, triton_device, cowclip, count_lr_s)


@pytest.mark.parametrize("cowclip", [True, False])
@pytest.mark.parametrize("count_lr_s", [1.0, 4.0, 32.0])
def test_cpu_loop_matches_reference_with_scale_and_count_lr(cowclip, count_lr_s):
    _matches_reference_with_scale_and_count_lr(cowclip_adam_cpu, "cpu", cowclip, count_lr_s)


def _matches_reference_with_scale_and_count_lr(impl, device, cowclip, count_lr_s):
    n, u, d = 313, 300, 11
    table = make_table(n, d, seed=5, device=device)
    batch = make_batch(n, u, d, seed=5, device=device)
    kw = dict(step=3, l2=1e-4, clip_dims=d - 1, cowclip=cowclip, clip_scale=1 / 64,
              count_lr_s=count_lr_s)
    *ref, ref_stats = run(cowclip_adam_reference, table, batch, **kw)
    *out, out_stats = run(impl, table, batch, **kw)
    for name, r, o, atol in zip("wmv", ref, out, (1e-6, 1e-8, 1e-11)):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=atol, msg=f"{name} differs")
    assert out_stats.rows_clipped.item() == ref_stats.rows_clipped.item()


def test_clip_scale_divides_the_threshold(impl_device):
    # Per-occurrence units: a mean-loss gradient g is clipped at thr / batch.
    impl, device = impl_device
    w = torch.tensor([[0.6, 0.8]], device=device)                  # ||w|| = 1
    table = [w, torch.zeros_like(w), torch.zeros_like(w)]
    g = torch.tensor([[0.03, 0.04]], device=device)                 # ||g|| = 0.05
    batch = [torch.tensor([0], device=device), g, torch.tensor([2], device=device)]
    *_, stats = run(impl, table, batch, clip_dims=2)                # thr 2: no clip
    assert stats.rows_clipped.item() == 0
    _, m, _, stats = run(impl, table, batch, clip_dims=2, clip_scale=1 / 100)   # thr 0.02
    assert stats.rows_clipped.item() == 1
    torch.testing.assert_close(clipped_grad(m).norm(), torch.tensor(0.02, device=device))


def test_count_lr_multiplies_each_rows_step(impl_device):
    from stream_ctr.ops.cowclip_adam import row_lr_multiplier
    impl, device = impl_device
    count = torch.tensor([1, 2, 10, 1000])
    mult = row_lr_multiplier(count, 8.0)
    # 1 occurrence: one base step; a few: ~count; many: at most s.
    torch.testing.assert_close(mult, torch.tensor([1.0, 1.875, 8 * (1 - (7 / 8) ** 10), 8.0]))
    assert torch.equal(row_lr_multiplier(count, 1.0), torch.ones(4))
    n, d = 4, 3
    table = make_table(n, d, seed=9, device=device)
    batch = [torch.arange(n, device=device), torch.full((n, d), 0.1, device=device), count.to(device)]
    w0 = table[0]
    w1, *_ = run(impl, table, batch, clip_dims=d, cowclip=False)
    w8, *_ = run(impl, table, batch, clip_dims=d, cowclip=False, count_lr_s=8.0)
    torch.testing.assert_close((w8 - w0) / (w1 - w0), mult.to(device)[:, None].expand(n, d),
                               rtol=1e-4, atol=1e-4)
