"""k-step merging of dense replicas (PaddleBox's k-step Adam).

Dense replicas train on their own micro-batches and are averaged every k
steps, weighted by the records each trained since the last merge, by flag
with their Adam moments; `hierarchical` replicas all-reduce gradients inside
a node every step and merge across nodes every k.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from stream_ctr.distributed.context import collective

def ring_allreduce_bytes(payload_bytes: int, n: int) -> int:
    """Bytes one rank sends in a ring all-reduce of `payload_bytes` over n ranks."""
    return 2 * (n - 1) * payload_bytes // n if n > 1 else 0


@dataclass
class MergeStats:
    merges: int = 0              # global (or cross-node) merges
    node_merges: int = 0         # per-step gradient all-reduces inside a node (hierarchical)
    payload_bytes: int = 0       # bytes of the averaged tensors, summed over merges
    sent_bytes: int = 0          # bytes this rank sent (ring all-reduce estimate)
    seconds: float = 0.0


class DenseMerger:
    """k-step model merging of the dense replicas (as PaddleBox merges its dense replicas).

    `after_step(records)` is called by every rank after every lockstep step
    (records = rows it trained, 0 when idle); every k steps it averages the
    dense parameters (and floating buffers, and the averaged weights the run
    evaluates) and, with `merge_moments`, Adam's
    exp_avg / exp_avg_sq, in one flat all-reduce. `flush()` merges now if any
    step happened since the last merge (end of stream, before a checkpoint),
    so every rank then holds the same dense state.

    The average is weighted by the records each replica trained since the
    last merge: with equal micro-batches that is the plain mean PaddleBox
    takes; a replica that sat idle (an exhausted stripe, a quiet Kafka
    partition) does not drag the others back to its stale copy. If nobody
    trained, the plain mean.

    Hierarchical (`node_size` ranks per node, consecutive ranks): inside a node
    the replicas train synchronously -- every step, before the dense optimizer
    steps, `reduce_gradients` replaces each rank's dense gradients by the node's
    records-weighted mean (an all-reduce), so the node's replicas take the same
    Adam step and stay identical (PaddleBox's intra-node data parallelism)
    -- and every k steps the merge runs across nodes,
    between ranks with the same local rank.

    Blocks in collectives; raises DistributedError when a peer is lost.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, k: int,
                 merge_moments: bool, hierarchical: bool = False, node_size: int | None = None,
                 on_merge=None, timeout_s: float | None = None,
                 average: torch.nn.Module | None = None) -> None:
        if k < 1:
            raise ValueError(f"merge every k >= 1 steps, got {k}")
        self.model, self.optimizer, self.k = model, optimizer, k
        # The evaluated average of the dense weights (Trainer.average_model) is merged
        # with them: otherwise each rank would test and export its own replica's average.
        self.average = average
        self.merge_moments = merge_moments
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.on_merge = on_merge            # callable(seconds, sent_bytes), e.g. metrics
        self.stats = MergeStats()
        self.steps_since_merge = 0
        self._records = 0                   # this rank (or its node) since the last merge
        self.node_group = self.cross_group = None
        self._node_records = 0              # hierarchical: this step's records of the node
        if hierarchical:
            self.node_group, self.cross_group = _node_groups(self.world, node_size or self.world,
                                                             timeout_s)
        if merge_moments:
            _init_adam_state(optimizer)

    # -- the tensors that make up a replica ------------------------------------------

    def tensors(self) -> list[torch.Tensor]:
        """Parameters, floating buffers and (by flag) Adam's moments, in a fixed order."""
        out = [p.data for p in self.model.parameters()]
        out += [b for b in self.model.buffers() if b.is_floating_point()]
        if self.average is not None:
            out += [p.data for p in self.average.parameters()]
        if self.merge_moments:
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    st = self.optimizer.state[p]
                    out += [st["exp_avg"], st["exp_avg_sq"]]
        return out

    def payload_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    # -- schedule ---------------------------------------------------------------------

    def reduce_gradients(self, records: int) -> int:
        """Hierarchical only, every rank of a node at every step, after backward and
        before the dense optimizer step: the dense gradients become the node's mean,
        weighted by the records each rank trained (0: idle, or a skipped step, whose
        gradients must not count). Returns the node's records: the optimizer steps
        on every rank of the node when it is > 0, on none when it is 0."""
        params = list(self.model.parameters())
        for p in params:
            if p.grad is None or records == 0:      # idle, skipped (maybe NaN): counts nothing
                p.grad = torch.zeros_like(p)
        self._node_records = self._average(self.node_group, records, [p.grad for p in params],
                                           "averaging the node's dense gradients", node=True)
        return self._node_records

    def after_step(self, records: int) -> None:
        """Count a lockstep step; merge globally (or, hierarchical, across nodes) every
        k steps. Hierarchical: the node's replicas already agree (`reduce_gradients`)."""
        self.steps_since_merge += 1
        if self.node_group is not None:
            self._records += self._node_records
            self._node_records = 0
        else:
            self._records += records
        if self.steps_since_merge >= self.k:
            self.merge()

    def flush(self) -> None:
        """Merge now if any step ran since the last merge (same decision on every rank)."""
        if self.steps_since_merge:
            self.merge()

    def merge(self) -> None:
        group = self.cross_group if self.node_group is not None else None
        self._average(group, self._records, self.tensors(), "merging the dense replicas")
        self._records, self.steps_since_merge = 0, 0

    def broadcast_from(self, src: int = 0) -> None:
        """Make every replica start from rank `src`'s dense state (same seeds should
        already agree; this makes it a fact)."""
        flat = _flatten(self.tensors())
        with collective("broadcasting the initial dense model"):
            dist.broadcast(flat, src)
        _unflatten_into(flat, self.tensors())

    def _average(self, group: dist.ProcessGroup | None, records: int, tensors: list[torch.Tensor],
                 what: str, node: bool = False) -> int:
        """Records-weighted mean of `tensors` over `group` (in place); returns the
        group's records. Counted in `stats` (a node's gradients, or a merge)."""
        n = dist.get_world_size(group)
        if n == 1:
            return records
        t0 = time.perf_counter()
        device = tensors[0].device
        with collective(what):
            total = torch.tensor([float(records)], dtype=torch.float64, device=device)
            dist.all_reduce(total, group=group)
            total_records = float(total.item())
            weight = records / total_records if total_records > 0 else 1.0 / n
            flat = _flatten(tensors)
            if weight != 1.0:
                flat.mul_(weight)
            dist.all_reduce(flat, group=group)
        _unflatten_into(flat, tensors)
        nbytes = flat.numel() * flat.element_size()
        dt = time.perf_counter() - t0
        s = self.stats
        s.payload_bytes += nbytes
        s.sent_bytes += ring_allreduce_bytes(nbytes, n) + 8 * (n - 1)
        s.seconds += dt
        if node:
            s.node_merges += 1
        else:
            s.merges += 1
        if self.on_merge is not None:
            self.on_merge(dt, ring_allreduce_bytes(nbytes, n))
        return int(total_records)


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def _init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create Adam's state (step 0, zero moments) the way Adam's first step would, so
    that a replica that has not stepped yet still has moments to average."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state[p]
            if not st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif "exp_avg" not in st:
                raise ValueError("merge_moments needs an Adam-style optimizer (exp_avg, exp_avg_sq)")


def _node_groups(world: int, node_size: int,
                 timeout_s: float | None = None) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's node group, its cross-node group of equal local ranks). Every rank
    creates every group, in the same order, as torch.distributed requires. New groups
    do not inherit the job's timeout (torch gives them its default, 30 min for gloo):
    `timeout_s` is passed on, so a hung peer fails a node merge as fast as any other."""
    if node_size < 1 or world % node_size:
        raise ValueError(f"hierarchical merge needs the same number of ranks on every node: "
                         f"world size {world} is not a multiple of {node_size} ranks per node")
    nodes = world // node_size
    rank = dist.get_rank()
    with collective("creating the node groups"):
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        node_group, _ = dist.new_subgroups_by_enumeration(
            [[n * node_size + i for i in range(node_size)] for n in range(nodes)], timeout=timeout)
        cross_group, _ = dist.new_subgroups_by_enumeration(
            [[n * node_size + i for n in range(nodes)] for i in range(node_size)], timeout=timeout)
    assert dist.get_rank(node_group) == rank % node_size
    return node_group, cross_group
