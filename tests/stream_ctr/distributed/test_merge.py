"""k-step merging of dense replicas (DenseMerger) with 2 and 4 real gloo ranks.

One spawn per world size runs every check (processes are expensive on a
2-core machine) and returns plain numbers; each test asserts one property.
"""
import hashlib

import pytest
import torch

from tests.stream_ctr.distributed.harness import run_ranks, values

LR = 0.1


def _data(rank: int, step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)


def _model() -> torch.nn.Linear:
    torch.manual_seed(7)
    return torch.nn.Linear(4, 1)


def _grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((x - y).detach().abs().max()) for x, y in zip(a.parameters(), b.parameters()))


def merge_checks(rank: int, world: int) -> dict:
    from stream_ctr.distributed.context import init_distributed
    from stream_ctr.distributed.merge import DenseMerger
    init_distributed(torch.device("cpu"), timeout_s=60)
    out: dict = {}

    # SGD, k=1: the average of the replicas' steps is one SGD step on the averaged gradient.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    merger = DenseMerger(model, opt, k=1, merge_moments=False)
    ref = _model()
    for step in range(3):
        x, y = _data(rank, step)
        _grads(model, x, y)
        opt.step()
        merger.after_step(records=8)
        per_rank = [_grads(ref, *_data(r, step)) for r in range(world)]
        with torch.no_grad():
            for i, p in enumerate(ref.parameters()):
                p -= LR * sum(g[i] for g in per_rank) / world
    out["sgd_max_diff"] = _max_diff(model, ref)
    out["sgd_payload"] = merger.stats.payload_bytes
    out["sgd_param_bytes"] = sum(p.numel() * 4 for p in model.parameters())

    # Adam, k=3: replicas drift apart between merges and are identical right after one.
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    merger = DenseMerger(model, opt, k=3, merge_moments=True)
    digests = []
    for step in range(5):
        _grads(model, *_data(rank, step))
        opt.step()
        merger.after_step(records=8)
        digests.append(_digest(model))
    merger.flush()
    digests.append(_digest(model))
    out["adam_digests"] = digests
    out["adam_merges"] = merger.stats.merges
    out["adam_payload"] = merger.stats.payload_bytes
    out["adam_sent"] = merger.stats.sent_bytes

    # Adam, k=1, with moments, on a loss linear in the parameters (its gradient is the
    # data, whatever the parameters): exp_avg equals synchronous Adam's at every step.
    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.Adam([w], lr=LR)
    merger = DenseMerger(torch.nn.ParameterList([w]), opt, k=1, merge_moments=True)
    w_ref = torch.nn.Parameter(torch.zeros(4))
    opt_ref = torch.optim.Adam([w_ref], lr=LR)
    diffs = []
    for step in range(4):
        w.grad = _data(rank, step)[0].mean(0)
        opt.step()
        merger.after_step(records=8)
        w_ref.grad = sum(_data(r, step)[0].mean(0) for r in range(world)) / world
        opt_ref.step()
        diffs.append(float((opt.state[w]["exp_avg"] - opt_ref.state[w_ref]["exp_avg"]).abs().max()))
    out["moment_diffs"] = diffs
    out["exp_avg_norm"] = float(opt_ref.state[w_ref]["exp_avg"].norm())

    # A replica that trained nothing since the last merge does not pull the others back.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    merger = DenseMerger(model, opt, k=1, merge_moments=False)
    active = rank == 0
    if active:
        _grads(model, *_data(0, 0))
        opt.step()
    merger.after_step(records=8 if active else 0)
    ref = _model()
    _grads(ref, *_data(0, 0))
    with torch.no_grad():
        for p in ref.parameters():
            p -= LR * p.grad
    out["idle_max_diff"] = _max_diff(model, ref)
    out["idle_digest"] = _digest(model)
    return out


def hierarchical_checks(rank: int, world: int) -> dict:
    """4 ranks as 2 nodes x 2: every step the node's replicas agree, every k=2 all agree.
    Inside a node that is synchronous Adam: one Adam on the node's mean gradient."""
    from stream_ctr.distributed.context import init_distributed
    from stream_ctr.distributed.merge import DenseMerger
    init_distributed(torch.device("cpu"), timeout_s=60)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    merger = DenseMerger(model, opt, k=2, merge_moments=True, hierarchical=True, node_size=2)
    node = [rank - rank % 2, rank - rank % 2 + 1]
    sync = _model()                              # synchronous Adam over this node's two ranks
    sync_opt = torch.optim.Adam(sync.parameters(), lr=LR)
    digests, sync_diff = [], None
    for step in range(3):
        records = 8 if not (rank == 1 and step == 0) else 0       # rank 1 idles at first
        if records:
            _grads(model, *_data(rank, step))
        else:
            model.zero_grad(set_to_none=True)
        if merger.reduce_gradients(records):
            opt.step()
        merger.after_step(records)
        digests.append(_digest(model))
        if step == 0:                            # before any cross-node merge
            weights = [0 if (r == 1 and step == 0) else 8 for r in node]
            mean = [sum(w * g for w, g in zip(weights, gs)) / sum(weights)
                    for gs in zip(*[_grads(sync, *_data(r, step)) for r in node])]
            for p, g in zip(sync.parameters(), mean):
                p.grad = g
            sync_opt.step()
            sync_diff = _max_diff(model, sync)
    return {"digests": digests, "sync_diff": sync_diff}


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def merged(request):
    return request.param, values(run_ranks(merge_checks, request.param))


def test_sgd_k1_averaging_equals_synchronous_sgd_on_the_averaged_gradient(merged):
    world, results = merged
    for r in results:
        assert r["sgd_max_diff"] < 1e-6
        assert r["sgd_payload"] == 3 * r["sgd_param_bytes"]        # one merge per step


def test_after_a_merge_all_ranks_hold_identical_dense_parameters(merged):
    world, results = merged
    per_step = list(zip(*(r["adam_digests"] for r in results)))   # [step][rank]
    # steps 1, 2 local (different data -> different replicas), 3 merged, 4, 5 local, flush
    assert len(set(per_step[0])) == world and len(set(per_step[1])) == world
    assert len(set(per_step[2])) == 1
    assert len(set(per_step[3])) == world
    assert len(set(per_step[5])) == 1
    assert all(r["adam_merges"] == 2 for r in results)


def test_merge_traffic_is_counted(merged):
    world, results = merged
    params = results[0]["sgd_param_bytes"]
    for r in results:
        assert r["adam_payload"] == 2 * 3 * params                 # 2 merges of w, m and v
        ring = 2 * (world - 1) * (3 * params) // world
        assert r["adam_sent"] == 2 * (ring + 8 * (world - 1))


def test_first_moment_after_a_k1_merge_with_moments_equals_synchronous_adams(merged):
    world, results = merged
    for r in results:
        assert r["exp_avg_norm"] > 0.01
        assert max(r["moment_diffs"]) < 1e-7


def test_an_idle_replica_does_not_drag_the_average(merged):
    world, results = merged
    assert len({r["idle_digest"] for r in results}) == 1        # everyone holds rank 0's step
    assert all(r["idle_max_diff"] < 1e-7 for r in results)


def test_hierarchical_is_synchronous_inside_a_node_and_merges_across_nodes_every_k():
    results = values(run_ranks(hierarchical_checks, 4, local_world=2))
    digests = [r["digests"] for r in results]
    assert all(r["sync_diff"] < 1e-7 for r in results), [r["sync_diff"] for r in results]
    step1 = [d[0] for d in digests]
    assert step1[0] == step1[1] and step1[2] == step1[3] and step1[0] != step1[2]
    step2 = {d[1] for d in digests}
    assert len(step2) == 1
    step3 = [d[2] for d in digests]
    assert step3[0] == step3[1] and step3[2] == step3[3] and step3[0] != step3[2]


def stalled_node_merge(rank: int, world: int) -> str:
    """Rank 1 hangs (alive) past the merger's timeout while rank 0 reduces the node's gradients.
    The job's own timeout is not that short: with 3 s for everything, the rendezvous, the
    node groups' creation and `agree` also had to fit in 3 s on a loaded machine."""
    import time
    from stream_ctr.distributed.context import DistributedError, agree, init_distributed
    from stream_ctr.distributed.merge import DenseMerger
    init_distributed(torch.device("cpu"), timeout_s=60)
    model = _model()
    merger = DenseMerger(model, torch.optim.Adam(model.parameters()), k=4, merge_moments=False,
                         hierarchical=True, node_size=2, timeout_s=3)
    agree([True])
    if rank == 1:
        time.sleep(10)
    try:
        merger.reduce_gradients(1)
        return "merged"
    except DistributedError:
        return "DistributedError"


def test_a_hung_peer_fails_a_node_merge_within_the_job_timeout():
    """Node groups used to get torch's default timeout (30 min for gloo), not the job's
    (the merger's `timeout_s`, which a run sets to it): rank 0 then simply waited for the
    hung peer and merged."""
    outcomes = run_ranks(stalled_node_merge, 2, timeout_s=90)
    assert outcomes[0].ok and outcomes[0].value == "DistributedError", outcomes[0]
