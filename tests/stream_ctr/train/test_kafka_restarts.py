"""One command line, restarted after SIGKILLs at random moments, trains every record once.

The supervisor's view (issue "Chaos you can run", must-show 2): 10,000 records
replayed into 3 partitions; the same `stream-ctr train URL --resume DIR ...`
command runs 7 times, the first 6 SIGKILLed at seeded random moments (some
before the run's first checkpoint, some during training); the 7th runs until
the topic is idle. The model's own counter (records trained into the state its
checkpoint holds) says 10,000 and the group has committed every message.
"""
from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time

from tests.kafka_broker import KafkaHelper

CLI = [sys.executable, "-m", "stream_ctr"]
RECORDS = 10_000


def test_seven_restarts_of_one_command_line_train_every_record_once(kafka_broker, tmp_path):
    kafka = KafkaHelper(kafka_broker.bootstrap)
    topic = kafka.topic(partitions=3)
    replay = subprocess.run(CLI + ["replay", "criteo:sample", "--to", kafka.url(topic), "--limit", str(RECORDS),
                                   "--packed", "50", "--quiet"], capture_output=True, text=True, timeout=300)
    assert replay.returncode == 0, replay.stderr[-2000:]
    group = f"restarts-{topic}"
    run_dir = tmp_path / "run"
    command = CLI + ["train", kafka.url(topic, group), "--resume", str(run_dir), "--batch-size", "256",
                     "--checkpoint-every", "3", "--stop-when-idle", "4", "--threads", "1",
                     "--set", "model.mlp_dims=32,32", "--json", "--quiet"]
    rng = random.Random(20261125)
    # The first kill lands during start-up, before any checkpoint can exist.
    kills = [0.5] + sorted(rng.uniform(1.0, 14.0) for _ in range(5))
    killed_before_checkpoint = 0
    for attempt, after_s in enumerate(kills):
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(after_s)
        had_checkpoint = (run_dir / "checkpoints" / "LATEST").exists()
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        killed_before_checkpoint += not had_checkpoint
        assert proc.returncode in (-signal.SIGKILL, 0), f"attempt {attempt} ended with {proc.returncode}"
    last = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert last.returncode == 0, last.stderr[-3000:]
    summary = json.loads(last.stdout.strip().splitlines()[-1])
    assert summary["records_trained_total"] == RECORDS
    # Offsets count messages: 50 lines each, every one committed.
    assert sum(kafka.committed(group, topic, 3).values()) == RECORDS // 50
    assert killed_before_checkpoint >= 1          # the schedule hit the start-up too
