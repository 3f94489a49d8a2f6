"""CTR models (DeepFM, Wide&Deep, DCN, DCNv2, and logistic regression as a baseline)
over externally stored embeddings.

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
CowClip paper's code: "linear" -> [w_lin] (scaled l2, same
as the embedding tables), "cross" -> the cross-net kernels (DCN: w_l; DCNv2:
U, V, C; fixed 1e-5). DNN weights, biases, the output layer and the DCNv2
gating carry no L2.

Inits follow the CowClip paper's code and DeepCTR: Keras
`glorot_normal` (a normal truncated at 2 sigma, rescaled so its variance is
2 / (fan_in + fan_out), Keras fan rules for 3-D kernels) for every kernel,
zeros for biases, Keras `glorot_uniform` for the DCNv2 gating (a default
`Dense`). Unlike TF with a fixed seed, layers of equal shape do not start
identical.
"""
from __future__ import annotations


import torch
from torch import Tensor, nn

from stream_ctr.config import ModelConfig
from stream_ctr.models.layers import (glorot_normal_, _dense, fm_term, MLP, LinearLogit, CrossNet, CrossNetMix)
from stream_ctr.ops.deepfm_input import deepfm_input
from stream_ctr.ops.dispatch import use_cpu_loop

__all__ = ["CTRModel", "LogisticRegression", "DeepFM", "WideDeep", "DCN", "DCNv2", "build_model",
           "MLP", "CrossNet", "CrossNetMix", "fm_term", "glorot_normal_"]

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


class LogisticRegression(CTRModel):
    """Hashed logistic regression ("lr"): the shared linear logit alone, one weight per
    (field, id) and the numeric kernel. The baseline that says how much a stream's
    clicks depend on interactions: the embedding rows are gathered as for every model
    but take no part, so their gradient is zero and they never move."""

    def __init__(self, cfg: ModelConfig, n_fields: int, n_dense: int):
        super().__init__(n_fields, cfg.embed_dim, n_dense)

    def interaction(self, emb: Tensor, dense: Tensor) -> Tensor:
        return emb.new_zeros(emb.shape[0])


class WideDeep(CTRModel):
    """Wide & Deep ("wdl"): linear + Dense(1, no bias) over DNN(x0)."""

    def __init__(self, cfg: ModelConfig, n_fields: int, n_dense: int):
        super().__init__(n_fields, cfg.embed_dim, n_dense)
        self.dnn = MLP(self.in_features, tuple(cfg.mlp_dims))
        self.out = _dense(self.dnn.out_features, 1, bias=False)

    def interaction(self, emb: Tensor, dense: Tensor) -> Tensor:
        return self.out(self.dnn(self.x0(emb, dense))).squeeze(1)


class DeepFM(WideDeep):
    """DeepFM: linear + FM 2nd-order term over emb + Dense(1, no bias) over DNN(x0).

    Under bf16 autocast on the CPU the FM term and a bf16 x0 come from one compiled
    pass over emb (`ops.deepfm_input`; the same x0 bits as autocast's cast), and the
    backward is one pass too: ~8 passes over [B, F, d] fewer per step. Not under
    torch.compile: dynamo cannot trace the loop (a graph break at each call), and
    inductor fuses those passes itself."""

    def interaction(self, emb: Tensor, dense: Tensor) -> Tensor:
        if (use_cpu_loop(emb) and torch.is_autocast_enabled("cpu")
                and torch.get_autocast_dtype("cpu") == torch.bfloat16
                and not torch.compiler.is_compiling()):
            fm, x0 = deepfm_input(emb, dense)        # dense is [B, 0] without numeric fields
            return fm + self.out(self.dnn(x0)).squeeze(1)
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
    "deepfm": DeepFM, "wdl": WideDeep, "dcn": DCN, "dcnv2": DCNv2, "lr": LogisticRegression}


def build_model(cfg: ModelConfig, n_fields: int, n_dense: int) -> CTRModel:
    """The model named by cfg.name, for n_fields embedded fields and n_dense numeric ones."""
    if cfg.name not in MODEL_CLASSES:
        raise ValueError(f"model.name must be one of {', '.join(MODEL_CLASSES)}, got {cfg.name!r}")
    if n_fields < 1 or n_dense < 0:
        raise ValueError(f"need n_fields >= 1 and n_dense >= 0, got {n_fields}, {n_dense}")
    return MODEL_CLASSES[cfg.name](cfg, n_fields, n_dense)
