"""Embedding rows keyed by 64-bit feature signs, and the store interface.

A row holds `dim + 1` float32 values: the d-dim embedding the interaction
layers use, then the 1-dim "linear" weight of the same sign (one lookup serves
both). Each row has Adam moments of the same shape. CowClip clips only the
first `dim` columns: the linear weight is a scalar per
feature, which the paper's column-wise clip leaves alone.

A new row's initial values are a pure function of (key, seed): the same key
starts from the same embedding whatever tier, replica or arrival order created
it. That is what makes training with tiny caches, or with several replicas,
give the same numbers as one big table.

`EmbeddingStore` is the contract the trainer uses; `InMemoryEmbeddingStore`
implements it with growable tensors; the tiered store (device cache, host RAM,
LMDB) implements the same methods.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from stream_ctr.ops.cowclip_adam import ClipStats, cowclip_adam_
from stream_ctr.config import ModelConfig, OptimConfig
from stream_ctr.store.key_index import KeyIndex

_C1 = -7046029254386353131   # 0x9E3779B97F4A7C15
_C2 = -4658895280553007687   # 0xBF58476D1CE4E5B9
_C3 = -7723592293110705685   # 0x94D049BB133111EB


def _mix64(x: torch.Tensor) -> torch.Tensor:
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _C2
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _C3
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def init_rows(keys: torch.Tensor, dim: int, std: float, seed: int) -> torch.Tensor:
    """Initial rows [len(keys), dim + 1]: N(0, std) embedding (Box-Muller on a
    counter-based hash of key, seed and column), linear weight 0."""
    n = keys.numel()
    out = torch.zeros(n, dim + 1, dtype=torch.float32, device=keys.device)
    if n == 0:
        return out
    salt = (seed * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    salt = salt - (1 << 64) if salt >= 1 << 63 else salt      # as a signed int64
    cols = torch.arange(2 * ((dim + 1) // 2), device=keys.device, dtype=torch.int64)
    h = _mix64((keys.view(-1, 1) ^ salt) * _C1 + cols.view(1, -1) * _C2)
    # 24 random bits -> uniform in (0, 1], exact in float32
    u = (((h >> 8) & ((1 << 24) - 1)).to(torch.float32) + 1.0) / float(1 << 24)
    u1, u2 = u[:, 0::2], u[:, 1::2]
    radius = torch.sqrt(-2.0 * torch.log(u1))
    normal = torch.cat([radius * torch.cos(2 * math.pi * u2), radius * torch.sin(2 * math.pi * u2)], 1)
    out[:, :dim] = normal[:, :dim] * std
    return out


def update_options(optim: OptimConfig) -> dict:
    """`cowclip_adam_` keywords from the run's optimizer settings (every store uses these).
    A plain OptimConfig (not resolved by config.resolve_optim) clips in mean units and
    gives every row lr_embed."""
    return dict(lr=optim.lr_embed, l2=optim.l2, clip_r=optim.cowclip_r, clip_zeta=optim.cowclip_zeta,
                beta1=optim.beta1, beta2=optim.beta2, eps=optim.eps, cowclip=optim.cowclip,
                clip_scale=getattr(optim, "clip_scale", 1.0),
                count_lr_s=getattr(optim, "count_lr_s", 1.0))


class EmbeddingStore(ABC):
    """Rows of `dim + 1` floats with Adam moments, addressed by slots.

    `prepare(keys)` makes every key of a batch resident and returns its slot
    (the no-miss invariant: nothing is fetched during the step). Slots stay
    valid until the next `prepare`. `weight` is indexed by slot; `update`
    applies CowClip + Adam to the given slots and marks them dirty.
    """

    dim: int
    weight: torch.Tensor

    @abstractmethod
    def prepare(self, keys: torch.Tensor) -> torch.Tensor:
        """Slots [U] for unique keys [U] (int64); creates absent rows from `init_rows`."""

    @abstractmethod
    def peek(self, keys: torch.Tensor) -> torch.Tensor:
        """Rows [U, dim + 1] for unique keys without creating or moving anything
        (absent keys get their initial values): for evaluation."""

    @abstractmethod
    def update(self, slots: torch.Tensor, grad: torch.Tensor, counts: torch.Tensor,
               step: int, optim: OptimConfig) -> ClipStats:
        """CowClip + Adam on rows `slots` with their summed mean-loss gradient and batch counts."""

    @abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every row with its moments, as CPU tensors (for a checkpoint)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the contents with a `state_dict()`."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of rows held."""

    def observe_event_time(self, event_time_ms: int) -> None:
        """The newest event time of the batch about to be prepared (-1: none); for TTL by time."""

    def close(self) -> None:
        """Release files and threads (a tiered store's LMDB); the store is unusable after."""

    def prefetch(self, keys: torch.Tensor) -> None:
        """Hint: `keys` (unique) are the next batch's working set; a store with slow tiers
        may start fetching them while the current step runs. No effect on any result."""


class InMemoryEmbeddingStore(EmbeddingStore):
    """All rows in one growable tensor on one device; slot == row id."""

    def __init__(self, cfg: ModelConfig, seed: int, device: torch.device | str = "cpu",
                 initial_rows: int = 1 << 16) -> None:
        self.dim = cfg.embed_dim
        self.init_std = cfg.init_std
        self.seed = seed
        self.device = torch.device(device)
        self.index = KeyIndex(2 * initial_rows, self.device)
        self._alloc(initial_rows)

    def _alloc(self, rows: int) -> None:
        def grown(old: torch.Tensor | None) -> torch.Tensor:
            new = torch.zeros(rows, self.dim + 1, dtype=torch.float32, device=self.device)
            if old is not None:
                new[: old.shape[0]] = old
            return new
        self.weight = grown(getattr(self, "weight", None))
        self.exp_avg = grown(getattr(self, "exp_avg", None))
        self.exp_avg_sq = grown(getattr(self, "exp_avg_sq", None))

    def __len__(self) -> int:
        return len(self.index)

    def prepare(self, keys: torch.Tensor) -> torch.Tensor:
        rows, new = self.index.lookup_or_insert(keys)
        n_new = int(new.sum())
        if n_new:
            if len(self.index) > self.weight.shape[0]:
                self._alloc(max(len(self.index), 2 * self.weight.shape[0]))
            # Rows ids of new keys are consecutive, in key order.
            start = len(self.index) - n_new
            self.weight[start:start + n_new] = init_rows(keys[new], self.dim, self.init_std, self.seed)
        return rows

    def peek(self, keys: torch.Tensor) -> torch.Tensor:
        rows = self.index.lookup(keys)
        out = self.weight[rows.clamp(min=0)]
        absent = rows < 0
        if bool(absent.any()):
            out[absent] = init_rows(keys[absent], self.dim, self.init_std, self.seed)
        return out

    def update(self, slots: torch.Tensor, grad: torch.Tensor, counts: torch.Tensor,
               step: int, optim: OptimConfig) -> ClipStats:
        return cowclip_adam_(self.weight, self.exp_avg, self.exp_avg_sq, slots, grad, counts,
                             step=step, clip_dims=self.dim, **update_options(optim))

    def state_dict(self) -> dict[str, torch.Tensor]:
        n = len(self.index)
        # Copies: `.cpu()` of a CPU tensor would be a view of the rows training goes on updating.
        return {"keys": self.index.keys_by_row().cpu(), "weight": self.weight[:n].to("cpu", copy=True),
                "exp_avg": self.exp_avg[:n].to("cpu", copy=True),
                "exp_avg_sq": self.exp_avg_sq[:n].to("cpu", copy=True)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state.get("kind") == "tiered":
            from stream_ctr.config import ConfigError
            raise ConfigError("this checkpoint's embedding rows live in a tiered store "
                              f"({state.get('store_dir')}): resume it with store.kind = tiered")
        keys = state["keys"]
        if state["weight"].shape != (keys.numel(), self.dim + 1):
            raise ValueError(f"embedding state has shape {tuple(state['weight'].shape)}, "
                             f"expected ({keys.numel()}, {self.dim + 1}) for embed_dim {self.dim}")
        self.index = KeyIndex.from_keys(keys, self.device)
        self.weight = self.exp_avg = self.exp_avg_sq = None  # type: ignore[assignment]
        self._alloc(max(keys.numel(), 1024))
        n = keys.numel()
        self.weight[:n] = state["weight"].to(self.device)
        self.exp_avg[:n] = state["exp_avg"].to(self.device)
        self.exp_avg_sq[:n] = state["exp_avg_sq"].to(self.device)
