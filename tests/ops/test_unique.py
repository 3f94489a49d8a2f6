"""ops.unique.unique_keys: exactly torch.unique's three tensors, on every kind of batch."""
import pytest
import torch

from stream_ctr.ops.dispatch import force_reference
from stream_ctr.ops.unique import unique_keys


def torch_unique(keys):
    return torch.unique(keys, return_inverse=True, return_counts=True)


def assert_same(keys):
    expected, got = torch_unique(keys), unique_keys(keys)
    for e, g in zip(expected, got):
        assert g.dtype == e.dtype and torch.equal(g, e)


@pytest.mark.parametrize("n, high", [(1, 10), (7, 3), (1000, 5), (20_000, 2**62), (300_000, 40_000)])
def test_matches_torch_unique(n, high):
    gen = torch.Generator().manual_seed(n)
    # Zipf-like repeats over a range (most keys seen many times) and, with a huge range,
    # nearly every key unique: the map grows from its start size several times.
    keys = (torch.rand(n, generator=gen) ** 3 * high).long()
    assert_same(keys)


def test_any_int64_value_and_order():
    gen = torch.Generator().manual_seed(1)
    extremes = torch.tensor([-2**63, 2**63 - 1, -1, 0, 1, -2**63, 2**63 - 1])
    assert_same(extremes)
    assert_same(torch.randint(-2**63, 2**63 - 1, (50_000,), generator=gen, dtype=torch.int64))
    assert_same(torch.arange(70_000).flip(0))             # descending, all unique
    assert_same(torch.full((5000,), 42))                   # one key
    # Keys apart only in their high bits (multiples of a large power of two).
    assert_same(torch.arange(0, 2**40 * 3000, 2**40))
    assert_same(torch.arange(-2**61, 2**61, 2**48))


def test_other_inputs_go_to_torch_unique():
    assert_same(torch.empty(0, dtype=torch.int64))
    for keys in (torch.tensor([3, 1, 3], dtype=torch.int32), torch.tensor([[2, 1], [2, 5]])):
        for e, g in zip(torch_unique(keys), unique_keys(keys)):
            assert torch.equal(g, e)
    with force_reference():
        assert_same(torch.tensor([5, 5, 2]))
