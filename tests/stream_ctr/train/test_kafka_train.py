"""Training from Kafka in-process: accuracy vs the file source, dead letters, packed resume, errors."""
import gzip
import json

import pytest

from stream_ctr.connectors.files import SAMPLE_PATHS
from stream_ctr.connectors.kafka.options import parse_kafka_url
from stream_ctr.connectors.kafka.sink import topic_partitions
from stream_ctr.connectors.kafka.replay import replay_file
from stream_ctr.train.checkpoint import load_checkpoint
from stream_ctr.cli import main
from stream_ctr.config import Config, ConfigError, validate
from stream_ctr.distributed.job_checkpoint import load_any
from stream_ctr.train.loop import evaluate_checkpoint, train
from tests.kafka_broker import TEST_KAFKA
from tests.stream_ctr.train.test_loop import tensors_equal

TRAIN_RECORDS = 13044          # the first 90% of the Criteo sample; the rest is the test set


def kafka_config(tmp_path, source: str, **data) -> Config:
    cfg = Config()
    cfg.data.source = source
    cfg.data.batch_size = 128
    cfg.data.max_batch_delay_s = 1e9        # batches by size only: runs are reproducible
    cfg.model.mlp_dims = (32, 32)
    cfg.train.run_dir = str(tmp_path / "run")
    cfg.train.threads = 1
    for name, value in TEST_KAFKA.items():
        setattr(cfg.kafka, name, value)
    for name, value in data.items():
        setattr(cfg.data, name, value)
    return cfg


def test_kafka_training_matches_the_file_source_and_commits_the_checkpoint_offsets(kafka, tmp_path):
    topic = kafka.topic(partitions=3)
    replay_file("criteo:sample", kafka.url(topic), limit=TRAIN_RECORDS)
    cfg = kafka_config(tmp_path / "kafka", kafka.url(topic, "auc"), limit_records=TRAIN_RECORDS)
    cfg.train.checkpoint_every_batches = 40
    s = train(cfg, show_progress=False)
    assert s.records_trained == TRAIN_RECORDS and s.records_rejected == 0
    ckpt = load_checkpoint(cfg.train.run_dir)
    assert ckpt.positions == {f"{topic}/{p}": 4348 for p in range(3)}
    assert kafka.committed("auc", topic, 3) == ckpt.positions          # external lag tools agree
    kafka_auc = evaluate_checkpoint(load_any(cfg.train.run_dir), cfg.train.run_dir, "criteo:sample", start=TRAIN_RECORDS)["auc"]

    file_cfg = kafka_config(tmp_path / "file", "criteo:sample", holdout_fraction=0.1)
    file_auc = train(file_cfg, show_progress=False).test["auc"]
    # Same records, a different order (3 partitions interleave): equal within noise.
    assert abs(kafka_auc - file_auc) < 0.03, (kafka_auc, file_auc)
    assert kafka_auc > 0.65


def test_bad_records_go_to_the_dead_letter_topic_with_reasons(kafka, tmp_path):
    topic = kafka.topic(partitions=2)
    good = gzip.open(SAMPLE_PATHS["criteo"], "rb").read().split(b"\n")[:600]
    bad = {b"1\t2\t3": "field_count", b"x" + good[0][1:]: "bad_label",
           good[1].replace(b"\t", b"\tz", 1): "bad_integer", b"": "empty_message"}
    values = good[:300] + list(bad) + good[300:]
    kafka.produce(topic, values, partitions=[i % 2 for i in range(len(values))])
    cfg = kafka_config(tmp_path, kafka.url(topic, "dlq"))
    cfg.kafka.stop_when_idle_s = 1.5
    s = train(cfg, show_progress=False)
    assert s.records_trained == 600 and s.records_rejected == 4
    assert s.rejected_by_reason == {r: 1 for r in bad.values()}
    assert s.dead_letter_path.endswith(f"/{topic}.dead-letter")
    letters = kafka.dead_letters(f"{topic}.dead-letter")
    expected = {(topic, (300 + i) % 2, (300 + i) // 2, reason) for i, reason in enumerate(bad.values())}
    assert {(d["topic"], d["partition"], d["offset"], d["reason"]) for d in letters} == expected
    assert load_checkpoint(cfg.train.run_dir).positions == {f"{topic}/0": 302, f"{topic}/1": 302}


def test_resume_inside_packed_messages_is_bit_identical(kafka, tmp_path):
    topic = kafka.topic()
    replay_file("criteo:sample", kafka.url(topic), packed=50, limit=1000)
    whole = kafka_config(tmp_path / "whole", kafka.url(topic, "whole"), batch_size=64, limit_records=1000)
    assert train(whole, show_progress=False).records_trained == 1000

    part = kafka_config(tmp_path / "part", kafka.url(topic, "part"), batch_size=64, limit_records=448)
    train(part, show_progress=False)
    # 448 rows = 8 messages of 50 and 48 rows of the 9th: the checkpoint says so.
    assert load_checkpoint(part.train.run_dir).positions == {f"{topic}/0": 8, f"{topic}/0#rows_done": 48}
    assert kafka.committed("part", topic, 1) == {f"{topic}/0": 8}
    part.data.limit_records = 552
    s = train(part, resume=part.train.run_dir, show_progress=False)
    assert s.records_trained == 552 and s.records_trained_total == 1000
    a = load_checkpoint(whole.train.run_dir)
    b = load_checkpoint(part.train.run_dir)
    assert a.positions == b.positions == {f"{topic}/0": 20}
    assert tensors_equal(a.tensors["trainer"], b.tensors["trainer"])
    assert tensors_equal(a.tensors["window"], b.tensors["window"])


def test_user_errors_are_one_line(kafka, tmp_path, capsys):
    run = ["--run-dir", str(tmp_path / "run"), "--quiet", "--set", "kafka.connect_timeout_s=1"]
    # exit codes: 3 the source (its URL, broker, topic), 2 the command or config
    cases = [(["kafka://127.0.0.1:9/clicks"], "cannot reach a Kafka broker at 127.0.0.1:9", 3),
             ([kafka.url("no-such-topic-abc")], "topic 'no-such-topic-abc' does not exist", 3),
             (["kafka://127.0.0.1/clicks"], "must be HOST:PORT", 3),
             (["kafka://[::1/t?group=g"], "'kafka://[::1/t?group=g' is not a valid URL", 3),
             ([kafka.url("t") + "?colour=red"], "unknown parameter 'colour'", 3),
             ([kafka.url("t"), "--holdout-fraction", "0.1"], "data.holdout_fraction needs a file", 2),
             ([kafka.url("t"), "--set", "kafka.value_format=xml"], "kafka.value_format", 2),
             ([kafka.url("t"), "--set", "kafka.dead_letter_topic=bad name/with spaces"],
              "kafka.dead_letter_topic 'bad name/with spaces' is not a valid topic name", 2),
             ([kafka.url("clicks"), "--set", "kafka.dead_letter_topic={topic}" + "x" * 245],
              "which is not a valid topic name (251 characters; at most 249)", 2)]
    for args, message, code in cases:
        assert main(["train", *args, *run]) == code, args
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("stream-ctr: error: ") and message in err[-1], (args, err)
    dlq = "no-such-topic-abc.dead-letter"          # nothing was created for the typo
    assert not topic_partitions(parse_kafka_url(kafka.url(dlq)), dlq)
    cfg = kafka_config(tmp_path, "criteo:sample")
    cfg.kafka.start = "soon"
    with pytest.raises(ConfigError, match="kafka.start"):
        validate(cfg)


def test_bench_ingest_prints_both_clients_for_both_layouts(kafka, capsys):
    assert main(["bench", "ingest", "--bootstrap", kafka.bootstrap, "--records", "3000",
                 "--packed", "100", "--repeat", "1", "--json", "--quiet"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = result["rows"]
    assert [(r["layout"], r["client"]) for r in rows] == [
        (layout, client) for layout in ("1 record/message", "packed 100/message")
        for client in ("kafka-python loop (a)", "KafkaSource + decode (b)",
                       "confluent-kafka loop (a')", "KafkaSource client=confluent (b')")]
    assert all(r["records"] == 3000 and r["records_per_s"] > 0 and r["mb_per_s"] > 0 for r in rows)
    assert rows[1]["ratio_b_a"] > 0 and rows[3]["ratio_b_a"] > 0 and rows[3]["ratio_vs_a"] > 0
    assert result["crc32c"] is True


def test_a_run_waiting_for_records_says_so_once_and_when_they_come_back(kafka, tmp_path, monkeypatch, capsys):
    import threading
    from stream_ctr.train.inputs import KafkaInput
    monkeypatch.setattr(KafkaInput, "WAITING_NOTE_S", 1.0)
    lines = gzip.open(SAMPLE_PATHS["criteo"], "rb").read().split(b"\n")[:400]
    topic = kafka.topic(partitions=1)
    kafka.produce(topic, lines[:100])                       # less than one batch
    # The rest after a quiet spell: once the run has said it waits for records (a fixed
    # delay raced the group join on a slow machine, and then there was no quiet spell).
    said_waiting, note = threading.Event(), KafkaInput._note_waiting

    def noting(self) -> None:
        note(self)
        if self._said_waiting:
            said_waiting.set()

    monkeypatch.setattr(KafkaInput, "_note_waiting", noting)
    later = threading.Thread(target=lambda: said_waiting.wait(120) and kafka.produce(topic, lines[100:400]))
    later.start()
    cfg = kafka_config(tmp_path, kafka.url(topic, "quiet"))
    cfg.kafka.stop_when_idle_s = 10.0
    try:
        s = train(cfg, show_progress=False)
    finally:
        said_waiting.set()                          # (a run that failed first: no wait)
        later.join()
    err = capsys.readouterr().err
    assert s.records_trained == 400                 # the idle end trains the partial batch
    # Once per quiet spell: before the first batch, and after the last
    # full one (16 pending) until the idle end; records coming back in between are noted.
    assert err.count(f"waiting for records from {topic}: no batch for") == 2
    assert "rows pending of a 128-row batch); the run ends after kafka.stop_when_idle_s = 10 s" in err
    assert err.count("stream-ctr: records again after") == 1    # not for the idle end's last batch


def test_a_run_waiting_for_the_group_says_so_and_does_not_promise_an_idle_end(kafka, tmp_path, monkeypatch,
                                                                              capsys):
    """Until the group assigns partitions (tansu admits a member only after half the
    session timeout) the records wait in the topic: the run says it waits for the group,
    repeatedly, not that no records come and that the idle end is near."""
    from stream_ctr.train.inputs import KafkaInput
    monkeypatch.setattr(KafkaInput, "WAITING_NOTE_S", 0.0)
    topic = kafka.topic()
    kafka.produce(topic, gzip.open(SAMPLE_PATHS["criteo"], "rb").read().split(b"\n")[:300])
    cfg = kafka_config(tmp_path, kafka.url(topic, "join"))
    cfg.kafka.stop_when_idle_s = 2.0
    assert train(cfg, show_progress=False).records_trained == 300
    lines = capsys.readouterr().err.splitlines()
    group = kafka.group("join", topic)
    joining = [i for i, x in enumerate(lines)
               if x.startswith(f"stream-ctr: waiting for group {group!r} to assign partitions of {topic} (")]
    idle = [i for i, x in enumerate(lines) if x.startswith(f"stream-ctr: waiting for records from {topic}")]
    assert joining and all(lines[i].endswith("kafka.stop_when_idle_s does not count this wait") for i in joining)
    assert max(joining) < min(idle, default=len(lines))     # records are awaited only once assigned


def test_a_resume_keeps_the_runs_kafka_options(kafka, tmp_path, capsys):
    """A group given as kafka.group (not in the URL) stays the run's on a resume that does
    not repeat it: the resume reads on from its checkpoint in that group, warns of no
    default group and says no switch."""
    lines = gzip.open(SAMPLE_PATHS["criteo"], "rb").read().split(b"\n")
    topic = kafka.topic()
    kafka.produce(topic, lines[:300])
    cfg = kafka_config(tmp_path, kafka.url(topic))
    cfg.kafka.group, cfg.kafka.stop_when_idle_s = kafka.group("own", topic), 2.0
    assert train(cfg, show_progress=False).records_trained == 300
    kafka.produce(topic, lines[300:400])
    again = kafka_config(tmp_path, kafka.url(topic))
    again.kafka.stop_when_idle_s = 2.0
    capsys.readouterr()
    s = train(again, resume=again.train.run_dir, show_progress=True)
    assert (s.records_trained, s.records_trained_total) == (100, 400)
    err = capsys.readouterr().err
    assert "names no group" not in err and "this run reads" not in err, err
    assert kafka.committed("own", topic, 1) == {f"{topic}/0": 400}


def test_a_resume_that_reads_another_topic_or_group_says_so(kafka, tmp_path, capsys):
    """As a file run may name another file, a resume may name another topic or group
    (docs/kafka.md): it goes on, and its start line says what it reads from where."""
    lines = gzip.open(SAMPLE_PATHS["criteo"], "rb").read().split(b"\n")
    first, second = kafka.topic(), kafka.topic()
    kafka.produce(first, lines[:300])
    kafka.produce(second, lines[300:500])
    cfg = kafka_config(tmp_path, kafka.url(first, "g1"))
    cfg.kafka.stop_when_idle_s = 2.0
    assert train(cfg, show_progress=False).records_trained == 300
    capsys.readouterr()

    cfg.data.source = kafka.url(second, "g2")
    s = train(cfg, resume=cfg.train.run_dir, show_progress=True)
    assert s.records_trained == 200 and s.records_trained_total == 500
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("stream-ctr: resumed from")]
    g1, g2 = kafka.group("g1", first), kafka.group("g2", second)
    assert line.endswith(f"at offsets {first}/0 300; the checkpoint read topic {first} (group {g1!r}); this "
                         f"run reads topic {second} (group {g2!r}): topic {second} from the committed "
                         f"offsets of group {g2!r} (else kafka.start = earliest), the checkpoint's offsets of "
                         f"topic {first} are not used"), line
