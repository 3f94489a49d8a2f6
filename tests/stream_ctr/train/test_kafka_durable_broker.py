"""A broker that keeps its log across a restart (tansu on s3:// storage, s3rver on disk).

The restart users meet: the broker process dies (SIGKILL) with its data on
disk and comes back on the same port with the same topics, records and
committed offsets.  The trainer waits through the outage, rejoins the group
and goes on where it stood: every record of 3 partitions trained exactly once.
"""
from __future__ import annotations

import json
import time
from collections import Counter

from stream_ctr.connectors.kafka.replay import replay_file
from stream_ctr.train.checkpoint import load_checkpoint
from tests.kafka_broker import KafkaHelper
from tests.stream_ctr.train.test_kafka_faults import trained_rows, trainer, train_args, wait_for


def test_the_durable_broker_keeps_records_and_offsets_across_a_kill(durable_broker):
    kafka = KafkaHelper(durable_broker.bootstrap)
    topic = kafka.topic(partitions=3)
    kafka.produce(topic, [b"m%d" % i for i in range(90)], [i % 3 for i in range(90)])
    durable_broker.stop(kill=True)
    durable_broker.s3.stop(kill=True)                  # the storage server dies too
    durable_broker.s3.start()
    durable_broker.start()
    assert sorted(r.value for r in kafka.read_all(topic, 3)) == sorted(b"m%d" % i for i in range(90))


def test_training_goes_on_exactly_once_across_a_broker_restart_that_keeps_data(durable_broker, tmp_path):
    kafka = KafkaHelper(durable_broker.bootstrap)
    topic, total = kafka.topic(partitions=3), 3000
    replay_file("criteo:sample", kafka.url(topic), limit=total, packed=10)
    log = tmp_path / "trained.log"
    child = trainer("slow", 100, str(log), train_args(kafka.url(topic, "durable"), tmp_path / "run",
                                                      "--checkpoint-every", "3", "--stop-when-idle", "8",
                                                      "--set", "kafka.deterministic_batches=true"))
    try:
        wait_for(lambda: len(trained_rows(log)) >= total // 3, 120, "a third to be trained")
        durable_broker.stop(kill=True)
        time.sleep(4)
        durable_broker.start()                          # same port, same log on disk
        out, err = child.communicate(timeout=300)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, err[-3000:]
    # It noticed: the broker unreachable, or the group membership lost with it.
    assert "unreachable" in err or "membership expired" in err, err[-3000:]
    # Each record once: every message (10 records) of every partition, 10 rows each.
    assert Counter(trained_rows(log)) == {(f"{topic}/{p}", o): 10 for p in range(3) for o in range(100)}
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["records_trained_total"] == total
    ckpt = load_checkpoint(tmp_path / "run")
    messages = {f"{topic}/{p}": n for p, n in enumerate((100, 100, 100))}
    assert ckpt.records_trained == total and ckpt.positions == messages
    assert kafka.committed("durable", topic, 3) == messages
