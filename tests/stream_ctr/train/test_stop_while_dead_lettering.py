"""A stop ends a dead-letter write whose broker never acknowledges, and nothing is skipped.

Found in a long chaos run: a trainer whose broker came back broken retried its
dead-letter write forever and ignored a supervisor's SIGTERM for 21 minutes.
The write now looks at the stop about once a second; the batch those records
came with is then not trained, so the checkpoint stays before them and a
resumed run reads (and dead-letters) them again.
"""
from __future__ import annotations

import gzip
import threading

import pytest

from stream_ctr.connectors.batch import Rejected
from stream_ctr.connectors.files import SAMPLE_PATHS
from stream_ctr.connectors.kafka.local_broker import LocalBroker
from stream_ctr.connectors.kafka.options import parse_kafka_url
from stream_ctr.connectors.kafka.sink import DeadLetterUnsent, KafkaDeadLetter
from stream_ctr.config import Config
from stream_ctr.train.batches import StopSignal
from stream_ctr.train.events import Ready
from stream_ctr.train.inputs import KafkaInput
from tests.kafka_broker import kafka_test_options


@pytest.fixture
def dead_letter_with_its_broker_gone(tmp_path):
    """A dead-letter topic on a broker of its own, killed after the producer connected."""
    broker = LocalBroker(log_dir=tmp_path / "dlq-broker").start()
    url = parse_kafka_url(f"kafka://{broker.bootstrap}/dlq", kafka_test_options())
    sink = KafkaDeadLetter(url, "dlq")
    broker.stop(kill=True)
    yield sink
    sink.close()                                # bounded: the producer's close has a timeout


def stop_after(seconds: float) -> StopSignal:
    stop = StopSignal()                         # not entered: no signal handlers in a test
    threading.Timer(seconds, lambda: setattr(stop, "requested", True)).start()
    return stop


def test_a_stop_ends_the_wait_for_an_acknowledgement(dead_letter_with_its_broker_gone):
    sink = dead_letter_with_its_broker_gone
    rejected = [Rejected("clicks/0", 7, "field_count", b"1\t2"), Rejected("clicks/1", 9, "bad_label", b"x")]
    with pytest.raises(DeadLetterUnsent, match="stopping with 2 rejected records not acknowledged"):
        sink.write(rejected, stop_after(2.0))
    assert sink.total == 0                      # nothing counted as dead-lettered


def test_the_batch_of_unsent_dead_letters_is_not_trained(kafka, dead_letter_with_its_broker_gone):
    lines = gzip.open(SAMPLE_PATHS["criteo"], "rb").read().split(b"\n")[:300]
    topic = kafka.topic()
    kafka.produce(topic, lines[:100] + [b"not\ta\tcriteo\tline"] + lines[100:300])
    cfg = Config()
    cfg.data.source, cfg.data.batch_size, cfg.data.max_batch_delay_s = kafka.url(topic, "stop"), 256, 1e9
    url = parse_kafka_url(cfg.data.source, kafka_test_options(stop_when_idle_s=60))
    source = KafkaInput(cfg, url, trained_records=lambda: 0, checkpoints_revocations=False)
    stop, written = StopSignal(), []

    class Sink:
        """The stop comes a second into the write of the bad record (a stop 3 s after the
        start could come before the group had assigned the partition: nothing was read)."""
        def write(self, rejected, stop_signal=None):
            if rejected:
                written.append(rejected)
                threading.Timer(1.0, lambda: setattr(stop, "requested", True)).start()
                dead_letter_with_its_broker_gone.write(rejected, stop_signal)

    try:
        events = list(source.events(-1, stop, Sink(), None, look_ahead=False))
    finally:
        source.close()
    assert [r.offset for r in written[0]] == [100]
    batches = [e.batch for e in events if isinstance(e, Ready)]
    # 300 good rows would make a batch of 256; the rows read with the bad record are
    # dropped with it, so nothing past the record that was never dead-lettered trains.
    assert batches == []


def test_a_bad_record_right_after_the_trained_rows_stays_ahead_of_the_positions(
        kafka, dead_letter_with_its_broker_gone):
    """Everything before the bad record trained, then the read that brings it cannot be
    dead-lettered: the positions a stop checkpoints must stay at the bad record (a resume
    reads and dead-letters it), not move past it as if it had been written."""
    lines = gzip.open(SAMPLE_PATHS["criteo"], "rb").read().split(b"\n")[:100]
    topic = kafka.topic()
    kafka.produce(topic, lines)
    cfg = Config()
    cfg.data.source, cfg.data.batch_size, cfg.data.max_batch_delay_s = kafka.url(topic, "stop-at"), 100, 1e9
    url = parse_kafka_url(cfg.data.source, kafka_test_options(stop_when_idle_s=60))
    source = KafkaInput(cfg, url, trained_records=lambda: 0, checkpoints_revocations=False)
    stop = StopSignal()

    class Sink:
        """The sink of a healthy broker until the bad record comes, then one gone."""
        def write(self, rejected, stop_signal=None):
            if rejected:
                dead_letter_with_its_broker_gone.write(rejected, stop_after(1.0))

    try:
        for event in source.events(-1, stop, Sink(), None, look_ahead=False):
            if isinstance(event, Ready):
                source.trained(event.batch)
                assert source.snapshot().to_checkpoint() == {f"{topic}/0": 100}
                kafka.produce(topic, [b"not\ta\tcriteo\tline"] + lines[:10])
        positions = source.snapshot().to_checkpoint()
    finally:
        source.close()
    assert positions == {f"{topic}/0": 100}
