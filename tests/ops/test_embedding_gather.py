"""gather_rows: forward is index_select, backward is a per-row segment sum."""

import pytest
import torch

from stream_ctr.ops.dispatch import FORCE_TRITON_ENV
from stream_ctr.ops import embedding_gather
from stream_ctr.ops.embedding_gather import gather_rows, gather_rows_reference, gather_rows_triton
from tests.ops.conftest import needs_interpreter

# (U, M, D): tiny, duplicated slots, unused unique rows, padded widths.
SHAPES = [(1, 1, 10), (7, 50, 11), (40, 300, 16), (64, 200, 17), (5, 0, 16), (0, 0, 10)]


def make_case(u, m, d, seed, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randn(u, d, generator=gen, dtype=dtype)
    inverse = torch.randint(0, max(u, 1), (m,), generator=gen)
    grad_out = torch.randn(m, d, generator=gen, dtype=dtype)
    return src.to(device), inverse.to(device), grad_out.to(device)


def forward_backward(fn, src, inverse, grad_out):
    leaf = src.detach().clone().requires_grad_(True)
    out = fn(leaf, inverse)
    out.backward(grad_out)
    return out.detach(), leaf.grad


@pytest.mark.parametrize("u, m, d", SHAPES)
def test_reference_is_index_select_and_index_add(u, m, d):
    src, inverse, grad_out = make_case(u, m, d, seed=u + m + d)
    out, grad = forward_backward(gather_rows_reference, src, inverse, grad_out)
    assert torch.equal(out, src.index_select(0, inverse))
    assert torch.equal(grad, torch.zeros(u, d).index_add_(0, inverse, grad_out))


def test_reference_gradcheck_float64():
    src, inverse, _ = make_case(6, 20, 5, seed=0, dtype=torch.float64)
    src.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda s: gather_rows_reference(s, inverse), (src,))


@pytest.mark.parametrize("deterministic", [True, False], ids=["segment", "atomic"])
@pytest.mark.parametrize("u, m, d", SHAPES)
def test_triton_matches_reference(triton_device, u, m, d, deterministic):
    src, inverse, grad_out = make_case(u, m, d, seed=u + m + d, device=triton_device)
    ref_out, ref_grad = forward_backward(gather_rows_reference, src, inverse, grad_out)
    fn = lambda s, i: gather_rows_triton(s, i, deterministic=deterministic)  # noqa: E731
    out, grad = forward_backward(fn, src, inverse, grad_out)
    assert torch.equal(out, ref_out)  # a gather copies: bit-exact
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    unused = torch.ones(u, dtype=torch.bool, device=triton_device)
    unused[inverse] = False
    assert torch.equal(grad[unused], torch.zeros_like(grad[unused]))


def test_triton_hot_row_and_int32_inverse(triton_device):
    """One row takes most slots (a segment longer than a block); int32 indices."""
    src, _, grad_out = make_case(4, 500, 11, seed=1, device=triton_device)
    inverse = torch.zeros(500, dtype=torch.int32, device=triton_device)
    inverse[::7] = 3
    ref_out, ref_grad = forward_backward(gather_rows_reference, src, inverse, grad_out)
    for deterministic in (True, False):
        fn = lambda s, i: gather_rows_triton(s, i, deterministic=deterministic)  # noqa: E731
        out, grad = forward_backward(fn, src, inverse, grad_out)
        assert torch.equal(out, ref_out)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("piece", [1, 3, 64])
def test_triton_segments_cut_into_pieces(triton_device, monkeypatch, piece):
    """A hot row's segment is summed in pieces, then the pieces per row: the same sums,
    and rows no slot uses still get zero."""
    monkeypatch.setattr(embedding_gather, "SEGMENT_PIECE_SLOTS", piece)
    src, inverse, grad_out = make_case(9, 300, 12, seed=piece, device=triton_device)
    inverse[: 200] = 4                      # one row: 200+ slots, many pieces
    inverse[inverse == 7] = 6               # row 7 unused
    ref_out, ref_grad = forward_backward(gather_rows_reference, src, inverse, grad_out)
    out, grad = forward_backward(gather_rows_triton, src, inverse, grad_out)
    assert torch.equal(out, ref_out)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)
    assert torch.equal(grad[7], torch.zeros_like(grad[7]))


def test_pieces_cover_each_segment_in_order():
    starts = torch.tensor([0, 5, 5, 6, 16])           # lengths 5, 0, 1, 10
    begin, end, first = embedding_gather._pieces(starts, 16, 4)
    assert first.tolist() == [0, 2, 3, 4, 7]
    assert list(zip(begin.tolist(), end.tolist()))[:7] == [
        (0, 4), (4, 5), (5, 5), (5, 6), (6, 10), (10, 14), (14, 16)]
    assert len(begin) == 4 + 16 // 4 and all(b == e for b, e in zip(begin[7:], end[7:]))


def test_triton_segment_sum_is_reproducible(triton_device):
    src, inverse, grad_out = make_case(30, 400, 16, seed=2, device=triton_device)
    _, g1 = forward_backward(gather_rows_triton, src, inverse, grad_out)
    _, g2 = forward_backward(gather_rows_triton, src, inverse, grad_out)
    assert torch.equal(g1, g2)


def test_triton_non_contiguous_input(triton_device):
    src = torch.randn(16, 9, device=triton_device).t()  # [9, 16], strided
    inverse = torch.tensor([8, 0, 3, 3], device=triton_device)
    grad_out = torch.randn(4, 16, device=triton_device)
    ref = forward_backward(gather_rows_reference, src, inverse, grad_out)
    out = forward_backward(gather_rows_triton, src, inverse, grad_out)
    assert torch.equal(out[0], ref[0])
    torch.testing.assert_close(out[1], ref[1])


@needs_interpreter
@pytest.mark.parametrize("deterministic", [True, False], ids=["segment", "atomic"])
def test_triton_gradcheck_float64(deterministic):
    src, inverse, _ = make_case(4, 9, 3, seed=3, dtype=torch.float64)
    src.requires_grad_(True)
    fn = lambda s: gather_rows_triton(s, inverse, deterministic=deterministic)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (src,))


@pytest.mark.parametrize("force", [False, pytest.param(True, marks=needs_interpreter)])
def test_dispatcher(monkeypatch, force):
    if force:
        monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    calls = []
    real = gather_rows_triton
    monkeypatch.setattr("stream_ctr.ops.embedding_gather.gather_rows_triton",
                        lambda *a, **k: calls.append(k) or real(*a, **k))
    src, inverse, grad_out = make_case(7, 50, 11, seed=4)
    out, grad = forward_backward(
        lambda s, i: gather_rows(s, i, deterministic=False), src, inverse, grad_out)
    ref_out, ref_grad = forward_backward(gather_rows_reference, src, inverse, grad_out)
    assert calls == ([{"deterministic": False}] if force else [])
    assert torch.equal(out, ref_out)
    torch.testing.assert_close(grad, ref_grad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="inverse"):
        gather_rows(torch.zeros(3, 4), torch.zeros(2))
    with pytest.raises(ValueError, match="unique_rows"):
        gather_rows(torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="no unique rows"):
        gather_rows(torch.zeros(0, 4), torch.zeros(2, dtype=torch.int64))
