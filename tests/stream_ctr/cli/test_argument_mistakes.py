"""Arguments a user can get wrong: one clear line and exit 2, never a traceback."""
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "stream_ctr"]


@pytest.mark.parametrize("args, needle", [
    (["synth", "{tmp}/z.tsv", "--records", "-5"], "--records -5: the number of rows to write must be >= 0"),
    (["serve", "{tmp}/no-bundle", "--port", "70000"], "--port 70000: a TCP port is 0-65535"),
    (["predict", "{tmp}/no-bundle", "--chunk-records", "0", "--out", "{tmp}/p.npy"],
     "--chunk-records 0: records scored at a time must be >= 1"),
    (["predict", "{tmp}/no-bundle", "--heap-keep-bytes", "1MiB", "--out", "{tmp}/p.npy"],
     "--heap-keep-bytes 1MiB: must be 0 (glibc's defaults) or at least 64MiB"),
    (["predict", "{tmp}/no-bundle", "--heap-keep-bytes", "lots", "--out", "{tmp}/p.npy"],
     "--heap-keep-bytes: not a byte size: 'lots'"),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, args, needle):
    out = subprocess.run(CLI + [a.format(tmp=tmp_path) for a in args], capture_output=True, text=True,
                         timeout=120)
    assert (out.returncode, len(out.stderr.strip().splitlines())) == (2, 1), out.stderr
    assert needle in out.stderr
    assert not list(tmp_path.iterdir())          # nothing half-written (synth's .probs.npy)


def test_a_file_where_a_directory_is_needed_is_named(tmp_path):
    (tmp_path / "afile").write_text("")
    out = subprocess.run(CLI + ["train", "--run-dir", str(tmp_path / "afile"), "--limit", "10", "--quiet"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "afile exists and is not a directory" in out.stderr, out.stderr


def test_a_model_too_large_for_memory_is_one_line(tmp_path):
    out = subprocess.run(CLI + ["train", "--run-dir", str(tmp_path / "r"), "--limit", "10", "--quiet",
                                "--set", "model.mlp_dims=1000000,1000000"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "stream-ctr: error: out of memory" in out.stderr, out.stderr
    assert "model.mlp_dims" in out.stderr and "Traceback" not in out.stderr


def test_skipped_batches_and_a_stop_by_signal_are_said(tmp_path):
    """A learning rate that makes every loss inf reads the data but teaches nothing: the
    summary line alone would read like success."""
    out = subprocess.run(CLI + ["train", "--run-dir", str(tmp_path / "r"), "--limit", "2000", "--quiet",
                                "--set", "optim.lr_dense=1e30"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "batches were not trained: their loss was not finite" in out.stderr, out.stderr
    assert "stream_ctr_batches_skipped_total" in out.stderr


def test_a_dead_letter_path_that_cannot_be_written_names_the_option(tmp_path):
    (tmp_path / "afile").write_text("")
    out = subprocess.run(CLI + ["train", "--run-dir", str(tmp_path / "r"), "--limit", "10", "--quiet",
                                "--set", f"data.dead_letter_path={tmp_path / 'afile' / 'dl.jsonl'}"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "data.dead_letter_path = " in out.stderr, out.stderr
    assert "cannot write there" in out.stderr
