"""Must-show: a predict server follows a trainer reading a real broker, through a SIGKILL.

The bundled Criteo sample is produced into a 2-partition topic of the test broker
(tansu) in packed messages over ~30 s, its last message only once the server has
answered with two versions. `stream-ctr train URL --resume DIR --publish PUB
--publish-every-s 1` runs as a subprocess; once it has published, `stream-ctr
serve --follow PUB` starts as another. A watcher asks the server for
predictions all along. The trainer is SIGKILLed mid-stream and the same command
line restarted; it trains the rest and exits when the topic is idle.

Shown: the served version advances while records keep arriving; no answer ever
comes from a model older (fewer steps) than one answered before -- a rolled-back
model was never served; at the end the server answers exactly as a bundle
exported from the final checkpoint does.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from stream_ctr.connectors.decode import decode_lines
from stream_ctr.connectors.formats import CRITEO
from stream_ctr.serving.bundle import read_bundle
from stream_ctr.serving.published import read_index
from stream_ctr.serving.scorer import Scorer
from tests.kafka_broker import kafka_set_args
from tests.stream_ctr.serving.test_serve import request, sample_lines

CLI = [sys.executable, "-m", "stream_ctr"]
PACKED = 50                     # lines per Kafka message
CHUNKS = 30                     # produced one every PRODUCE_EVERY_S
PRODUCE_EVERY_S = 1.0


def wait_for(what: str, check, timeout_s: float = 180.0, procs: tuple = ()) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        for p in procs:
            assert p.poll() is None, f"{what}: a process exited with {p.returncode}: {p.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s} s"
        time.sleep(0.1)


def parse_version(model_version: str) -> tuple[int, int]:
    """"v12:ckpt-00000120@120" -> (12, 120)."""
    head, _, step = model_version.partition("@")
    return int(head.split(":")[0][1:]), int(step)


class Watcher(threading.Thread):
    """Posts a few records to the server every 0.1 s; keeps (time, version, step) of each answer."""

    def __init__(self, port: int, body: bytes) -> None:
        super().__init__(daemon=True)
        self.port, self.body = port, body
        self.answers: list[tuple[float, int, int]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            status, out = request(self.port, "POST", "/predict", self.body)
            if status != 200:
                self.errors.append(out.decode()[:300])
            else:
                self.answers.append((time.time(), *parse_version(json.loads(out)["model_version"])))
            self.stop.wait(0.1)


def test_a_server_follows_a_kafka_trainer_through_a_sigkill(kafka, tmp_path):
    lines = sample_lines()
    topic = kafka.topic(partitions=2)
    messages = [b"\n".join(lines[i:i + PACKED]) for i in range(0, len(lines), PACKED)]
    per_chunk = -(-len(messages) // CHUNKS)
    produced_all_at: list[float] = []
    two_served = threading.Event()

    def produce() -> None:
        # A chunk every PRODUCE_EVERY_S; once half is sent and until the server has answered
        # with two versions, one message at a time (records keep arriving: the trainer never
        # stops idle), and the last one only after that. However slow the start-ups, records
        # are still arriving when the server has served two versions.
        sent = 0
        while sent < len(messages):
            n = per_chunk if sent < len(messages) // 2 or two_served.is_set() else 1
            if sent + n >= len(messages):
                two_served.wait(600)
            kafka.produce(topic, messages[sent:sent + n], [(sent + i) % 2 for i in range(n)])
            sent += n
            time.sleep(PRODUCE_EVERY_S)
        produced_all_at.append(time.time())

    run_dir, pub = tmp_path / "run", tmp_path / "pub"
    command = CLI + ["train", kafka.url(topic, "follow"), "--resume", str(run_dir), "--batch-size", "256",
                     "--publish", str(pub), "--publish-every-s", "1", "--stop-when-idle", "8",
                     "--threads", "1", "--set", "model.mlp_dims=32,32", "--set", "data.max_batch_delay_s=0.5",
                     "--json", "--quiet", *kafka_set_args()]
    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server = watcher = second = None
    try:
        wait_for("the first version", lambda: (pub / "PUBLISHED.json").exists(), procs=(first,))
        server = subprocess.Popen(CLI + ["serve", "--follow", str(pub), "--port", "0", "--follow-poll-s", "0.2"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = server.stdout.readline()
        assert line.startswith("serving v"), (line, server.stderr.read() if server.poll() is not None else "")
        port = int(line.split("http://127.0.0.1:")[1].split()[0])
        watcher = Watcher(port, b"\n".join(lines[:20]) + b"\n")
        watcher.start()

        # Mid-stream, once the server has answered with two versions: SIGKILL, and the same
        # command line again.
        wait_for("two versions served", lambda: len({v for _, v, _ in watcher.answers}) >= 2,
                 procs=(first, server))
        assert producer.is_alive() and not produced_all_at, "the whole topic was produced already"
        two_served.set()
        time.sleep(0.7)                         # into training after the last publish
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=60)
        killed_at, published_before_kill = time.time(), read_index(pub).latest
        second = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert second.returncode == 0, second.stderr[-3000:]
        summary = json.loads(second.stdout.strip().splitlines()[-1])
        assert summary["records_trained_total"] == len(lines)
        latest = read_index(pub).latest
        wait_for("the server on the last version",
                 lambda: watcher.answers and watcher.answers[-1][1] == latest, timeout_s=60, procs=(server,))
        watcher.stop.set()
        watcher.join(30)

        # The final checkpoint's export answers exactly as the server does.
        final = tmp_path / "final"
        assert subprocess.run(CLI + ["export", str(run_dir), "--out", str(final), "--quiet"],
                              capture_output=True, timeout=300).returncode == 0
        body = b"\n".join(lines[:2000]) + b"\n"
        status, out = request(port, "POST", "/predict", body)
        assert status == 200
        served = np.array(json.loads(out)["probabilities"], np.float32)
        batch = decode_lines(body, CRITEO, "t", 0)[0]
        assert np.array_equal(served, Scorer(read_bundle(final)).score(batch))
        assert read_bundle(final).manifest["checkpoint"]["step"] == parse_version(
            json.loads(out)["model_version"])[1]

        status, text = request(port, "GET", "/metrics")
        samples = {s.name: s for f in text_string_to_metric_families(text.decode()) for s in f.samples}
        assert samples["stream_ctr_serving_model_published_version"].value == latest
        assert samples['stream_ctr_serving_update_apply_seconds_count'].value >= 2
        assert 0 < samples["stream_ctr_serving_freshness_seconds"].value < 120
    finally:
        for p in (first, server):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM if p is server else signal.SIGKILL)
                p.communicate(timeout=60)
        if watcher is not None:
            watcher.stop.set()
        two_served.set()                        # (the producer's last message, on a failure)
    producer.join(60)

    answers = watcher.answers
    assert not watcher.errors, watcher.errors[:3]
    versions = [v for _, v, _ in answers]
    steps = [s for _, _, s in answers]
    # Never a rolled-back model: versions only go up, and so does the step of the model answering
    # (the resumed run's first version is the checkpoint it resumed from, at or past every one
    # published before the kill).
    seen = sorted({(v, s) for _, v, s in answers})
    assert versions == sorted(versions) and steps == sorted(steps), seen
    assert versions[0] <= published_before_kill < versions[-1], (published_before_kill, seen)
    # The served version advanced while records were still being produced.
    while_arriving = {v for t, v, _ in answers if t < produced_all_at[0]}
    assert len(while_arriving) >= 2, (while_arriving, seen)
    assert any(t > killed_at for t, _, _ in answers)


def test_publishing_through_a_kafka_topic(kafka, tmp_path):
    """`--publish kafka://.../TOPIC`: versions staged in RUN_DIR/published are sent to the topic
    file by file (parts of at most 512 KiB), then the index; a mirror rebuilds the directory
    from the topic, and a server following it ends on the final checkpoint's export. The
    CLI's `serve --follow kafka://...` starts on the newest version."""
    import uuid
    from stream_ctr.serving.follower import Follower, initial_bundle
    from stream_ctr.serving.kafka_publish import KafkaMirror
    from stream_ctr.serving.predictor import Predictor
    from stream_ctr.train.loop import train
    from tests.stream_ctr.store.helpers import BATCH, small_config
    url = f"kafka://{kafka.bootstrap}/published-{uuid.uuid4().hex[:8]}"
    cfg = small_config(tmp_path / "run", tiered=False)
    cfg.train.checkpoint_every_batches = 20
    cfg.data.limit_records = 60 * BATCH
    cfg.serving.publish, cfg.serving.full_every = url, 0
    train(cfg, show_progress=False)
    staged = read_index(tmp_path / "run" / "published")
    assert (staged.full, staged.chain) == (1, [2, 3])
    mirror = KafkaMirror(url, tmp_path / "mirror").start()
    try:
        # Caught up with the topic's end at its start: the newest index, not the first one read.
        assert mirror.caught_up.wait(timeout=60)
        assert read_index(tmp_path / "mirror").latest == 3
    finally:
        mirror.close()
    for v in (1, 2, 3):                 # the files as the trainer wrote them
        for name in ("dense.pt", "keys.npy", "rows.npy", "manifest.json"):
            assert (tmp_path / "mirror" / f"v-{v:08d}" / name).read_bytes() == \
                (tmp_path / "run" / "published" / f"v-{v:08d}" / name).read_bytes()
    predictor = Predictor(Scorer(read_bundle(initial_bundle(tmp_path / "mirror"))))
    try:
        assert Follower(tmp_path / "mirror", predictor).poll()
        assert subprocess.run(CLI + ["export", cfg.train.run_dir, "--out", str(tmp_path / "final"), "--quiet"],
                              capture_output=True, timeout=300).returncode == 0
        batch = decode_lines(b"\n".join(sample_lines()[:2000]) + b"\n", CRITEO, "t", 0)[0]
        assert np.array_equal(predictor.current()[0].score(batch), Scorer(read_bundle(tmp_path / "final")).score(batch))
    finally:
        predictor.close()
    server = subprocess.Popen(CLI + ["serve", "--follow", url, "--port", "0"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        assert line.startswith("serving v3:ckpt-00000060@60 on http://127.0.0.1:"), \
            (line, server.stderr.read() if server.poll() is not None else "")
    finally:
        server.terminate()
        server.communicate(timeout=60)


def test_a_mirror_is_caught_up_only_once_it_holds_the_newest_index(kafka, tmp_path):
    """`KafkaMirror.caught_up` is set once every message up to the topic's end at the
    mirror's start is taken: here the newest index shares its batch with its version's
    files (tansu's ListOffsets then answers the end at that batch's first offset, plus
    one), and the mirror reads one message a poll, as a topic longer than a poll is read."""
    import functools
    import kafka as kafka_python
    from stream_ctr.serving.kafka_publish import VERSION_FILES, KafkaMirror
    topic = kafka.topic()
    producer = kafka_python.KafkaProducer(bootstrap_servers=kafka.bootstrap, acks="all", linger_ms=5)
    for v in (1, 2, 3):
        for name in VERSION_FILES:
            producer.send(topic, key=f"v-{v:08d}/{name}".encode(), value=b"x",
                          headers=[("part", b"0"), ("parts", b"1")])
        if v < 3:
            producer.flush()
        producer.send(topic, key=b"PUBLISHED.json",
                      value=json.dumps({"latest": v, "full": 1, "chain": list(range(2, v + 1))}).encode())
        producer.flush()
    producer.close()

    class Noted(threading.Event):
        """The mirrored index's latest version when the event is set."""
        latest: int | None = None

        def set(self) -> None:
            index = tmp_path / "mirror" / "PUBLISHED.json"
            self.latest = read_index(tmp_path / "mirror").latest if index.exists() else None
            super().set()

    real = kafka_python.KafkaConsumer
    kafka_python.KafkaConsumer = functools.partial(real, max_poll_records=1)
    try:
        mirror = KafkaMirror(f"kafka://{kafka.bootstrap}/{topic}", tmp_path / "mirror")
    finally:
        kafka_python.KafkaConsumer = real
    mirror.caught_up = Noted()
    mirror.start()
    try:
        assert mirror.caught_up.wait(timeout=60)
        assert mirror.caught_up.latest == 3
    finally:
        mirror.close()


def test_a_message_the_mirror_cannot_take_is_skipped_and_said(kafka, tmp_path, capsys):
    """A topic whose first message is an index that is not JSON (another producer's, a message
    cut short): the mirror's thread used to die on it, so a server never had a version. It is
    skipped and said once; the trainer's versions after it are mirrored."""
    from kafka import KafkaProducer
    from stream_ctr.serving.kafka_publish import KafkaMirror
    from stream_ctr.train.loop import train
    from tests.stream_ctr.store.helpers import BATCH, small_config
    topic = kafka.topic(1, prefix="published")
    url = f"kafka://{kafka.bootstrap}/{topic}"
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap, acks="all")
    producer.send(topic, key=b"PUBLISHED.json", value=b'{"latest": 1', partition=0)
    producer.flush()
    producer.close()
    cfg = small_config(tmp_path / "run", tiered=False)
    cfg.data.limit_records = 20 * BATCH
    cfg.serving.publish = url
    train(cfg, show_progress=False)
    mirror = KafkaMirror(url, tmp_path / "mirror").start()
    try:
        assert mirror.caught_up.wait(timeout=60)
        assert mirror._thread.is_alive()
        assert read_index(tmp_path / "mirror").latest == read_index(tmp_path / "run" / "published").latest
    finally:
        mirror.close()
    assert "JSONDecodeError" in mirror.last_error
    err = capsys.readouterr().err
    assert err.count("skipped message 0 ('PUBLISHED.json')") == 1, err
