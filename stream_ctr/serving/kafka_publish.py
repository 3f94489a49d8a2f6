"""Publishing through a Kafka topic: `train --publish kafka://HOST:PORT/TOPIC`,
`serve --follow kafka://HOST:PORT/TOPIC`.

The topic carries the publish directory (published.py), file by file:

    key b"v-00000012/rows.npy"   value: part i of n of that file   headers: part=i, parts=n
    ...                          (every file of a version, parts of at most PART_BYTES)
    key b"PUBLISHED.json"        value: the index, sent once every file of every version
                                 it names has been acknowledged (acks=all)

* **Trainer** (`KafkaSink`): it publishes into a local directory as with
  `--publish DIR` (RUN_DIR/published) and, after each version, sends the
  versions of the current chain the topic does not have yet, then the index. A
  send that fails is retried at the next publish (the chain is still on disk),
  so the topic never names a delta whose base it lacks.
* **Server** (`KafkaMirror`): a thread reads the topic from its start (one
  partition, no consumer group) and rebuilds the directory in a local folder: a
  version's files go under a temporary name and are renamed into place once all
  parts are there; an index is written (atomically) only when every version it
  names is complete. The `Follower` follows that folder as any other. Its
  `caught_up` event is set once it has read as far as the topic's end at its
  start, so a server starts on the newest version, not on the first index read.

The topic is created with one partition (order matters). It grows with every
version: give it a retention long enough to hold the newest full snapshot and
its chain (serving.full_every publishes), since a new server reads from the start.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import threading
from pathlib import Path

from stream_ctr.config import ConfigError
from stream_ctr.serving.bundle import FILES
from stream_ctr.serving.published import (INDEX, PublishedIndex, read_index, version_dir, version_dirs,
                                          write_index)

PART_BYTES = 512 << 10           # under the 1 MB a broker accepts by default
VERSION_FILES = (*FILES, "manifest.json")


def _url(spec: str):
    from stream_ctr.connectors.kafka.options import parse_kafka_url
    url = parse_kafka_url(spec)
    if len(url.topics) != 1:
        raise ConfigError(f"{spec}: name one topic to publish through (kafka://HOST:PORT/TOPIC)")
    return url


class KafkaSink:
    """Sends a local publish directory's new versions, then its index, to a topic."""

    def __init__(self, spec: str) -> None:
        from kafka import KafkaProducer
        from kafka.errors import KafkaError
        from stream_ctr.connectors.kafka.options import client_config
        from stream_ctr.connectors.kafka.sink import create_topic
        self.url = _url(spec)
        self.topic = self.url.topics[0]
        try:
            create_topic(self.url, self.topic, 1)
            self._producer = KafkaProducer(**client_config(self.url), acks="all", linger_ms=5,
                                           max_request_size=2 * PART_BYTES)
        except (KafkaError, OSError) as e:
            raise ConfigError(f"--publish {spec}: cannot reach the broker: {e}") from None
        self.sent: set[int] = set()

    def send(self, root: Path, index: PublishedIndex) -> None:
        """Send every version of `index` not sent yet, then `index`; OSError if the broker
        does not acknowledge (the next call sends what is missing)."""
        from kafka.errors import KafkaError
        try:
            for version in index.versions():
                if version not in self.sent:
                    self._send_version(version_dir(root, version))
                    self.sent.add(version)
            self._producer.send(self.topic, key=INDEX.encode(), value=(root / INDEX).read_bytes())
            self._producer.flush()
        except KafkaError as e:
            raise OSError(f"sending to {self.url.text} failed: {e}") from None

    def _send_version(self, path: Path) -> None:
        """Every file of the version at `path`, PART_BYTES at a time (never whole in memory)."""
        for name in VERSION_FILES:
            parts = max(1, -(-(path / name).stat().st_size // PART_BYTES))
            futures = []
            with open(path / name, "rb") as f:
                for i in range(parts):
                    futures.append(self._producer.send(
                        self.topic, key=f"{path.name}/{name}".encode(), value=f.read(PART_BYTES),
                        headers=[("part", str(i).encode()), ("parts", str(parts).encode())]))
                    if len(futures) >= 64:      # bounded: wait for the acks of what was sent
                        self._producer.flush()
            self._producer.flush()
            for fut in futures:
                fut.get(timeout=60)             # raises the KafkaError of a part not acknowledged

    def close(self) -> None:
        self._producer.close()


class KafkaMirror:
    """Rebuilds the publish directory a topic carries into `root` (a local folder)."""

    def __init__(self, spec: str, root: str | Path) -> None:
        from kafka import KafkaConsumer, TopicPartition
        from stream_ctr.connectors.kafka.options import client_config
        self.spec, self.url = spec, _url(spec)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._consumer = KafkaConsumer(**client_config(self.url), group_id=None, enable_auto_commit=False,
                                       fetch_max_bytes=64 << 20, max_partition_fetch_bytes=16 << 20)
        self._tp = TopicPartition(self.url.topics[0], 0)
        self._consumer.assign([self._tp])
        self._consumer.seek_to_beginning(self._tp)
        # The topic's end when the mirror starts: once read up to there, the directory holds
        # the newest version published before this server started (see `caught_up`). Taken
        # from the first fetch answer (sent after this), not asked with ListOffsets: tansu
        # answers that behind its log (the first offset of its last batch, plus one), and a
        # mirror that stopped there would serve the index before the newest.
        self._start_end: int | None = None
        self.caught_up = threading.Event()
        self._parts: dict[str, set[int]] = {}       # file -> the parts of it on disk
        self.last_error = ""                        # why the last message skipped was
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stream-ctr-kafka-mirror", daemon=True)

    def start(self) -> "KafkaMirror":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._consumer.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            for records in self._consumer.poll(timeout_ms=200).values():
                for r in records:
                    # A message it cannot take (a disk full or read-only, a message no
                    # trainer wrote) is skipped and said: raised, it ended this thread, and
                    # the server answered with its version for ever (or, before its first
                    # version, waited --follow-wait-s to say nothing was published).
                    try:
                        self.take(r.key or b"", r.value or b"", dict(r.headers or []))
                    except Exception as e:          # noqa: BLE001
                        self._skipped(r.offset, r.key, e)
            if not self.caught_up.is_set():
                if self._start_end is None:     # the high watermark a fetch answered; None before
                    self._start_end = self._consumer.highwater(self._tp)
                if self._start_end is not None and self._consumer.position(self._tp) >= self._start_end:
                    self.caught_up.set()

    def _skipped(self, offset: int, key: bytes | None, error: Exception) -> None:
        """Say (once, until the reason changes) that the message at `offset` was skipped."""
        reason = f"{type(error).__name__}: {error}"
        if reason != self.last_error:
            name = (key or b"").decode(errors="replace")
            print(f"stream-ctr serve: warning: skipped message {offset} ({name!r}) of "
                  f"{self.spec}: {reason}; the server keeps its "
                  "model until an index names only versions the mirror has whole (at the latest "
                  "the trainer's next full snapshot: serving.full_every)", file=sys.stderr, flush=True)
        self.last_error = reason

    def take(self, key: bytes, value: bytes, headers: dict[str, bytes]) -> None:
        """One message of the topic (see the module docstring)."""
        name = key.decode(errors="replace")
        if name == INDEX:
            self._index(value)
            return
        version, _, file = name.partition("/")
        if file not in VERSION_FILES or (self.root / version).exists():
            return                          # not ours, or a version sent again after a failure
        part, parts = int(headers.get("part", b"0")), int(headers.get("parts", b"1"))
        tmp = self.root / f".tmp-{version}"
        tmp.mkdir(exist_ok=True)
        (tmp / f"{file}.part-{part:08d}").write_bytes(value)      # parts on disk, not in memory
        got = self._parts.setdefault(name, set())
        got.add(part)
        if len(got) < parts:
            return
        with open(tmp / f".{file}", "wb") as out:
            for i in range(parts):
                piece = tmp / f"{file}.part-{i:08d}"
                with open(piece, "rb") as f:
                    shutil.copyfileobj(f, out)
                piece.unlink()
        os.replace(tmp / f".{file}", tmp / file)
        del self._parts[name]
        if all((tmp / f).exists() for f in VERSION_FILES):
            os.rename(tmp, self.root / version)

    def _index(self, value: bytes) -> None:
        raw = json.loads(value)
        index = PublishedIndex(int(raw["latest"]), int(raw["full"]), [int(v) for v in raw["chain"]])
        have = version_dirs(self.root)
        if not all(v in have for v in index.versions()):
            return                          # a part is missing: wait for a later index
        write_index(self.root, index)
        for v, path in have.items():        # older versions than the chain: not needed any more
            if v < index.full:
                shutil.rmtree(path, ignore_errors=True)


def is_kafka_target(spec: str | None) -> bool:
    return bool(spec) and spec.strip().lower().startswith("kafka://")


__all__ = ["KafkaMirror", "KafkaSink", "is_kafka_target", "read_index"]
