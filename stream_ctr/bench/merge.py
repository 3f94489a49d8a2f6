"""`stream-ctr bench merge`: k-step merging of dense replicas, bytes and time per step, AUC.

For each number of ranks and each k, a real job runs on this machine (gloo
on 127.0.0.1, one process per rank, `--threads` torch threads each) over the
same stream: the bundled Criteo sample (or --data), striped over the ranks,
`--epochs` passes, the last `--holdout` fraction held out. Per configuration:

- dense bytes/step: what one rank sends in the merges (ring all-reduce
  estimate of the averaged parameters and, by default, Adam moments);
- sparse bytes/step: what one rank sends in the row all-to-alls (exact);
- ms/step: wall clock of the whole job divided by its steps (rank 0), and
  the part spent in merges;
- test AUC on the holdout after the stream, and its delta to k=1.

A one-replica run with the same global batch (ranks x batch) gives the
synchronous reference AUC. Timings on a machine with fewer cores than ranks
include the ranks competing for cores.
"""
from __future__ import annotations

import argparse
import os
import queue
import socket
import tempfile
import time
from typing import Any

FORKSERVER_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "stream_ctr.distributed.run"]


def add_bench_merge_parser(bsub: argparse._SubParsersAction, add_common) -> None:
    b = bsub.add_parser("merge", help="k-step merging: bytes and ms per step, AUC per k, 2 and 4 ranks",
                        description=__doc__.split("\n\n")[0])
    b.add_argument("--ranks", default="2,4", help="numbers of ranks to run (default 2,4)")
    b.add_argument("--k", default="1,4,16,64", help="merge every k steps (default 1,4,16,64)")
    b.add_argument("--data", default="criteo:sample", help="source (default: the bundled Criteo sample)")
    b.add_argument("--epochs", type=int, default=3, help="passes over the data (default 3)")
    b.add_argument("--batch-size", type=int, default=64, help="micro-batch per rank (default 64)")
    b.add_argument("--holdout", type=float, default=0.2, help="held-out fraction for the AUC")
    b.add_argument("--model", default="deepfm", help="model whose dense part is merged: deepfm, wdl, dcn, dcnv2")
    b.add_argument("--mlp-dims", default="400,400,400", help="model.mlp_dims (default 400,400,400)")
    b.add_argument("--no-moments", action="store_true", help="merge parameters only, not Adam's m, v")
    b.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    add_common(b)
    b.set_defaults(func=cmd_bench_merge)


def cmd_bench_merge(args: argparse.Namespace) -> tuple[dict, str]:
    """The bench command: prints the table; returns (JSON summary, one line) for the CLI to emit."""
    rows = bench_merge(args)
    if not args.json:
        print(format_merge_table(rows))
    return ({"bench": "merge", "cpus": os.cpu_count(), "rows": rows},
         f"bench merge: {len(rows)} configurations measured")


def _config(args: argparse.Namespace, run_dir: str, batch_size: int, k: int):
    from stream_ctr.config import Config, set_option
    cfg = Config()
    cfg.data.source = args.data
    cfg.data.epochs = args.epochs
    cfg.data.batch_size = batch_size
    cfg.data.holdout_fraction = args.holdout
    cfg.model.name = args.model
    set_option(cfg, "model.mlp_dims", args.mlp_dims)
    cfg.train.run_dir = run_dir
    cfg.train.threads = args.threads
    cfg.metrics.timeseries_every_s = 0
    cfg.distributed.merge_every_k_steps = k
    cfg.distributed.merge_moments = not args.no_moments
    return cfg


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, cfg_dict: dict, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        from stream_ctr.config import Config
        from stream_ctr.distributed.run import train_distributed
        s = train_distributed(Config.from_dict(cfg_dict), show_progress=False)
        results.put((rank, s.as_dict(), ""))
    except BaseException as e:          # reported to the parent, which names the rank
        results.put((rank, None, f"{type(e).__name__}: {e}"))


def run_job(cfg, world: int, timeout_s: float = 3600) -> dict:
    """Run `cfg` as a `world`-rank job of local processes; rank 0's summary (blocks)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, cfg.to_dict(), results))
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world:
            try:
                rank, summary, error = results.get(timeout=1.0)
                got[rank] = (summary, error)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"bench merge: ranks {dead or 'all'} failed or timed out")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [f"rank {r}: {e}" for r, (_, e) in sorted(got.items()) if e]
    if errors:
        raise RuntimeError("bench merge: " + "; ".join(errors))
    return got[0][0]


def bench_merge(args: argparse.Namespace) -> list[dict]:
    import sys
    ranks = [int(x) for x in args.ranks.split(",")]
    ks = [int(x) for x in args.k.split(",")]
    rows: list[dict] = []

    def show(row: dict) -> None:
        if not args.quiet:
            print(f"bench merge: {row['ranks']} ranks, {row['config']}: {row['ms_per_step']:.1f} ms/step, "
                  f"test AUC {row['test_auc']:.4f}", file=sys.stderr, flush=True)
    for world in ranks:
        with tempfile.TemporaryDirectory(prefix="bench-merge-") as tmp:
            ref = run_job(_config(args, f"{tmp}/one", world * args.batch_size, 1), 1)
            rows.append(_row(world, 0, ref, synchronous=True))
            show(rows[-1])
            for k in ks:
                s = run_job(_config(args, f"{tmp}/k{k}", args.batch_size, k), world)
                rows.append(_row(world, k, s))
                show(rows[-1])
        base = next(r["test_auc"] for r in rows if r["ranks"] == world and r["k"] == ks[0])
        for r in rows:
            if r["ranks"] == world:
                r["auc_delta_vs_first_k"] = r["test_auc"] - base
    return rows


def _row(world: int, k: int, s: dict, synchronous: bool = False) -> dict:
    steps = max(int(s.get("steps", s["batches"])), 1)
    return {"ranks": world, "k": k, "config": "1 replica, batch x ranks" if synchronous else f"k={k}",
            "steps": steps, "merges": int(s.get("merges", 0)),
            "dense_bytes_per_step": s.get("merge_sent_bytes", 0) / steps,
            "sparse_bytes_per_step": s.get("exchange_sent_bytes", 0) / max(world, 1) / steps,
            "ms_per_step": 1000 * s["seconds"] / steps,
            "merge_ms_per_step": 1000 * s.get("merge_seconds", 0.0) / steps,
            "records": int(s["records_trained"]), "test_auc": float(s["test_auc"]),
            "test_logloss": float(s["test_logloss"])}


def format_merge_table(rows: list[dict]) -> str:
    head = (f"{'ranks':>5} {'config':<24} {'steps':>5} {'merges':>6} {'dense KB/step':>13} "
            f"{'sparse KB/step':>14} {'ms/step':>8} {'merge ms/step':>13} {'test AUC':>8} {'dAUC vs k=1':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['ranks']:>5} {r['config']:<24} {r['steps']:>5} {r['merges']:>6} "
                     f"{r['dense_bytes_per_step'] / 1e3:>13.1f} {r['sparse_bytes_per_step'] / 1e3:>14.1f} "
                     f"{r['ms_per_step']:>8.1f} {r['merge_ms_per_step']:>13.2f} {r['test_auc']:>8.4f} "
                     f"{r.get('auc_delta_vs_first_k', float('nan')):>+11.4f}")
    lines.append(f"(per rank; dense = ring all-reduce estimate of the merges; {os.cpu_count()} CPUs, "
                 "ranks share them)")
    return "\n".join(lines)
