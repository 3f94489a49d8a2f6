"""`stream-ctr serve`: a real server process answers with the run's own numbers.

Must-show: train on the bundled Criteo sample holding out the last 10%, export,
start `stream-ctr serve` as a subprocess on a free loopback port, POST the 1,449
held-out lines: the served probabilities' AUC is the run's test AUC, and they are
`stream-ctr predict`'s probabilities bit for bit. Then: a bad request is a 400
naming the record, /healthz, /metrics, and models swapped while requests run.
"""
from __future__ import annotations

import gzip
import http.client
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stream_ctr.cli.main import main
from stream_ctr.connectors.decode import decode_lines
from stream_ctr.connectors.files import SAMPLE_PATHS
from stream_ctr.connectors.formats import CRITEO
from stream_ctr.serving.bundle import read_bundle
from stream_ctr.serving.metrics import SERIES
from stream_ctr.serving.predictor import Predictor, RequestError
from stream_ctr.serving.scorer import Scorer
from stream_ctr.serving.server import Server
from stream_ctr.train.evaluation import accuracy
from stream_ctr.train.loop import held_out_start, train
from tests.stream_ctr.store.helpers import small_config

HOLDOUT = 0.1
N_SAMPLE = 14_493


def sample_lines() -> list[bytes]:
    with gzip.open(SAMPLE_PATHS["criteo"], "rb") as f:
        return f.read().splitlines()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The whole sample trained with the last 10% held out; bundles of the final checkpoint
    and of step 40."""
    tmp = tmp_path_factory.mktemp("serve")
    cfg = small_config(tmp / "run", tiered=False)
    cfg.data.holdout_fraction = HOLDOUT
    cfg.train.checkpoint_every_batches = 40
    summary = train(cfg, show_progress=False)
    assert main(["export", cfg.train.run_dir, "--out", str(tmp / "bundle"), "--quiet"]) == 0
    old = Path(cfg.train.run_dir) / "checkpoints" / "ckpt-00000040"
    assert main(["export", str(old), "--out", str(tmp / "bundle40"), "--quiet"]) == 0
    return tmp, summary


@pytest.fixture(scope="module")
def served(run):
    """`stream-ctr serve BUNDLE --port 0` as a subprocess; yields its port."""
    tmp, _ = run
    proc = subprocess.Popen([sys.executable, "-m", "stream_ctr", "serve", str(tmp / "bundle"),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()           # "serving VERSION on http://127.0.0.1:PORT ..."
        assert line.startswith("serving "), (line, proc.stderr.read() if proc.poll() is not None else "")
        yield int(line.split("http://127.0.0.1:")[1].split()[0])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def request(port: int, method: str, path: str, body: bytes = b"",
            content_type: str = "text/plain") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body or None, headers={"Content-Type": content_type})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_served_held_out_lines_give_the_runs_test_auc_and_predicts_numbers(run, served, capsys):
    tmp, summary = run
    start = held_out_start(N_SAMPLE, HOLDOUT)
    held = sample_lines()[start:]
    assert len(held) == 1449 == summary.test["records"]
    status, body = request(served, "POST", "/predict", b"\n".join(held) + b"\n")
    assert status == 200, body
    answer = json.loads(body)
    manifest = read_bundle(tmp / "bundle").manifest
    assert answer["model_version"] == f"{manifest['checkpoint']['name']}@{manifest['checkpoint']['step']}"
    probs = np.array(answer["probabilities"], dtype=np.float64)
    served32 = probs.astype(np.float32)
    assert np.array_equal(served32.astype(np.float64), probs)   # the float32 values, exactly
    labels = decode_lines(b"\n".join(held), CRITEO, "held", 0)[0].labels
    assert abs(accuracy(served32, labels).auc - summary.test["auc"]) <= 1e-6
    # `stream-ctr predict` on the same lines: the same float32 numbers, bit for bit.
    assert main(["predict", str(tmp / "bundle"), "--out", str(tmp / "p.npy"), "--quiet"]) == 0
    assert np.array_equal(np.load(tmp / "p.npy"), served32)
    # The same records as a JSON array of lines. 50 rows go through smaller matmuls than
    # 1,449 do (another blocking of the sums): equal to a float32 rounding, not bit for bit.
    status, body = request(served, "POST", "/predict",
                           json.dumps([x.decode() for x in held[:50]]).encode(), "application/json")
    assert status == 200
    assert np.abs(np.array(json.loads(body)["probabilities"], np.float32) - served32[:50]).max() <= 1e-6


def test_a_bad_record_is_a_400_that_names_it(served):
    good = sample_lines()[0].decode()
    status, body = request(served, "POST", "/predict", f"{good}\n1\t2\t3\n{good}\n".encode())
    err = json.loads(body)
    assert status == 400
    assert "record 1: field_count" in err["error"] and "expected 40 tab-separated fields" in err["error"] \
        or "expected 40 tab-separated fields" in err["records"][0]["detail"]
    assert err["records"][0]["index"] == 1
    status, body = request(served, "POST", "/predict", good.replace("0", "x", 1).encode())
    assert status == 400 and json.loads(body)["records"][0]["reason"] == "bad_label"
    for bad in (b"[1, 2]", b"[\"unterminated", b"{\"a\": 1}", b""):
        status, body = request(served, "POST", "/predict", bad, "application/json")
        assert status == 400 and json.loads(body)["error"], bad
    assert request(served, "GET", "/nowhere")[0] == 404


def test_healthz_and_metrics(run, served):
    status, body = request(served, "GET", "/healthz")
    assert status == 200 and json.loads(body)["status"] == "ok"
    request(served, "POST", "/predict", sample_lines()[0])
    status, body = request(served, "GET", "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    samples = {s.name: s for f in families.values() for s in f.samples}
    for name in SERIES:
        base = name.removesuffix("_total")
        assert base in families, name
    assert samples["stream_ctr_serving_records_scored_total"].value >= 1
    assert samples["stream_ctr_serving_request_seconds_count"].value >= 1
    info = samples["stream_ctr_serving_model_info"]
    assert info.labels["version"] == json.loads(request(served, "GET", "/healthz")[1])["model_version"]
    assert 0 <= samples["stream_ctr_serving_model_age_seconds"].value < 3600
    # as the trainer's scrape: build info, the process, no `_created` series
    from stream_ctr import __version__
    assert samples["stream_ctr_serving_build_info"].labels["version"] == __version__
    assert samples["process_resident_memory_bytes"].value > 0
    assert not [name for name in samples if name.endswith("_created")]
    # one process, as a trainer alone: no series carries a rank label
    assert not [s.name for f in families.values() for s in f.samples if "rank" in s.labels]


def test_a_bundle_without_a_checkpoint_time_still_serves(run, tmp_path):
    """Bundles exported before manifests carried `checkpoint.time_s`: no model age, no error."""
    tmp, _ = run
    bundle = read_bundle(tmp / "bundle")
    bundle.manifest["checkpoint"].pop("time_s")
    predictor = Predictor(Scorer(bundle))
    try:
        status, _ = predictor.predict(sample_lines()[0])
        assert status == 200
        names = {s.name for f in predictor.metrics.registry.collect() for s in f.samples}
        assert "stream_ctr_serving_model_step" in names and "stream_ctr_serving_model_age_seconds" not in names
    finally:
        predictor.close()


def test_swapping_models_while_requests_run(run):
    """Clients post all the time while the model flips between two bundles; every answer
    is the named model's answer, none fails, and both models answered."""
    tmp, _ = run
    new, old = Scorer(read_bundle(tmp / "bundle")), Scorer(read_bundle(tmp / "bundle40"))
    lines = sample_lines()[:64]
    body = b"\n".join(lines)
    batch = decode_lines(body, CRITEO, "x", 0)[0]
    expect = {new.version: new.score(batch), old.version: old.score(batch)}
    assert np.abs(expect[new.version] - expect[old.version]).max() > 1e-3
    server = Server(new, port=0, max_wait_s=0.002).start()
    seen: list[tuple[str, np.ndarray]] = []
    errors: list[object] = []
    stop = threading.Event()

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        while not stop.is_set():
            conn.request("POST", "/predict", body=body)
            resp = conn.getresponse()
            out = resp.read()
            if resp.status != 200:
                errors.append(out)
                continue
            a = json.loads(out)
            seen.append((a["model_version"], np.array(a["probabilities"], np.float32)))
        conn.close()

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        give_up = time.monotonic() + 120                # a client that died must not hang the test
        for i in range(20):
            server.swap(old if i % 2 == 0 else new)
            while len(seen) < 5 * (i + 1) and not errors and time.monotonic() < give_up:
                threading.Event().wait(0.005)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        server.close()
    assert errors == []
    assert {v for v, _ in seen} == set(expect)
    for version, probs in seen:         # coalesced calls may differ in the last float32 bit
        assert np.abs(probs - expect[version]).max() <= 1e-6
    swaps = server.predictor.metrics.registry.get_sample_value("stream_ctr_serving_model_swaps_total")
    assert swaps == 20


def test_swap_refuses_a_model_of_other_records(run):
    tmp, _ = run
    predictor = Predictor(Scorer(read_bundle(tmp / "bundle")))
    try:
        other = Scorer(read_bundle(tmp / "bundle"))
        other.n_dense = 0
        with pytest.raises(ValueError, match="other records"):
            predictor.swap(other)
    finally:
        predictor.close()


def test_concurrent_requests_are_coalesced_into_one_scoring_call(run):
    tmp, _ = run
    scorer = Scorer(read_bundle(tmp / "bundle"))
    predictor = Predictor(scorer, max_wait_s=0.5, max_batch_records=1000)
    lines = sample_lines()
    bodies = [b"\n".join(lines[i * 10:(i + 1) * 10]) for i in range(8)]
    results: list[tuple[int, bytes] | None] = [None] * 8
    try:
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, predictor.predict(bodies[i])))
                   for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        registry = predictor.metrics.registry
        calls = registry.get_sample_value("stream_ctr_serving_batch_records_count")
        assert registry.get_sample_value("stream_ctr_serving_batch_records_sum") == 80
        assert calls < 8                                  # some requests shared a call
        for i, (status, out) in enumerate(results):
            assert status == 200
            alone = scorer.score(decode_lines(bodies[i], CRITEO, "x", 0)[0])
            assert np.abs(np.array(json.loads(out)["probabilities"], np.float32) - alone).max() <= 1e-6
    finally:
        predictor.close()


def test_request_error_of_an_oversized_body():
    with pytest.raises(RequestError) as e:
        from stream_ctr.serving.predictor import MAX_BODY_BYTES, parse_body
        parse_body(b"x" * (MAX_BODY_BYTES + 1), "", CRITEO)
    assert e.value.status == 413


def test_bench_serve_prints_its_rows(run, capsys):
    """`stream-ctr bench serve` runs end to end (numbers are not asserted: the machine is shared)."""
    tmp, _ = run
    out = json.loads(_cli(capsys, "bench", "serve", str(tmp / "bundle"), "--clients", "2",
                          "--seconds", "0.3", "--warmup-seconds", "0.1", "--batching", "coalesce"))
    rows = out["rows"]
    assert [(r["http"], r["batching"], r["records_per_request"]) for r in rows] == \
        [("stdlib", "coalesce", 1), ("stdlib", "coalesce", 256)]
    assert all(r["requests"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0 for r in rows)


@pytest.mark.parametrize("via", ["dir", "kafka"])
def test_bench_serve_measures_freshness_end_to_end(run, kafka, capsys, via):
    """`--measure freshness` on the test broker: a trainer publishing every second (into a
    directory, or through a topic), a server following; each applied version has a freshness
    (values not asserted: a shared machine)."""
    tmp, _ = run
    out = json.loads(_cli(capsys, "bench", "serve", str(tmp / "bundle"), "--measure", "freshness",
                          "--publish-every-s", "1", "--freshness-seconds", "6", "--rate", "1000",
                          "--broker", f"kafka://{kafka.bootstrap}", "--publish-via", via))
    fresh = out["freshness"]
    assert "rows" not in out and fresh["versions"] >= 1 and fresh["publish_every_s"] == 1
    assert fresh["via"] == via
    assert 0 < fresh["freshness_min_s"] <= fresh["freshness_p50_s"] <= fresh["freshness_max_s"]


def _cli(capsys, *args) -> str:
    assert main([*args, "--json"]) == 0
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_a_json_schema_bundle_takes_objects_or_lines(tmp_path):
    """For a declared JSON schema, a JSON array of objects decodes like the same JSON lines,
    the label may be left out, and a record missing a feature is named with the field."""
    from stream_ctr.connectors.schema import parse_schema
    from stream_ctr.connectors.synth_json import AD_LOG_SCHEMA, write_synthetic_json
    from stream_ctr.serving.predictor import decode_request, parse_body, for_scoring
    schema = for_scoring(parse_schema(AD_LOG_SCHEMA))
    write_synthetic_json(tmp_path / "log.jsonl", 20, write_probs=False)
    lines = (tmp_path / "log.jsonl").read_bytes().splitlines()
    objects = [json.loads(x) for x in lines]
    for o in objects[::2]:
        del o["clicked"]                                    # no label: still a record to score
    objects[1]["clicked"] = "maybe"                         # nor is a label read when there is one
    del objects[3]["ts"]                                    # the event time is no model input here
    as_objects = decode_request(parse_body(json.dumps(objects).encode(), "application/json", schema), schema)
    as_lines = decode_request(parse_body(b"\n".join(lines), "application/x-ndjson", schema), schema)
    assert len(as_objects) == 20 and np.array_equal(as_objects.keys, as_lines.keys)
    assert np.array_equal(as_objects.dense, as_lines.dense)
    del objects[2]["ad_id"]
    with pytest.raises(RequestError) as e:
        decode_request(parse_body(json.dumps(objects[:3]).encode(), "application/json", schema), schema)
    assert e.value.records[0]["index"] == 2 and "ad_id" in e.value.records[0]["reason"]
    assert "record 2" in str(e.value)


def test_a_scoring_failure_is_a_500_and_the_server_goes_on(run):
    tmp, _ = run
    scorer = Scorer(read_bundle(tmp / "bundle"))
    predictor = Predictor(scorer)
    try:
        real = scorer.score
        scorer.score = lambda batch: (_ for _ in ()).throw(RuntimeError("boom"))
        status, body = predictor.predict(sample_lines()[0])
        assert status == 500 and "boom" in json.loads(body)["error"]
        scorer.score = real
        assert predictor.predict(sample_lines()[0])[0] == 200
        assert predictor.metrics.registry.get_sample_value(
            "stream_ctr_serving_requests_total", {"code": "500"}) == 1
    finally:
        predictor.close()


def test_the_aiohttp_front_end_answers_the_same(run):
    """`--http aiohttp` (the measured alternative; aiohttp is not a dependency)."""
    pytest.importorskip("aiohttp")
    tmp, _ = run
    scorer = Scorer(read_bundle(tmp / "bundle"))
    server = Server(scorer, port=0, http="aiohttp").start()
    try:
        body = b"\n".join(sample_lines()[:20])
        status, out = request(server.port, "POST", "/predict", body)
        expect = scorer.score(decode_lines(body, CRITEO, "x", 0)[0])
        assert status == 200 and np.array_equal(np.array(json.loads(out)["probabilities"], np.float32), expect)
        assert request(server.port, "POST", "/predict", b"1\t2")[0] == 400
        assert request(server.port, "GET", "/healthz")[0] == 200
        assert b"stream_ctr_serving_records_scored_total" in request(server.port, "GET", "/metrics")[1]
    finally:
        server.close()
