"""`stream-ctr chaos` in CI: the short schedules (the long one is in test_chaos.py).

A small one (2 partitions, 3,000 records, 3 kills, one inside a checkpoint
write) is the schedule an operator saw fail on 0.13.0: the verifier compared the
checkpoint's position keys, and a partition given up in the rebalance a restart
causes keeps a ``#given_up`` key beside its offset. The other ends its stream
long before its schedule, so its last fault must strike a new attempt.
"""
from __future__ import annotations

import os

import pytest

from stream_ctr.chaos.harness import ChaosConfig, run_chaos
from stream_ctr.chaos.schedule import DISK_FULL, KILL_IN_CHECKPOINT, KILLS, ScheduleSpec, make_schedule

SEED = 1811


def test_a_small_two_partition_schedule_passes(tmp_path):
    """2 partitions, 3,000 records, 3 kills (one during start-up, one inside a checkpoint
    write): every check holds, dead letters exactly once included."""
    cfg = ChaosConfig(seed=SEED, records=3_000, partitions=2, bad_rate=0.01, produce_s=30.0,
                      batch_size=64, checkpoint_every=2,
                      schedule=ScheduleSpec(kills=3, checkpoint_kills=1, rebalance_kills=0, pauses=0,
                                            broker_restarts=0, member_joins=0),
                      work_dir=str(tmp_path / "chaos"))
    lines: list[str] = []
    report = run_chaos(cfg, lines.append)
    log = "\n".join(lines)
    assert report.ok, log
    assert [f["fault"] for f in report.faults].count(KILL_IN_CHECKPOINT) == 1
    assert sum(f["fault"] in KILLS for f in report.faults) == 3
    assert sum(bool(f.get("inside_checkpoint_write")) for f in report.faults) == 1, log
    assert {c.name for c in report.checks} >= {"exactly once (positions)", "dead letters (exactly once)"}
    assert report.attempts >= 4 and sum(report.bad_messages.values()) > 0


@pytest.mark.skipif(os.geteuid() != 0, reason="a full checkpoint disk needs a tmpfs mounted (root)")
def test_a_fault_after_the_trainer_stopped_idle_strikes_a_new_attempt(tmp_path):
    """The stream ends long before the schedule does: a trainer that found nothing more to
    train stops on its own, and the full disk at the end (seed 0) must still strike a
    running trainer and stop it with one clear error. It once struck nothing, and the
    verifier failed the trainer for it (seed 1811 of the test above, on a fast machine)."""
    spec = ScheduleSpec(kills=4, checkpoint_kills=0, rebalance_kills=0, pauses=0, broker_restarts=0,
                        member_joins=0, disk_fulls=1)
    assert [f.kind for f in make_schedule(spec, 0)][-1] == DISK_FULL
    cfg = ChaosConfig(seed=0, records=3_000, partitions=2, produce_s=1.0, stop_when_idle_s=2.0,
                      schedule=spec, work_dir=str(tmp_path / "chaos"))
    lines: list[str] = []
    report = run_chaos(cfg, lines.append)
    log = "\n".join(lines)
    assert report.ok, log
    assert report.faults[-1]["exit"] == 4, log
    # More attempts than the faults account for (the first, one per kill, one after the
    # full disk): the harness started the trainers that had stopped idle.
    assert report.attempts > 1 + 4 + 1, log
