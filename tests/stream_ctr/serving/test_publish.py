"""`train --publish DIR` and a follower: the chain of deltas is the model of the last checkpoint.

Real runs on the bundled Criteo sample (DeepFM with a 32x32 MLP, batches of 128),
real publish directories and bundles on disk, a real HTTP server answering.
Must-show: a tiered store with most rows on LMDB publishes and serves the same
predictions as one big in-memory table (export: test_export_predict.py).
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from stream_ctr.cli.main import main
from stream_ctr.config import ConfigError
from stream_ctr.connectors.decode import decode_lines
from stream_ctr.connectors.formats import CRITEO
from stream_ctr.serving.bundle import read_bundle
from stream_ctr.serving.follower import Follower, initial_bundle
from stream_ctr.serving.predictor import Predictor
from stream_ctr.serving.published import PublishInfo, read_index, version_dir, version_dirs, write_index
from stream_ctr.serving.publisher import Publisher
from stream_ctr.serving.scorer import Scorer
from stream_ctr.serving.server import Server
from stream_ctr.serving.table import RowTable
from stream_ctr.train.loop import train
from tests.stream_ctr.serving.test_serve import request, sample_lines
from tests.stream_ctr.store.helpers import BATCH, CRITEO_FIELDS, small_config

LINES = 2000                    # scored by every model below


def lines_batch():
    return decode_lines(b"\n".join(sample_lines()[:LINES]) + b"\n", CRITEO, "t", 0)[0]


def publishing_run(tmp, name: str, tiered: bool, **data):
    cfg = small_config(tmp / name, tiered=tiered)
    cfg.train.checkpoint_every_batches = 20
    cfg.serving.publish = str(tmp / f"{name}-pub")
    cfg.serving.full_every = 4          # full snapshots mid-chain too
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def followed(pub) -> tuple[Predictor, Follower]:
    predictor = Predictor(Scorer(read_bundle(initial_bundle(pub))))
    follower = Follower(pub, predictor)
    follower.poll()
    return predictor, follower


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The whole sample trained twice, publishing: one in-memory table, and a tiered store
    with a tiny device cache and RAM tier (most rows on LMDB); and the memory run's export."""
    tmp = tmp_path_factory.mktemp("publish")
    mem = publishing_run(tmp, "mem", tiered=False)
    train(mem, show_progress=False)
    tiered = publishing_run(tmp, "tiered", tiered=True)
    train(tiered, show_progress=False)
    assert main(["export", mem.train.run_dir, "--out", str(tmp / "final"), "--quiet"]) == 0
    return tmp, mem, tiered


def test_the_followed_chain_is_the_final_checkpoints_export(runs):
    tmp, mem, _ = runs
    pub = mem.serving.publish
    index = read_index(pub)
    # 14,493 records in batches of 128: 114 steps, checkpoints every 20 and at the end;
    # every 4th publish is a full snapshot; the versions before it are pruned.
    assert index.latest == 6 and index.full == 5 and index.chain == [6]
    kinds = {v: PublishInfo.from_manifest(read_bundle(p).manifest, p).kind for v, p in version_dirs(pub).items()}
    assert kinds == {5: "full", 6: "delta"}
    predictor, follower = followed(pub)
    try:
        assert predictor.model().published_version == 6
        final = Scorer(read_bundle(tmp / "final"))
        batch = lines_batch()
        assert np.array_equal(predictor.current()[0].score(batch), final.score(batch))
        # A delta holds only the rows trained since its base, far fewer than the table.
        delta = read_bundle(version_dir(pub, 6))
        assert 0 < len(delta.keys) < len(read_bundle(tmp / "final").keys) / 2
    finally:
        predictor.close()


def test_tiered_store_on_lmdb_publishes_and_serves_the_in_memory_tables_predictions(runs):
    """Must-show: most rows lived only in LMDB while training; the published chain, read by a
    real HTTP server, answers exactly as the in-memory run's chain and export do."""
    tmp, mem, tiered = runs
    resident = 2 * BATCH * CRITEO_FIELDS + 3000
    tier_full = read_bundle(version_dir(tiered.serving.publish, read_index(tiered.serving.publish).full))
    assert tier_full.manifest["rows"]["store"] == "tiered"
    assert len(tier_full.keys) > 4 * resident                   # most rows were on disk only
    body = b"\n".join(sample_lines()[:LINES]) + b"\n"
    answers = {}
    for name, pub in (("tiered", tiered.serving.publish), ("mem", mem.serving.publish)):
        scorer = Scorer(read_bundle(initial_bundle(pub)))
        server = Server(scorer, port=0).start()
        follower = Follower(pub, server.predictor)
        try:
            assert follower.poll()
            status, out = request(server.port, "POST", "/predict", body)
            assert status == 200
            answers[name] = json.loads(out)
        finally:
            server.close()
    assert answers["tiered"]["model_version"].startswith("v6:")
    assert answers["tiered"]["probabilities"] == answers["mem"]["probabilities"]
    export = Scorer(read_bundle(tmp / "final")).score(lines_batch())
    assert np.array_equal(np.array(answers["mem"]["probabilities"], np.float32), export)


def test_a_resumed_tiered_run_publishes_a_full_snapshot_at_once_and_the_chain_ends_at_its_export(tmp_path):
    """Half the sample, then a resume (a new process would do the same): the resume publishes
    the checkpoint it resumed from as a full snapshot above every version there (read from
    the LMDB environment the trainer has open), then deltas; a follower that was on the
    first run's chain goes over to it."""
    cfg = publishing_run(tmp_path, "run", tiered=True, limit_records=60 * BATCH)
    cfg.serving.full_every = 0
    train(cfg, show_progress=False)
    pub = cfg.serving.publish
    first = read_index(pub)
    assert (first.full, first.chain) == (1, [2, 3])
    predictor, follower = followed(pub)
    try:
        resumed = publishing_run(tmp_path, "run", tiered=True)
        resumed.serving.full_every = 0
        train(resumed, resume=cfg.train.run_dir, show_progress=False)
        index = read_index(pub)
        assert index.full == 4 and index.chain == [5, 6, 7]
        resume_snapshot = read_bundle(version_dir(pub, 4))
        assert resume_snapshot.manifest["checkpoint"]["step"] == 60      # what it resumed from
        assert PublishInfo.from_manifest(resume_snapshot.manifest, "").newest_arrival_s is None
        assert follower.poll() and follower.applied[-1].kind == "full"   # not on its chain any more
        assert main(["export", cfg.train.run_dir, "--out", str(tmp_path / "final"), "--quiet"]) == 0
        batch = lines_batch()
        assert np.array_equal(predictor.current()[0].score(batch),
                              Scorer(read_bundle(tmp_path / "final")).score(batch))
        assert set(version_dirs(pub)) == {4, 5, 6, 7}
    finally:
        predictor.close()


def test_deltas_apply_twice_harmlessly_and_override_the_base():
    base = RowTable.of(np.array([1, 5, 9], np.int64), np.arange(6, dtype=np.float32).reshape(3, 2))
    keys, rows = np.array([5, 7], np.int64), np.array([[50, 51], [70, 71]], np.float32)
    once = base.updated(keys, rows)
    twice = once.updated(keys, rows)
    for table in (once, twice):
        found, out = table.lookup(np.array([1, 5, 7, 8, 9], np.int64))
        assert found.tolist() == [True, True, True, False, True]
        assert out[found].tolist() == [[0, 1], [50, 51], [70, 71], [4, 5]]
    assert np.array_equal(once.keys, twice.keys) and np.array_equal(once.rows, twice.rows)
    later = twice.updated(np.array([1], np.int64), np.array([[10, 11]], np.float32))
    assert later.lookup(np.array([1, 5], np.int64))[1].tolist() == [[10, 11], [50, 51]]


def test_a_server_off_the_chain_loads_the_full_snapshot_and_refuses_a_delta_on_another_base(runs, tmp_path):
    """A server started from an exported bundle (no version) reads the full snapshot and its
    chain; a delta naming a base the follower does not have is not applied: the model
    answering stays, a failure is counted, and the next good poll applies."""
    tmp, mem, _ = runs
    pub = tmp_path / "pub"
    shutil.copytree(mem.serving.publish, pub)
    predictor = Predictor(Scorer(read_bundle(tmp / "final")))
    follower = Follower(pub, predictor)
    try:
        assert follower.poll() and follower.applied[-1].kind == "full"
        assert predictor.model().published_version == 6
        assert not follower.poll()              # nothing new
    finally:
        predictor.close()
    manifest_path = version_dir(pub, 6) / "manifest.json"
    good = manifest_path.read_text()
    manifest = json.loads(good)
    manifest["publish"]["base_version"] = 3     # not the full snapshot 5 it follows in the chain
    manifest_path.write_text(json.dumps(manifest))
    predictor = Predictor(Scorer(read_bundle(version_dir(pub, 5))))
    follower = Follower(pub, predictor)
    try:
        assert not follower.poll()
        assert predictor.model().published_version == 5 and "applies on version 3" in follower.last_error
        assert follower.metrics.failures._value.get() == 1
        manifest_path.write_text(good)
        assert follower.poll() and predictor.model().published_version == 6
    finally:
        predictor.close()


def _publish_copy_of_latest(pub, edit=None) -> int:
    """Publish into `pub` a delta on its latest version, a copy of that one's files, its
    manifest passed through `edit`, as a trainer would (renamed into place, then the index)."""
    index = read_index(pub)
    new = index.latest + 1
    shutil.copytree(version_dir(pub, index.latest), pub / f".tmp-{new}")
    manifest = json.loads((pub / f".tmp-{new}" / "manifest.json").read_text())
    manifest["publish"].update(version=new, base_version=index.latest, kind="delta")
    if edit is not None:
        edit(manifest)
    (pub / f".tmp-{new}" / "manifest.json").write_text(json.dumps(manifest))
    (pub / f".tmp-{new}").rename(version_dir(pub, new))
    index.latest, index.chain = new, [*index.chain, new]
    write_index(pub, index)
    return new


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m.pop("rows"), "manifest.json has no rows"),
    (lambda m: m["checkpoint"].pop("step"), "has no checkpoint.step"),
    (lambda m: m["publish"].update(version="7"), "version and base_version must be integers"),
])
def test_a_published_manifest_lacking_a_field_is_refused_and_the_follower_goes_on(runs, tmp_path, edit, needle):
    """A version whose manifest parses but lacks a field raised a KeyError (or, for a version
    that is no integer, a ValueError after the swap) out of `poll`: the follower's thread
    died and the server answered with the old version for ever. It is a failed poll now."""
    _, mem, _ = runs
    pub = tmp_path / "pub"
    shutil.copytree(mem.serving.publish, pub)
    predictor, follower = followed(pub)
    try:
        bad = _publish_copy_of_latest(pub, edit)
        assert not follower.poll() and not follower.poll()
        assert needle in follower.last_error and follower.metrics.failures._value.get() == 2
        assert "re-export" not in follower.last_error       # a bundle's remedy, not a published version's
        assert predictor.model().published_version == bad - 1
        health = json.loads(predictor.health())         # says why it does not advance
        assert health["status"] == "ok" and needle in health["follow_error"]
        assert predictor.predict(sample_lines()[0])[0] == 200
        shutil.rmtree(version_dir(pub, bad))            # the trainer's next full snapshot, say
        index = read_index(pub)
        index.chain.remove(bad)
        index.latest = index.chain[-1] if index.chain else index.full
        write_index(pub, index)
        good = _publish_copy_of_latest(pub)
        assert follower.poll() and predictor.model().published_version == good
        assert "follow_error" not in json.loads(predictor.health())
    finally:
        predictor.close()


def test_a_publish_directory_removed_while_followed_is_said_and_the_model_stays(runs, tmp_path, capsys):
    """The followed directory removed: the follower used to find no index and say nothing,
    as if nothing had ever been published. It is a failure, said once; the model answering
    stays; the directory back, the next version applies."""
    _, mem, _ = runs
    pub = tmp_path / "pub"
    shutil.copytree(mem.serving.publish, pub)
    predictor, follower = followed(pub)
    try:
        version = predictor.model().published_version
        shutil.move(pub, tmp_path / "elsewhere")
        assert not follower.poll() and not follower.poll()
        assert "PUBLISHED.json is gone" in follower.last_error
        assert follower.metrics.failures._value.get() == 2
        assert capsys.readouterr().err.count("PUBLISHED.json is gone") == 1
        assert predictor.model().published_version == version
        assert predictor.predict(sample_lines()[0])[0] == 200
        shutil.move(tmp_path / "elsewhere", pub)
        assert not follower.poll() and follower.last_error == ""
        new = _publish_copy_of_latest(pub)
        assert follower.poll() and predictor.model().published_version == new
    finally:
        predictor.close()


def test_one_publisher_per_directory_and_leftovers_of_a_crash_are_cleaned(runs, tmp_path):
    _, mem, _ = runs
    pub = tmp_path / "pub"
    shutil.copytree(mem.serving.publish, pub)
    (pub / "v-00000009").mkdir()             # renamed into place, the index never updated
    (pub / ".tmp-v-00000010-123").mkdir()    # a version half written
    cfg = small_config(tmp_path / "r", tiered=False)
    cfg.serving.publish = str(pub)
    fmt = CRITEO
    first = Publisher(pub, cfg, fmt)
    try:
        assert not (pub / ".tmp-v-00000010-123").exists()
        with pytest.raises(ConfigError, match="another trainer is publishing into it"):
            Publisher(pub, cfg, fmt)
    finally:
        first.close()
    # A run publishing into it goes on above every version there, orphan included.
    cfg.data.limit_records = 20 * BATCH
    cfg.train.checkpoint_every_batches = 10
    train(cfg, show_progress=False)
    index = read_index(pub)
    assert (index.full, index.chain) == (10, [11])
    assert 9 not in version_dirs(pub)


def test_serve_follow_without_anything_published_says_so(tmp_path, capsys):
    assert main(["serve", "--follow", str(tmp_path), "--port", "0"]) != 0
    assert "nothing is published there yet" in capsys.readouterr().err


def test_the_dashboards_serving_panels_and_alert_read_a_following_server(runs, tmp_path, prometheus_server):
    """A real Prometheus scrapes a server that follows the memory run's chain: every serving
    panel's expression returns data (event-time freshness aside: Criteo has no event time),
    and the freshness alert evaluates healthy without firing."""
    from tests.monitoring.test_prometheus import ALERTS, DASHBOARD
    from tests.prometheus_server import alert_rules, dashboard_panels, grafana_to_promql, metric_names
    _, mem, _ = runs
    server = Server(Scorer(read_bundle(initial_bundle(mem.serving.publish))), port=0).start()
    follower = Follower(mem.serving.publish, server.predictor)
    try:
        assert follower.poll()
        prom = prometheus_server({"stream_ctr": [f"127.0.0.1:{server.port}"]}, rule_files=[ALERTS])
        prom.wait_for("three scrapes of the server", lambda: prom.query(
            "count_over_time(stream_ctr_serving_model_published_version[1m])") and float(prom.query(
                "count_over_time(stream_ctr_serving_model_published_version[1m])")[0]["value"][1]) >= 3)
        serving = [p for p in dashboard_panels(DASHBOARD)
                   if any("stream_ctr_serving_" in t["expr"] for t in p["targets"])]
        assert len(serving) == 3
        for p in serving:
            for t in p["targets"]:
                result = prom.query(grafana_to_promql(t["expr"]).replace("$job", "stream_ctr"))
                empty_ok = metric_names(t["expr"]) == {"stream_ctr_serving_event_freshness_seconds"}
                assert result or empty_ok, (p["title"], t["expr"])
        assert float(prom.query("stream_ctr_serving_model_published_version")[0]["value"][1]) == 6
        rule = next(r for r in alert_rules(ALERTS) if r["alert"] == "StreamCtrServingNotFresh")
        prom.query(rule["expr"])
        prom.wait_for("the alert rules evaluated", lambda: all(
            r.get("lastEvaluation", "").startswith("20") for g in prom.api("rules")["groups"] for r in g["rules"]))
        rules = {r["name"]: r for g in prom.api("rules")["groups"] for r in g["rules"]}
        assert rules["StreamCtrServingNotFresh"]["health"] == "ok"
        assert rules["StreamCtrServingNotFresh"]["state"] == "inactive"
    finally:
        server.close()


def test_a_published_model_of_other_records_is_refused_and_the_server_goes_on(runs, tmp_path):
    """Following a directory an Avazu run publishes into, with a Criteo model answering: the
    swap is refused, a failure counted and said once, the Criteo model keeps answering."""
    tmp, _, _ = runs
    cfg = small_config(tmp_path / "avazu", tiered=False)
    cfg.data.source = "avazu:sample"
    cfg.data.limit_records = 10 * BATCH
    cfg.serving.publish = str(tmp_path / "pub")
    train(cfg, show_progress=False)
    predictor = Predictor(Scorer(read_bundle(tmp / "final")))
    follower = Follower(cfg.serving.publish, predictor)
    try:
        assert not follower.poll() and not follower.poll()
        assert "takes other records" in follower.last_error
        assert follower.metrics.failures._value.get() == 2
        assert predictor.model().published_version is None
        status, _ = predictor.predict(sample_lines()[0])
        assert status == 200
    finally:
        predictor.close()
    # Avazu records carry event times: a server of the Avazu model reports event freshness too.
    own = Predictor(Scorer(read_bundle(initial_bundle(cfg.serving.publish))))
    try:
        status = own.model()
        assert status.published_version == 1 and status.freshness_s > 0 and status.event_freshness_s > 0
        info = PublishInfo.from_manifest(read_bundle(version_dir(cfg.serving.publish, 1)).manifest, "")
        assert info.newest_event_ms > 1.3e12           # 2014's click log, in ms
    finally:
        own.close()


def test_publish_refuses_what_cannot_work_with_clear_messages(tmp_path, monkeypatch):
    from stream_ctr.config import validate
    from stream_ctr.serving.publisher import open_publisher
    cfg = small_config(tmp_path / "r", tiered=False)
    (tmp_path / "a_file").write_text("x")
    cfg.serving.publish = str(tmp_path / "a_file")
    with pytest.raises(ConfigError, match="cannot use it as the publish directory"):
        open_publisher(cfg, CRITEO)
    cfg.serving.publish = str(tmp_path / "pub")
    monkeypatch.setenv("WORLD_SIZE", "2")           # a rank of a torchrun job ...
    monkeypatch.setenv("RANK", "1")
    assert open_publisher(cfg, CRITEO) is None      # ... publishes from rank 0 only
    tiered = small_config(tmp_path / "t", tiered=True)
    tiered.serving.publish = str(tmp_path / "pub")
    with pytest.raises(ConfigError, match="in a distributed job needs store.kind = memory"):
        open_publisher(tiered, CRITEO)
    cfg.serving.publish_every_s = -1
    with pytest.raises(ConfigError, match="serving.publish_every_s must be >= 0"):
        validate(cfg)
