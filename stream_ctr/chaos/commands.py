"""`stream-ctr chaos`: the command line of `harness.run_chaos` (its CI test calls the same code)."""
from __future__ import annotations

import argparse
import json
import random
import sys

from stream_ctr.chaos.schedule import ScheduleSpec

EPILOG = """examples:
  stream-ctr chaos                                   # a random seed, printed first
  stream-ctr chaos --seed 7 --records 100000 --kills 10 --checkpoint-kills 3
  stream-ctr chaos --seed 7 --work-dir /tmp/chaos-7  # keep logs and run dirs where you want them

exit status: 0 when every check holds, 1 when one fails (the seed replays it)."""


def add_chaos_parser(sub: argparse._SubParsersAction, add_common) -> None:
    p = sub.add_parser("chaos", help="train a known stream under a seeded fault schedule and verify "
                       "exactly-once, dead letters and the model", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Start a broker that keeps its data across restarts (tansu on s3:// "
                       "storage with s3rver, 127.0.0.1 only), produce a known stream (good Criteo "
                       "records and malformed messages) into several partitions, train it once "
                       "without faults, then again with the same `stream-ctr train --resume DIR` "
                       "command line while the schedule strikes: SIGKILLs at random moments and "
                       "inside checkpoint writes, SIGSTOP/SIGCONT pauses, broker restarts, a second "
                       "group member joining and leaving. Then verify: every record trained exactly "
                       "once (checkpoint, summary and group offsets), every malformed message "
                       "dead-lettered, the model equal bit for bit to the fault-free run's "
                       "(kafka.deterministic_batches), every checkpoint readable.")
    spec = ScheduleSpec()
    p.add_argument("--seed", type=int, help="seed of the stream and the schedule (default: a random one, printed)")
    p.add_argument("--records", type=int, default=20_000, help="good records to produce")
    p.add_argument("--partitions", type=int, default=3, help="partitions of the topic")
    p.add_argument("--bad-rate", type=float, default=0.01, help="malformed messages per message")
    p.add_argument("--kills", type=int, default=spec.kills, help="SIGKILLs of the trainer in all")
    p.add_argument("--checkpoint-kills", type=int, default=spec.checkpoint_kills,
                   help="... of them inside a checkpoint write")
    p.add_argument("--rebalance-kills", type=int, default=spec.rebalance_kills,
                   help="... of them while a second member joins the group")
    p.add_argument("--pauses", type=int, default=spec.pauses, help="SIGSTOP/SIGCONT pauses")
    p.add_argument("--broker-restarts", type=int, default=spec.broker_restarts,
                   help="broker SIGKILLs, each started again on its data")
    p.add_argument("--member-joins", type=int, default=spec.member_joins,
                   help="times a second group member joins and leaves")
    p.add_argument("--disk-fulls", type=int, default=spec.disk_fulls,
                   help="times the checkpoint disk (a size-capped tmpfs; needs root) fills up")
    p.add_argument("--max-gap", type=float, default=spec.max_gap_s, metavar="SECONDS",
                   help="longest wait before a fault")
    p.add_argument("--produce-seconds", type=float, default=60.0, metavar="SECONDS",
                   help="the stream arrives over this long, while the faults strike (0: all before)")
    p.add_argument("--batch-size", type=int, default=256, help="the trainers' data.batch_size")
    p.add_argument("--checkpoint-every", type=int, default=4, help="the trainers' checkpoint interval, in batches")
    p.add_argument("--store", choices=("memory", "tiered"), default="memory",
                   help="the trainers' embedding store (tiered: LMDB on disk, kills land in its flushes)")
    p.add_argument("--work-dir", default="", help="logs, run directories and broker data (default: a new "
                   "temporary directory, kept)")
    add_common(p)
    p.set_defaults(func=cmd_chaos)


def cmd_chaos(args: argparse.Namespace) -> int:
    # here, not at the top: the harness's verifier loads torch, which `stream-ctr --help` must not
    from stream_ctr.chaos.harness import ChaosConfig, ChaosError, run_chaos
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1_000_000)
    spec = ScheduleSpec(kills=args.kills, checkpoint_kills=args.checkpoint_kills,
                        rebalance_kills=args.rebalance_kills, pauses=args.pauses,
                        broker_restarts=args.broker_restarts, member_joins=args.member_joins,
                        disk_fulls=args.disk_fulls,
                        max_gap_s=args.max_gap)
    cfg = ChaosConfig(seed=seed, records=args.records, partitions=args.partitions, bad_rate=args.bad_rate,
                      batch_size=args.batch_size, checkpoint_every=args.checkpoint_every, schedule=spec,
                      work_dir=args.work_dir, produce_s=args.produce_seconds, store=args.store)

    def say(line: str) -> None:
        if not args.quiet or line.startswith("chaos: seed"):
            print(line, file=sys.stderr, flush=True)
    try:
        report = run_chaos(cfg, say)
    except ChaosError as e:
        print(e, file=sys.stderr, flush=True)
        return 3                # EXIT_DATA: the broker (the source) did not come back
    if args.json:
        print(json.dumps(report.as_dict()), flush=True)
    return 0 if report.ok else 1
