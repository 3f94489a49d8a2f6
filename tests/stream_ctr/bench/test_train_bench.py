"""`stream-ctr bench train`: the trainer's samples/s beside a bare MLP measured in the same process."""
import json
import math
import re

import pytest

from stream_ctr.cli import main


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bench_train_reports_the_same_run_bare_mlp_and_the_ratio(capsys, precision):
    assert main(["bench", "train", "--records", "3000", "--batch-sizes", "512", "--threads", "1",
                 "--precision", precision, "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (row,) = out["rows"]
    assert row["batch_size"] == 512 and row["precision"] == precision and row["records"] > 2000
    for key in ("samples_per_s_excl_decode", "samples_per_s_incl_decode", "bare_mlp_fp32_samples_per_s",
                "bare_mlp_bf16_samples_per_s", "vs_bare_fp32"):
        assert positive(row[key]), key
    assert row["vs_bare_fp32"] == pytest.approx(row["samples_per_s_incl_decode"] / row["bare_mlp_fp32_samples_per_s"])
    before, after = row["bare_mlp_fp32_before_after"]        # bracketing the timed pass
    assert positive(before) and positive(after)
    assert row["bare_mlp_fp32_samples_per_s"] == pytest.approx((before + after) / 2)


def test_bench_train_alternates_eager_and_compiled_trainers(capsys):
    # reduce-overhead records CUDA graphs on a GPU; on the CPU it compiles as default does.
    # The compiled trainer is timed after it compiled (its warm-up steps are its own).
    from stream_ctr.bench.train import format_table
    from stream_ctr.cli.main import build_parser
    assert build_parser().parse_args(["bench", "train", "--compile"]).compile == "default"
    assert main(["bench", "train", "--records", "3000", "--batch-sizes", "512", "--threads", "1",
                 "--precision", "fp32", "--compile", "off,reduce-overhead", "--json", "--quiet"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    eager, graphs = rows
    table = format_table(rows).splitlines()
    assert "compile" in table[1] and "excl. decode vs compile off" in table[1]
    assert (eager["compile"], graphs["compile"]) == ("off", "reduce-overhead")
    assert positive(graphs["samples_per_s_incl_decode"]) and positive(graphs["samples_per_s_excl_decode"])
    assert "vs_first_store_excl_decode" not in eager
    assert graphs["vs_first_store_excl_decode"] == pytest.approx(
        graphs["samples_per_s_excl_decode"] / eager["samples_per_s_excl_decode"])
    assert main(["bench", "train", "--compile", "fast"]) == 2
    assert "--compile takes off, default, reduce-overhead" in capsys.readouterr().err


def test_bench_train_on_a_json_log_with_its_schema(capsys, tmp_path):
    from stream_ctr.connectors.synth_json import AD_LOG_SCHEMA, write_synthetic_json
    log = tmp_path / "log.jsonl"
    write_synthetic_json(log, 3000)
    (tmp_path / "s.toml").write_text(AD_LOG_SCHEMA)
    assert main(["bench", "train", "--data", f"json:{log}", "--schema", str(tmp_path / "s.toml"),
                 "--batch-sizes", "512", "--threads", "1", "--json", "--quiet"]) == 0
    (row,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert row["records"] == 5 * 512 and positive(row["samples_per_s_incl_decode"])


def test_bench_train_profiles_steps_after_the_timed_pass(capsys):
    assert main(["bench", "train", "--records", "3000", "--batch-sizes", "512", "--threads", "1",
                 "--precision", "fp32", "--profile-steps", "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "profile of 2 steps at batch 512 on cpu (sorted by self_cpu_time_total)" in out
    assert "aten::mm" in out or "aten::addmm" in out          # the MLP's matrix products
    assert main(["bench", "train", "--records", "3000", "--batch-sizes", "512",
                 "--profile-steps", "-1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--profile-steps" in err[0]


def test_bench_train_alternates_the_memory_and_the_tiered_store_and_reports_the_tiers(capsys):
    # A cache of ~1.2 worst-case working sets, a RAM tier of ~4,000 rows and a spill of
    # ~1,600: rows go down to LMDB.
    assert main(["bench", "train", "--records", "6000", "--batch-sizes", "256", "--threads", "1",
                 "--store", "memory,tiered", "--cache-bytes", "3MiB", "--ram-bytes", "1MiB",
                 "--spill-bytes", "256KiB", "--repeats", "2", "--json", "--quiet"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [r["store"] for r in rows] == ["memory", "tiered", "memory", "tiered"]      # A, B, A, B
    for memory, tiered in (rows[0:2], rows[2:4]):
        assert memory["store_counters"] is None and "vs_first_store_excl_decode" not in memory
        assert tiered["vs_first_store_excl_decode"] == pytest.approx(
            tiered["samples_per_s_excl_decode"] / memory["samples_per_s_excl_decode"])
        c = tiered["store_counters"]
        assert 0 < c["hit_rate"]["cache"] < 1 and c["lmdb_written_rows"] > 0 and c["lmdb_read_rows"] > 0
        assert c["prefetch_wait_s"] >= 0 and c["rows_spilled"] > c["rows_written_back"] > 0
    assert main(["bench", "train", "--records", "3000", "--store", "disk", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--store" in err[0]


def test_bench_train_steps_a_tiered_store_with_look_ahead_and_compares_evict_ahead_modes(capsys):
    # As `train` runs it: each step names the next batch, so the store prefetches its rows
    # and (evict_ahead on) frees their cache slots during the step before.
    assert main(["bench", "train", "--records", "6000", "--batch-sizes", "256", "--threads", "1",
                 "--store", "tiered", "--evict-ahead", "on,off", "--cache-bytes", "3MiB",
                 "--ram-bytes", "1MiB", "--profile-steps", "3", "--json", "--quiet"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [r["store"] for r in rows] == ["tiered, evict_ahead on", "tiered, evict_ahead off"]
    on, off = (r["store_counters"] for r in rows)
    assert on["lmdb_read_rows"] > 0 and off["lmdb_read_rows"] > 0
    assert 0 < on["rows_evicted_ahead"] <= on["cache_evictions"] and off["rows_evicted_ahead"] == 0
    assert off["cache_evictions"] > 0
    assert rows[1]["vs_first_store_excl_decode"] > 0
    # The profile names the store's parts on both threads: evictions on the I/O thread
    # with evict_ahead on, in prepare with it off.
    parts = {r["store"]: dict(re.findall(r"^  (store\.[\w.]+) +(\d+) calls", r["profile"], re.M))
             for r in rows}
    on_parts, off_parts = parts["tiered, evict_ahead on"], parts["tiered, evict_ahead off"]
    assert on_parts["store.prepare"] == "3" and "store.io.prefetch" in on_parts
    assert "store.io.evict_ahead" in on_parts and "store.io.evict_ahead" not in off_parts
    assert main(["bench", "train", "--records", "3000", "--store", "tiered", "--evict-ahead", "soon",
                 "--quiet"]) == 2
    assert "--evict-ahead" in capsys.readouterr().err


def _fails(queue) -> None:
    raise RuntimeError("a bug in the measuring process")


def test_a_measuring_process_that_fails_is_an_error_not_a_wait(capsys):
    # A budget too small for the batch: the child's ConfigError is the command's one line.
    assert main(["bench", "train", "--records", "3000", "--batch-sizes", "2048", "--store", "tiered",
                 "--cache-bytes", "12MiB", "--threads", "1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cache-bytes" in err[0]
    # Any other death of the child (its traceback is its own) ends the wait too.
    import multiprocessing as mp
    from stream_ctr.bench.train import _in_process
    with pytest.raises(RuntimeError, match="ended without a result .exit code 1"):
        _in_process(mp.get_context("spawn"), _fails)
