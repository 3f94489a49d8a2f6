"""`stream-ctr bench scaling` as a user runs it: a real synthetic stream with its sidecar."""
import json
import math
import subprocess
import sys

import numpy as np

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


def test_stream_specs_name_the_teacher_they_draw_from():
    from stream_ctr.bench.scaling import parse_stream_spec, parse_stream_specs
    from stream_ctr.config import ConfigError
    from stream_ctr.connectors.synth import ADDITIVE_TEACHER, DEFAULT_TEACHER, Teacher
    assert parse_stream_spec("interaction").teacher == DEFAULT_TEACHER
    assert parse_stream_spec("additive").teacher == ADDITIVE_TEACHER
    spec = parse_stream_spec("interaction:zipf=1.20:dim=8:seed=1:vocab=5000:fields=10:nonlinear=0.5")
    assert spec.teacher == Teacher(seed=1, zipf_exponent=1.2, vocab_per_field=5000, fields=10,
                                   interaction=1.0, interaction_dim=8, nonlinear=0.5)
    # one canonical name (the knobs that differ from the named teacher, in a fixed order) per stream
    assert spec.name == "interaction:seed=1:zipf=1.2:vocab=5000:fields=10:dim=8:nonlinear=0.5"
    assert spec.slug == "interaction-seed1-zipf1.2-vocab5000-fields10-dim8-nonlinear0.5"
    assert parse_stream_spec("interaction:seed=0").slug == "interaction"
    assert parse_stream_spec("additive:interaction=0.5").teacher.interaction == 0.5
    try:
        parse_stream_specs("additive,interaction:interaction=0")
    except ConfigError as e:
        assert "twice" in str(e)
    else:
        raise AssertionError("the same teacher under two specs was accepted")


def test_matrix_writes_each_stream_once_and_gathers_every_cell(tmp_path):
    out = tmp_path / "m"
    args = CLI + ["bench", "scaling", "--synth", "interaction,additive:seed=1:zipf=1.2", "--rows", "8000,4000",
                  "--batches", "1024,256", "--rules", "none,cowclip", "--seeds", "1", "--base-batch", "256",
                  "--threads", "1", "--out", str(out), "--quiet"]
    first = subprocess.run(args + ["--json"], capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    saved = json.loads((out / "matrix.json").read_text())
    assert summary["cells"] == saved["cells"] and summary["pivots"] == saved["pivots"]
    streams = ["interaction", "additive:seed=1:zipf=1.2"]
    cells = {(c["stream"], c["rows"], c["rule"], c["batch"]): c for c in saved["cells"]}
    assert set(cells) == {(s, r, rule, b) for s in streams for r in (4000, 8000)
                          for rule in ("none", "cowclip") for b in (256, 1024)}
    for (stream, rows, rule, batch), c in cells.items():
        assert 0.5 < c["bayes_auc"] <= 1 and 0.5 < c["auc_mean"] < c["bayes_auc"] + 0.02
        assert math.isclose(c["gap_to_bayes"], c["bayes_auc"] - c["auc_mean"])
        assert c["steps"] == math.ceil(rows * 0.9 / batch) and c["seeds"] == 1
    # one Bayes AUC per stream and size, the same in each of its cells
    assert len({(s, r, c["bayes_auc"]) for (s, r, _, _), c in cells.items()}) == 4
    # rows down, batch across, per stream and rule; the smallest batch is the zero
    assert [(p["stream"], p["rule"]) for p in saved["pivots"]] == [(s, rule) for s in streams
                                                                   for rule in ("none", "cowclip")]
    for p in saved["pivots"]:
        assert (p["rows"], p["batches"], p["smallest_batch"]) == ([4000, 8000], [256, 1024], 256)
        assert [row[0] for row in p["vs_smallest_points"]] == [0.0, 0.0]
        for rows, vals in zip(p["rows"], p["vs_smallest_points"]):
            c, small = cells[(p["stream"], rows, p["rule"], 1024)], cells[(p["stream"], rows, p["rule"], 256)]
            assert math.isclose(vals[1], 100 * (c["auc_mean"] - small["auc_mean"]), abs_tol=1e-12)
    text = (out / "matrix.txt").read_text()
    assert text.count("gap to Bayes (pt)") == 1 and text.count("additive:seed=1:zipf=1.2, cowclip:\n") == 1
    for slug in ("interaction", "additive-seed1-zipf1.2"):
        for rows in (4000, 8000):
            pair = out / f"{slug}-{rows}"
            assert len((pair / "results.jsonl").read_text().splitlines()) == 4
            assert (pair / "auc_vs_batch.png").exists() and "Bayes AUC" in (pair / "table.txt").read_text()
            assert len(np.load(out / "data" / f"{slug}-{rows}.tsv.probs.npy")) == rows
    # the stream is the one `stream-ctr synth` writes for that teacher, and a size is a prefix of a larger one
    ref = tmp_path / "ref.tsv"
    assert subprocess.run(CLI + ["synth", str(ref), "--records", "4000", "--seed", "1", "--zipf", "1.2",
                                 "--interaction", "0"], capture_output=True).returncode == 0
    small = (out / "data" / "additive-seed1-zipf1.2-4000.tsv").read_bytes()
    assert small == ref.read_bytes()
    assert (out / "data" / "additive-seed1-zipf1.2-8000.tsv").read_bytes().startswith(small)

    # Started again after a write that stopped half-way: that stream is written again, the
    # others are reused, no cell runs twice and the matrix is the same.
    torn = out / "data" / "interaction-8000.tsv.probs.npy"
    torn.write_bytes(torn.read_bytes()[:20_000])
    (out / "data" / "interaction-4000.tsv.partial").write_bytes(b"1\t2\n")
    data = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in (out / "data").glob("*.tsv")}
    results = {p: p.read_text() for p in out.glob("*/results.jsonl")}
    again = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith(text)
    for p in (out / "data").glob("*.tsv"):
        mtime, body = data[p.name]
        assert p.read_bytes() == body
        assert (p.stat().st_mtime_ns == mtime) == (p.name != "interaction-8000.tsv")
    assert len(np.load(torn)) == 8000
    assert {p: p.read_text() for p in out.glob("*/results.jsonl")} == results
    assert json.loads((out / "matrix.json").read_text()) == saved


def test_matrix_options_a_user_gets_wrong_are_one_line_errors(tmp_path):
    base = CLI + ["bench", "scaling", "--out", str(tmp_path / "m"), "--rows", "4000"]
    for extra, cause in ((["--synth", "interaction,wide"], "unknown stream 'wide'"),
                         (["--synth", "interaction:zipff=1.2"], "'zipff=1.2' is not key=value"),
                         (["--synth", "additive:dim=2.5"], "dim='2.5' is not a whole number"),
                         (["--synth", "interaction:fields=40"], "fields must be 1..26"),
                         (["x.tsv", "--synth", "additive"], "not both")):
        out = subprocess.run(base + extra, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, (extra, out.stderr)
        assert out.stderr.count("\n") == 1 and cause in out.stderr, out.stderr
    assert not (tmp_path / "m").exists()
