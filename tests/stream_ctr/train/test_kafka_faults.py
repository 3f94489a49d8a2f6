"""Trainer processes against a real broker: SIGKILL crashes, a rebalance, a broker outage.

Each trainer is a `stream-ctr train` child process started through a small
driver that can (a) kill itself with SIGKILL at a precise point (after the
n-th step, inside the n-th checkpoint write, before the n-th group commit),
(b) slow its steps down (to 1 s a step while a file `<log>.hold` exists), and
(c) log every trained (partition, offset).
"""
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stream_ctr.connectors.kafka.options import parse_kafka_url
from stream_ctr.connectors.kafka.sink import create_topic
from stream_ctr.connectors.kafka.replay import replay_file
from stream_ctr.train.checkpoint import load_checkpoint
from stream_ctr.train.loop import train
from tests.kafka_broker import KafkaHelper, kafka_set_args
from tests.stream_ctr.train.test_kafka_train import kafka_config
from tests.stream_ctr.train.test_loop import tensors_equal

ROOT = Path(__file__).resolve().parents[3]

DRIVER = r"""
import os, signal, sys, time
mode, n, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
import numpy as np
import stream_ctr.connectors.kafka.source, stream_ctr.train.trainer
calls = [0]
def maybe_die():
    calls[0] += 1
    if calls[0] == n:
        os.kill(os.getpid(), signal.SIGKILL)
step = stream_ctr.train.trainer.Trainer.train_step
def train_step(self, batch, *args, **kwargs):
    result = step(self, batch, *args, **kwargs)
    if log != "-":
        names = np.array(batch.partitions)[batch.partition]
        with open(log, "a") as f:
            f.write("".join(f"{p} {o}\n" for p, o in zip(names, batch.offset.tolist())))
    if mode == "step":
        maybe_die()
    if mode == "slow":                   # 1 s a step while the test holds this trainer back
        time.sleep(1.0 if os.path.exists(log + ".hold") else n / 1000)
    return result
stream_ctr.train.trainer.Trainer.train_step = train_step
if mode == "checkpoint":                 # inside the write: the new directory is not renamed yet
    rename = os.rename
    def dying_rename(src, dst, *a, **k):
        if ".tmp-ckpt" in str(src):
            maybe_die()
        return rename(src, dst, *a, **k)
    os.rename = dying_rename
if mode == "commit":                     # the checkpoint is durable, the group commit not done
    commit = stream_ctr.connectors.kafka.source.KafkaSource.commit
    def dying_commit(self, positions):
        maybe_die()
        return commit(self, positions)
    stream_ctr.connectors.kafka.source.KafkaSource.commit = dying_commit
from stream_ctr.cli import main
sys.exit(main(sys.argv[4:]))
"""


def trainer(mode: str, n: int, log: str, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", DRIVER, mode, str(n), log, "train", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def train_args(url: str, run_dir: Path, *extra: str) -> list[str]:
    return [url, "--run-dir", str(run_dir), "--batch-size", "64", "--threads", "1", "--json",
            "--set", "model.mlp_dims=32,32", "--set", "data.max_batch_delay_s=1e9",
            *kafka_set_args(), *extra]


def trained_rows(log: Path) -> list[tuple[str, int]]:
    if not log.exists():
        return []
    text = log.read_text()
    lines = text.split("\n")[:-1]      # a last line without its line feed is still being written
    return [(p, int(o)) for p, o in (line.split() for line in lines)]


def wait_for(condition, timeout: float, what: str, children=()) -> None:
    """Polls `condition`; on timeout kills `children` and puts their stderr in the failure."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            tails = []
            for child in children:
                if child.poll() is None:
                    child.kill()
                tails.append(child.communicate(timeout=30)[1][-3000:])
            raise AssertionError(f"timed out waiting for {what}" + "".join(
                f"\n--- trainer {i} stderr ---\n{tail}" for i, tail in enumerate(tails)))
        time.sleep(0.1)


def checkpointed(run_dir: Path) -> int:
    return load_checkpoint(run_dir).records_trained if (run_dir / "checkpoints" / "LATEST").exists() else 0


def test_sigkill_at_several_points_then_resume_is_bit_identical(kafka, tmp_path, kafka_client):
    total = 1600                          # 25 batches of 64
    topic = kafka.topic()
    replay_file("criteo:sample", kafka.url(topic), limit=total)
    # The uninterrupted run over the same records.
    ref = kafka_config(tmp_path / "ref", kafka.url(topic, "ref"), batch_size=64, limit_records=total)
    assert train(ref, show_progress=False).records_trained == total

    run_dir = tmp_path / "crash"
    url = kafka.url(topic, "crash")
    # (failpoint, n): after step 5 (checkpoint at 3 survives); inside the 2nd checkpoint
    # write; before the 1st group commit (checkpoint durable, group behind); then to the end.
    for mode, n in (("step", 5), ("checkpoint", 2), ("commit", 1), ("none", 0)):
        before = checkpointed(run_dir)
        resume = ["--resume", str(run_dir)] if before else []
        child = trainer(mode, n, "-", train_args(url, run_dir, "--checkpoint-every", "3",
                                                 "--limit", str(total - before), *resume))
        out, err = child.communicate(timeout=120)
        if mode == "none":
            assert child.returncode == 0, err
            summary = json.loads(out.strip().splitlines()[-1])
            assert summary["records_trained_total"] == total
        else:
            assert child.returncode == -signal.SIGKILL, err
            assert checkpointed(run_dir) >= before
        if mode == "checkpoint":              # the half-written checkpoint is left aside
            assert list((run_dir / "checkpoints").glob(".tmp-ckpt-*"))
        if mode == "commit":                  # the group is behind the checkpoint: resume must not use it
            group = kafka.committed("crash", topic, 1).get(f"{topic}/0", 0)
            assert group < load_checkpoint(run_dir).positions[f"{topic}/0"]
    crashed, whole = load_checkpoint(run_dir), load_checkpoint(ref.train.run_dir)
    assert crashed.records_trained == whole.records_trained == total          # nothing lost or twice
    assert crashed.positions == whole.positions == {f"{topic}/0": total}
    assert tensors_equal(crashed.tensors["trainer"], whole.tensors["trainer"])
    assert tensors_equal(crashed.tensors["window"], whole.tensors["window"])
    assert kafka.committed("crash", topic, 1) == {f"{topic}/0": total}


@pytest.mark.parametrize("store", ["memory", "tiered"])
def test_a_second_consumer_joins_and_leaves_every_record_trained_once(kafka, tmp_path, store,
                                                                     kafka_client):
    """With the tiered store the trainer holds the batch after the current one (its rows
    are prefetched): the rebalance must drop its rows of revoked partitions even when the
    group gives the same partitions straight back (eager revocation revokes them all)."""
    topic = kafka.topic(partitions=4)
    records = 6000
    replay_file("criteo:sample", kafka.url(topic), limit=records)
    url = kafka.url(topic, f"rebalance-{store}")
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    extra = ["--set", f"store.kind={store}"]
    a = trainer("slow", 150, str(log_a), train_args(url, tmp_path / "a", "--checkpoint-every", "5",
                                                    "--stop-when-idle", "4", *extra))
    try:
        wait_for(lambda: len(trained_rows(log_a)) >= 640, 60, "the first trainer to start", [a])
        # Until the second trainer has trained, the first one goes slowly enough that
        # records are left for it however long its start takes on a busy machine.
        hold = Path(f"{log_a}.hold")
        hold.touch()
        b = trainer("slow", 150, str(log_b), train_args(url, tmp_path / "b", "--checkpoint-every", "5",
                                                        *extra))
        wait_for(lambda: len(trained_rows(log_b)) >= 320, 150, "the second trainer to get partitions",
                 [a, b])
        hold.unlink()
        b.send_signal(signal.SIGTERM)                 # finishes its batch, checkpoints, commits, leaves
        out_b, err_b = b.communicate(timeout=60)
        out_a, err_a = a.communicate(timeout=120)
    finally:
        for child in (a, locals().get("b")):
            if child is not None and child.poll() is None:
                child.kill()
    assert a.returncode == 0 and b.returncode == 0, (err_a[-2000:], err_b[-2000:])
    rows_a, rows_b = trained_rows(log_a), trained_rows(log_b)
    assert rows_b and len(rows_a) > len(rows_b)
    everything = sorted(rows_a + rows_b)
    assert everything == sorted((f"{topic}/{p}", o) for p in range(4) for o in range(records // 4))
    # What each trainer says it trained into its model adds up the same.
    sa, sb = (json.loads(out.strip().splitlines()[-1]) for out in (out_a, out_b))
    assert sa["records_trained_total"] + sb["records_trained_total"] == records
    assert "revoked by a rebalance" in err_a
    assert kafka.committed(f"rebalance-{store}", topic, 4) == {f"{topic}/{p}": records // 4 for p in range(4)}


def test_broker_outage_the_trainer_waits_says_so_and_continues(fresh_broker, tmp_path, kafka_client):
    kafka = KafkaHelper(fresh_broker.bootstrap)
    topic, half = "outage", 640
    replay_to = kafka.url(topic)

    def recreate_and_replay(limit: int) -> None:
        create_topic(parse_kafka_url(replay_to), topic, 1)
        replay_file("criteo:sample", replay_to, limit=limit)

    recreate_and_replay(half)
    log = tmp_path / "trained.log"
    child = trainer("none", 0, str(log), train_args(kafka.url(topic, "outage"), tmp_path / "run",
                                                    "--checkpoint-every", "2", "--limit",
                                                    str(2 * half), "--set", "kafka.dead_letter_topic="))
    err_lines: list[str] = []               # its stderr as it comes: the outage is waited for there
    reader = threading.Thread(target=lambda: err_lines.extend(child.stderr), daemon=True)
    reader.start()
    try:
        wait_for(lambda: len(trained_rows(log)) >= half, 60, "the first half to be trained")
        fresh_broker.stop()                    # memory storage: topic, records, group are gone
        # Down until the trainer has said so: its probe comes after 2 s without records and
        # fails after 2 s more, which a fixed 5 s barely covered on a loaded machine.
        wait_for(lambda: any("unreachable" in x for x in err_lines), 60, "the trainer to notice the outage")
        fresh_broker.start()                   # same port
        recreate_and_replay(2 * half)          # the same first half again, then the second
        child.wait(timeout=120)
        out = child.stdout.read()
    finally:
        if child.poll() is None:
            child.kill()
        reader.join(30)
    err = "".join(err_lines)
    assert child.returncode == 0, err[-3000:]
    assert "unreachable" in err and "reachable again" in err, err[-3000:]
    assert [o for _, o in trained_rows(log)] == list(range(2 * half))     # each record once, in order
    ckpt = load_checkpoint(tmp_path / "run")
    assert ckpt.records_trained == 2 * half and ckpt.positions == {f"{topic}/0": 2 * half}
    assert kafka.committed("outage", topic, 1) == {f"{topic}/0": 2 * half}
