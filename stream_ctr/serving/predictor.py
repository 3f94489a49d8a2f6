"""The predict server's core, independent of the HTTP stack: request bodies -> probabilities.

    request body ──parse──> LF-joined lines ──decode──> Batch ──queue──> scoring thread
                                                                          │ coalesces what waits
    answer <── {"model_version", "probabilities"} <── its slice ──────────┘ (one Scorer.score)

* **Bodies** (`parse_body`): newline-delimited records (Criteo TSV / Avazu CSV
  lines, or JSON lines for a bundle with a declared schema), or a JSON array of
  such lines (strings) or, for a JSON schema, of objects. Records are the
  bundle's training format without a header. Criteo/Avazu lines keep their
  label column (any valid label, e.g. 0; it is ignored); under a declared
  JSON schema the label, the weight and the event time (unless a time_part
  feature reads it) are not read: leave them out or send anything.
* **Bad records** make the whole request a 400 whose message names each bad
  record (0-based index in the request, reason, detail; the first 20): a client
  sends records it built, so a bad one is a bug to fix, not a row to skip.
* **Batching** (`Batcher`): one scoring thread takes the oldest waiting request
  and every other one waiting behind it, up to `max_batch_records` records and
  `max_wait_s` of waiting for more, scores them in one vectorized call and
  hands each request its slice. A single request alone in the queue is scored
  exactly as `stream-ctr predict` scores the same lines in one chunk (bit for
  bit); coalesced with others its rows go through larger matmuls, which may
  differ in the last float32 bit.
* **Hot swap** (`Predictor.swap`): the scoring thread reads the scorer under a
  lock held only for that read, and every answer names the version that
  scored it, so a swap never pauses requests and never mixes two models in one
  answer.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import orjson

from stream_ctr.connectors.batch import Batch, Rejected
from stream_ctr.connectors.decode import decode_lines
from stream_ctr.connectors.formats import RecordFormat, format_by_name
from stream_ctr.connectors.schema import (EventTimeField, LabelField, Schema, TimePartField, WeightField,
                                          parse_schema)
from stream_ctr.connectors.schema_decode import decode_records
from stream_ctr.serving.bundle import Bundle
from stream_ctr.serving.metrics import ModelStatus, ServingMetrics
from stream_ctr.serving.options import MAX_BODY_BYTES
from stream_ctr.serving.scorer import Scorer

MAX_REASONS = 20                    # bad records named in one 400 answer


class RequestError(ValueError):
    """A request the client must fix: answered with `status` and this message."""

    def __init__(self, message: str, status: int = 400, records: list[dict] | None = None) -> None:
        super().__init__(message)
        self.status, self.records = status, records or []

    def body(self) -> bytes:
        out: dict[str, Any] = {"error": str(self)}
        if self.records:
            out["records"] = self.records
        return orjson.dumps(out)


def bundle_layout(bundle: Bundle) -> RecordFormat | Schema:
    """The record layout the bundle's model takes: its declared schema, else its named format."""
    rf = bundle.manifest["record_format"]
    if rf.get("schema"):
        return for_scoring(parse_schema(rf["schema"], origin=f"{bundle.path}/manifest.json schema"))
    return format_by_name(rf["name"])


# A path no record holds: a field the server does not read decodes to its default.
UNREAD_PATH = "__stream_ctr_not_read_when_scoring__"


def for_scoring(schema: Schema) -> Schema:
    """`schema` as the server reads a request: the label and the weight (outcomes, unknown
    when scoring) and the event time (unless a time_part feature is computed from it)
    are not read, so a request may leave them out or carry anything there. A csv
    record's columns are positional: there the label may be left empty (it defaults to 0)."""
    if schema.encoding != "json":
        return dataclasses.replace(schema, fields=tuple(
            dataclasses.replace(f, default=0) if isinstance(f, LabelField) and f.default is None else f
            for f in schema.fields))
    uses_time = any(isinstance(f, TimePartField) for f in schema.fields)

    def unread(f):
        if isinstance(f, LabelField):
            return dataclasses.replace(f, path=UNREAD_PATH, default=0, threshold=None)
        if isinstance(f, WeightField):
            return dataclasses.replace(f, path=UNREAD_PATH, default=1.0)
        if isinstance(f, EventTimeField) and not uses_time:
            return dataclasses.replace(f, path=UNREAD_PATH, default=0, unit="ms", format="")
        return f
    return dataclasses.replace(schema, fields=tuple(unread(f) for f in schema.fields))


def parse_body(body: bytes, content_type: str, layout: RecordFormat | Schema) -> bytes:
    """The records of a request body as LF-terminated lines (what the decoders take)."""
    if len(body) > MAX_BODY_BYTES:
        raise RequestError(f"request body of {len(body):,} bytes; at most {MAX_BODY_BYTES:,}", 413)
    is_json = "json" in content_type.split(";")[0] and "ndjson" not in content_type
    if is_json or body[:1] == b"[":
        try:
            items = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise RequestError(f"body is not valid JSON: {e}") from None
        if not isinstance(items, list):
            raise RequestError("a JSON body must be an array of records (strings, or objects for a "
                               "JSON-schema bundle)")
        return _join_items(items, layout)
    text = body[:-1] if body.endswith(b"\n") else body       # one trailing LF ends the last line
    return text + b"\n" if text else b""


def _join_items(items: list[Any], layout: RecordFormat | Schema) -> bytes:
    takes_objects = isinstance(layout, Schema) and layout.encoding == "json"
    lines = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            line = item.encode()
        elif isinstance(item, dict) and takes_objects:
            line = orjson.dumps(item)
        else:
            want = "a string (one line) or an object" if takes_objects else "a string (one line)"
            raise RequestError(f"record {i}: {type(item).__name__}, expected {want}",
                               records=[{"index": i, "reason": "not_a_record"}])
        if b"\n" in line.rstrip(b"\r\n"):
            raise RequestError(f"record {i} holds a line break; one record is one line",
                               records=[{"index": i, "reason": "line_break"}])
        lines.append(line.rstrip(b"\r\n"))
    return b"".join(x + b"\n" for x in lines)


def decode_request(lines: bytes, layout: RecordFormat | Schema) -> Batch:
    """Decode LF-terminated lines; RequestError naming every bad record (the first 20)."""
    if not lines:
        raise RequestError("no records in the request body")
    if isinstance(layout, Schema):
        batch, bad = decode_records(lines, layout, "request", 0)
    else:
        batch, bad = decode_lines(lines, layout, "request", 0)
    if bad:
        named = [_describe(r, layout) for r in bad[:MAX_REASONS]]
        first = named[0]
        raise RequestError(f"{len(bad)} of {len(batch) + len(bad)} records do not decode as "
                           f"{getattr(layout, 'name', 'schema')} records; first: record "
                           f"{first['index']}: {first['reason']}"
                           + (f" ({first['detail']})" if first.get("detail") else ""), records=named)
    return batch


def _describe(r: Rejected, layout: RecordFormat | Schema) -> dict[str, Any]:
    out: dict[str, Any] = {"index": int(r.offset), "reason": r.reason}
    detail = r.detail
    if not detail and isinstance(layout, RecordFormat):
        sep = {"\t": "tab", ",": "comma"}.get(layout.delimiter, repr(layout.delimiter))
        detail = {"field_count": f"expected {layout.n_fields} {sep}-separated fields "
                                 f"({', '.join(layout.field_names[:3])}, ...; the label may be any 0/1)",
                  "bad_label": "the label field (criteo: the first, avazu: click) must be 0 or 1; it is ignored",
                  "bad_integer": "an integer field holds something else",
                  "bad_time": "the hour field is not YYMMDDHH"}.get(r.reason, "")
    if detail:
        out["detail"] = detail
    return out


@dataclass
class _Job:
    batch: Batch
    done: Callable[["_Job"], None]
    probabilities: np.ndarray | None = None
    version: str = ""
    error: BaseException | None = None


class Batcher:
    """A small queue and one scoring thread that coalesces the requests waiting in it.

    `max_batch_records` bounds one scoring call (a request larger than it is scored
    alone); `max_wait_s` is how long the thread waits for more requests once it
    has one (0: take only what is already waiting). `coalesce=False` scores each
    request alone (the baseline `stream-ctr bench serve` compares against)."""

    def __init__(self, scorer: Callable[[], tuple[Scorer, str]], metrics: ServingMetrics,
                 max_batch_records: int = 4096, max_wait_s: float = 0.0, coalesce: bool = True,
                 max_queue: int = 1024) -> None:
        self.scorer, self.metrics = scorer, metrics
        self.max_batch_records, self.max_wait_s, self.coalesce = max_batch_records, max_wait_s, coalesce
        self._queue: queue.Queue[_Job | None] = queue.Queue(max_queue)
        self._thread = threading.Thread(target=self._run, name="stream-ctr-scoring", daemon=True)
        self._thread.start()

    def submit(self, batch: Batch, done: Callable[[_Job], None]) -> None:
        """Queue a decoded request; `done(job)` runs on the scoring thread when it is scored."""
        try:
            self._queue.put_nowait(_Job(batch, done))
        except queue.Full:
            raise RequestError("the scoring queue is full; retry later", 503) from None

    def score(self, batch: Batch) -> tuple[np.ndarray, str]:
        """Blocking: (probabilities, version) of one request."""
        event = threading.Event()
        job_box: list[_Job] = []
        self.submit(batch, lambda job: (job_box.append(job), event.set()))
        event.wait()
        job = job_box[0]
        if job.error is not None:
            raise job.error
        return job.probabilities, job.version

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _take(self, first: _Job) -> tuple[list[_Job], bool]:
        """`first` and the jobs waiting behind it that fit; (jobs, whether to stop after)."""
        jobs, n = [first], len(first.batch)
        deadline = time.monotonic() + self.max_wait_s
        while self.coalesce and n < self.max_batch_records:
            try:
                wait = deadline - time.monotonic()
                job = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                return jobs, True
            if n + len(job.batch) > self.max_batch_records:
                self._carry = job               # scored first in the next call
                break
            jobs.append(job)
            n += len(job.batch)
        return jobs, False

    def _run(self) -> None:
        self._carry: _Job | None = None
        stop = False
        while not stop:
            first = self._carry if self._carry is not None else self._queue.get()
            self._carry = None
            if first is None:
                return
            jobs, stop = self._take(first)
            scorer, version = self.scorer()          # the model answering this call, read under the swap lock
            try:
                batch = jobs[0].batch if len(jobs) == 1 else Batch.concat([j.batch for j in jobs])
                probs = scorer.score(batch)
                self.metrics.batch_records.observe(len(batch))
                at = 0
                for j in jobs:
                    j.probabilities, j.version = probs[at:at + len(j.batch)], version
                    at += len(j.batch)
            except BaseException as e:            # noqa: BLE001 - handed to every request of the call
                for j in jobs:
                    j.error = e
            for j in jobs:
                j.done(j)


class Predictor:
    """A scorer behind a lock, the batcher, the metrics: what every HTTP front end calls."""

    def __init__(self, scorer: Scorer, metrics: ServingMetrics | None = None, **batching: Any) -> None:
        from prometheus_client import CollectorRegistry
        self._lock = threading.Lock()
        self._scorer = scorer
        scorer.live_since_s = time.time()
        self.layout = bundle_layout(scorer.bundle)
        self.metrics = metrics or ServingMetrics(CollectorRegistry(), self.model)
        self.batcher = Batcher(self.current, self.metrics, **batching)
        self.follow_error = ""          # set by a Follower: why its last poll did not apply

    def current(self) -> tuple[Scorer, str]:
        with self._lock:
            return self._scorer, self._scorer.version

    def model(self) -> ModelStatus:
        """The version, step, checkpoint time and freshness of the model answering now."""
        scorer, version = self.current()
        ckpt = scorer.bundle.manifest["checkpoint"]
        published = scorer.bundle.manifest.get("publish") or {}
        since = scorer.live_since_s
        fresh = since - scorer.newest_arrival_s if since and scorer.newest_arrival_s is not None else None
        event = since - scorer.newest_event_ms / 1000 if since and scorer.newest_event_ms is not None else None
        return ModelStatus(version, int(ckpt["step"]), ckpt.get("time_s"), published.get("version"),
                           fresh, event)

    def swap(self, scorer: Scorer) -> Scorer:
        """Answer with `scorer` from the next scoring call on; returns the one it replaces.
        It must take the same records (format, fields) as the one it replaces."""
        new = bundle_layout(scorer.bundle)
        if new != self.layout or (scorer.n_fields, scorer.n_dense) != (self.current()[0].n_fields,
                                                                        self.current()[0].n_dense):
            raise ValueError(f"cannot swap in {scorer.bundle.path}: it takes other records than "
                             f"the model serving now")
        with self._lock:
            scorer.live_since_s = time.time()      # the next scoring call answers with it
            old, self._scorer = self._scorer, scorer
        self.metrics.swaps.inc()
        return old

    def decode(self, body: bytes, content_type: str = "") -> Batch:
        return decode_request(parse_body(body, content_type, self.layout), self.layout)

    @staticmethod
    def answer(probabilities: np.ndarray, version: str) -> bytes:
        # float32 -> float64 is exact, and orjson writes the shortest text that reads back to
        # that double: the client gets the float32 values bit for bit.
        return orjson.dumps({"model_version": version,
                             "probabilities": probabilities.astype(np.float64).tolist()})

    def predict(self, body: bytes, content_type: str = "") -> tuple[int, bytes]:
        """(HTTP status, JSON body) of one POST /predict, blocking until it is scored."""
        t0 = time.perf_counter()
        try:
            probs, version = self.batcher.score(self.decode(body, content_type))
            status, out = 200, self.answer(probs, version)
            self.metrics.records_scored.inc(len(probs))
        except RequestError as e:
            status, out = e.status, e.body()
        except Exception as e:          # noqa: BLE001 - a bug or a broken model: say so, keep serving
            status, out = 500, orjson.dumps({"error": f"scoring failed: {type(e).__name__}: {e}"})
        self.metrics.requests.labels(str(status)).inc()
        self.metrics.request_seconds.observe(time.perf_counter() - t0)
        return status, out

    def health(self) -> bytes:
        """GET /healthz: the model answering; with `follow_error` while a follower's last poll
        failed (why the model does not advance: it still answers, so the status stays ok)."""
        m = self.model()
        out = {"status": "ok", "model_version": m.version, "step": m.step}
        if m.published_version is not None:
            out["published_version"] = m.published_version
        if self.follow_error:
            out["follow_error"] = self.follow_error
        return orjson.dumps(out)

    def close(self) -> None:
        self.batcher.close()
