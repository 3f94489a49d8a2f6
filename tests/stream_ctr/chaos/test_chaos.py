"""`stream-ctr chaos` in CI: the schedule's and the verifier's rules, and one seeded run.

The same code as the command (`run_chaos`): 100,000 records into 3
partitions, arriving over 2 minutes while 10 SIGKILLs (one during start-up,
three inside checkpoint writes, one while a second member joins), a
SIGSTOP/SIGCONT pause past the session timeout, a broker restart that keeps
its data, a second group member joining and leaving, and (as root) a full
checkpoint disk strike; malformed messages at 1%. Every check must hold:
exactly once, every malformed message dead-lettered, the model bit-identical to
the fault-free run's, every checkpoint readable. A longer schedule is the
documented command in BENCHMARKS.md; the short schedules are in
test_chaos_short.py (a file of their own, so that they run beside this one).
"""
from __future__ import annotations

import os
import random
from collections import Counter

import numpy as np

from stream_ctr.chaos.harness import ChaosConfig, run_chaos
from stream_ctr.chaos.schedule import (BROKER_RESTART, KILL, KILL_IN_CHECKPOINT, KILL_IN_REBALANCE,
                                       KILLS, MEMBER_JOIN, PAUSE, ScheduleSpec, make_schedule)
from stream_ctr.chaos.stream import BAD_KINDS, malformed, sample_lines
from stream_ctr.chaos.verify import dead_letters_check, positions_check
from stream_ctr.connectors.formats import FORMATS
from stream_ctr.connectors.kafka.decode import decode_messages

SEED = 1811


def test_the_schedule_is_a_function_of_the_seed():
    spec = ScheduleSpec(kills=6, checkpoint_kills=2)
    a, b = make_schedule(spec, SEED), make_schedule(spec, SEED)
    assert a == b and a != make_schedule(spec, SEED + 1)
    kinds = [f.kind for f in a]
    assert kinds[0] == KILL                       # during start-up
    assert sum(k in KILLS for k in kinds) == 6 and kinds.count(KILL_IN_CHECKPOINT) == 2
    assert {PAUSE, MEMBER_JOIN, BROKER_RESTART, KILL_IN_REBALANCE} <= set(kinds)


def test_every_malformed_kind_is_rejected_never_trained():
    lines, rng = sample_lines(), random.Random(SEED)
    for kind in BAD_KINDS:
        values = [malformed(kind, lines[rng.randrange(len(lines))], rng) for _ in range(50)]
        n = len(values)
        decoded = decode_messages(values, np.zeros(n, np.int32), np.arange(n), np.zeros(n, np.int64),
                                  ("t/0",), FORMATS["criteo"], "text")
        assert len(decoded.batch) == 0, kind
        assert sorted(r.offset for r in decoded.rejected) == list(range(n)), kind    # one each


def test_the_verifier_compares_offsets_however_they_are_keyed():
    ends = {"t/0": 1500, "t/1": 1500}
    assert positions_check({"t/0": 1500, "t/1": 1500, "t/1#given_up": 1}, ends).ok
    assert not positions_check({"t/0": 1500, "t/1": 1499, "t/1#given_up": 1}, ends).ok
    assert not positions_check({"t/0": 1500, "t/1": 1500, "t/1#rows_done": 3}, ends).ok     # a message in part
    assert not positions_check({"t/0": 1500}, ends).ok


def test_the_verifier_fails_a_malformed_message_dead_lettered_twice():
    bad = {(0, 7): "json", (1, 3): "truncated"}
    assert dead_letters_check(bad, Counter({(0, 7): 1, (1, 3): 1})).ok
    twice = dead_letters_check(bad, Counter({(0, 7): 2, (1, 3): 1}))
    assert not twice.ok and "1 dead-lettered more than once" in twice.detail
    assert not dead_letters_check(bad, Counter({(0, 7): 1})).ok                   # one missing
    assert not dead_letters_check(bad, Counter({(0, 7): 1, (1, 3): 1, (0, 8): 1})).ok   # a good one


def test_a_seeded_chaos_run_verifies_exactly_once_and_the_fault_free_model(tmp_path):
    cfg = ChaosConfig(seed=SEED, records=100_000, partitions=3, bad_rate=0.01, produce_s=120.0,
                      # A full checkpoint disk needs a tmpfs mounted: root only (CI runs as root).
                      schedule=ScheduleSpec(kills=10, checkpoint_kills=3, rebalance_kills=1, pauses=1,
                                            broker_restarts=1, member_joins=1,
                                            disk_fulls=int(os.geteuid() == 0)),
                      work_dir=str(tmp_path / "chaos"))
    lines: list[str] = []
    report = run_chaos(cfg, lines.append)
    log = "\n".join(lines)
    assert report.ok, log
    assert f"seed {SEED}" in lines[0]
    kinds = [f["fault"] for f in report.faults]
    assert sum(k in KILLS for k in kinds) == 10
    assert sum(bool(f.get("inside_checkpoint_write")) for f in report.faults) >= 1, log
    assert report.faults[0]["checkpointed_records"] is None        # killed before any checkpoint
    assert report.attempts >= 11
    assert sum(report.bad_messages.values()) > 0
