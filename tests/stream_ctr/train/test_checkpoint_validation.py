"""A checkpoint is verified before anything of it is read: a manifest not in the form the
trainer writes, a file it does not list, a size or checksum that does not match, is one
"corrupt checkpoint" error naming the file. `--resume RUN_DIR` goes on from the newest
valid checkpoint, saying so; `--resume CHECKPOINT` of a corrupt one fails (exit 4)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stream_ctr.chaos.verify import same_tensors
from stream_ctr.train.checkpoint import CorruptCheckpoint, load_checkpoint

from tests.stream_ctr.train.small_run import EXIT_STATE, cli


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run of 9 batches with checkpoints at steps 6, 8 and 9 (LATEST)."""
    cwd = tmp_path_factory.mktemp("trained")
    done = cli(cwd, "--run-dir", "run", "--limit", "576", "--checkpoint-every", "2")
    assert done.returncode == 0, done.stderr
    root = cwd / "run" / "checkpoints"
    assert sorted(p.name for p in root.glob("ckpt-*")) == ["ckpt-00000006", "ckpt-00000008", "ckpt-00000009"]
    return cwd / "run"


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the trained run, at tmp_path/run, to damage."""
    shutil.copytree(trained, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def _edit_manifest(ckpt: Path, edit) -> None:
    path = ckpt / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _flip_byte(ckpt: Path) -> None:
    data = bytearray((ckpt / "tensors.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (ckpt / "tensors.pt").write_bytes(bytes(data))


def _truncate(ckpt: Path) -> None:
    data = (ckpt / "tensors.pt").read_bytes()
    (ckpt / "tensors.pt").write_bytes(data[:-1])


def _unlist_state(manifest: dict) -> None:
    del manifest["files"]["state.json"], manifest["bytes"]["state.json"]


# (how the checkpoint is damaged, what the error says)
DAMAGE = {
    "empty manifest": (lambda c: (c / "manifest.json").write_text("{}"), 'manifest.json has no "checkpoint"'),
    "no files": (lambda c: (c / "manifest.json").write_text('{"files": {}}'), 'manifest.json has no "checkpoint"'),
    "files emptied": (lambda c: _edit_manifest(c, lambda m: m.update(files={}, bytes={})),
                      'manifest.json does not list tensors.pt in "files"'),
    "a file not listed": (lambda c: _edit_manifest(c, _unlist_state),
                          'manifest.json does not list state.json in "files"'),
    "an extra file": (lambda c: (c / "notes.txt").write_text("hello"),
                      "notes.txt is in the directory but not listed in manifest.json"),
    "a size mismatch": (_truncate, "tensors.pt is "),
    "a flipped byte": (_flip_byte, "tensors.pt does not match its sha256 in manifest.json"),
    "save_seq a string": (lambda c: _edit_manifest(c, lambda m: m.update(save_seq="9")),
                          'manifest.json "save_seq" is \'9\', not an integer'),
    "not JSON": (lambda c: (c / "manifest.json").write_text('{"checkpoint": '), "manifest.json is not JSON"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_each_damage_is_one_corrupt_checkpoint_error_naming_the_file(run, damage):
    ckpt = run / "checkpoints" / "ckpt-00000009"
    apply, says = DAMAGE[damage]
    apply(ckpt)
    with pytest.raises(CorruptCheckpoint) as err:
        load_checkpoint(ckpt)
    assert str(err.value).startswith(f"corrupt checkpoint {ckpt}: "), err.value
    assert says in str(err.value)
    with pytest.raises(CorruptCheckpoint):       # the run's LATEST: eval and export read it so
        load_checkpoint(run)


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_resuming_a_named_corrupt_checkpoint_fails_with_exit_4_and_writes_nothing(run, damage):
    ckpt = run / "checkpoints" / "ckpt-00000009"
    apply, says = DAMAGE[damage]
    apply(ckpt)
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    out = cli(run.parent, "--resume", "run/checkpoints/ckpt-00000009", "--limit", "64")
    assert out.returncode == EXIT_STATE, out.stderr
    error = out.stderr.strip().splitlines()[-1]
    assert error.startswith("stream-ctr: error: corrupt checkpoint run/checkpoints/ckpt-00000009: "), error
    assert says in error and "Traceback" not in out.stderr
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before


@pytest.mark.parametrize("damage", ["empty manifest", "a flipped byte"])
def test_resuming_a_run_whose_newest_checkpoint_is_corrupt_goes_on_from_the_newest_valid_one(
        run, tmp_path, damage):
    # The reference: the same resume, from the valid checkpoint named by hand.
    reference = tmp_path / "reference"
    shutil.copytree(run, reference / "run", symlinks=True)
    ref = cli(reference, "--resume", "run/checkpoints/ckpt-00000008", "--limit", "128")
    assert ref.returncode == 0, ref.stderr

    DAMAGE[damage][0](run / "checkpoints" / "ckpt-00000009")
    out = cli(tmp_path, "--resume", "run", "--limit", "128")
    assert out.returncode == 0, out.stderr
    (warning,) = [line for line in out.stderr.splitlines() if "corrupt checkpoint" in line]
    assert warning.startswith("stream-ctr: warning: corrupt checkpoint run/checkpoints/ckpt-00000009: "
                              + DAMAGE[damage][1]), warning
    assert "--resume run continues from ckpt-00000008 (step 8, 512 records)" in warning
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["records_trained_total"] == 512 + 128
    # The checkpoint it wrote continues the valid state: the same as resuming ckpt-00000008 by name.
    new, expected = load_checkpoint(run), load_checkpoint(reference / "run")
    assert new.path != expected.path and new.step == expected.step == 10
    assert new.records_trained == expected.records_trained == 640 and new.positions == expected.positions
    assert same_tensors(new.tensors, expected.tensors)


def test_a_run_with_no_valid_checkpoint_left_is_one_clear_error(run):
    for name in ("ckpt-00000006", "ckpt-00000008", "ckpt-00000009"):
        _flip_byte(run / "checkpoints" / name)
    out = cli(run.parent, "--resume", "run", "--limit", "64")
    assert out.returncode == EXIT_STATE, out.stderr
    error = out.stderr.strip().splitlines()[-1]
    assert error.startswith("stream-ctr: error: corrupt checkpoint run/checkpoints/ckpt-00000009: "), error
    assert "holds no other valid checkpoint" in error and "ckpt-00000006" in error
    assert "another --run-dir" in error and "Traceback" not in out.stderr


def test_a_manifest_of_an_older_version_without_sizes_still_loads(run):
    """Version 0.13 wrote no "bytes": its runs resume after an upgrade, checked by sha256."""
    ckpt = run / "checkpoints" / "ckpt-00000009"
    _edit_manifest(ckpt, lambda m: m.pop("bytes"))
    assert load_checkpoint(ckpt).step == 9
    _flip_byte(ckpt)
    with pytest.raises(CorruptCheckpoint, match="tensors.pt does not match its sha256"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize("job_json, says", [
    ("{}", 'job.json "format_version" is None, not an integer'),
    ('{"format_version": 1, "world_size": 1, "global_step": 9, "records_trained": 576, "config": {}, '
     '"ranks": [{"rank": 0, "checkpoint": "../../run/checkpoints/ckpt-00000009", "manifest_sha256": "0", '
     '"positions": {}, "records_trained": 576, "trainer_step": 9}]}',
     "rank 0's checkpoint '../../run/checkpoints/ckpt-00000009' is not inside its rank-00000 directory"),
])
def test_a_corrupt_job_manifest_is_one_corrupt_checkpoint_error(tmp_path, job_json, says):
    """A distributed job's job.json is checked the same way before any rank's checkpoint is read."""
    from stream_ctr.distributed.job_checkpoint import load_any, open_job
    root = tmp_path / "job" / "checkpoints"
    (root / "job-00000001").mkdir(parents=True)
    (root / "job-00000001" / "job.json").write_text(job_json)
    (root / "LATEST_JOB").write_text("job-00000001")
    for read in (lambda: load_any(tmp_path / "job"), lambda: open_job(tmp_path / "job", 1)):
        with pytest.raises(CorruptCheckpoint) as err:
            read()
        assert str(err.value).startswith(f"corrupt checkpoint {root / 'job-00000001'}: ") and says in str(err.value)
