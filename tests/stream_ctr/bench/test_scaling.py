"""`stream-ctr bench scaling` as a user runs it: a real synthetic stream with its sidecar."""
import json
import math
import subprocess
import sys

from stream_ctr.bench.scaling import rule_config
from stream_ctr.config import Config, resolve_optim

CLI = [sys.executable, "-m", "stream_ctr"]


def test_rules_derive_the_batch_that_trains_from_the_base_values():
    base = Config()
    base.optim.lr_dense, base.optim.lr_embed, base.optim.l2 = 8e-4, 1e-4, 1e-5
    none = rule_config(base, "none", 8192, 1024)
    assert (none.data.batch_size, none.optim.lr_dense, none.optim.scale_from_batch) == (8192, 8e-4, 0)
    sqrt = rule_config(base, "sqrt", 8192, 1024)
    assert math.isclose(sqrt.optim.lr_dense, 8e-4 * math.sqrt(8)) and math.isclose(sqrt.optim.lr_embed, 1e-4 * math.sqrt(8))
    linear = rule_config(base, "linear", 8192, 1024)
    assert math.isclose(linear.optim.lr_embed, 8e-4) and linear.optim.l2 == 1e-5
    cow = resolve_optim(rule_config(base, "cowclip", 131072, 1024))
    assert math.isclose(cow.lr_dense, 90.51e-4, rel_tol=1e-4) and cow.l2 == 1e-5    # single-pass default
    assert cow.lr_embed == 1e-4 and cow.count_lr_s == 8
    base.optim.l2_rule = "scaled"                                  # the paper's L2 rule
    assert math.isclose(resolve_optim(rule_config(base, "cowclip", 131072, 1024)).l2, 1.28e-3)
    assert resolve_optim(rule_config(base, "none", 131072, 1024)).count_lr_s == 1.0


def test_study_table_png_and_resume(tmp_path):
    data = tmp_path / "s.tsv"
    assert subprocess.run(CLI + ["synth", str(data), "--records", "12000"], capture_output=True).returncode == 0
    args = CLI + ["bench", "scaling", f"criteo:{data}", "--batches", "256,1024", "--rules", "none,cowclip",
                  "--seeds", "2", "--base-batch", "256", "--threads", "1", "--out", str(tmp_path / "out"),
                  "--json", "--quiet"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    cells = {(c["rule"], c["batch"]): c for c in summary["cells"]}
    assert set(cells) == {("none", 256), ("none", 1024), ("cowclip", 256), ("cowclip", 1024)}
    assert all(c["seeds"] == 2 and 0.5 < c["auc_mean"] <= summary["bayes_auc"] + 0.02 for c in cells.values())
    # one pass over the same 10,800 training records: 4x the batch, ~1/4 of the steps
    assert (cells[("none", 256)]["steps"], cells[("none", 1024)]["steps"]) == (math.ceil(10800 / 256), math.ceil(10800 / 1024))
    assert cells[("cowclip", 256)]["gap_to_smallest"] == 0
    assert (tmp_path / "out" / "auc_vs_batch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (tmp_path / "out" / "table.txt").read_text()
    assert "Bayes AUC of the held-out rows" in table and "cowclip" in table
    rows = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    assert len(rows) == 8
    # Started again: every cell is there, nothing runs twice, the same table comes out.
    again = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "out" / "results.jsonl").read_text().splitlines() == rows
    assert (tmp_path / "out" / "table.txt").read_text() == table


def test_study_on_a_json_log_with_its_schema_and_sidecar(tmp_path):
    data = tmp_path / "log.jsonl"
    assert subprocess.run(CLI + ["synth", "--format", "json", str(data), "--records", "6000"],
                          capture_output=True).returncode == 0
    schema = subprocess.run(CLI + ["schema", "infer", f"json:{data}", "--label", "clicked"],
                            capture_output=True, text=True)
    assert schema.returncode == 0, schema.stderr
    (tmp_path / "s.toml").write_text(schema.stdout)
    out = subprocess.run(CLI + ["bench", "scaling", f"json:{data}", "--schema", str(tmp_path / "s.toml"),
                                "--batches", "256", "--rules", "cowclip", "--seeds", "1", "--threads", "1",
                                "--out", str(tmp_path / "out"), "--json", "--quiet"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    (cell,) = summary["cells"]
    assert cell["steps"] == math.ceil(5400 / 256) and 0.5 < cell["auc_mean"] < summary["bayes_auc"]
