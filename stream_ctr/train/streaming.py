"""What a training run needs for a stream (Kafka) source and a file source does not.

- `StreamBatcher`: the micro-batcher with a latency budget (a partial batch
  trains once its oldest row has waited `data.max_batch_delay_s`) that can
  drop the pending rows of partitions a rebalance took away;
- `new_stream_batcher`: the batcher a run's flags ask for (fetch order, or
  `offset_batches.OffsetOrderBatcher`: batches a function of offsets);
- `open_dead_letter`: the run's dead-letter sink (the sink's mark in each
  checkpoint keeps dead letters exactly once across restarts).

`inputs.KafkaInput` cuts the stream's batches with them.

A Kafka run is one long epoch: it never "finishes" a topic, its positions are
never reset, and a resumed run continues the stream.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from stream_ctr.connectors.batch import Batch
from stream_ctr.connectors.dead_letter import DeadLetterFile, DeadLetterMark, ExactlyOnceDeadLetter, start_mark
from stream_ctr.connectors.files import detect_format
from stream_ctr.connectors.formats import RecordFormat
from stream_ctr.connectors.schema import Schema, parse_schema
from stream_ctr.connectors.kafka.options import KafkaUrl, dead_letter_problem, is_kafka_url, parse_kafka_url
from stream_ctr.connectors.kafka.positions import filter_partitions
from stream_ctr.train.batcher import MicroBatcher
from stream_ctr.train.offset_batches import JOURNAL_NAME, CutJournal, OffsetOrderBatcher
from stream_ctr.config import Config, ConfigError


class StreamBatcher(MicroBatcher):
    """A MicroBatcher that knows when its oldest pending row arrived."""

    def __init__(self, batch_size: int) -> None:
        super().__init__(batch_size)
        self._arrivals: list[list] = []          # [arrival time, rows still pending], oldest first

    def add(self, chunk: Batch) -> list[Batch]:
        if len(chunk):
            self._arrivals.append([time.monotonic(), len(chunk)])
        out = super().add(chunk)
        taken = len(out) * self.batch_size
        while taken and self._arrivals:
            used = min(taken, self._arrivals[0][1])
            self._arrivals[0][1] -= used
            taken -= used
            if not self._arrivals[0][1]:
                self._arrivals.pop(0)
        return out

    def flush(self) -> Batch | None:
        self._arrivals = []
        return super().flush()

    def oldest_wait_s(self) -> float:
        """Seconds the oldest pending row has waited (0 when none is pending)."""
        return time.monotonic() - self._arrivals[0][0] if self._arrivals else 0.0

    def discard(self, partitions: list[str]) -> int:
        """Drop pending rows of `partitions`; returns how many."""
        gone = set(partitions)
        before = self._rows
        self._pending = [b for b in (filter_partitions(b, gone) for b in self._pending) if len(b)]
        self._rows = sum(map(len, self._pending))
        if not self._rows:
            self._arrivals = []
        elif self._rows != before:          # keep the oldest arrival: the budget stays conservative
            self._arrivals = [[self._arrivals[0][0], self._rows]]
        return before - self._rows


def new_stream_batcher(cfg: Config, url: KafkaUrl, trained_records: Callable[[], int]
                       ) -> StreamBatcher | OffsetOrderBatcher:
    """The batcher of a stream run: by fetch order (default), or by offsets alone with
    `kafka.deterministic_batches` (its cut journal in the run directory).
    `trained_records` counts the records in the model (a resume's included)."""
    if not url.options.deterministic_batches:
        return StreamBatcher(cfg.data.batch_size)
    journal = CutJournal(Path(cfg.train.run_dir) / JOURNAL_NAME, trained_records())
    return OffsetOrderBatcher(cfg.data.batch_size, journal, trained_records)


def stream_url(cfg: Config) -> KafkaUrl | None:
    """The parsed kafka:// source of `cfg` (URL query over the [kafka] section), or None."""
    if not is_kafka_url(cfg.data.source):
        return None
    url = parse_kafka_url(cfg.data.source, cfg.kafka)
    problem = dead_letter_problem(url.options, url.topics[0])     # {topic} made it too long?
    if problem:
        raise ConfigError(problem)
    if cfg.data.holdout_fraction:
        raise ConfigError("data.holdout_fraction needs a file source; score a Kafka-trained "
                          "checkpoint on a file with `stream-ctr eval`")
    if cfg.data.epochs != 1:
        raise ConfigError(f"data.epochs must be 1 for a Kafka source (a stream is one long "
                          f"epoch), got {cfg.data.epochs}")
    return url


def source_format(cfg: Config) -> RecordFormat | Schema:
    """The record format of `cfg.data.source`, file or Kafka (a Schema when data.schema declares one)."""
    url = stream_url(cfg)
    if url is None:
        return detect_format(cfg.data.source, cfg.data.schema)[0]
    return declared_schema(cfg) or url.options.record_format


def file_prefix(fmt: RecordFormat | Schema) -> str:
    """What names a file of `fmt` on the command line: criteo:, avazu:, json:, csv:."""
    return fmt.encoding if isinstance(fmt, Schema) else fmt.name


def declared_schema(cfg: Config) -> Schema | None:
    """data.schema parsed (it was validated when set), or None."""
    return parse_schema(cfg.data.schema) if cfg.data.schema.strip() else None


def open_dead_letter(cfg: Config, url: KafkaUrl | None, resumed: dict | None) -> ExactlyOnceDeadLetter:
    """The run's dead-letter sink: the Kafka dead-letter topic, or the JSON-lines file,
    storing each rejected record once across restarts.  `resumed`: the `extra` of the
    checkpoint the run resumes from (its `dead_letter` mark), None for a run without one
    (it starts at the mark its start left in the run directory, see `start_mark`)."""
    if url is not None and url.options.dead_letter_topic:
        from stream_ctr.connectors.kafka.sink import KafkaDeadLetter, require_topics
        require_topics(url)                 # a typo must not leave a dead-letter topic behind
        topic = url.options.dead_letter_topic_for(url.topics[0])
        sink = KafkaDeadLetter(url, topic, cfg.data.dead_letter_max_bytes)
    else:
        path = cfg.data.dead_letter_path or Path(cfg.train.run_dir) / "dead_letter.jsonl"
        try:
            sink = DeadLetterFile(path, cfg.data.dead_letter_max_bytes)
        except OSError as e:
            if not cfg.data.dead_letter_path:
                raise
            raise ConfigError(f"data.dead_letter_path = {path}: cannot write there ({e.strerror}); "
                              "name a file in a writable directory, or leave it unset "
                              "(RUN_DIR/dead_letter.jsonl)") from None
    try:
        if resumed is None:
            mark = start_mark(Path(cfg.train.run_dir), sink)
        else:
            mark = DeadLetterMark.from_dict(resumed.get("dead_letter"))
        return ExactlyOnceDeadLetter(sink, mark, epoch=(resumed or {}).get("epoch", 0))
    except BaseException:
        sink.close()
        raise
