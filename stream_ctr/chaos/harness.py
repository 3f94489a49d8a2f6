"""A chaos run: broker, known stream, the run under faults, a fault-free reference, the verdict.

Everything runs on 127.0.0.1: s3rver and tansu on s3:// storage (a broker
restart keeps the log and the committed offsets, `local_s3`), the trainers as
child processes started with one command line that a supervisor would use:
``stream-ctr train kafka://... --resume RUN_DIR ...`` with
`kafka.deterministic_batches` on, so the run under faults must end with the
reference's model bit for bit.  Only processes started here are signalled.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from stream_ctr.chaos.disk import SmallDisk, wait_for_exit
from stream_ctr.chaos.schedule import (BROKER_RESTART, DISK_FULL, KILL, KILL_IN_CHECKPOINT, KILL_IN_REBALANCE,
                                       MEMBER_JOIN, PAUSE, Fault, ScheduleSpec, make_schedule)
from stream_ctr.chaos.stream import StreamProducer
from stream_ctr.chaos.verify import Check, dead_letter_topic, verify_run

# Test-sized group timeouts: tansu admits a member after half the session timeout.
KAFKA_SETTINGS = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000, "reconnect_backoff_max_s": 1.0,
                  "commit_timeout_s": 10.0, "connect_timeout_s": 20.0}
FINISH_TIMEOUT_S = 900.0
CHECKPOINT_WATCH_S = 30.0            # a kill inside a checkpoint write waits this long for one


@dataclass
class ChaosConfig:
    seed: int = 0
    records: int = 20_000
    partitions: int = 3
    bad_rate: float = 0.01           # malformed messages per message produced
    batch_size: int = 256
    checkpoint_every: int = 4        # batches
    stop_when_idle_s: float = 15.0   # longer than a member's stay or an outage: the end of the stream only
    produce_s: float = 60.0          # the stream arrives over this long while the faults strike (0: at once)
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    work_dir: str = ""               # default: a new temporary directory (kept: logs, run dirs)
    threads: int = 1
    store: str = "memory"            # the trainers' store.kind; tiered: kills land in LMDB flushes too
    checkpoint_disk_mib: int = 256   # the tmpfs the checkpoints go to when the schedule fills a disk


@dataclass
class ChaosReport:
    seed: int
    records: int
    partitions: int
    bad_messages: dict[str, int]
    faults: list[dict]               # each fault as applied: kind, moment, what it hit
    attempts: int                    # trainer processes started for the run under faults
    checks: list[Check]
    seconds: float
    work_dir: str

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def as_dict(self) -> dict:
        return {"seed": self.seed, "ok": self.ok, "records": self.records, "partitions": self.partitions,
                "bad_messages": self.bad_messages, "faults": self.faults, "attempts": self.attempts,
                "checks": [c.__dict__ for c in self.checks], "seconds": round(self.seconds, 1),
                "work_dir": self.work_dir}


def trainer_command(cfg: ChaosConfig, bootstrap: str, topic: str, group: str, run_dir: Path,
                    checkpoint_dir: Path | None = None, reference: bool = False) -> list[str]:
    """The one command line that starts and restarts a run (`reference`: the fault-free
    run's, with a dead-letter topic of its own)."""
    cmd = [sys.executable, "-m", "stream_ctr", "train", f"kafka://{bootstrap}/{topic}?group={group}",
           "--resume", str(run_dir), "--batch-size", str(cfg.batch_size),
           "--checkpoint-every", str(cfg.checkpoint_every), "--stop-when-idle", str(cfg.stop_when_idle_s),
           "--threads", str(cfg.threads), "--store", cfg.store, "--set", "model.mlp_dims=32,32",
           "--set", "kafka.deterministic_batches=true", "--set", "data.max_batch_delay_s=1e9",
           "--set", f"kafka.dead_letter_topic={dead_letter_topic(topic, reference)}",
           "--json", "--quiet"]
    for name, value in KAFKA_SETTINGS.items():
        cmd += ["--set", f"kafka.{name}={value}"]
    if checkpoint_dir is not None:
        cmd += ["--set", f"train.checkpoint_dir={checkpoint_dir}"]
    return cmd


class Trainers:
    """Trainer processes of one run directory, one at a time, each with its own log files."""

    def __init__(self, command: list[str], logs: Path, name: str) -> None:
        self.command, self.logs, self.name = command, logs, name
        self.proc: subprocess.Popen | None = None
        self.started = 0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> subprocess.Popen:
        self.started += 1
        out = open(self.logs / f"{self.name}-{self.started}.out", "wb")
        err = open(self.logs / f"{self.name}-{self.started}.err", "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(self.command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
        out.close()
        err.close()
        return self.proc

    def ensure_running(self) -> None:
        if not self.alive:
            self.start()

    def kill(self) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def finish(self, timeout_s: float) -> tuple[int, dict]:
        """Wait for the trainer (starting one if none runs) to end; (exit code, its JSON summary)."""
        self.ensure_running()
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return -1, {}
        lines = (self.logs / f"{self.name}-{self.started}.out").read_text().strip().splitlines()
        try:
            return code, json.loads(lines[-1]) if lines else {}
        except json.JSONDecodeError:
            return code, {}


def checkpointed_records(run_dir: Path) -> int | None:
    """Records in the run's latest checkpoint (None before the first)."""
    latest = run_dir / "checkpoints" / "LATEST"
    try:
        name = latest.read_text().strip()
        return json.loads((run_dir / "checkpoints" / name / "state.json").read_text())["records_trained"]
    except (OSError, ValueError, KeyError):
        return None


def wait_for_progress(trainers: Trainers, run_dir: Path, base: int | None, timeout_s: float = 120.0) -> None:
    """Until the attempt has written a checkpoint past `base` (it is training, not starting)."""
    deadline = time.monotonic() + timeout_s
    while trainers.alive and time.monotonic() < deadline:
        now = checkpointed_records(run_dir)
        if now is not None and (base is None or now > base):
            return
        time.sleep(0.05)


def kill_inside_checkpoint(trainers: Trainers, run_dir: Path) -> bool:
    """SIGKILL the trainer while a checkpoint directory is being written (`.tmp-ckpt-*`
    exists); True if it was caught inside one, False if it was killed without (none
    was written in `CHECKPOINT_WATCH_S`, or it ended first)."""
    root = run_dir / "checkpoints"
    deadline = time.monotonic() + CHECKPOINT_WATCH_S
    while time.monotonic() < deadline and trainers.alive:
        try:
            writing = any(n.startswith(".tmp-ckpt") for n in os.listdir(root))
        except OSError:
            writing = False
        if writing:
            trainers.kill()
            return True
        time.sleep(0.002)
    trainers.kill()
    return False


def idle_member(bootstrap: str, topic: str, group: str, stay_s: float) -> threading.Thread:
    """A second member of the group that joins, takes its share of partitions for
    `stay_s` (fetching, never training nor committing), and leaves."""
    def run() -> None:
        from kafka import KafkaConsumer
        consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                                 session_timeout_ms=KAFKA_SETTINGS["session_timeout_ms"],
                                 heartbeat_interval_ms=KAFKA_SETTINGS["heartbeat_interval_ms"])
        consumer.subscribe([topic])
        joined_by = time.monotonic() + 30.0
        leave_at = None
        while True:
            consumer.poll(timeout_ms=200)
            now = time.monotonic()
            if leave_at is None and (consumer.assignment() or now > joined_by):
                leave_at = now + stay_s
            if leave_at is not None and now >= leave_at:
                break
        consumer.close(autocommit=False)
    thread = threading.Thread(target=run, name="chaos-member", daemon=True)
    thread.start()
    return thread


def fill_disk(trainers: Trainers, disk: SmallDisk, timeout_s: float = 120.0) -> dict:
    """Fill the checkpoint disk until the trainer's next checkpoint fails; what it said."""
    disk.fill()
    try:
        code = wait_for_exit(trainers.proc, timeout_s)
        if code is None:                    # no checkpoint came due (the stream is idle)
            trainers.kill()
        err = (trainers.logs / f"{trainers.name}-{trainers.started}.err").read_text(errors="replace")
        lines = [line for line in err.splitlines() if "cannot write checkpoint" in line]
        return {"exit": code, "error": lines[-1][:400] if lines else "",
                "clear_error": code == 4 and bool(lines) and str(disk.path) in lines[-1] and "MiB" in lines[-1]}
    finally:
        disk.free()


def apply_fault(fault: Fault, trainers: Trainers, broker, run_dir: Path, bootstrap: str, topic: str,
                group: str, disk: SmallDisk | None = None) -> dict:
    """Strike `fault` (its moment has come); what happened, for the report."""
    done = {"fault": fault.kind, "after_s": fault.after_s, "attempt": trainers.started,
            "checkpointed_records": checkpointed_records(run_dir), "trainer_alive": trainers.alive}
    if fault.kind == KILL:
        trainers.kill()
    elif fault.kind == KILL_IN_CHECKPOINT:
        done["inside_checkpoint_write"] = kill_inside_checkpoint(trainers, run_dir)
    elif fault.kind == PAUSE and trainers.alive:
        trainers.proc.send_signal(signal.SIGSTOP)
        time.sleep(fault.hold_s)
        trainers.proc.send_signal(signal.SIGCONT)
    elif fault.kind == BROKER_RESTART:
        broker.stop(kill=True)
        time.sleep(fault.hold_s)        # the trainer lives through the outage
        # Held still while the broker comes back and reads its partitions once
        # (`LocalBroker.warm_partitions`: a produce before that would overwrite).
        paused = trainers.alive
        if paused:
            trainers.proc.send_signal(signal.SIGSTOP)
        try:
            broker.start()
        finally:
            if paused:
                trainers.proc.send_signal(signal.SIGCONT)
    elif fault.kind == MEMBER_JOIN:
        idle_member(bootstrap, topic, group, fault.hold_s).join(timeout=120)
    elif fault.kind == DISK_FULL and disk is not None and trainers.alive:
        done.update(fill_disk(trainers, disk))
    elif fault.kind == KILL_IN_REBALANCE:
        member = idle_member(bootstrap, topic, group, fault.hold_s)
        # tansu admits the new member after half the session timeout; the trainer's
        # revocation (drop, checkpoint, commit) and its rejoin follow: kill in there.
        time.sleep(KAFKA_SETTINGS["session_timeout_ms"] / 2000 + 0.2)
        trainers.kill()
        member.join(timeout=120)
    return done


class ChaosError(RuntimeError):
    """The harness itself could not go on (a fault it applies failed): no verdict on the trainer."""


def run_chaos(cfg: ChaosConfig, say: Callable[[str], None] = print) -> ChaosReport:
    """Produce (live, over `produce_s`), train under the seeded faults, train a fault-free
reference on the same stream, verify."""
    from stream_ctr.connectors.kafka.local_broker import LocalBroker
    from stream_ctr.connectors.kafka.local_s3 import LocalS3
    t0 = time.monotonic()
    work = Path(cfg.work_dir or tempfile.mkdtemp(prefix="stream-ctr-chaos-"))
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    faults = make_schedule(cfg.schedule, cfg.seed)
    say(f"chaos: seed {cfg.seed} (the same --seed replays this schedule); working in {work}")
    say("chaos: schedule: " + "; ".join(f.describe() for f in faults))
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(LocalS3(work / "s3" / "data"))
        broker = LocalBroker(log_dir=work / "broker", s3=s3).start()
        trainers = None
        try:
            topic = f"chaos-{cfg.seed}"
            producer = StreamProducer(broker.bootstrap, topic, cfg.records, cfg.partitions, cfg.bad_rate,
                                      cfg.seed)
            producer.start(cfg.produce_s)
            say(f"chaos: producing {cfg.records:,} records (and malformed messages at a rate of "
                f"{cfg.bad_rate:g}) into {cfg.partitions} partitions of {topic} on {broker.bootstrap} "
                f"(s3:// storage) over {cfg.produce_s:.0f} s")
            run_dir = work / "run"
            disk = stack.enter_context(SmallDisk(work / "checkpoint-disk", cfg.checkpoint_disk_mib)) \
                if cfg.schedule.disk_fulls else None
            trainers = Trainers(trainer_command(cfg, broker.bootstrap, topic, "chaos", run_dir,
                                                disk.path / "checkpoints" if disk else None), logs, "attempt")
            applied, base = [], None
            for i, fault in enumerate(faults):
                if not trainers.alive:
                    trainers.start()
                    base = checkpointed_records(run_dir)
                if i:       # after the start-up kill, faults strike an attempt that is training
                    wait_for_progress(trainers, run_dir, base)
                if not trainers.alive:
                    # It stopped on its own while we waited (idle at the end of the stream): the
                    # fault strikes a new attempt, or a full disk would find no trainer to stop.
                    trainers.start()
                    base = checkpointed_records(run_dir)
                time.sleep(fault.after_s)
                try:
                    with producer.lock if fault.kind == BROKER_RESTART else contextlib.nullcontext():
                        applied.append(apply_fault(fault, trainers, broker, run_dir, broker.bootstrap, topic,
                                                   "chaos", disk))
                except Exception as e:
                    raise ChaosError(f"chaos: seed {cfg.seed}: {fault.describe()} (fault {i + 1} of "
                                     f"{len(faults)}) could not be applied: {type(e).__name__}: {e}. The "
                                     f"broker's logs are in {work / 'broker'}, the trainers' in {logs}; "
                                     f"nothing was verified") from e
                inside, error = applied[-1].get("inside_checkpoint_write"), applied[-1].get("error")
                say(f"chaos: {fault.describe()}: attempt {trainers.started}, checkpointed records "
                    f"{applied[-1]['checkpointed_records']}"
                    + ("" if inside is None else f", inside a checkpoint write: {inside}")
                    + ("" if error is None else f", exit {applied[-1]['exit']}: {error}"))
            stream = producer.join()
            say(f"chaos: produced {stream.good:,} records and {len(stream.bad):,} malformed messages")
            code, summary = trainers.finish(FINISH_TIMEOUT_S)
            say(f"chaos: last attempt ({trainers.started}): exit {code}, "
                f"{summary.get('records_trained_total', '?')} records in the model")
            # The fault-free reference: the same command line, another group, the whole stream.
            reference = Trainers(trainer_command(cfg, broker.bootstrap, topic, "reference", work / "reference",
                                                 reference=True), logs, "reference")
            ref_code, ref_summary = reference.finish(FINISH_TIMEOUT_S)
            say(f"chaos: fault-free reference: exit {ref_code}, "
                f"{ref_summary.get('records_trained_total', '?')} records in {ref_summary.get('seconds', 0):.1f} s")
            checks = verify_run(stream, broker.bootstrap, "chaos", run_dir, work / "reference",
                                code, summary, ref_code, ref_summary)
            fulls = [f for f in applied if f["fault"] == DISK_FULL]
            if fulls:
                clear = sum(bool(f.get("clear_error")) for f in fulls)
                checks.append(Check("disk full", clear == len(fulls),
                                    f"{clear} of {len(fulls)} full disks stopped the trainer with one clear "
                                    f"error (exit 4, the path, the MiB needed); each resumed"))
        finally:
            if trainers is not None:        # never leave a trainer of ours running
                trainers.kill()
            broker.stop()
    report = ChaosReport(cfg.seed, cfg.records, cfg.partitions, stream.bad_by_kind(), applied,
                         trainers.started, checks, time.monotonic() - t0, str(work))
    for check in checks:
        say(f"chaos: {'ok  ' if check.ok else 'FAIL'} {check.name}: {check.detail}")
    say(f"chaos: seed {cfg.seed}: {'passed' if report.ok else 'FAILED'} in {report.seconds:.0f} s "
        f"({len(applied)} faults, {trainers.started} trainer processes)")
    return report
