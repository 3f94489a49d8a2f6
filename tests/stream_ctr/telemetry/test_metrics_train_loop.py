"""The train loop's monitoring hooks: metrics from a real run, the endpoint's life, the time series."""
from __future__ import annotations

import gzip
import json
import socket

import pytest
from prometheus_client import CollectorRegistry

from stream_ctr.connectors.dead_letter import DeadLetterFile
from stream_ctr.connectors.files import SAMPLE_PATHS, FileSource, detect_format
from stream_ctr.cli import main
from stream_ctr.config import Config, ConfigError, load_config, validate
from stream_ctr.telemetry.monitor import RunMonitor
from stream_ctr.telemetry.timeseries import read_timeseries
from stream_ctr.train.batches import micro_batches
from stream_ctr.train.loop import train
from tests.prometheus_server import free_port


def small_config(tmp_path, **data) -> Config:
    cfg = Config()
    cfg.model.mlp_dims = (16,)
    cfg.data.batch_size = 64
    cfg.train.run_dir = str(tmp_path / "run")
    cfg.train.threads = 1
    cfg.train.eval_window_records = 1000
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def criteo_with_bad_lines(tmp_path, n: int = 200, bad: dict[int, str] | None = None):
    with gzip.open(SAMPLE_PATHS["criteo"], "rt") as f:
        lines = [next(f) for _ in range(n)]
    for i, kind in (bad or {}).items():
        fields = lines[i].rstrip("\n").split("\t")
        if kind == "bad_label":
            fields[0] = "x"
        elif kind == "field_count":
            fields = fields[:5]
        lines[i] = "\t".join(fields) + "\n"
    path = tmp_path / "criteo_bad.tsv"
    path.write_text("".join(lines))
    return path


def test_three_bad_records_reach_rejected_total_through_the_loop(tmp_path):
    path = criteo_with_bad_lines(tmp_path, bad={3: "bad_label", 50: "bad_label", 99: "bad_label",
                                                120: "field_count"})
    cfg = small_config(tmp_path)
    reg = CollectorRegistry()
    monitor = RunMonitor(cfg, tmp_path / "run", registry=reg)
    fmt, _ = detect_format(str(path))
    with FileSource(path, fmt, chunk_records=64) as source, DeadLetterFile(tmp_path / "dl.jsonl") as dl:
        rows = sum(len(b) for b in micro_batches(source, 32, dl, monitor=monitor))
    assert rows == 196
    assert reg.get_sample_value("stream_ctr_records_rejected_total", {"reason": "bad_label"}) == 3
    assert reg.get_sample_value("stream_ctr_records_rejected_total", {"reason": "field_count"}) == 1
    assert reg.get_sample_value("stream_ctr_records_consumed_total",
                                {"partition": "file:criteo_bad.tsv"}) == 200
    assert reg.get_sample_value("stream_ctr_step_phase_seconds_count", {"phase": "decode"}) == 4
    monitor.close()


@pytest.mark.parametrize("world, rank, labels", [
    (None, None, {}),                      # trained alone: no rank label on any series
    ("1", "0", {}),                        # torchrun with one process: alone too
    ("2", "1", {"rank": "1"}),             # a rank of a job of two: rank="1"
])
def test_a_rank_label_only_in_a_job_of_several_ranks(tmp_path, monkeypatch, world, rank, labels):
    for name, v in (("WORLD_SIZE", world), ("RANK", rank), ("LOCAL_RANK", rank)):
        if v is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, v)
    reg = CollectorRegistry()
    monitor = RunMonitor(small_config(tmp_path), tmp_path / "run", registry=reg)
    try:
        monitor.metrics.observe_batch(5, False, {"update": 0.01})
        assert reg.get_sample_value("stream_ctr_records_trained_total", labels) == 5
        assert reg.get_sample_value("stream_ctr_last_checkpoint_age_seconds", labels) >= 0
        assert reg.get_sample_value("stream_ctr_step_phase_seconds_count", {**labels, "phase": "update"}) == 1
        ranked = {s.labels.get("rank") for fam in reg.collect() for s in fam.samples
                  if fam.name.startswith("stream_ctr_")}
        assert ranked == {labels.get("rank")}
    finally:
        monitor.close()


def test_a_run_writes_its_time_series(tmp_path):
    cfg = small_config(tmp_path, limit_records=1280)
    cfg.metrics.timeseries_every_s = 1e-9         # a record after every batch
    s = train(cfg, show_progress=False)
    recs = list(read_timeseries(tmp_path / "run" / "timeseries.jsonl"))
    assert recs[0]["kind"] == "start" and recs[0]["model"] == "deepfm" and recs[0]["records"] == 0
    assert recs[-1]["kind"] == "end" and recs[-1]["records_trained"] == s.records_trained == 1280
    intervals = [r for r in recs if r["kind"] == "interval"]
    assert len(intervals) >= 20
    assert [r["records"] for r in intervals][:3] == [64, 128, 192]
    assert intervals[-1]["records"] == 1280
    last = intervals[-1]
    assert 0 <= last["hit_ratio"]["device"] <= 1 and last["rows"]["device"] > 1000
    assert last["lag_records"] == 14493 - 1280       # the rest of the file is not trained yet
    assert last["freshness_s"] is None                # Criteo carries no event time
    assert 0.4 < last["auc"] < 0.9 and last["samples_per_s"] > 0
    # a resumed run continues the records axis in the same file
    cfg.data.limit_records = 640
    train(cfg, resume=cfg.train.run_dir, show_progress=False)
    recs = list(read_timeseries(tmp_path / "run" / "timeseries.jsonl"))
    starts = [r for r in recs if r["kind"] == "start"]
    assert [r["records"] for r in starts] == [0, 1280]
    assert [r for r in recs if r["kind"] == "interval"][-1]["records"] == 1920


def test_metrics_endpoint_lives_with_the_run(tmp_path):
    cfg = small_config(tmp_path, limit_records=256)
    cfg.metrics.port = free_port()
    train(cfg, show_progress=False)
    with socket.socket() as s:                        # closed again: the port is free
        s.bind(("127.0.0.1", cfg.metrics.port))


def test_metrics_config_is_validated():
    for option, bad in (("port", "70000"), ("port", "-1"), ("auc_baseline", "1.5"),
                        ("timeseries_every_s", "-2"), ("addr", " ")):
        cfg = load_config(None, [f"metrics.{option}={bad}"])
        with pytest.raises(ConfigError, match=f"metrics.{option}"):
            validate(cfg)
    with pytest.raises(ConfigError, match="metrics.port"):
        load_config(None, ["metrics.port=abc"])


def test_cli_metrics_flags(tmp_path, capsys):
    code = main(["train", "--quiet", "--metrics-port", "70000", "--run-dir", str(tmp_path)])
    assert code == 2 and "metrics.port" in capsys.readouterr().err
    code = main(["train", "--quiet", "--json", "--limit", "128", "--batch-size", "64",
                 "--metrics-port", str(free_port()), "--metrics-addr", "127.0.0.1",
                 "--set", "model.mlp_dims=16", "--run-dir", str(tmp_path / "r")])
    assert code == 0
    saved = json.loads((tmp_path / "r" / "timeseries.jsonl").read_text().splitlines()[0])
    assert saved["kind"] == "start"
