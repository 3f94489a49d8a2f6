"""The bundle on disk: plain tensors and arrays (no pickles), one clear error when it is wrong,
and the scoring path free of the trainer's code."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from stream_ctr.cli.main import EXIT_STATE, main
from stream_ctr.serving.bundle import BundleError, BundleWriter, read_bundle
from stream_ctr.serving.scorer import Scorer
from stream_ctr.train.loop import train
from tests.stream_ctr.store.helpers import small_config


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bundle")
    cfg = small_config(tmp / "run", tiered=False)
    cfg.data.limit_records = 20 * 128
    train(cfg, show_progress=False)
    assert main(["export", cfg.train.run_dir, "--out", str(tmp / "bundle"), "--quiet"]) == 0
    return tmp / "bundle"


def test_the_bundle_loads_without_pickles(bundle_dir):
    dense = torch.load(bundle_dir / "dense.pt", weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in dense.values()) and "linear.bias" in dense
    keys = np.load(bundle_dir / "keys.npy", mmap_mode="r", allow_pickle=False)
    rows = np.load(bundle_dir / "rows.npy", mmap_mode="r", allow_pickle=False)
    assert keys.dtype == np.int64 and rows.dtype == np.float32 and rows.shape == (len(keys), 11)
    assert np.all(np.diff(keys) > 0) and keys[0] >= 0
    manifest = json.loads((bundle_dir / "manifest.json").read_text())
    assert manifest["format_version"] == 1 and manifest["n_fields"] == 39 and manifest["n_dense"] == 13
    assert manifest["record_format"]["name"] == "criteo" and manifest["checkpoint"]["step"] == 20
    assert manifest["model"]["mlp_dims"] == [32, 32] and manifest["precision"] in ("fp32", "bf16")
    bundle = read_bundle(bundle_dir)
    assert bundle.version == "ckpt-00000020@20"
    assert Scorer(bundle).model.training is False


def test_a_pickled_object_in_dense_pt_is_refused(bundle_dir, tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(bundle_dir, bad)
    with open(bad / "dense.pt", "wb") as f:       # a torch file holding a non-tensor object
        torch.save({"evil": BundleWriter}, f)
    _reseal(bad)
    with pytest.raises(BundleError, match="dense.pt"):
        read_bundle(bad)


def _reseal(path):
    """Recompute the manifest's checksums, as a tamperer would."""
    from stream_ctr.serving.bundle import _sha256
    m = json.loads((path / "manifest.json").read_text())
    for name in m["files"]:
        m["files"][name] = {"bytes": (path / name).stat().st_size, "sha256": _sha256(path / name)}
    (path / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("damage, needle", [
    ("flip", "rows.npy does not match its checksum"),
    ("version", "bundle format version 99"),
    ("truncate", "keys.npy"),
    ("manifest", "manifest.json is unreadable"),
    ("missing", "no bundle at"),
])
def test_a_corrupt_or_wrong_version_bundle_is_one_clear_error(bundle_dir, tmp_path, capsys, damage, needle):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(bundle_dir, bad)
    if damage == "flip":
        data = bytearray((bad / "rows.npy").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (bad / "rows.npy").write_bytes(bytes(data))
    elif damage == "version":
        m = json.loads((bad / "manifest.json").read_text())
        m["format_version"] = 99
        (bad / "manifest.json").write_text(json.dumps(m))
    elif damage == "truncate":
        (bad / "keys.npy").write_bytes((bad / "keys.npy").read_bytes()[:-8])
    elif damage == "manifest":
        (bad / "manifest.json").write_text("{not json")
    else:
        shutil.rmtree(bad)
    code = main(["predict", str(bad), "criteo:sample", "--stop", "100", "--out", str(tmp_path / "p.txt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_STATE == 4
    assert len(err) == 1 and err[0].startswith("stream-ctr: error:") and needle in err[0], err
    assert not (tmp_path / "p.txt").exists()


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m.pop("rows"), "manifest.json has no rows"),
    (lambda m: m.pop("init"), "manifest.json has no init"),
    (lambda m: m["checkpoint"].pop("name"), "manifest.json has no checkpoint.name"),
    (lambda m: m["rows"].update(count="x"), "rows.count is 'x', not int"),
    (lambda m: m.update(files=[]), "files is [], not dict"),
    (lambda m: m["files"].pop("dense.pt"), "file dense.pt missing from the manifest"),
    (lambda m: m["model"].update(embed_dim="x"), "model.embed_dim is 'x', not int"),
    (lambda m: m["model"].update(bogus=1), "model section not understood"),
    (lambda m: m["model"].update(mlp_dims=[-1]), "does not build a model"),
    (None, "dense.pt holds a list, not a state_dict"),
])
def test_a_manifest_that_parses_but_lacks_a_field_is_one_clear_error(bundle_dir, tmp_path, capsys, edit, needle):
    """Each was a KeyError, TypeError or RuntimeError traceback (and killed a follower's thread)."""
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(bundle_dir, bad)
    if edit is None:
        with open(bad / "dense.pt", "wb") as f:         # loads weights_only, but is no state_dict
            torch.save([torch.zeros(2)], f)
        _reseal(bad)
    else:
        m = json.loads((bad / "manifest.json").read_text())
        edit(m)
        (bad / "manifest.json").write_text(json.dumps(m))
    code = main(["predict", str(bad), "criteo:sample", "--stop", "100", "--out", str(tmp_path / "p.txt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_STATE
    assert len(err) == 1 and err[0].startswith("stream-ctr: error:") and needle in err[0], err


def test_a_run_or_a_checkpoint_named_as_a_bundle_says_to_export_it(bundle_dir, tmp_path, capsys):
    """They were "no bundle at RUN" / "not a stream-ctr-bundle manifest": true, but not what to do."""
    run = bundle_dir.parent / "run"
    ckpt = next((run / "checkpoints").glob("ckpt-*"))
    for path, what in ((run, "a training run"), (ckpt, "a training checkpoint")):
        code = main(["predict", str(path), "criteo:sample", "--stop", "10", "--out", str(tmp_path / "p.txt")])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == EXIT_STATE and len(err) == 1, err
        assert f"{path} is {what}, not a bundle: export it first (stream-ctr export {path} --out BUNDLE)" in err[0]


def test_export_refuses_a_non_empty_out_dir_and_leaves_no_partial_bundle(bundle_dir, tmp_path):
    with pytest.raises(FileExistsError):
        BundleWriter(bundle_dir, 11)
    w = BundleWriter(tmp_path / "b", 3)
    w.add(np.array([1, 5]), np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="increasing"):
        w.add(np.array([5]), np.zeros((1, 3), np.float32))
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_scoring_does_not_import_the_trainer():
    """bundle, scorer and export reach no module of train, distributed, bench or cli."""
    from tests.import_graph import import_graph
    graph = import_graph()
    seen, todo = set(), ["stream_ctr.serving.bundle", "stream_ctr.serving.scorer", "stream_ctr.serving.export"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += sorted(graph.get(m, ()))
    bad = [m for m in seen if m.split(".")[1:2] and m.split(".")[1] in ("train", "distributed", "bench", "cli")]
    assert bad == []


def test_records_of_another_format_are_refused_by_name(bundle_dir, tmp_path, capsys):
    code = main(["predict", str(bundle_dir), "avazu:sample", "--out", str(tmp_path / "p.txt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "criteo records" in err[0] and "avazu" in err[0], err
