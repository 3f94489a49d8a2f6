"""The compiled CPU row add is index_add_, bit for bit."""
import pytest
import torch

from stream_ctr.ops.cpu_rows import index_add_rows, pool_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("u, m, d", [(1, 1, 1), (7, 500, 11), (300, 20000, 10), (5, 0, 3), (4, 9, 0)])
def test_same_bits_as_index_add(dtype, index_dtype, u, m, d):
    gen = torch.Generator().manual_seed(u + m + d)
    grad = torch.randn(m, d, generator=gen, dtype=dtype) * 10 ** torch.randint(-3, 4, (m, 1), generator=gen)
    inverse = torch.randint(0, u, (m,), generator=gen).to(index_dtype)
    expected = torch.zeros(u, d, dtype=dtype).index_add_(0, inverse, grad)
    assert torch.equal(index_add_rows(grad, inverse, u), expected)


def test_strided_grad_and_other_dtypes():
    grad = torch.randn(10, 6)[:, ::2]                      # not contiguous
    inverse = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 3])
    assert torch.equal(index_add_rows(grad, inverse, 4), torch.zeros(4, 3).index_add_(0, inverse, grad))
    half = grad.to(torch.bfloat16)                          # index_add_ itself
    assert torch.equal(index_add_rows(half, inverse, 4),
                       torch.zeros(4, 3, dtype=torch.bfloat16).index_add_(0, inverse, half))


def test_out_of_range_index_is_an_error():
    with pytest.raises(IndexError):
        index_add_rows(torch.ones(3, 2), torch.tensor([0, 5, 1]), 2)


def test_pool_rows_is_index_add_with_its_gradient():
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(50, 7, generator=gen, requires_grad=True)
    index = torch.randint(0, 9, (50,), generator=gen)
    out = pool_rows(rows, index, 9)
    assert torch.equal(out, torch.zeros(9, 7).index_add(0, index, rows.detach()))
    grad_out = torch.randn(9, 7, generator=gen)
    out.backward(grad_out)
    assert torch.equal(rows.grad, grad_out.index_select(0, index))
    double = rows.detach().double().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda r: pool_rows(r, index, 9), (double,))
