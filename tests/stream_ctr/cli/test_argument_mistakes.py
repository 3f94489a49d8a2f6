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
