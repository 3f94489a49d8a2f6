"""Kafka source addresses and client options (the `[kafka]` config section).

A Kafka source is named by a URL::

    kafka://HOST:PORT[,HOST:PORT...]/TOPIC[,TOPIC...][?group=G&format=criteo&value=text&start=earliest&client=kafka-python]

The query keys override the `KafkaOptions` fields of the same name (`value`
is `value_format`).  Secrets never live in the URL or in the options (the
options are stored in every checkpoint): a SASL password is read from the
environment variable that `sasl_password_env` names.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from urllib.parse import parse_qsl, urlsplit

from stream_ctr.connectors.errors import SourceError
from stream_ctr.connectors.formats import FORMATS, RecordFormat

log = logging.getLogger("stream_ctr.connectors.kafka")

SCHEME = "kafka://"
VALUE_FORMATS = ("text", "json")
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
CLIENTS = ("kafka-python", "confluent")
URL_KEYS = {"group": "group", "format": "format", "value": "value_format", "start": "start",
            "client": "client"}
# Kafka's rule for topic names (its Topic.validate): at most 249 of these characters,
# and neither "." nor "..".
TOPIC_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
TOPIC_MAX_CHARS = 249


DEFAULT_GROUP = "stream-ctr"


@dataclass
class KafkaOptions:
    """Options of a kafka:// source; the `[kafka]` section of the config."""
    # Consumer group id (URL ?group=).  Without either, every such run shares this group
    # and its committed offsets: a trainer says so at its start (`default_group_warning`).
    group: str = DEFAULT_GROUP
    format: str = "criteo"                     # record format of the values: criteo | avazu
    # text: a TSV/CSV line per message, or many lines ("packed"); json: one
    # JSON object per message whose keys are the format's field names.
    value_format: str = "text"
    # Where a partition starts when neither the checkpoint nor the group has
    # an offset for it: earliest | latest | a time (ISO-8601 or ms since epoch).
    start: str = "earliest"
    # Bad records go here ("{topic}" = the source topic); "" = the run's
    # dead-letter file instead.
    dead_letter_topic: str = "{topic}.dead-letter"
    stop_when_idle_s: float = 0.0              # end the run after this long without records; 0 = never
    # Batches as a function of offsets alone: each takes a fixed share of every
    # partition in offset order, so a resumed or re-run job trains the same
    # batches and ends with the same model bit for bit (stream_ctr/train/offset_batches.py).
    # For one consumer per group; a partition that lags stalls a batch up to data.max_batch_delay_s.
    deterministic_batches: bool = False
    max_poll_records: int = 20000              # messages per fetch round
    fetch_max_bytes: int = 64 << 20
    max_partition_fetch_bytes: int = 16 << 20
    max_buffered_records: int = 262144         # decoded, undelivered rows before partitions pause
    poll_timeout_s: float = 0.5                # longest a read() waits for records
    # A killed trainer's restart waits up to this for the group to drop its old member
    # (a stopped one leaves the group); tansu admits any member only after half of it.
    session_timeout_ms: int = 30000
    heartbeat_interval_ms: int = 3000
    connect_timeout_s: float = 10.0            # start-up: broker unreachable -> error after this
    reconnect_backoff_max_s: float = 10.0      # mid-stream outage: retry interval grows to this
    commit_timeout_s: float = 30.0             # a group commit that fails longer is logged and skipped
    client_id: str = "stream-ctr"
    # The consumer library: kafka-python (default, pure Python) or confluent
    # (librdkafka: fetches in C off the GIL, ~2x the packed-message throughput;
    # pip install confluent-kafka).  Producers (replay, dead letters) use kafka-python.
    client: str = "kafka-python"
    security_protocol: str = "PLAINTEXT"       # PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL
    sasl_mechanism: str = ""                   # PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512
    sasl_username: str = ""
    sasl_password_env: str = "STREAM_CTR_KAFKA_PASSWORD"   # env var holding the SASL password
    ssl_cafile: str = ""
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    ssl_check_hostname: bool = True

    def problem(self, prefix: str = "kafka.") -> str | None:
        """The first option that cannot work, as a message naming it; None if all are fine."""
        checks = [
            (bool(self.group), f"{prefix}group must not be empty"),
            (self.format in FORMATS, f"{prefix}format must be one of {', '.join(sorted(FORMATS))}, "
                                     f"got {self.format!r}"),
            (self.value_format in VALUE_FORMATS,
             f"{prefix}value_format must be text or json, got {self.value_format!r}"),
            (self.stop_when_idle_s >= 0, f"{prefix}stop_when_idle_s must be >= 0"),
            (self.max_poll_records >= 1, f"{prefix}max_poll_records must be >= 1"),
            (self.fetch_max_bytes >= 1024 and self.max_partition_fetch_bytes >= 1024,
             f"{prefix}fetch_max_bytes and {prefix}max_partition_fetch_bytes must be >= 1024"),
            (self.max_buffered_records >= 1, f"{prefix}max_buffered_records must be >= 1"),
            (self.poll_timeout_s > 0, f"{prefix}poll_timeout_s must be > 0"),
            (self.heartbeat_interval_ms >= 1 and self.session_timeout_ms > self.heartbeat_interval_ms,
             f"{prefix}session_timeout_ms must exceed {prefix}heartbeat_interval_ms"),
            (self.connect_timeout_s > 0 and self.reconnect_backoff_max_s > 0 and self.commit_timeout_s > 0,
             f"{prefix}connect_timeout_s, reconnect_backoff_max_s and commit_timeout_s must be > 0"),
            (self.client in CLIENTS, f"{prefix}client must be one of {', '.join(CLIENTS)}, "
                                     f"got {self.client!r}"),
            (self.security_protocol in SECURITY_PROTOCOLS,
             f"{prefix}security_protocol must be one of {', '.join(SECURITY_PROTOCOLS)}, "
             f"got {self.security_protocol!r}"),
            (self.sasl_mechanism in SASL_MECHANISMS,
             f"{prefix}sasl_mechanism must be one of {', '.join(m for m in SASL_MECHANISMS if m)}, "
             f"got {self.sasl_mechanism!r}"),
            (self.sasl_mechanism == "" or self.security_protocol.startswith("SASL"),
             f"{prefix}sasl_mechanism needs {prefix}security_protocol SASL_PLAINTEXT or SASL_SSL"),
        ]
        for ok, message in checks:
            if not ok:
                return message
        try:
            start_timestamp_ms(self.start)
        except ValueError:
            return (f"{prefix}start must be earliest, latest, an ISO-8601 time or ms since the "
                    f"epoch, got {self.start!r}")
        # The source topic is not known here: a one-character one stands in for {topic}
        # (`dead_letter_problem` checks the name a run really uses).
        return dead_letter_problem(self, "t", prefix)

    def dead_letter_topic_for(self, topic: str) -> str:
        """The dead-letter topic of a run reading `topic` ("" = the run's dead-letter file)."""
        return self.dead_letter_topic.replace("{topic}", topic)

    @property
    def record_format(self) -> RecordFormat:
        return FORMATS[self.format]


@dataclass(frozen=True)
class KafkaUrl:
    """A parsed kafka:// URL; `options` has the URL's query applied."""
    bootstrap: tuple[str, ...]      # "host:port"
    topics: tuple[str, ...]
    options: KafkaOptions
    # False when neither the URL's ?group= nor kafka.group named the group (the default).
    group_named: bool = True

    @property
    def text(self) -> str:
        return f"{SCHEME}{','.join(self.bootstrap)}/{','.join(self.topics)}"


def topic_name_problem(name: str) -> str | None:
    """Why Kafka would refuse `name` as a topic name; None if it is a valid one."""
    if not name or name in (".", ".."):
        return "is not a valid topic name"
    if len(name) > TOPIC_MAX_CHARS:
        return f"is not a valid topic name ({len(name)} characters; at most {TOPIC_MAX_CHARS})"
    if not set(name) <= TOPIC_CHARS:
        return "is not a valid topic name (letters, digits, '.', '_', '-')"
    return None


def dead_letter_problem(options: KafkaOptions, topic: str, prefix: str = "kafka.") -> str | None:
    """A message naming the dead-letter topic option if the topic it gives a run that
    reads `topic` is not a valid name (the producer would fail at the first bad record,
    in the middle of the stream); None if it is fine or unset."""
    if not options.dead_letter_topic:
        return None
    name = options.dead_letter_topic_for(topic)
    why = topic_name_problem(name)
    if why is None:
        return None
    def short(text: str) -> str:
        return repr(text if len(text) <= 60 else f"{text[:40]}...{text[-10:]}")
    what = (short(name) if name == options.dead_letter_topic
            else f"{short(options.dead_letter_topic)} gives {short(name)}, which")
    return (f"{prefix}dead_letter_topic {what} {why}; set another name ({{topic}} stands for the "
            f"source topic), or \"\" to write rejected records to the run's dead-letter file")


def is_kafka_url(spec: str) -> bool:
    return spec.strip().lower().startswith(SCHEME)


def parse_kafka_url(url: str, base: KafkaOptions | None = None) -> KafkaUrl:
    """Parse `url`; its query overrides fields of `base` (default options). SourceError if malformed."""
    example = "kafka://HOST:PORT/TOPIC?group=G"
    if not is_kafka_url(url):
        raise SourceError(f"{url!r} is not a Kafka URL (expected {example})")
    try:
        parts = urlsplit(url.strip())
    except ValueError as e:         # e.g. an unclosed IPv6 bracket: "Invalid IPv6 URL"
        raise SourceError(f"{url!r} is not a valid URL ({e}; expected {example})") from None
    hosts = tuple(h.strip() for h in parts.netloc.split(",") if h.strip())
    topics = tuple(t.strip() for t in parts.path.lstrip("/").split(",") if t.strip())
    if not hosts:
        raise SourceError(f"{url!r} names no broker (expected {example})")
    for host in hosts:
        name, colon, port = host.rpartition(":")
        if not colon or not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise SourceError(f"{url!r}: broker {host!r} must be HOST:PORT (expected {example})")
    if not topics:
        raise SourceError(f"{url!r} names no topic (expected {example})")
    for topic in topics:
        why = topic_name_problem(topic)
        if why is not None:
            raise SourceError(f"{url!r}: {topic!r} {why}")
    options = dataclasses.replace(base or KafkaOptions())
    group_named = options.group != DEFAULT_GROUP
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key not in URL_KEYS:
            raise SourceError(f"{url!r}: unknown parameter {key!r} (known: {', '.join(URL_KEYS)}; "
                              "other options go in the [kafka] config section)")
        setattr(options, URL_KEYS[key], value)
        group_named |= key == "group"
    problem = options.problem(prefix="kafka.")
    if problem:
        raise SourceError(f"{url!r}: {problem}")
    return KafkaUrl(hosts, topics, options, group_named)


def default_group_warning(url: KafkaUrl) -> str | None:
    """The warning a trainer prints at its start when no group was named (neither
    ?group= nor kafka.group): it reads in the default group, whose committed offsets
    every such run shares, so one run can take up where an unrelated one stopped."""
    if url.group_named:
        return None
    return (f"kafka: the URL names no group (?group=) and kafka.group is not set: reading "
            f"{', '.join(url.topics)} in the default group {url.options.group!r}, whose committed "
            f"offsets every run without a group shares; give this run its own with "
            f"{url.text}?group=NAME")


def start_timestamp_ms(start: str) -> int | None:
    """None for earliest/latest, else the start time in ms since the epoch; ValueError if neither."""
    if start in ("earliest", "latest"):
        return None
    if start.lstrip("-").isdigit():
        return int(start)
    moment = datetime.fromisoformat(start)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1000)


def client_config(url: KafkaUrl) -> dict:
    """kafka-python keyword arguments shared by consumers, producers and admin clients."""
    o = url.options
    config: dict = {"bootstrap_servers": list(url.bootstrap), "client_id": o.client_id,
                    "security_protocol": o.security_protocol,
                    "bootstrap_timeout_ms": int(o.connect_timeout_s * 1000),
                    "reconnect_backoff_max_ms": int(o.reconnect_backoff_max_s * 1000)}
    if o.security_protocol in ("SSL", "SASL_SSL"):
        config.update(ssl_check_hostname=o.ssl_check_hostname, ssl_cafile=o.ssl_cafile or None,
                      ssl_certfile=o.ssl_certfile or None, ssl_keyfile=o.ssl_keyfile or None)
    if o.sasl_mechanism:
        config.update(sasl_mechanism=o.sasl_mechanism, sasl_plain_username=o.sasl_username,
                      sasl_plain_password=sasl_password(o))
    return config


def sasl_password(o: KafkaOptions) -> str:
    """The SASL password from the environment variable `o.sasl_password_env`; SourceError if unset."""
    password = os.environ.get(o.sasl_password_env)
    if password is None:
        raise SourceError(f"kafka.sasl_mechanism is {o.sasl_mechanism} but the environment "
                          f"variable {o.sasl_password_env} (kafka.sasl_password_env) is not set")
    return password


def check_crc32c() -> bool:
    """True when kafka-python verifies record CRCs with the C `crc32c` package (else ~6x slower)."""
    from kafka.record import util
    fast = getattr(util, "crc32c_c", None) is not None
    if not fast:
        log.warning("kafka: the crc32c package is not installed; kafka-python verifies record "
                    "checksums in pure Python, about 6x slower (pip install crc32c)")
    return fast


def partition_name(topic: str, partition: int) -> str:
    """Source partition name used in Batch.partitions and positions: "topic/partition"."""
    return f"{topic}/{partition}"


def split_partition_name(name: str) -> tuple[str, int]:
    topic, _, partition = name.rpartition("/")
    return topic, int(partition)
