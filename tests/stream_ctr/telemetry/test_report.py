"""`stream-ctr report`: PNGs and HTML from a finished run's time series."""
from __future__ import annotations

import json

import pytest

from stream_ctr.cli import main
from stream_ctr.config import Config, ConfigError
from stream_ctr.telemetry.report import find_run_dir, load_series, write_report
from stream_ctr.train.loop import train

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# A file source has no lag plot; the Avazu sample has event times, so freshness is drawn.
PLOTS = {"quality.png", "throughput.png", "freshness.png", "tier_share.png"}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A short real run on the bundled Avazu sample (it has event times), checkpointed twice."""
    tmp = tmp_path_factory.mktemp("report")
    cfg = Config()
    cfg.data.source = "avazu:sample"
    cfg.data.batch_size = 64
    cfg.data.limit_records = 1600
    cfg.model.mlp_dims = (16,)
    cfg.train.run_dir = str(tmp / "run")
    cfg.train.threads = 1
    cfg.train.checkpoint_every_batches = 10
    cfg.train.eval_window_records = 800
    cfg.metrics.timeseries_every_s = 1e-9
    train(cfg, show_progress=False)
    return tmp / "run"


def test_report_writes_four_plots_and_a_page(finished_run):
    out = write_report(finished_run)
    assert {p.name for p in out.plots} == PLOTS
    for p in out.plots:
        data = p.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, p
    assert out.records == 1600
    page = out.html.read_text()
    for name in PLOTS:
        assert f'src="{name}"' in page
    for text in ("deepfm", "avazu:sample", "records trained (run)", "1,600", "prequential AUC",
                 "optim.lr_dense", "not plotted: a file source"):
        assert text in page, text
    (series,) = load_series(finished_run)
    assert len(series.checkpoints) >= 2          # every checkpoint is a mark on the time axis


def test_report_from_a_checkpoint_directory_and_the_cli(finished_run, tmp_path, capsys):
    ckpt = finished_run / "checkpoints" / (finished_run / "checkpoints" / "LATEST").read_text().strip()
    assert find_run_dir(ckpt) == finished_run
    assert find_run_dir(finished_run / "checkpoints") == finished_run
    code = main(["report", str(ckpt), "--out", str(tmp_path / "out"), "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["records"] == 1600 and result["report"].endswith("index.html")
    assert {p.rsplit("/", 1)[1] for p in result["plots"]} == PLOTS


def test_report_without_a_time_series_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(ConfigError, match="timeseries.jsonl"):
        write_report(tmp_path)
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_report_draws_ranks_tiers_restarts_and_survives_a_torn_line(tmp_path):
    """Synthetic series: two invocations, three tiers, a second rank, a crash mid-line."""
    def interval(t, records, lag, dev, host):
        return {"kind": "interval", "t": t, "records": records, "samples_per_s": 100.0, "auc": 0.7,
                "logloss": 0.5, "calibration": 1.0, "lag_records": lag, "freshness_s": 3.0,
                "hit_ratio": {"device": dev, "host": host, "disk": 1.0}, "rows": {"device": 10}}
    lines = [{"kind": "start", "t": 0, "records": 0, "model": "dcnv2", "source": "kafka://x/t"}]
    lines += [interval(10 * i, 1000 * i, 500 - i, 0.9, 0.5) for i in range(1, 6)]
    lines += [{"kind": "start", "t": 100, "records": 5000}]
    lines += [interval(100 + 10 * i, 5000 + 1000 * i, 400, 0.95, None) for i in range(1, 4)]
    (tmp_path / "timeseries.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + '\n{"kind": "inter')
    (tmp_path / "timeseries-rank1.jsonl").write_text("\n".join(json.dumps(x) for x in lines[:4]) + "\n")
    series = load_series(tmp_path)
    assert [s.rank for s in series] == [0, 1] and len(series[0].intervals) == 8
    assert len(series[0].starts) == 2 and series[0].end is None
    out = write_report(tmp_path)
    assert out.records == 8000
    assert "lag.png" in {p.name for p in out.plots}          # a Kafka source: lag is drawn
    page = out.html.read_text()
    assert "still going or crashed" in page and "dcnv2" in page


def test_a_directory_holding_two_runs_is_refused(tmp_path):
    """What an older version wrote: a Criteo run, then an Avazu run from 0 in the same file."""
    lines = [{"kind": "start", "t": 0, "records": 0, "model": "deepfm", "source": "criteo:sample"},
             {"kind": "interval", "t": 10, "records": 13044, "auc": 0.7},
             {"kind": "start", "t": 20, "records": 0, "model": "deepfm", "source": "avazu:sample"},
             {"kind": "interval", "t": 30, "records": 9000, "auc": 0.7}]
    (tmp_path / "timeseries.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    with pytest.raises(ConfigError, match="2 runs in one time series .*avazu:sample"):
        write_report(tmp_path)


def test_a_two_epoch_tiered_run_marks_its_passes_and_held_out_auc(tmp_path):
    cfg = Config()
    cfg.data.source, cfg.data.epochs, cfg.data.holdout_fraction = "criteo:sample", 2, 0.1
    cfg.data.batch_size, cfg.data.limit_records = 256, 0
    cfg.model.mlp_dims = (16,)
    cfg.store.kind = "tiered"
    cfg.store.cache_bytes, cfg.store.ram_bytes = 4 << 20, 64 << 20
    cfg.train.run_dir, cfg.train.threads = str(tmp_path / "run"), 1
    cfg.train.checkpoint_every_batches = 40
    cfg.metrics.timeseries_every_s = 1e-9
    summary = train(cfg, show_progress=False)
    assert [e["epoch"] for e in summary.test_per_epoch] == [1, 2]
    out = write_report(tmp_path / "run")
    (series,) = load_series(tmp_path / "run")
    assert len(series.epoch_starts) == 1 and len(series.checkpoints) >= 2
    assert any(r.get("served_share") for r in series.intervals)
    assert {p.name for p in out.plots} == {"quality.png", "throughput.png", "tier_share.png"}
    page = out.html.read_text()
    assert "held-out AUC after pass 1" in page and "held-out AUC after pass 2" in page
    assert "passes begun</th><td>2" in page


def test_a_crashed_resume_is_not_shown_with_the_previous_invocations_end(tmp_path):
    first = [{"kind": "start", "t": 0, "records": 0, "model": "deepfm", "source": "criteo:x"},
             {"kind": "interval", "t": 10, "records": 1000, "samples_per_s": 100.0, "auc": 0.7},
             {"kind": "end", "t": 11, "records_trained": 1000}]
    crashed = [{"kind": "start", "t": 20, "records": 1000},
               {"kind": "interval", "t": 30, "records": 3000, "samples_per_s": 200.0, "auc": 0.72}]
    (tmp_path / "timeseries.jsonl").write_text("\n".join(json.dumps(x) for x in first + crashed) + "\n")
    (series,) = load_series(tmp_path)
    assert series.end is None
    page = write_report(tmp_path).html.read_text()
    assert "still going or crashed" in page


def test_restarts_break_the_line_and_the_legend_says_what_the_marks_are(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import math
    import matplotlib.pyplot as plt
    from stream_ctr.telemetry.report import _fmt, _line
    lines = [{"kind": "start", "t": 0, "records": 0, "model": "deepfm", "source": "criteo:x"}]
    lines += [{"kind": "interval", "t": 10 * i, "records": 100 * i, "auc": 0.7} for i in range(1, 4)]
    lines += [{"kind": "checkpoint", "t": 25}, {"kind": "start", "t": 600, "records": 300}]
    lines += [{"kind": "interval", "t": 600 + 10 * i, "records": 300 + 100 * i, "auc": 0.72} for i in range(1, 3)]
    (tmp_path / "timeseries.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    fig, ax = plt.subplots()
    assert _line(ax, load_series(tmp_path), "auc", "AUC")
    ys = list(ax.get_lines()[0].get_ydata())
    # 3 samples, a gap while the run was down (no segment drawn across it), 2 samples
    assert [math.isnan(y) for y in ys] == [False, False, False, True, False, False]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["AUC", "restart (the run was down until here)", "checkpoint"]
    plt.close(fig)
    assert _fmt(1e-05) == "1e-05" and _fmt(0.0) == "0.0000" and _fmt(0.73154) == "0.7315"


def test_the_page_names_the_run_a_latest_link_points_at(finished_run, tmp_path):
    latest = tmp_path / "latest"
    latest.symlink_to(finished_run)
    page = write_report(latest, out=tmp_path / "report").html.read_text()
    assert str(finished_run.resolve()) in page and str(latest) not in page
