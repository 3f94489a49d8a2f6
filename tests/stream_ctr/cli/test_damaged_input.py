"""`stream-ctr train` on a damaged gzip and on empty inputs, as a user runs it: real
processes, real files. A damaged file trains every line before the damage, checkpoints,
then exits 3 with one line; the repaired file resumes from there. An input with no
records exits 5 with a warning naming it, and no summary says "AUC nan"."""
import gzip
import json
import re
import subprocess
import sys
import zlib

import pytest

from stream_ctr.connectors.files import SAMPLE_PATHS
from stream_ctr.train.checkpoint import load_checkpoint

CLI = [sys.executable, "-m", "stream_ctr"]
N_LINES = 10_000
SMALL = ["--set", "model.mlp_dims=32,32", "--batch-size", "512", "--threads", "1", "--quiet"]


def run(*args, timeout=300):
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=timeout)


def says_nan(text: str) -> bool:
    return re.search(r"\bnan\b", text, re.IGNORECASE) is not None


def summary_of(out) -> dict:
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def gz() -> bytes:
    """10,000 lines of the bundled Criteo sample, gzipped."""
    lines = gzip.decompress(SAMPLE_PATHS["criteo"].read_bytes()).split(b"\n")[:N_LINES]
    return gzip.compress(b"\n".join(lines) + b"\n", mtime=0)


def readable_lines(damaged: bytes) -> int:
    """Complete lines zlib inflates from a cut gzip (a cut raises nothing in zlib)."""
    return zlib.decompressobj(wbits=31).decompress(damaged).count(b"\n")


@pytest.mark.parametrize("where, holdout", [("mid-stream", 0.0), ("near the end", 0.1)])
def test_a_truncated_gzip_trains_its_readable_lines_checkpoints_and_exits_3(tmp_path, gz, where, holdout):
    cut = len(gz) // 2 if where == "mid-stream" else len(gz) - 500
    path = tmp_path / "day_criteo.tsv.gz"
    path.write_bytes(gz[:cut])
    n = readable_lines(gz[:cut])
    train_end = n - int(round(n * holdout))
    run_dir = tmp_path / "run"
    out = run("train", f"criteo:{path}", "--holdout-fraction", str(holdout), "--run-dir", str(run_dir),
              "--json", *SMALL)
    assert out.returncode == 3, out.stderr
    # Every readable line trained (or held out and scored), none of the cut one.
    s = summary_of(out)
    assert s["records_trained"] + s["records_rejected"] == train_end
    assert s.get("test_records", 0) == n - train_end
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
    assert errors[0].startswith(f"stream-ctr: error: {path}: gzip stream truncated after {n:,} lines "
                                f"(byte {cut:,} of {cut:,})")
    assert "the file is damaged: re-copy it" in errors[0] and f"--resume {run_dir}" in errors[0]
    # ... and checkpointed before the error: the resume point is the line after them.
    state = load_checkpoint(str(run_dir))
    assert state.positions == {f"file:{path.name}": train_end}
    assert state.records_trained == s["records_trained"] and s["checkpoint"] in errors[0]
    if holdout:
        return
    # The repaired file: the same --resume goes on from there, and the run is complete.
    path.write_bytes(gz)
    resumed = run("train", "--resume", str(run_dir), "--json", *SMALL)
    assert resumed.returncode == 0, resumed.stderr
    r = summary_of(resumed)
    assert r["records_trained"] + r["records_rejected"] == N_LINES - n
    assert r["records_trained_total"] == s["records_trained"] + r["records_trained"]


@pytest.mark.parametrize("name", ["empty_criteo.tsv", "empty_criteo.tsv.gz", "header_avazu.csv"])
def test_an_input_without_records_exits_5_with_a_warning(tmp_path, name):
    path = tmp_path / name
    if name.endswith(".gz"):
        path.write_bytes(gzip.compress(b""))
    elif "avazu" in name:                               # the header line alone
        path.write_bytes(gzip.decompress(SAMPLE_PATHS["avazu"].read_bytes()).split(b"\n", 1)[0] + b"\n")
    else:
        path.write_bytes(b"")
    run_dir = tmp_path / "run"
    out = run("train", str(path), "--run-dir", str(run_dir), *SMALL)
    assert out.returncode == 5, out.stderr
    warning = out.stderr.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith(f"stream-ctr: warning: {path} holds no records"), out.stderr
    assert "no records" in out.stdout and not says_nan(out.stdout), out.stdout
    if name != "empty_criteo.tsv":
        return
    # A checkpoint of no training: a resume with records in the file trains them all.
    assert load_checkpoint(str(run_dir)).positions == {}
    # eval of the empty file: the same status and warning.
    ev = run("eval", str(run_dir), f"criteo:{path}")
    assert ev.returncode == 5 and not says_nan(ev.stdout), ev.stderr
    assert ev.stderr.strip().startswith(f"stream-ctr: warning: {path} holds no records"), ev.stderr
    # A handful of rows of one class: the AUC is undefined and the line says so.
    one_class = tmp_path / "negatives_criteo.tsv"
    lines = gzip.decompress(SAMPLE_PATHS["criteo"].read_bytes()).split(b"\n")
    one_class.write_bytes(b"\n".join([line for line in lines if line.startswith(b"0\t")][:20]) + b"\n")
    ev = run("eval", str(run_dir), f"criteo:{one_class}")
    assert ev.returncode == 0, ev.stderr
    assert "AUC n/a (needs both a click and a non-click among the scored rows)" in ev.stdout, ev.stdout
    assert "calibration n/a (no click among the scored rows)" in ev.stdout and not says_nan(ev.stdout), ev.stdout
