"""Run directories: one per run, runs/latest at the one trained last, --resume writes where it resumes."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stream_ctr.config import Config, ConfigError
from stream_ctr.train.run_dir import choose_run_dir, run_dir_of, source_slug

CLI = [sys.executable, "-m", "stream_ctr"]


def cli(cwd, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(args), capture_output=True, text=True, cwd=cwd, timeout=300)


def test_two_runs_get_two_directories_and_resume_writes_into_its_own(tmp_path):
    first = cli(tmp_path, "train", "--limit", "640", "--quiet", "--json")
    second = cli(tmp_path, "train", "avazu:sample", "--limit", "640", "--quiet", "--json")
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir() if p.name != "latest")
    assert len(runs) == 2 and any(r.endswith("-deepfm-criteo-sample") for r in runs) \
        and any(r.endswith("-deepfm-avazu-sample") for r in runs)
    latest = (tmp_path / "runs" / "latest").resolve()
    assert latest.name.endswith("avazu-sample")
    criteo = next(r for r in runs if r.endswith("criteo-sample"))

    resumed = cli(tmp_path, "train", "--limit", "320", "--quiet", "--json", "--resume", f"runs/{criteo}")
    assert resumed.returncode == 0, resumed.stderr
    ckpt = json.loads(resumed.stdout)["checkpoint"]
    assert ckpt.startswith(f"runs/{criteo}/checkpoints/"), ckpt
    assert (tmp_path / "runs" / "latest").resolve().name == criteo   # the run trained last
    assert len(list((tmp_path / "runs" / criteo / "checkpoints").glob("ckpt-*"))) == 2


def test_a_new_run_into_a_directory_with_a_run_is_refused(tmp_path):
    ok = cli(tmp_path, "train", "--limit", "320", "--quiet", "--run-dir", "mine")
    assert ok.returncode == 0, ok.stderr
    again = cli(tmp_path, "train", "--limit", "320", "--quiet", "--run-dir", "mine")
    assert again.returncode != 0
    assert "mine already holds a run" in again.stderr and "--resume mine" in again.stderr
    assert len(list((tmp_path / "mine" / "checkpoints").glob("ckpt-*"))) == 1
    assert not (tmp_path / "latest").exists()         # only runs/ gets a latest link


def test_choose_run_dir_rules(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = Config()
    cfg.data.source = "kafka://127.0.0.1:9092/clicks?client=confluent"
    cfg.model.name = "dcnv2"
    assert str(choose_run_dir(cfg, None, now_s=0)) == "runs/19700101-000000-dcnv2-kafka-clicks"
    (tmp_path / "runs" / "19700101-000000-dcnv2-kafka-clicks").mkdir(parents=True)
    assert str(choose_run_dir(cfg, None, now_s=0)).endswith("-kafka-clicks-2")
    run = tmp_path / "r1"
    (run / "checkpoints" / "ckpt-00000010").mkdir(parents=True)
    (run / "checkpoints" / "ckpt-00000010" / "manifest.json").write_text("{}")
    (run / "checkpoints" / "LATEST").write_text("ckpt-00000010")
    for resume in (run, run / "checkpoints", run / "checkpoints" / "ckpt-00000010"):
        assert run_dir_of(resume) == run
        assert choose_run_dir(cfg, str(resume)) == run
    # A checkpoint copied out of its run: no run directory to write into without --run-dir.
    copied = tmp_path / "backup" / "ckpt-00000010"
    copied.mkdir(parents=True)
    (copied / "manifest.json").write_text("{}")
    (copied / "state.json").write_text("{}")
    with pytest.raises(ConfigError, match="outside any run directory: .*--run-dir"):
        choose_run_dir(cfg, str(copied))
    cfg.train.run_dir = str(run)
    with pytest.raises(ConfigError, match="already holds a run"):
        choose_run_dir(cfg, None)
    assert choose_run_dir(cfg, str(run)) == run
    cfg.train.run_dir = str(tmp_path / "continued")
    assert choose_run_dir(cfg, str(copied)) == tmp_path / "continued"


@pytest.mark.parametrize("source, slug", [
    ("criteo:sample", "criteo-sample"), ("avazu:/data/train.gz", "avazu-train"),
    ("/data/day_0.tsv.gz", "day_0"), ("kafka://127.0.0.1:9092/clicks", "kafka-clicks"),
    ("weird name?.csv", "weird-name"),
])
def test_source_slug(source, slug):
    assert source_slug(source) == slug


def test_resume_of_a_run_without_a_checkpoint_starts_it_and_the_same_line_then_continues(tmp_path, capsys):
    """A supervisor's one command line: `--resume DIR` before any checkpoint exists
    (never started, or killed before its first) starts the run; afterwards it resumes."""
    from stream_ctr.config import Config
    from stream_ctr.train.checkpoint import load_checkpoint
    from stream_ctr.train.loop import train
    run_dir = tmp_path / "runs" / "clicks"

    def cfg(limit):
        c = Config()
        c.model.mlp_dims = (16,)
        c.train.threads, c.data.limit_records = 1, limit
        return c

    first = train(cfg(640), resume=str(run_dir), show_progress=False)      # DIR does not exist
    assert "no checkpoint in" in capsys.readouterr().err
    assert first.records_trained_total == 640 and load_checkpoint(run_dir).records_trained == 640
    second = train(cfg(640), resume=str(run_dir), show_progress=False)     # the same line again
    assert second.records_trained_total == 1280 and "no checkpoint" not in capsys.readouterr().err

    # Killed before its first checkpoint: a time series, no checkpoint. Its series moves aside.
    other = tmp_path / "runs" / "killed"
    other.mkdir()
    (other / "timeseries.jsonl").write_text('{"kind":"start","t":1,"records":0}\n')
    third = train(cfg(320), resume=str(other), show_progress=False)
    assert third.records_trained_total == 320
    (aside,) = other.glob("no-checkpoint-*")
    assert (aside / "timeseries.jsonl").read_text().startswith('{"kind":"start","t":1')
    starts = [line for line in (other / "timeseries.jsonl").read_text().splitlines() if '"start"' in line]
    assert len(starts) == 1
