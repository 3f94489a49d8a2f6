"""A topic deleted (or a partition gone) under a running trainer is one clear error and a
non-zero exit, after a checkpoint of everything trained.

Found on 0.13.0: the trainer logged "could not commit group offsets" and exited 0
on --stop-when-idle, as if the stream had ended.  (With kafka-python 3.0 the
consumer's next metadata request even re-created the deleted topic, empty.)

kafka-python only: with the confluent client, librdkafka 2.16 crashes (SIGSEGV)
on tansu's fetch reply for a deleted topic (connectors/kafka/confluent.py).
"""
import signal
import time

from kafka import KafkaAdminClient

from stream_ctr.cli.main import EXIT_DATA
from stream_ctr.connectors.kafka.options import parse_kafka_url
from stream_ctr.connectors.kafka.replay import replay_file
from stream_ctr.connectors.kafka.sink import create_topic, topic_partitions
from stream_ctr.train.checkpoint import load_checkpoint
from tests.stream_ctr.train.test_kafka_faults import trained_rows, train_args, trainer, wait_for


def run_until_deleted(kafka, tmp_path, topic: str, group: str, then=None):
    """Train `topic` (2 partitions, 640 records) until every record is trained, delete the
    topic (then call `then`), and wait for the trainer to end; returns (child, stderr)."""
    replay_file("criteo:sample", kafka.url(topic), limit=640)
    log, run_dir = tmp_path / "trained.log", tmp_path / "run"
    # Idle for longer than the 640 records take, shorter than a wait for a topic to come back.
    child = trainer("none", 0, str(log), train_args(kafka.url(topic, group), run_dir, "--checkpoint-every", "3",
                                                    "--stop-when-idle", "8", "--set", "kafka.dead_letter_topic="))
    try:
        wait_for(lambda: len(trained_rows(log)) >= 640, 90, "every record to be trained")
        admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
        try:
            admin.delete_topics([topic])
        finally:
            admin.close()
        if then is not None:
            then()
        _, err = child.communicate(timeout=90)
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
            child.wait()
    return child, err


def test_a_deleted_topic_stops_the_run_after_a_checkpoint(kafka, tmp_path):
    topic = kafka.topic(partitions=2)
    child, err = run_until_deleted(kafka, tmp_path, topic, "deleted")
    assert child.returncode == EXIT_DATA, err[-3000:]
    last = err.strip().splitlines()[-1]
    ckpt = load_checkpoint(tmp_path / "run")
    assert last.startswith(f"stream-ctr: error: kafka: topic {topic!r} was deleted while training: "
                           f"what was trained is checkpointed at {ckpt.path}"), last
    assert last.endswith("recreate it or point the run at another topic"), last
    assert ckpt.records_trained == 640
    assert {k: v for k, v in ckpt.positions.items() if "#" not in k} == {f"{topic}/0": 320, f"{topic}/1": 320}
    # Nothing asked the broker to create the topic again.
    assert not topic_partitions(parse_kafka_url(kafka.url(topic)), topic)


def test_a_partition_gone_stops_the_run_naming_it(kafka, tmp_path):
    """The topic deleted and created again with one partition: partition 1 is gone."""
    topic = kafka.topic(partitions=2)

    def recreate_smaller():
        deadline = time.monotonic() + 30
        while not create_topic(parse_kafka_url(kafka.url(topic)), topic, 1):   # deletion may lag
            assert time.monotonic() < deadline, "the topic was not deleted"
            time.sleep(0.2)

    child, err = run_until_deleted(kafka, tmp_path, topic, "shrunk", then=recreate_smaller)
    assert child.returncode == EXIT_DATA, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert f"kafka: partition {topic}/1 is gone ({topic!r} has 1 now) while training" in last, last
    assert "what was trained is checkpointed at" in last
    assert load_checkpoint(tmp_path / "run").records_trained == 640


def test_a_recreated_topic_is_trained_from_its_start_on_resume(kafka, tmp_path):
    """What the error above advises: the topic deleted and created again (here after the run
    ended), with fewer records than the run had read. Its partitions now end before the
    checkpoint's positions; the resume used to drop every new record as one already read
    (exit 0, nothing trained, nothing said). It trains them, and says why it starts over."""
    import json
    import subprocess
    import sys
    topic = kafka.topic(partitions=2)
    replay_file("criteo:sample", kafka.url(topic), limit=640)
    run_dir = tmp_path / "run"
    args = train_args(kafka.url(topic, "recreated"), run_dir, "--stop-when-idle", "3",
                      "--set", "kafka.dead_letter_topic=")
    first = subprocess.run([sys.executable, "-m", "stream_ctr", "train", *args],
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    try:
        admin.delete_topics([topic])
    finally:
        admin.close()
    deadline = time.monotonic() + 30
    while not create_topic(parse_kafka_url(kafka.url(topic)), topic, 2):   # deletion may lag
        assert time.monotonic() < deadline, "the topic was not deleted"
        time.sleep(0.2)
    replay_file("criteo:sample", kafka.url(topic), limit=200, resume=1000)   # other records
    again = subprocess.run([sys.executable, "-m", "stream_ctr", "train", *args, "--resume", str(run_dir)],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["records_trained"] == 200
    for p in (0, 1):
        assert (f"partition {topic}/{p} ends at offset 100, before this run's position 320: the topic "
                f"was deleted and recreated") in again.stderr, again.stderr[-3000:]
    ckpt = load_checkpoint(run_dir)
    assert {k: v for k, v in ckpt.positions.items() if "#" not in k} == {f"{topic}/0": 100, f"{topic}/1": 100}
    assert ckpt.records_trained == 840
