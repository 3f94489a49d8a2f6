"""The seeded fault schedule of a chaos run: the same seed strikes the same faults in the same order.

A schedule is a list of `Fault`s applied one after the other to the trainer
of the moment (a trainer killed by one is restarted, with the same command
line, before the next).  Moments are seconds after the fault before it, or,
on a restarted trainer, after its first new checkpoint (so faults strike a
trainer that is training, not one starting up) -- except the first fault, a
kill during start-up, before any checkpoint can exist.  A kill inside a
checkpoint write waits its moment, then for the next checkpoint being written.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

KILL = "kill"                            # SIGKILL at a random moment
KILL_IN_CHECKPOINT = "kill_in_checkpoint"  # SIGKILL while a checkpoint directory is being written
PAUSE = "pause"                          # SIGSTOP for hold_s (past the session timeout), then SIGCONT
BROKER_RESTART = "broker_restart"        # the broker SIGKILLed, down hold_s, started on its data again
MEMBER_JOIN = "member_join"              # a second member joins the group for hold_s, then leaves
KILL_IN_REBALANCE = "kill_in_rebalance"  # SIGKILL while a second member is joining (a rebalance)
DISK_FULL = "disk_full"                  # the checkpoint disk fills: the trainer stops with an error
KILLS = (KILL, KILL_IN_CHECKPOINT, KILL_IN_REBALANCE)


@dataclass(frozen=True)
class Fault:
    kind: str
    after_s: float                       # after the previous fault (or the trainer's start)
    hold_s: float = 0.0                  # pause / outage / membership length

    def describe(self) -> str:
        hold = f", {self.hold_s:.1f} s" if self.hold_s else ""
        return f"{self.kind} after {self.after_s:.1f} s{hold}"


@dataclass(frozen=True)
class ScheduleSpec:
    """How many faults of each kind; the moments come from the seed."""
    kills: int = 6                       # SIGKILLs in all: `checkpoint_kills` inside checkpoint
    checkpoint_kills: int = 2            # writes, `rebalance_kills` while a member joins
    rebalance_kills: int = 1
    pauses: int = 1
    broker_restarts: int = 1
    member_joins: int = 1
    disk_fulls: int = 0                  # needs root (a size-capped tmpfs for the checkpoints)
    max_gap_s: float = 3.0               # longest wait before a fault (once the attempt trains)
    pause_s: float = 8.0                 # > the session timeout: the group drops the paused member
    outage_s: float = 3.0
    member_s: float = 5.0


def make_schedule(spec: ScheduleSpec, seed: int) -> list[Fault]:
    """The schedule of `seed`: the first fault is a kill during start-up (before any
    checkpoint can exist), the others in a seeded order at seeded moments."""
    rng = random.Random(seed)
    if spec.kills and spec.checkpoint_kills + spec.rebalance_kills > spec.kills - 1:
        raise ValueError("checkpoint_kills + rebalance_kills must leave one plain kill (the start-up one)")
    rest = ([KILL] * (spec.kills - spec.checkpoint_kills - spec.rebalance_kills - 1)
            + [KILL_IN_CHECKPOINT] * spec.checkpoint_kills + [KILL_IN_REBALANCE] * spec.rebalance_kills
            + [PAUSE] * spec.pauses + [BROKER_RESTART] * spec.broker_restarts + [MEMBER_JOIN] * spec.member_joins
            + [DISK_FULL] * spec.disk_fulls)
    rng.shuffle(rest)
    faults = [Fault(KILL, round(rng.uniform(0.3, 2.0), 2))] if spec.kills else []
    holds = {PAUSE: spec.pause_s, BROKER_RESTART: spec.outage_s, MEMBER_JOIN: spec.member_s,
             KILL_IN_REBALANCE: spec.member_s}
    for kind in rest:
        faults.append(Fault(kind, round(rng.uniform(0.5, spec.max_gap_s), 2), holds.get(kind, 0.0)))
    return faults
