"""jagged_pool: bags of unique rows pooled (sum / mean) to one row per bag, and its backward."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from stream_ctr.ops.jagged_pool import jagged_pool, jagged_pool_reference, jagged_pool_triton


def make_case(u, lengths, d, seed, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    n = int(offsets[-1])
    rows = torch.randn(u, d, generator=gen, dtype=dtype)
    index = torch.randint(0, max(u, 1), (n,), generator=gen)
    grad_out = torch.randn(len(lengths), d, generator=gen, dtype=dtype)
    return rows.to(device), index.to(device), offsets.to(device), grad_out.to(device)


def forward_backward(fn, rows, index, offsets, grad_out, mean):
    leaf = rows.detach().clone().requires_grad_(True)
    out = fn(leaf, index, offsets, mean)
    out.backward(grad_out)
    return out.detach(), leaf.grad


def naive(rows, index, offsets, mean):
    out = []
    for b in range(len(offsets) - 1):
        s, e = int(offsets[b]), int(offsets[b + 1])
        bag = rows[index[s:e]].sum(0) if e > s else rows.new_zeros(rows.shape[1])
        out.append(bag / max(1, e - s) if mean else bag)
    return torch.stack(out) if out else rows.new_zeros((0, rows.shape[1]))


CASES = [(5, [2, 0, 3], 4), (1, [1], 9), (30, [0, 0, 0], 8), (50, [60, 1, 0, 7], 17), (4, [], 8)]


@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
@pytest.mark.parametrize("u, lengths, d", CASES)
def test_reference_matches_a_naive_loop(u, lengths, d, mean):
    rows, index, offsets, _ = make_case(u, lengths, d, seed=u + d)
    torch.testing.assert_close(jagged_pool_reference(rows, index, offsets, mean), naive(rows, index, offsets, mean))


def test_reference_gradcheck_float64():
    rows, index, offsets, _ = make_case(6, [3, 0, 5, 1], 3, seed=0, dtype=torch.float64)
    for mean in (False, True):
        assert torch.autograd.gradcheck(lambda r: jagged_pool_reference(r, index, offsets, mean),
                                        (rows.clone().requires_grad_(True),))


@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
@pytest.mark.parametrize("u, lengths, d", CASES)
def test_triton_matches_reference(triton_device, u, lengths, d, mean):
    case = make_case(u, lengths, d, seed=u + d, device=triton_device)
    ref_out, ref_grad = forward_backward(jagged_pool_reference, *case, mean)
    out, grad = forward_backward(jagged_pool_triton, *case, mean)
    # A bag of 60 rows sums values of ~8 in float32, in another order than the reference
    # (whose CUDA index_add_ uses atomics): 1.8e-6 apart once on an H200, so 1e-5.
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)


@settings(max_examples=15, deadline=None)
@given(u=st.integers(1, 20), lengths=st.lists(st.integers(0, 40), max_size=8), d=st.integers(1, 20),
       mean=st.booleans(), seed=st.integers(0, 1000))
def test_triton_matches_reference_on_random_bags(u, lengths, d, mean, seed):
    import os
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # float64: the two paths sum in different orders (a hot row's gradient sums ~300 terms,
    # whose float32 rounding differs by more than a fixed tolerance allows)
    case = make_case(u, lengths, d, seed, device=device, dtype=torch.float64)
    ref_out, ref_grad = forward_backward(jagged_pool_reference, *case, mean)
    out, grad = forward_backward(jagged_pool_triton, *case, mean)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10)


def test_dispatcher_runs_the_reference_on_cpu():
    rows, index, offsets, _ = make_case(5, [2, 0, 3], 4, seed=3)
    assert torch.equal(jagged_pool(rows, index, offsets, True), jagged_pool_reference(rows, index, offsets, True))


def test_bad_arguments_are_named():
    rows, index, offsets, _ = make_case(5, [2, 0, 3], 4, seed=3)
    with pytest.raises(ValueError, match="offsets"):
        jagged_pool(rows, index, offsets.int())
    with pytest.raises(ValueError, match="unique_rows"):
        jagged_pool(rows[0], index, offsets)
