"""The CLI as a user runs it: real subprocesses, real files."""
import json
import signal
import subprocess
import sys
import time

import pytest

CLI = [sys.executable, "-m", "stream_ctr"]


def run(*args, timeout=300):
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=timeout)


def test_help_reads_well():
    out = run("--help")
    assert out.returncode == 0
    for word in ("train", "eval", "synth", "bench", "examples:"):
        assert word in out.stdout
    assert "STREAM_CTR_CONFIG" in run("train", "--help").stdout


def test_report_eval_and_export_default_to_the_newest_run():
    from stream_ctr.cli.main import build_parser
    parser = build_parser()
    assert parser.parse_args(["report"]).run_dir == "runs/latest"
    assert parser.parse_args(["eval"]).checkpoint == "runs/latest"
    assert parser.parse_args(["export", "--out", "b"]).run_dir == "runs/latest"


def test_every_option_with_a_default_shows_it():
    import argparse
    from stream_ctr.cli.main import build_parser, _subparsers
    parsers = _subparsers(build_parser())
    assert {"stream-ctr eval", "stream-ctr bench scaling", "stream-ctr replay"} <= {p.prog for p in parsers}
    missing = [f"{p.prog} {a.option_strings[-1]}" for p in parsers for a in p._actions
               if a.option_strings and a.nargs != 0 and a.help != argparse.SUPPRESS
               and a.default not in (None, []) and "(default" not in (a.help or "")]
    assert not missing
    # Shown as the user reads it, on a subcommand far from train.
    assert "(default: 1024)" in run("bench", "scaling", "--help").stdout.replace("\n", " ")


@pytest.mark.parametrize("args, needle, code", [
    (["train", "criteo:/no/such/file.tsv"], "/no/such/file.tsv", 3),     # data
    (["train", "parquet:/tmp/x"], "parquet", 3),
    (["train", "--set", "model.name=xgboost"], "model.name", 2),         # usage
    (["train", "--batch-size", "0"], "data.batch_size", 2),
    (["eval", "/no/such/run", "criteo:sample"], "no checkpoint", 4),
])
def test_user_errors_are_one_clear_line(args, needle, code, tmp_path):
    out = run(*args, "--run-dir", str(tmp_path)) if args[0] == "train" else run(*args)
    assert out.returncode == code, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stream-ctr: error:") and needle in lines[0], out.stderr


def test_a_run_dir_that_cannot_be_written_is_one_clear_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = run("train", "--limit", "256", "--run-dir", str(blocker / "run"))
    assert out.returncode == 4 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "a-file" in lines[0] and "--run-dir" in lines[0], out.stderr


def test_train_json_then_eval(tmp_path):
    run_dir = tmp_path / "run"
    out = run("train", "criteo:sample", "--holdout-fraction", "0.1", "--limit", "2000",
              "--set", "model.mlp_dims=32,32", "--run-dir", str(run_dir), "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("records_trained", "records_rejected", "samples_per_s", "test_auc", "test_logloss"):
        assert key in summary
    assert summary["records_trained"] == 2000 and summary["test_records"] == 1449
    ev = run("eval", str(run_dir), "criteo:sample", "--start", "13044", "--json")
    assert ev.returncode == 0, ev.stderr
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    assert result["records"] == 1449
    assert abs(result["auc"] - summary["test_auc"]) < 1e-9      # same model, same records
    # Without a source: the run's own file, only its held-out rows, and it says so.
    own = run("eval", str(run_dir), "--json")
    assert own.returncode == 0, own.stderr
    held = json.loads(own.stdout.strip().splitlines()[-1])
    assert (held["start"], held["stop"], held["records"]) == (13044, 14493, 1449)
    assert held["auc"] == result["auc"] and "held-out" in held["rows"]
    every = json.loads(run("eval", str(run_dir), "--all", "--json").stdout.strip().splitlines()[-1])
    assert every["records"] == 14493 and every["start"] == 0
    mismatch = run("eval", str(run_dir), "avazu:sample")
    assert mismatch.returncode == 2 and "do not match" in mismatch.stderr


def test_sigterm_finishes_batch_and_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(CLI + ["train", "criteo:sample", "--epochs", "1000", "--batch-size", "64",
                                   "--run-dir", str(run_dir), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def trained() -> bool:
        """The run's time series has an interval record with records trained (one a second)."""
        path = run_dir / "timeseries.jsonl"
        lines = path.read_text().split("\n")[:-1] if path.exists() else []     # (not a line being written)
        return any(json.loads(x).get("kind") == "interval" and json.loads(x)["records"] > 0 for x in lines)

    try:
        # Trained for a while, not a fixed 3 s after its start (a first batch can take that
        # on a loaded machine, and a run stopped before it trains nothing).
        deadline = time.time() + 120
        while not trained() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["records_trained"] > 0
    assert (run_dir / "checkpoints" / "LATEST").exists()
    ckpt = (run_dir / "checkpoints" / (run_dir / "checkpoints" / "LATEST").read_text())
    state = json.loads((ckpt / "state.json").read_text())
    assert state["records_trained"] == summary["records_trained"]
    # the summary alone reads like a finished run: the stop and the way on are said
    assert "stopped by a signal before the end of the data" in err
    assert f"continue with `stream-ctr train --resume {run_dir}`" in err


def test_synth_writes_decodable_file(tmp_path):
    path = tmp_path / "s.tsv"
    out = run("synth", str(path), "--records", "5000", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["records"] == 5000
    assert sum(1 for _ in open(path)) == 5000
    # The sidecar: each row's true click probability (connectors/synth.py).
    import numpy as np
    probs = np.load(summary["probs"])
    assert summary["probs"] == str(path) + ".probs.npy" and probs.shape == (5000,)


def test_version_is_the_installed_distributions():
    from importlib import metadata
    out = run("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"stream-ctr {metadata.version('stream-ctr')}"


def test_monitoring_export_writes_every_shipped_file_and_keeps_edited_ones(tmp_path):
    import yaml
    out = run("monitoring", "export", str(tmp_path / "mon"), "--json")
    assert out.returncode == 0, out.stderr
    files = {str(p.relative_to(tmp_path / "mon")) for p in (tmp_path / "mon").rglob("*") if p.is_file()}
    assert {"prometheus.yml", "prometheus-ranks.yml", "alerts.yml", "alerts_test.yml", "RUNBOOK.md", "compose.yaml",
            "grafana/dashboards/stream_ctr.json", "grafana/provisioning/datasources/stream_ctr.yml",
            "grafana/provisioning/dashboards/stream_ctr.yml"} == files
    assert json.loads(out.stdout)["files"]
    dashboard = json.loads((tmp_path / "mon/grafana/dashboards/stream_ctr.json").read_text())
    assert dashboard["panels"]
    assert "rule_files" in yaml.safe_load((tmp_path / "mon/prometheus.yml").read_text())
    (tmp_path / "mon/alerts.yml").write_text("# edited by the user\n")
    again = run("monitoring", "export", str(tmp_path / "mon"))
    assert again.returncode == 2 and "--force" in again.stderr
    assert (tmp_path / "mon/alerts.yml").read_text() == "# edited by the user\n"
    assert run("monitoring", "export", str(tmp_path / "mon"), "--force").returncode == 0
    assert "edited" not in (tmp_path / "mon/alerts.yml").read_text()


def test_monitoring_export_links_the_runbook_where_it_is_served(tmp_path, promtool):
    """Every alert's runbook_url is an absolute URL: the exported RUNBOOK.md's file:// URL
    by default, or --runbook-url's page, plus the alert's section; the exported promtool
    tests pass with either."""
    import yaml
    from stream_ctr.resources import RUNBOOK_PLACEHOLDER

    def links(directory):
        rules = [r for g in yaml.safe_load((directory / "alerts.yml").read_text())["groups"]
                 for r in g["rules"]]
        return {r["alert"]: r["annotations"]["runbook_url"] for r in rules}

    here = tmp_path / "here"
    out = run("monitoring", "export", str(here), "--json")
    assert out.returncode == 0, out.stderr
    page = (here / "RUNBOOK.md").resolve().as_uri()
    assert json.loads(out.stdout)["runbook_url"] == page and page.startswith("file:///")
    sections = {line[3:].strip() for line in (here / "RUNBOOK.md").read_text().splitlines()
                if line.startswith("## ")}
    for alert, url in links(here).items():
        assert url == f"{page}#{alert.lower()}" and alert in sections, (alert, url)

    hosted = tmp_path / "hosted"
    wiki = "https://git.example.com/ops/stream_ctr/-/blob/main/RUNBOOK.md"
    out = run("monitoring", "export", str(hosted), "--runbook-url", wiki)
    assert out.returncode == 0 and wiki in out.stdout, out.stderr
    assert all(url == f"{wiki}#{alert.lower()}" for alert, url in links(hosted).items())
    for directory in (here, hosted):
        assert RUNBOOK_PLACEHOLDER + "#" not in (directory / "alerts_test.yml").read_text()
        r = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=directory,
                           capture_output=True, text=True)
        assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr

    for bad in ("docs/RUNBOOK.md", "https://wiki.example.com/runbook#top", 'https://x.example/"a"', "https://[::1/runbook"):
        refused = run("monitoring", "export", str(tmp_path / "bad"), "--runbook-url", bad)
        assert refused.returncode == 2 and "--runbook-url" in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()


def test_config_example_loads_and_trains_as_printed(tmp_path):
    from stream_ctr.config import load_config, validate
    out = run("config", "example", "-o", str(tmp_path / "c.toml"))
    assert out.returncode == 0, out.stderr
    cfg = validate(load_config(tmp_path / "c.toml"))
    assert cfg.data.source == "criteo:sample" and cfg.store.cache_bytes == 256 << 20
    assert run("config", "example").stdout == (tmp_path / "c.toml").read_text()
    (tmp_path / "c.toml").write_text("# the user's own\n")
    refused = run("config", "example", "--out", str(tmp_path / "c.toml"))
    assert refused.returncode == 2 and "exists: it may be your config" in refused.stderr
    assert (tmp_path / "c.toml").read_text() == "# the user's own\n"
    assert run("config", "example", "--out", str(tmp_path / "c.toml"), "--force").returncode == 0


def test_options_may_follow_positionals_and_each_option_has_one_name():
    from stream_ctr.cli.main import build_parser
    parser = build_parser()
    args = parser.parse_args(["eval", "runs/m1", "--json", "criteo:sample", "--stop", "10"])
    assert (args.checkpoint, args.source, args.json, args.stop) == ("runs/m1", "criteo:sample", True, 10)
    args = parser.parse_args(["train", "--quiet", "criteo:sample", "--limit", "5", "--log-level", "debug"])
    assert (args.source, args.limit, args.log_level) == ("criteo:sample", 5, "debug")
    # the older name still works, and sets the same option; help shows only --limit
    assert parser.parse_args(["train", "--stop-after-records", "7"]).limit == 7
    assert "--stop-after-records" not in run("train", "--help").stdout
    assert "json:PATH" in run("predict", "--help").stdout


def test_scale_from_resolves_for_the_batch_that_trains(tmp_path):
    # --batch-size is the batch that trains; --scale-from names the batch the configured
    # rates are for: s = 256 / 64 = 4 -> lr_dense x 2, l2 x 4 (the paper's L2 rule, asked
    # for here; the default keeps it), lr_embed kept.
    run_dir = tmp_path / "run"
    out = run("train", "criteo:sample", "--batch-size", "256", "--scale-from", "64", "--limit", "2048",
              "--set", "optim.lr_dense=1e-3", "--set", "optim.l2=1e-5", "--set", "optim.lr_embed=1e-4",
              "--set", "optim.l2_rule=scaled",
              "--set", "optim.warmup_samples=4096", "--set", "optim.rule_warmup_samples=0",
              "--threads", "1", "--run-dir", str(run_dir), "--json")
    assert out.returncode == 0, out.stderr
    assert "optim: batch 256 = 4 x base 64: lr_dense 0.002" in out.stderr     # printed at start
    assert "warm-up 4,096 samples (16 steps)" in out.stderr
    resolved = json.loads(out.stdout.strip().splitlines()[-1])["optim"]
    assert resolved["batch_size"] == 256 and resolved["scale"] == 4
    assert abs(resolved["lr_dense"] - 2e-3) < 1e-12 and abs(resolved["l2"] - 4e-5) < 1e-15
    assert resolved["lr_embed"] == 1e-4
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "LATEST").read_text()
    state = json.loads((ckpt / "state.json").read_text())
    assert state["extra"]["resolved_optim"] == resolved
    assert state["config"]["optim"]["lr_dense"] == 1e-3          # the base values, as configured
    assert state["config"]["optim"]["scale_from_batch"] == 64
    gone = run("train", "--scale", "4", "--run-dir", str(tmp_path / "never"))
    assert gone.returncode == 2 and "--scale was removed" in gone.stderr and "--scale-from" in gone.stderr
