"""CTR models (DeepFM, Wide&Deep, DCN, DCNv2) over externally stored embeddings.

Contract
--------
Embeddings are NOT parameters of these modules. The trainer gathers, per
sample and field, a d-dim embedding and a 1-dim linear weight from an external
table and calls::

    model(emb: float32[B, F, d], lin: float32[B, F], dense: float32[B, n_dense])
        -> logits float32[B]

`n_dense` may be 0 (Avazu); pass a [B, 0] tensor then. The logits are raw
(no sigmoid). Every model is

    logit = sum_f lin[:, f] + dense @ w_lin + bias  +  model-specific term

where `w_lin` (no bias, absent when n_dense == 0) is the numeric-feature
linear kernel and `bias` a global scalar (init 0).

`CTRModel.l2_parameters()` names the tensors that carry an L2 penalty in the
CowClip repo (reference/cowclip.md 2.3): "linear" -> [w_lin] (scaled l2, same
as the embedding tables), "cross" -> the cross-net kernels (DCN: w_l; DCNv2:
U, V, C; fixed 1e-5). DNN weights, biases, the output layer and the DCNv2
gating carry no L2.

Inits follow the CowClip repo / DeepCTR (reference/cowclip.md 2.2): Keras
`glorot_normal` (a normal truncated at 2 sigma, rescaled so its variance is
2 / (fan_in + fan_out), Keras fan rules for 3-D kernels) for every kernel,
zeros for biases, Keras `glorot_uniform` for the DCNv2 gating (a default
`Dense`). Unlike TF with a fixed seed, layers of equal shape do not start
identical.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .config import ModelConfig

__all__ = ["CTRModel", "DeepFM", "WideDeep", "DCN", "DCNv2", "build_model",
           "MLP", "CrossNet", "CrossNetMix", "fm_term", "glorot_normal_"]

_TRUNC_STD = 0.87962566103423978  # std of N(0, 1) truncated to [-2, 2]


def glorot_normal_(t: Tensor, fan_in: int, fan_out: int) -> Tensor:
    """Keras `glorot_normal` in place: truncated normal, variance 2/(fan_in+fan_out)."""
    std = math.sqrt(2.0 / (fan_in + fan_out)) / _TRUNC_STD
    with torch.no_grad():
        return nn.init.trunc_normal_(t, 0.0, std, -2.0 * std, 2.0 * std)


def _dense(n_in: int, n_out: int, bias: bool) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=bias)
    glorot_normal_(layer.weight, n_in, n_out)
    if bias:
        nn.init.zeros_(layer.bias)
    return layer


def fm_term(emb: Tensor) -> Tensor:
    """FM 2nd-order term: 0.5 * sum_d((sum_f e)^2 - sum_f e^2); [B, F, d] -> [B]."""
    s = emb.sum(dim=1)
    return 0.5 * (s.square() - emb.square().sum(dim=1)).sum(dim=1)


class MLP(nn.Sequential):
    """Linear+ReLU per entry of `dims` (ReLU on the last one too), no dropout/BN."""

    def __init__(self, n_in: int, dims: tuple[int, ...]):
        layers: list[nn.Module] = []
        for n_out in dims:
            layers += [_dense(n_in, n_out, bias=True), nn.ReLU()]
            n_in = n_out
        super().__init__(*layers)
        self.out_features = n_in


class LinearLogit(nn.Module):
    """sum_f lin + dense @ kernel + global bias -> [B]."""

    def __init__(self, n_dense: int):
        super().__init__()
        self.kernel = _dense(n_dense, 1, bias=False) if n_dense > 0 else None
        self.bias = nn.Parameter(torch.zeros(()))

    def forward(self, lin: Tensor, dense: Tensor) -> Tensor:
        out = lin.sum(dim=1) + self.bias
        if self.kernel is not None:
            out = out + self.kernel(dense).squeeze(1)
        return out


class CrossNet(nn.Module):
    """DCN cross network, vector parameterisation:
    x_{l+1} = x0 * (x_l . w_l) + b_l + x_l; kernels [L, D] and biases [L, D]."""

    def __init__(self, dim: int, n_layers: int):
        super().__init__()
        self.kernel = nn.Parameter(torch.empty(n_layers, dim))
        self.bias = nn.Parameter(torch.zeros(n_layers, dim))
        for w in self.kernel:  # each layer's kernel is a Keras (dim, 1) kernel
            glorot_normal_(w, dim, 1)

    def forward(self, x0: Tensor) -> Tensor:
        x = x0
        for w, b in zip(self.kernel, self.bias):
            x = x0 * (x @ w).unsqueeze(1) + b + x
        return x


class CrossNetMix(nn.Module):
    """DCN-V2 mixture of low-rank cross experts (DeepCTR's CrossNetMix):
    x_{l+1} = sum_e g_e(x_l) * x0 * (U_le tanh(C_le tanh(V_le^T x_l)) + b_l) + x_l,
    g = softmax(x_l @ G) with the gating G [D, E] shared by all layers, as in DeepCTR.

    U, V: [L, E, D, r]; C: [L, E, r, r]; b: [L, D]. The experts are batched:
    because softmax weights sum to 1, sum_e g_e x0 (u_e + b) = x0 (sum_e g_e u_e + b),
    and sum_e g_e U_e v_e is one [B, E*r] x [E*r, D] matmul.
    """

    def __init__(self, dim: int, n_layers: int, low_rank: int, experts: int):
        super().__init__()
        L, E, D, r = n_layers, experts, dim, low_rank
        self.U = nn.Parameter(torch.empty(L, E, D, r))
        self.V = nn.Parameter(torch.empty(L, E, D, r))
        self.C = nn.Parameter(torch.empty(L, E, r, r))
        self.bias = nn.Parameter(torch.zeros(L, D))
        self.gating = nn.Parameter(torch.empty(D, E))
        for U, V, C in zip(self.U, self.V, self.C):  # Keras fans of 3-D kernels: x E
            glorot_normal_(U, E * D, E * r)
            glorot_normal_(V, E * D, E * r)
            glorot_normal_(C, E * r, E * r)
        bound = math.sqrt(6.0 / (D + 1))  # glorot_uniform of E separate Dense(1) kernels
        nn.init.uniform_(self.gating, -bound, bound)

    def forward(self, x0: Tensor) -> Tensor:
        B = x0.shape[0]
        L, E, D, r = self.U.shape
        x = x0
        for U, V, C, b in zip(self.U, self.V, self.C, self.bias):
            g = torch.softmax(x @ self.gating, dim=1)                       # [B, E]
            v = torch.tanh(x @ V.permute(1, 0, 2).reshape(D, E * r))      # [B, E*r]
            v = torch.tanh(torch.einsum("bek,ejk->bej", v.view(B, E, r), C))
            v = (v * g.unsqueeze(2)).reshape(B, E * r)
            u = v @ U.permute(0, 2, 1).reshape(E * r, D)                   # [B, D]
            x = x0 * (u + b) + x
        return x


class CTRModel(nn.Module):
    """Base class: forward(emb [B,F,d], lin [B,F], dense [B,n_dense]) -> logits [B].

    Subclasses add `interaction(emb, dense) -> [B]` to the shared linear logit.
    """

    def __init__(self, n_fields: int, embed_dim: int, n_dense: int):
        super().__init__()
        self.n_fields, self.embed_dim, self.n_dense = n_fields, embed_dim, n_dense
        self.in_features = n_fields * embed_dim + n_dense  # width of x0 / DNN input
        self.linear = LinearLogit(n_dense)

    def x0(self, emb: Tensor, dense: Tensor) -> Tensor:
        """DNN / cross input: concat(emb.flatten(1), dense) -> [B, F*d + n_dense]."""
        flat = emb.flatten(1)
        return torch.cat([flat, dense], dim=1) if self.n_dense else flat

    def interaction(self, emb: Tensor, dense: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, emb: Tensor, lin: Tensor, dense: Tensor) -> Tensor:
        return self.linear(lin, dense) + self.interaction(emb, dense)

    def cross_kernels(self) -> list[nn.Parameter]:
        return []

    def l2_parameters(self) -> dict[str, list[nn.Parameter]]:
        """{"linear": [numeric-feature kernel] (empty if n_dense == 0),
        "cross": cross-net kernels (empty for deepfm / wdl)}."""
        kernel = self.linear.kernel
        return {"linear": [kernel.weight] if kernel is not None else [],
                "cross": self.cross_kernels()}


class WideDeep(CTRModel):
    """Wide & Deep ("wdl"): linear + Dense(1, no bias) over DNN(x0)."""

    def __init__(self, cfg: ModelConfig, n_fields: int, n_dense: int):
        super().__init__(n_fields, cfg.embed_dim, n_dense)
        self.dnn = MLP(self.in_features, tuple(cfg.mlp_dims))
        self.out = _dense(self.dnn.out_features, 1, bias=False)

    def interaction(self, emb: Tensor, dense: Tensor) -> Tensor:
        return self.out(self.dnn(self.x0(emb, dense))).squeeze(1)


class DeepFM(WideDeep):
    """DeepFM: linear + FM 2nd-order term over emb + Dense(1, no bias) over DNN(x0)."""

    def interaction(self, emb: Tensor, dense: Tensor) -> Tensor:
        return fm_term(emb) + super().interaction(emb, dense)


class DCN(CTRModel):
    """DCN: linear + Dense(1, no bias) over concat(CrossNet(x0), DNN(x0))."""

    def __init__(self, cfg: ModelConfig, n_fields: int, n_dense: int):
        super().__init__(n_fields, cfg.embed_dim, n_dense)
        self.cross = self.make_cross(cfg)
        self.dnn = MLP(self.in_features, tuple(cfg.mlp_dims))
        self.out = _dense(self.in_features + self.dnn.out_features, 1, bias=False)

    def make_cross(self, cfg: ModelConfig) -> nn.Module:
        return CrossNet(self.in_features, cfg.cross_layers)

    def cross_kernels(self) -> list[nn.Parameter]:
        return [self.cross.kernel]

    def interaction(self, emb: Tensor, dense: Tensor) -> Tensor:
        x0 = self.x0(emb, dense)
        return self.out(torch.cat([self.cross(x0), self.dnn(x0)], dim=1)).squeeze(1)


class DCNv2(DCN):
    """DCN-V2 ("dcnv2", DeepCTR's DCNMix): DCN with CrossNetMix."""

    def make_cross(self, cfg: ModelConfig) -> nn.Module:
        return CrossNetMix(self.in_features, cfg.cross_layers, cfg.low_rank, cfg.experts)

    def cross_kernels(self) -> list[nn.Parameter]:
        return [self.cross.U, self.cross.V, self.cross.C]


MODEL_CLASSES: dict[str, type[CTRModel]] = {
    "deepfm": DeepFM, "wdl": WideDeep, "dcn": DCN, "dcnv2": DCNv2}


def build_model(cfg: ModelConfig, n_fields: int, n_dense: int) -> CTRModel:
    """The model named by cfg.name, for n_fields embedded fields and n_dense numeric ones."""
    if cfg.name not in MODEL_CLASSES:
        raise ValueError(f"model.name must be one of {', '.join(MODEL_CLASSES)}, got {cfg.name!r}")
    if n_fields < 1 or n_dense < 0:
        raise ValueError(f"need n_fields >= 1 and n_dense >= 0, got {n_fields}, {n_dense}")
    return MODEL_CLASSES[cfg.name](cfg, n_fields, n_dense)
