"""Tests for stream_ctr.models.networks: shapes, gradients, FM / cross formulas, sizes, L2 groups."""
from __future__ import annotations

import math

import pytest
import torch

from stream_ctr.config import MODELS, ModelConfig
from stream_ctr.models.networks import (DCN, CrossNet, CrossNetMix, CTRModel, DCNv2, DeepFM, LogisticRegression,
                               WideDeep, build_model, fm_term)

F, D, N_DENSE = 39, 10, 13  # Criteo


def inputs(b: int, f: int = F, d: int = D, n_dense: int = N_DENSE, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, f, d, generator=g) * 0.1, torch.randn(b, f, generator=g) * 0.1,
            torch.rand(b, n_dense, generator=g))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1235)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("n_dense", [N_DENSE, 0])
@pytest.mark.parametrize("b", [1, 5])
def test_builds_with_defaults_and_returns_b_logits(name, n_dense, b):
    model = build_model(ModelConfig(name=name), F, n_dense)
    assert isinstance(model, CTRModel)
    out = model(*inputs(b, n_dense=n_dense))
    assert out.shape == (b,) and out.dtype == torch.float32
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", MODELS)
def test_samples_are_independent(name):
    model = build_model(ModelConfig(name=name), F, N_DENSE)
    emb, lin, dense = inputs(5)
    batched = model(emb, lin, dense)
    single = torch.cat([model(emb[i:i + 1], lin[i:i + 1], dense[i:i + 1]) for i in range(5)])
    torch.testing.assert_close(batched, single, rtol=1e-5, atol=1e-6)


def test_model_classes():
    classes = {n: type(build_model(ModelConfig(name=n), F, N_DENSE)) for n in MODELS}
    assert classes == {"deepfm": DeepFM, "wdl": WideDeep, "dcn": DCN, "dcnv2": DCNv2, "lr": LogisticRegression}
    with pytest.raises(ValueError, match="model.name"):
        build_model(ModelConfig(name="xdeepfm"), F, N_DENSE)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("n_dense", [N_DENSE, 0])
def test_gradients_reach_inputs_and_every_parameter(name, n_dense):
    model = build_model(ModelConfig(name=name), F, n_dense)
    emb, lin, dense = (t.requires_grad_() for t in inputs(16, n_dense=n_dense))
    weights = torch.randn(16)
    (model(emb, lin, dense) * weights).sum().backward()
    for label, t in [("emb", emb), ("lin", lin)] + ([("dense", dense)] if n_dense else []):
        if name == "lr" and label != "lin":
            # The baseline has no interaction (emb takes no part), and dense reaches the
            # logit only through the numeric kernel, which starts at zero.
            assert t.grad is None or not t.grad.any(), label
            continue
        assert t.grad is not None and t.grad.abs().sum() > 0, label
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, pname


def test_logistic_regression_is_the_linear_part_alone():
    model = build_model(ModelConfig(name="lr"), F, N_DENSE)
    emb, lin, dense = inputs(4)
    with torch.no_grad():
        model.linear.bias.fill_(-0.5)
        torch.testing.assert_close(model(emb, lin, dense),
                                   lin.sum(1) + dense @ model.linear.kernel.weight[0] - 0.5)
        torch.testing.assert_close(model(emb * 7, lin, dense), model(emb, lin, dense))


def test_linear_part_is_sum_of_lin_plus_dense_kernel_plus_bias():
    model = build_model(ModelConfig(name="wdl"), F, N_DENSE)
    emb, lin, dense = inputs(4)
    with torch.no_grad():
        model.linear.bias.fill_(0.25)
        expected = lin.sum(1) + dense @ model.linear.kernel.weight[0] + 0.25
        deep = model.out(model.dnn(torch.cat([emb.flatten(1), dense], 1)))[:, 0]
        torch.testing.assert_close(model(emb, lin, dense), expected + deep)


def test_fm_term_matches_naive_pair_loop():
    emb = torch.randn(3, 5, 4, dtype=torch.float64)
    naive = torch.zeros(3, dtype=torch.float64)
    for b in range(3):
        for i in range(5):
            for j in range(i + 1, 5):
                naive[b] += (emb[b, i] * emb[b, j]).sum()
    torch.testing.assert_close(fm_term(emb), naive)


def test_fm_term_gradient_is_autograds_of_the_pair_sum():
    """The hand-written backward against autograd through the plain expression, and
    torch's numerical gradcheck; the weights of the upstream gradient differ per row."""
    emb = torch.randn(6, 5, 4, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(6, dtype=torch.float64)
    (fm_term(emb) * weights).sum().backward()
    plain = emb.detach().clone().requires_grad_()
    s = plain.sum(dim=1)
    (0.5 * (s.square() - plain.square().sum(dim=1)).sum(dim=1) * weights).sum().backward()
    torch.testing.assert_close(emb.grad, plain.grad)
    assert torch.autograd.gradcheck(fm_term, (emb.detach().clone().requires_grad_(),))


def test_deepfm_adds_fm_term_to_wide_deep():
    model = build_model(ModelConfig(name="deepfm"), F, N_DENSE)
    emb, lin, dense = inputs(3)
    with torch.no_grad():
        x0 = torch.cat([emb.flatten(1), dense], 1)
        expected = model.linear(lin, dense) + fm_term(emb) + model.out(model.dnn(x0))[:, 0]
        torch.testing.assert_close(model(emb, lin, dense), expected)


def test_cross_layer_matches_formula():
    net = CrossNet(dim=3, n_layers=1)
    with torch.no_grad():
        net.kernel.copy_(torch.tensor([[1.0, -2.0, 0.5]]))
        net.bias.copy_(torch.tensor([[0.1, 0.2, 0.3]]))
    x0 = torch.tensor([[1.0, 2.0, 4.0]])
    # x0 . w = 1 - 4 + 2 = -1 -> x1 = x0 * (-1) + b + x0 = b
    torch.testing.assert_close(net(x0), torch.tensor([[0.1, 0.2, 0.3]]))
    x0 = torch.tensor([[2.0, 1.0, 2.0]])  # x0 . w = 2 - 2 + 1 = 1 -> x1 = 2 * x0 + b
    torch.testing.assert_close(net(x0), torch.tensor([[4.1, 2.2, 4.3]]))


def test_cross_net_stacks_layers():
    net = CrossNet(dim=6, n_layers=3)
    with torch.no_grad():
        net.bias.normal_()
    x0 = torch.randn(4, 6)
    x = x0
    for w, b in zip(net.kernel, net.bias):
        x = x0 * (x * w).sum(1, keepdim=True) + b + x
    torch.testing.assert_close(net(x0), x)


def test_cross_net_mix_matches_deepctr_per_expert_loop():
    """The batched CrossNetMix equals DeepCTR's literal loop over layers and experts."""
    net = CrossNetMix(dim=7, n_layers=2, low_rank=3, experts=4).double()
    with torch.no_grad():
        net.bias.normal_()
    x0 = torch.randn(5, 7, dtype=torch.float64)
    x = x0
    for i in range(2):
        outs, scores = [], []
        for e in range(4):
            scores.append(x @ net.gating[:, e])
            v = torch.tanh(x @ net.V[i, e])               # V^T x
            v = torch.tanh(v @ net.C[i, e].T)             # C v
            outs.append(x0 * (v @ net.U[i, e].T + net.bias[i]))  # x0 * (U v + b)
        gate = torch.softmax(torch.stack(scores, 1), dim=1)
        x = (torch.stack(outs, 2) * gate.unsqueeze(1)).sum(2) + x
    torch.testing.assert_close(net(x0), x)


def test_parameter_shapes_deepfm_criteo():
    model = build_model(ModelConfig(name="deepfm"), F, N_DENSE)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes == {
        "linear.bias": (),
        "linear.kernel.weight": (1, 13),
        "dnn.0.weight": (400, 403), "dnn.0.bias": (400,),
        "dnn.2.weight": (400, 400), "dnn.2.bias": (400,),
        "dnn.4.weight": (400, 400), "dnn.4.bias": (400,),
        "out.weight": (1, 400),
    }
    assert sum(p.numel() for p in model.parameters()) == 482_814


def test_parameter_counts_all_models():
    counts = {n: sum(p.numel() for p in build_model(ModelConfig(name=n), F, N_DENSE).parameters())
              for n in MODELS}
    dnn = 403 * 400 + 400 + 2 * (400 * 400 + 400)
    assert counts["wdl"] == counts["deepfm"] == 14 + dnn + 400
    assert counts["lr"] == 14                          # the numeric kernel and the bias
    assert counts["dcn"] == 14 + dnn + 2 * 3 * 403 + (403 + 400)
    assert counts["dcnv2"] == (14 + dnn + 3 * 4 * (2 * 403 * 32 + 32 * 32) + 3 * 403
                               + 403 * 4 + (403 + 400))


@pytest.mark.parametrize("name", MODELS)
def test_l2_parameters(name):
    model = build_model(ModelConfig(name=name), F, N_DENSE)
    groups = model.l2_parameters()
    assert set(groups) == {"linear", "cross"}
    assert len(groups["linear"]) == 1 and groups["linear"][0] is model.linear.kernel.weight
    if name in ("deepfm", "wdl", "lr"):
        assert groups["cross"] == []
    elif name == "dcn":
        assert len(groups["cross"]) == 1 and groups["cross"][0] is model.cross.kernel
        assert groups["cross"][0].shape == (3, 403)
    else:
        assert [tuple(p.shape) for p in groups["cross"]] == [(3, 4, 403, 32), (3, 4, 403, 32),
                                                             (3, 4, 32, 32)]
        assert all(a is b for a, b in zip(groups["cross"], [model.cross.U, model.cross.V,
                                                            model.cross.C]))
    params = {id(p) for p in model.parameters()}
    assert all(id(p) in params for g in groups.values() for p in g)
    # no dense features: no linear kernel to regularise
    assert build_model(ModelConfig(name=name), 22, 0).l2_parameters()["linear"] == []


def test_inits():
    model = build_model(ModelConfig(name="dcnv2"), F, N_DENSE)
    assert model.linear.bias.item() == 0.0
    for n, p in model.named_parameters():
        if n.endswith("bias"):
            assert torch.count_nonzero(p) == 0, n
    w = model.dnn[0].weight  # Keras glorot_normal: truncated at 2 sigma, var 2/(fan_in+fan_out)
    std = math.sqrt(2 / (403 + 400))
    assert abs(w.std().item() / std - 1) < 0.02
    assert w.abs().max().item() <= 2 * std / 0.87962566103423978 + 1e-6
    u_std = math.sqrt(2 / (4 * 403 + 4 * 32))  # Keras fans of a [E, D, r] kernel
    assert abs(model.cross.U.std().item() / u_std - 1) < 0.02
    assert abs(model.cross.gating).max().item() <= math.sqrt(6 / 404)


def test_custom_dims():
    cfg = ModelConfig(name="dcnv2", embed_dim=4, mlp_dims=(8, 6), cross_layers=2, low_rank=3,
                      experts=2)
    model = build_model(cfg, 5, 2)
    assert model(*inputs(3, f=5, d=4, n_dense=2)).shape == (3,)
    assert model.out.weight.shape == (1, 22 + 6)
