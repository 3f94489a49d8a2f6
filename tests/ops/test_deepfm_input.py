"""ops.deepfm_input: the compiled CPU pass against the torch expression, and in DeepFM."""
import pytest
import torch

from stream_ctr.config import ModelConfig
from stream_ctr.models.networks import DeepFM
from stream_ctr.ops.deepfm_input import _DeepFMInput, deepfm_input, deepfm_input_reference
from stream_ctr.ops.dispatch import force_reference


def inputs(b, f, d, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    emb = torch.randn(b, f, d, generator=gen) * 0.05
    dense = torch.randn(b, n, generator=gen) * 3
    return emb, dense


def forward_backward(fn, emb, dense, grad_fm, grad_x0):
    e, x = emb.clone().requires_grad_(), dense.clone().requires_grad_()
    fm, x0 = fn(e, x)
    torch.autograd.backward([fm, x0], [grad_fm, grad_x0])
    return fm, x0, e.grad, x.grad


@pytest.mark.parametrize("b, f, d, n", [(1, 1, 1, 0), (7, 3, 4, 2), (3000, 39, 10, 13), (2500, 26, 16, 0)])
def test_cpu_loop_matches_the_torch_expression(b, f, d, n):
    emb, dense = inputs(b, f, d, n, seed=b)
    gen = torch.Generator().manual_seed(1)
    grad_fm = torch.randn(b, generator=gen)
    grad_x0 = torch.randn(b, f * d + n, generator=gen).to(torch.bfloat16)
    ref = forward_backward(deepfm_input_reference, emb, dense, grad_fm, grad_x0)
    out = forward_backward(_DeepFMInput.apply, emb, dense, grad_fm, grad_x0)
    assert out[1].dtype == torch.bfloat16 and torch.equal(out[1], ref[1])      # the same x0 bits
    # fm is a difference of squares: near 0 only an absolute bound holds
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[2], ref[2], rtol=1e-5, atol=1e-6)
    if n:                                          # the dense part of x0's gradient, exactly
        torch.testing.assert_close(out[3], ref[3], rtol=0, atol=0)


def test_rounding_ties_and_non_finite_values_as_torch():
    # Values on a bf16 tie (the low 16 bits exactly 0x8000), next to one, inf and NaN.
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F800000, -0x00800000,
                         0x7FC00000, 0x7F800001, 0x477FFFFF, 0], dtype=torch.int32)
    emb = bits.view(torch.float32).view(1, 10, 1)
    _, x0 = _DeepFMInput.apply(emb, torch.zeros(1, 0))
    expect = emb.flatten(1).to(torch.bfloat16)
    assert torch.equal(x0[:, :6], expect[:, :6]) and torch.equal(x0[:, 8:], expect[:, 8:])
    assert torch.isnan(x0[:, 6:8].float()).all()


def test_dispatch_and_a_missing_gradient():
    emb, dense = inputs(5, 4, 3, 2)
    fm, x0 = deepfm_input(emb, dense)
    with force_reference():
        fm_ref, x0_ref = deepfm_input(emb, dense)
    assert torch.equal(x0, x0_ref)
    torch.testing.assert_close(fm, fm_ref)
    e = emb.clone().requires_grad_()
    fm, x0 = _DeepFMInput.apply(e, dense)
    fm.sum().backward()                              # x0 unused: its gradient is None
    e_ref = emb.clone().requires_grad_()
    deepfm_input_reference(e_ref, dense)[0].sum().backward()
    torch.testing.assert_close(e.grad, e_ref.grad)


def test_deepfm_under_cpu_autocast_matches_the_unfused_model():
    torch.manual_seed(0)
    cfg = ModelConfig(embed_dim=8, mlp_dims=[32, 16])
    model = DeepFM(cfg, n_fields=6, n_dense=3)
    emb, dense = inputs(64, 6, 8, 3, seed=3)
    lin = torch.randn(64, 6) * 0.01

    def run():
        e = emb.clone().requires_grad_()
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(e, lin, dense)
        logits.float().sum().backward()
        return logits.float(), e.grad, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    fused = run()
    with force_reference():
        plain = run()
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused[1], plain[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(fused[2], plain[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_dense_of_another_batch_is_refused_not_read_past():
    emb, dense = inputs(4, 3, 2, 5)
    with pytest.raises(ValueError, match="does not match"):
        _DeepFMInput.apply(emb, dense[:2])
    with pytest.raises(RuntimeError):                 # the dispatcher leaves it to torch.cat
        deepfm_input(emb, dense[:2])
