"""Export a trained run, score its held-out lines with the bundle: the trainer's numbers.

Real runs on the bundled Criteo sample (DeepFM with a 32x32 MLP, batches of 128,
the last 10% held out), real bundles on disk, the real CLI entry point.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from stream_ctr.cli.main import main
from stream_ctr.connectors.files import detect_format
from stream_ctr.serving.bundle import read_bundle
from stream_ctr.serving.export import export_bundle
from stream_ctr.train.checkpoint import load_checkpoint
from stream_ctr.train.loop import configure_torch, held_out_start, score, train
from stream_ctr.train.trainer import Trainer
from tests.stream_ctr.store.helpers import BATCH, CRITEO_FIELDS, small_config

HOLDOUT = 0.1


def trained(run_dir, tiered: bool):
    cfg = small_config(run_dir, tiered=tiered)
    cfg.data.holdout_fraction = HOLDOUT
    cfg.train.checkpoint_every_batches = 40        # older checkpoints to export too
    return cfg, train(cfg, show_progress=False)


def trainer_scores(checkpoint, start: int) -> np.ndarray:
    """`Trainer.predict` of a checkpoint on the lines from `start` (what `eval` runs)."""
    state = load_checkpoint(checkpoint)
    from stream_ctr.config import Config
    cfg = Config.from_dict(state.config)
    configure_torch(cfg)
    fmt, path = detect_format("criteo:sample")
    trainer = Trainer(cfg, fmt.n_keys, fmt.n_dense, read_only=True)
    trainer.load_state_tensors(state.tensors["trainer"])
    probs, _ = score(trainer, path, fmt, start, None, cfg.data.chunk_records)
    trainer.store.close()
    return probs


def cli_json(capsys, *args) -> dict:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def memory_run(tmp_path_factory):
    """A run with every row in one in-memory table, and its bundle (tmp/bundle)."""
    tmp = tmp_path_factory.mktemp("memory")
    cfg, summary = trained(tmp / "run", tiered=False)
    assert main(["export", cfg.train.run_dir, "--out", str(tmp / "bundle"), "--quiet"]) == 0
    return tmp, cfg, summary


@pytest.fixture(scope="module")
def tiered_run(tmp_path_factory):
    """The same run with a tiny device cache and RAM tier: most rows live in LMDB."""
    tmp = tmp_path_factory.mktemp("tiered")
    cfg, summary = trained(tmp / "run", tiered=True)
    return tmp, cfg, summary


def test_predict_equals_trainer_predict_and_the_runs_test_auc(memory_run, capsys):
    tmp, cfg, summary = memory_run
    run_dir = cfg.train.run_dir
    exported = cli_json(capsys, "export", run_dir, "--out", str(tmp / "bundle2"))
    assert exported["rows"] > 40_000 and exported["precision"] == summary.precision
    out = cli_json(capsys, "predict", str(tmp / "bundle"), "--out", str(tmp / "probs.npy"))
    fmt, path = detect_format("criteo:sample")
    n = 14_493
    start = held_out_start(n, HOLDOUT)
    # By default it scores the run's held-out lines: the 1,449 its test AUC came from.
    assert (out["start"], out["stop"], out["records"]) == (start, n, 1449) == (start, n, summary.test["records"])
    probs = np.load(tmp / "probs.npy")
    reference = trainer_scores(run_dir, start)
    assert probs.shape == reference.shape == (1449,)
    assert np.abs(probs - reference).max() <= 1e-6
    assert np.array_equal(probs, reference)                  # in fact bit for bit
    # ... including the held-out keys the run never trained: their initial rows are recomputed.
    from stream_ctr.connectors.files import FileSource
    with FileSource(path, fmt, start_offset=start) as src:
        held_keys = np.unique(src.read()[0].keys)
    unseen = ~np.isin(held_keys, read_bundle(tmp / "bundle").keys)
    assert unseen.sum() > 1000
    assert abs(out["auc"] - summary.test["auc"]) <= 1e-6
    assert abs(out["logloss"] - summary.test["logloss"]) <= 1e-6
    # Text output: one probability per line, the same float32 values.
    text = cli_json(capsys, "predict", str(tmp / "bundle"), "criteo:sample", "--start", str(start),
                    "--out", str(tmp / "probs.txt"))
    assert text["records"] == 1449
    assert np.array_equal(np.loadtxt(tmp / "probs.txt", dtype=np.float32), probs)


def test_tiered_store_on_lmdb_exports_the_same_bundle(memory_run, tiered_run, tmp_path, capsys):
    mem_tmp, mem_cfg, mem_summary = memory_run
    _, cfg, summary = tiered_run
    # Device cache of 2 worst-case batches + 3,000 RAM rows: under 13K of the ~55K rows
    # fit above LMDB; the rest lived only on disk while training.
    resident = 2 * BATCH * CRITEO_FIELDS + 3000
    cli_json(capsys, "export", cfg.train.run_dir, "--out", str(tmp_path / "bundle"))
    tier_bundle = read_bundle(tmp_path / "bundle")
    mem_bundle = read_bundle(mem_tmp / "bundle")
    assert len(tier_bundle.keys) > 4 * resident
    assert tier_bundle.manifest["rows"]["store"] == "tiered"
    assert np.array_equal(tier_bundle.keys, mem_bundle.keys)
    assert np.array_equal(tier_bundle.rows, mem_bundle.rows)
    out = cli_json(capsys, "predict", str(tmp_path / "bundle"), "--out", str(tmp_path / "p.npy"))
    mem = cli_json(capsys, "predict", str(mem_tmp / "bundle"), "--out", str(tmp_path / "m.npy"))
    assert np.array_equal(np.load(tmp_path / "p.npy"), np.load(tmp_path / "m.npy"))
    assert out["auc"] == mem["auc"] and abs(out["auc"] - summary.test["auc"]) <= 1e-6
    assert summary.test["auc"] == mem_summary.test["auc"]


def test_an_older_tiered_checkpoint_exports_its_own_generation_in_chunks(tiered_run, tmp_path):
    """The LMDB table moved on after checkpoint 40; its bundle is generation 40's table
    (rows from the undo logs), read 1,000 rows at a time."""
    tier_tmp, cfg, _ = tiered_run
    old = tier_tmp / "run" / "checkpoints" / "ckpt-00000040"
    state = load_checkpoint(old)
    fmt, _ = detect_format("criteo:sample")
    info = {"path": str(old), "name": old.name, "step": state.step,
            "records_trained": state.records_trained, "positions": state.positions}
    export_bundle(state.tensors, state.config, tmp_path / "b40", fmt, info, "fp32", chunk_rows=1000)
    bundle = read_bundle(tmp_path / "b40")
    # Against the in-memory table of the same step, trained the same way.
    mem_cfg = small_config(tmp_path / "mem", tiered=False)
    mem_cfg.data.limit_records = 40 * BATCH
    train(mem_cfg, show_progress=False)
    mem = load_checkpoint(mem_cfg.train.run_dir).tensors["trainer"]["store"]
    order = torch.argsort(mem["keys"])
    assert np.array_equal(bundle.keys, mem["keys"][order].numpy())
    assert np.array_equal(bundle.rows, mem["weight"][order].numpy())
    # ... and the last generation's table differs from it (the undo logs were needed).
    last = read_bundle_of(tmp_path, cfg.train.run_dir)
    assert len(last.keys) > len(bundle.keys)


def read_bundle_of(tmp_path, run_dir):
    assert main(["export", run_dir, "--out", str(tmp_path / "blast"), "--quiet"]) == 0
    return read_bundle(tmp_path / "blast")


def test_predict_on_a_handful_of_rows_of_one_class_says_why_there_is_no_auc(memory_run, tmp_path, capsys):
    """Three rows, all non-clicks: AUC is undefined. The line says so (never "AUC nan"),
    and --json holds null; three rows with a click among them have an AUC."""
    import gzip
    import re
    from stream_ctr.connectors.files import SAMPLE_PATHS
    tmp, _, _ = memory_run
    lines = gzip.decompress(SAMPLE_PATHS["criteo"].read_bytes()).split(b"\n")
    negatives = [line for line in lines if line.startswith(b"0\t")]
    clicks = [line for line in lines if line.startswith(b"1\t")]
    one_class = tmp_path / "three_criteo.tsv"
    one_class.write_bytes(b"\n".join(negatives[:3]) + b"\n")
    assert main(["predict", str(tmp / "bundle"), f"criteo:{one_class}", "--out", str(tmp_path / "p.txt"),
                 "--quiet"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("AUC n/a (needs both a click and a non-click among the scored rows) logloss "), line
    assert "3 records" in line and not re.search(r"\bnan\b", line, re.I), line
    assert main(["predict", str(tmp / "bundle"), f"criteo:{one_class}", "--out", str(tmp_path / "p.txt"),
                 "--json", "--quiet"]) == 0
    raw = capsys.readouterr().out.strip().splitlines()[-1]
    assert "NaN" not in raw and json.loads(raw)["auc"] is None and json.loads(raw)["records"] == 3
    mixed = tmp_path / "mixed_criteo.tsv"
    mixed.write_bytes(b"\n".join(negatives[:2] + clicks[:1]) + b"\n")
    out = cli_json(capsys, "predict", str(tmp / "bundle"), f"criteo:{mixed}", "--out", str(tmp_path / "q.txt"))
    assert out["records"] == 3 and 0.0 <= out["auc"] <= 1.0
