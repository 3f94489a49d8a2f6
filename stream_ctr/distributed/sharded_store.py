"""Embedding rows sharded over the ranks of a job: one owner per key, exchanged each step.

The trainer's working set and row update with several replicas, as a parameter
server shards sparse rows: the owner of a key is `owner_of(key, world_size)`. Each step

    prepare(keys)   every rank sends the unique keys of its batch to their
                    owners (all-to-all); an owner makes the union resident in
                    its local store (the no-miss invariant holds there) and
                    sends the rows back. `weight` is then this batch's rows
                    [U, d+1], and the slots are 0..U-1.
    update(...)     every rank sends its row gradients and counts back; the
                    owner sums them per key, so the counts are the GLOBAL
                    counts CowClip needs (its clip and lr scale by them) and the
                    gradient is that of the global mean loss, and applies
                    CowClip + Adam once, in its local store.

A row is held and updated by its owner only: never averaged, never held by
two replicas (the gathered `weight` is a read-only copy for one step). Rows
start from `init_rows(key)`, so which rank creates a row does not matter.

Every rank must make the same sequence of calls (they are collectives): a
rank without a batch calls `idle_step()`; a rank whose step was skipped
(non-finite loss: no `update`) calls `settle()`, which sends an empty
contribution. Nothing here survives a crash beyond what the local store
checkpoints: `state_dict()` is this rank's shard.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from stream_ctr.ops.cowclip_adam import ClipStats
from stream_ctr.config import OptimConfig
from stream_ctr.distributed.context import collective
from stream_ctr.store.embedding import EmbeddingStore

# Owner hash: a mix with constants of its own (not KeyIndex's slot hash, not
# init_rows'), reading the high bits. If owners were the low bits of the slot
# hash, every key an owner holds would land on 1/world of its index's slots.
_O1 = -2961201700449640045   # 0xD6E8FEB86659FD93
_O2 = -6884282663029611473   # 0xA0761D6478BD642F


def owner_of(keys: torch.Tensor, world_size: int) -> torch.Tensor:
    """The rank [N] (int64) that owns each key, uniform over 0..world_size-1."""
    x = keys * _O1
    x = x ^ ((x >> 32) & 0xFFFFFFFF)
    x = x * _O2
    x = x ^ ((x >> 29) & ((1 << 35) - 1))
    return ((x >> 33) & 0x7FFFFFFF) % world_size


@dataclass
class _Plan:
    """How the last prepare routed keys; update sends the gradients back along it."""
    order: torch.Tensor         # [U] batch-key index of each key, in send (owner-sorted) order
    send_splits: list[int]      # keys sent to each rank
    recv_splits: list[int]      # keys received from each rank
    inverse: torch.Tensor       # [R] received key -> index into owned
    slots: torch.Tensor         # [Uo] local-store slots of the owned (unique received) keys


@dataclass
class ExchangeStats:
    steps: int = 0
    sent_bytes: int = 0          # to other ranks only (keys, rows, gradients, counts)


class ShardedEmbeddingStore(EmbeddingStore):
    """The EmbeddingStore interface over a job's shards; `local` holds this rank's rows."""

    def __init__(self, local: EmbeddingStore, optim: OptimConfig,
                 group: dist.ProcessGroup | None = None) -> None:
        self.local = local
        # The owner applies updates even in a step this rank skipped, so it needs
        # the optimizer settings outside `update` too.
        self.optim = optim
        self.dim = local.dim
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = local.weight.device
        self.weight = torch.zeros(0, self.dim + 1, device=self.device)
        self.stats = ExchangeStats()
        self._plan: _Plan | None = None

    def __getattr__(self, name: str):
        # Anything else (flush, metrics_snapshot, footprint...) is the local shard's.
        if name == "local":
            raise AttributeError(name)
        return getattr(self.local, name)

    def __len__(self) -> int:
        """Rows of this rank's shard."""
        return len(self.local)

    def observe_event_time(self, event_time_ms: int) -> None:
        self.local.observe_event_time(event_time_ms)

    def close(self) -> None:
        self.local.close()

    # -- the exchange -------------------------------------------------------------------

    def _all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                    what: str) -> torch.Tensor:
        out = send.new_empty((sum(recv_splits),) + tuple(send.shape[1:]))
        with collective(what):
            dist.all_to_all_single(out, send.contiguous(), recv_splits, send_splits, group=self.group)
        row_bytes = send.element_size() * math.prod(send.shape[1:])
        self.stats.sent_bytes += (sum(send_splits) - send_splits[self.rank]) * row_bytes
        return out

    def _route(self, keys: torch.Tensor, what: str) -> tuple[_Plan, torch.Tensor]:
        """Send unique keys to their owners; returns the plan and the keys this rank owns
        among all ranks' batches (unique)."""
        owner = owner_of(keys, self.world)
        order = torch.argsort(owner, stable=True)
        send_splits = torch.bincount(owner, minlength=self.world).to(torch.int64)
        recv_splits = torch.empty_like(send_splits)
        with collective(what):
            dist.all_to_all_single(recv_splits, send_splits, group=self.group)
        send_l, recv_l = send_splits.tolist(), recv_splits.tolist()
        self.stats.sent_bytes += 8 * (self.world - 1)
        received = self._all_to_all(keys[order], send_l, recv_l, what)
        owned, inverse = torch.unique(received, return_inverse=True)
        return _Plan(order, send_l, recv_l, inverse, torch.zeros(0, dtype=torch.int64)), owned

    def _send_back(self, plan: _Plan, owned_rows: torch.Tensor, what: str) -> torch.Tensor:
        """Rows of the owned keys back to the ranks that asked, in their batch-key order."""
        got = self._all_to_all(owned_rows[plan.inverse], plan.recv_splits, plan.send_splits, what)
        out = torch.empty_like(got)
        out[plan.order] = got
        return out

    # -- EmbeddingStore -----------------------------------------------------------------

    def prepare(self, keys: torch.Tensor) -> torch.Tensor:
        """Gather the rows of this batch's unique keys from their owners (collective)."""
        self.settle()
        plan, owned = self._route(keys, "exchanging the working set (sparse prepare)")
        plan.slots = self.local.prepare(owned)
        self.weight = self._send_back(plan, self.local.weight[plan.slots],
                                      "sending embedding rows (sparse prepare)")
        self._plan = plan
        self.stats.steps += 1
        return torch.arange(keys.numel(), device=keys.device)

    def peek(self, keys: torch.Tensor) -> torch.Tensor:
        """Rows for unique keys from their owners, creating nothing (collective)."""
        plan, owned = self._route(keys, "exchanging evaluation keys (sparse peek)")
        return self._send_back(plan, self.local.peek(owned), "sending embedding rows (sparse peek)")

    def update(self, slots: torch.Tensor, grad: torch.Tensor, counts: torch.Tensor,
               step: int, optim: OptimConfig) -> ClipStats:
        """Send this batch's row gradients and counts to the owners; each owner applies
        CowClip + Adam once per key on the sum over ranks (collective).

        `slots` are the ones `prepare` returned (0..U-1); `grad` is the gradient of
        this rank's mean loss. Ranks are weighted by their share of the global
        records (counts sum to records x fields), so the owner's gradient is that
        of the mean loss over all ranks' records.
        """
        plan = self._plan
        if plan is None:
            raise RuntimeError("ShardedEmbeddingStore.update without a prepare")
        if slots.numel() != plan.order.numel():
            raise ValueError(f"update got {slots.numel()} slots, prepare returned {plan.order.numel()}")
        g = torch.empty_like(grad)
        g[slots] = grad
        c = torch.empty_like(counts)
        c[slots] = counts
        self.optim = optim
        return self._push(plan, g[plan.order], c[plan.order], step, int(counts.sum()), True)

    def settle(self) -> ClipStats | None:
        """If the last prepare got no update (skipped step), send an empty contribution
        so the owners' collectives match; other ranks' rows are still updated."""
        if self._plan is None:
            return None
        plan = self._plan
        empty_g = self.weight.new_zeros((0, self.dim + 1))
        empty_c = torch.zeros(0, dtype=torch.int64, device=self.device)
        return self._push(plan, empty_g, empty_c, 0, 0, False)

    def idle_step(self, between: Callable[[], None] | None = None) -> None:
        """Take part in a step without a batch: serve other ranks' keys, update them.
        `between` runs where a training rank's backward would (between the two
        collectives), so that collectives of other groups keep the same order."""
        self.prepare(torch.zeros(0, dtype=torch.int64, device=self.device))
        if between is not None:
            between()
        self.settle()

    def _push(self, plan: _Plan, grad: torch.Tensor, counts: torch.Tensor, step: int,
              weight: int, contributes: bool) -> ClipStats:
        self._plan = None
        what = "sending embedding gradients (sparse update)"
        w = self.world
        send_splits = plan.send_splits if contributes else [0] * w
        # Per destination: [step, this rank's records x fields, rows sent].
        meta = torch.tensor([[step, weight, n] for n in send_splits], dtype=torch.int64,
                            device=self.device)
        recv_meta = torch.empty_like(meta)
        with collective(what):
            dist.all_to_all_single(recv_meta, meta, group=self.group)
        self.stats.sent_bytes += 24 * (w - 1)
        got_splits = recv_meta[:, 2].tolist()
        recv_grad = self._all_to_all(grad, send_splits, got_splits, what)
        recv_cnt = self._all_to_all(counts.to(torch.int64), send_splits, got_splits, what)

        # Owner: weight each sender by its share of the records, sum per owned key.
        share = recv_meta[:, 1].to(torch.float64)
        total = float(share.sum())
        if total == 0.0:
            return ClipStats(torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64), 0)
        scale = (share / total).to(grad.dtype)
        sent = torch.tensor([n > 0 for n in got_splits], device=self.device)
        inverse = plan.inverse[sent.repeat_interleave(torch.tensor(plan.recv_splits, device=self.device))]
        n_owned = plan.slots.numel()
        per_row = scale.repeat_interleave(recv_meta[:, 2])
        g_sum = recv_grad.new_zeros((n_owned, self.dim + 1)).index_add_(0, inverse, recv_grad * per_row[:, None])
        c_sum = torch.zeros(n_owned, dtype=torch.int64, device=self.device).index_add_(0, inverse, recv_cnt)
        slots = plan.slots
        present = c_sum > 0
        if not bool(present.all()):        # keys only a skipped rank asked for: no update
            slots, g_sum, c_sum = slots[present], g_sum[present], c_sum[present]
        return self.local.update(slots, g_sum, c_sum, int(recv_meta[:, 0].max()), self.optim)

    # -- checkpoints: this rank's shard ---------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.local.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        keys = state.get("keys")
        if keys is not None and keys.numel():
            wrong = owner_of(keys.to(torch.int64), self.world) != self.rank
            if bool(wrong.any()):
                raise ValueError(f"rank {self.rank}: {int(wrong.sum())} of the {keys.numel()} rows in "
                                 f"this shard belong to other ranks of a {self.world}-rank job; the "
                                 "shard was written by a job of another size")
        self.local.load_state_dict(state)
