"""The portable export: the model scored from spec.json + arrays without stream_ctr's torch code.

Real runs on the bundled samples (DeepFM on Criteo, W&D / LR / DCN on Avazu; fp32),
exported with the real CLI (`export --portable`); the numpy reference scorer
(stream_ctr/serving/portable.py) and the exported network must reproduce
`stream-ctr predict` to 1e-6, for held-out records and for records whose ids the
model never saw. Its hashing, parsing and unseen-key rows are checked against the
decoder and the store they reimplement.
"""
from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch

from stream_ctr.cli.main import main
from stream_ctr.config import schema_text
from stream_ctr.connectors.decode import decode_lines
from stream_ctr.connectors.files import detect_format
from stream_ctr.connectors.formats import AVAZU, CRITEO
from stream_ctr.connectors.hashing import hash_ints, hash_strings
from stream_ctr.connectors.synth_json import AD_LOG_SCHEMA, write_synthetic_json
from stream_ctr.serving import portable
from stream_ctr.serving.portable import Hashing, PortableError, PortableModel, record_inputs, score_numpy
from stream_ctr.serving.portable_export import (PortableExportError, check_portable, onnx_available,
                                                write_portable)
from stream_ctr.store.embedding import init_rows
from stream_ctr.train.loop import held_out_start, train
from tests.stream_ctr.store.helpers import small_config

HOLDOUT = 0.1
TOL = 1e-6


def sample_lines(name: str) -> list[bytes]:
    """The data lines of a bundled sample (Avazu's header left out)."""
    _, path = detect_format(f"{name}:sample")
    lines = gzip.open(path).read().splitlines()
    return lines[1:] if name == "avazu" else lines


def exported_run(tmp, source: str, model: str, limit: int = 0):
    """Train `model` on `source` in fp32, `export --portable` it; (bundle dir, held-out lines)."""
    cfg = small_config(tmp / "run", tiered=False)
    cfg.data.source, cfg.model.name = source, model
    cfg.data.holdout_fraction, cfg.data.limit_records = HOLDOUT, limit
    cfg.train.precision = "fp32"             # the portable network is fp32: compare like with like
    train(cfg, show_progress=False)
    assert main(["export", str(tmp / "run"), "--out", str(tmp / "bundle"), "--portable", "--quiet"]) == 0
    lines = sample_lines(source.split(":")[0])
    return tmp / "bundle", lines[held_out_start(len(lines), HOLDOUT):]


def predicted(bundle, tmp, source: str | None = None) -> np.ndarray:
    """`stream-ctr predict` of the run's held-out lines, or of every line of `source`."""
    out = tmp / "predict.npy"
    assert main(["predict", str(bundle), *([source] if source else []), "--out", str(out), "--quiet"]) == 0
    return np.load(out)


@pytest.fixture(scope="module")
def criteo_deepfm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("portable_criteo")
    bundle, held = exported_run(tmp, "criteo:sample", "deepfm")
    return tmp, bundle, held, predicted(bundle, tmp)


@pytest.fixture(scope="module", params=["wdl", "lr", "dcn"])
def avazu_run(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"portable_avazu_{request.param}")
    bundle, held = exported_run(tmp, "avazu:sample", request.param, limit=3000)
    return request.param, tmp, bundle, held, predicted(bundle, tmp)


def test_numpy_reference_reproduces_predict_on_the_held_out_lines(criteo_deepfm):
    tmp, bundle, held, reference = criteo_deepfm
    probs = score_numpy(bundle / "portable", held, backend="numpy")
    assert probs.dtype == np.float32 and probs.shape == reference.shape == (1449,)
    assert np.abs(probs - reference).max() <= TOL
    # The held-out lines bring keys the run never trained: their rows come from the formula.
    model = PortableModel(bundle / "portable", verify=True)
    keys, _ = record_inputs(model.spec, held)
    assert (~np.isin(np.unique(keys), model.keys)).sum() > 1000
    spec = json.loads((bundle / "portable" / "spec.json").read_text())
    assert spec["model"]["name"] == "deepfm" and spec["records"]["format"] == "criteo"
    assert spec["network"]["precision"] == "fp32" and spec["rows"]["linear_column"] == 10


def test_records_of_ids_never_seen_score_as_predict_scores_them(criteo_deepfm):
    tmp, bundle, held, _ = criteo_deepfm
    rows = [line.split(b"\t") for line in held[:300]]
    for i, cols in enumerate(rows):               # new tokens everywhere, odd and huge counts
        cols[1:14] = [b"" if (i + j) % 5 == 0 else str((-1) ** j * (10 ** (j % 12) + i)).encode()
                      for j in range(13)]
        cols[14:] = [b"" if (i + j) % 7 == 0 else b"never-seen-%d-%d-%s" % (i, j, b"x" * (j % 20))
                     for j in range(26)]
    lines = [b"\t".join(cols) for cols in rows]
    path = tmp / "unseen.tsv"
    path.write_bytes(b"\n".join(lines) + b"\n")
    reference = predicted(bundle, tmp, f"criteo:{path}")
    model = PortableModel(bundle / "portable")
    keys, _ = record_inputs(model.spec, lines)
    new_tokens = np.array([[c != b"" for c in cols[14:]] for cols in rows])
    assert new_tokens.sum() > 6000 and not np.isin(keys[:, 13:][new_tokens], model.keys).any()
    probs = model.score(lines, backend="numpy")
    assert reference.shape == probs.shape == (300,)
    assert np.abs(probs - reference).max() <= TOL


def test_the_onnx_network_reproduces_predict(criteo_deepfm):
    pytest.importorskip("onnxruntime")
    tmp, bundle, held, reference = criteo_deepfm
    spec = json.loads((bundle / "portable" / "spec.json").read_text())
    if spec["network"]["onnx"] is None:
        pytest.skip("exported without the onnx packages (pip install 'stream-ctr[portable]')")
    import onnxruntime
    session = onnxruntime.InferenceSession(str(bundle / "portable" / "dense.onnx"),
                                           providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["emb", "lin", "dense"]
    assert [o.name for o in session.get_outputs()] == ["logit", "probability"]
    probs = score_numpy(bundle / "portable", held, backend="onnx")
    assert np.abs(probs - reference).max() <= TOL
    # The graph's own probability output, fed from the arrays.
    model = PortableModel(bundle / "portable")
    keys, dense = record_inputs(model.spec, held)
    rows = model.lookup(keys)
    feeds = {"emb": np.ascontiguousarray(rows[:, :, :10]), "lin": np.ascontiguousarray(rows[:, :, 10]),
             "dense": dense}
    assert np.abs(session.run(["probability"], feeds)[0] - reference).max() <= TOL


def test_the_torch_export_network_reproduces_predict(criteo_deepfm, tmp_path):
    _, bundle, held, reference = criteo_deepfm
    spec = write_portable(bundle, tmp_path / "pt2", network="torch")
    assert spec["network"]["onnx"] is None and spec["network"]["torch_export"] == "dense.pt2"
    model = PortableModel(tmp_path / "pt2", verify=True)
    keys, dense = record_inputs(model.spec, held)
    rows = torch.from_numpy(model.lookup(keys))
    program = torch.export.load(str(tmp_path / "pt2" / "dense.pt2")).module()
    _, probs = program(rows[:, :, :10].contiguous(), rows[:, :, 10].contiguous(), torch.from_numpy(dense))
    assert np.abs(probs.detach().numpy() - reference).max() <= TOL
    assert np.abs(model.score(held, backend="numpy") - reference).max() <= TOL


def test_other_models_and_a_format_without_dense_features(avazu_run):
    name, tmp, bundle, held, reference = avazu_run
    model = PortableModel(bundle / "portable")
    assert model.spec["model"]["n_dense"] == 0 and model.spec["records"]["has_header"]
    if name in portable.NUMPY_MODELS:
        assert np.abs(model.score(held, backend="numpy") - reference).max() <= TOL
    else:
        with pytest.raises(PortableError, match=r"model 'dcn': the numpy forward covers deepfm, wdl, lr; "
                                                r"score it with onnxruntime"):
            model.score(held, backend="numpy")
    if model.spec["network"]["onnx"] and portable._has_onnxruntime():
        assert np.abs(model.score(held, backend="auto") - reference).max() <= TOL


def test_keys_and_dense_features_are_the_decoders_bit_for_bit(criteo_deepfm, avazu_run):
    _, c_bundle, _, _ = criteo_deepfm
    _, _, a_bundle, _, _ = avazu_run
    for bundle, fmt, lines in ((c_bundle, CRITEO, sample_lines("criteo")),
                               (a_bundle, AVAZU, sample_lines("avazu"))):
        spec = PortableModel(bundle / "portable").spec
        batch, rejected = decode_lines(b"\n".join(lines), fmt, "p", 0)
        assert not rejected
        keys, dense = record_inputs(spec, lines)
        assert np.array_equal(keys, batch.keys) and np.array_equal(dense.view(np.int32), batch.dense.view(np.int32))


EDGE_CRITEO = [
    # label, 13 integers, 26 tokens: negative, leading zeros, 18 digits, missing, long and empty tokens
    b"1\t-5\t007\t123456789012345678\t\t0\t1\t2\t3\t-1\t99999\t16384\t-17\t\t"
    + b"\t".join([b"a" * k for k in (0, 1, 7, 8, 9, 15, 16, 17, 33, 64)] + [b"\xc3\xa9t\xc3\xa9"] * 16),
    b"0\t" + b"\t".join([b"1"] * 13) + b"\t" + b"\t".join([b"68fd1e64"] * 26) + b"\r",   # CRLF line
    b"1\t1234567890123456789\t" + b"\t".join([b""] * 12) + b"\t" + b"\t".join([b"x"] * 26),  # 19 digits
    b"0\t+3\t" + b"\t".join([b""] * 12) + b"\t" + b"\t".join([b"x"] * 26),                  # '+'
    b"0\t-\t" + b"\t".join([b""] * 12) + b"\t" + b"\t".join([b"x"] * 26),                   # lone '-'
    b"2\t" + b"\t".join([b""] * 13) + b"\t" + b"\t".join([b"x"] * 26),                      # label 2
    b"1\t" + b"\t".join([b""] * 13) + b"\t" + b"\t".join([b"x"] * 25),                      # a column short
]
EDGE_AVAZU = [b"1,0,%s,1005,0,a,b,c,d,e,f,g,h,i,1,2,3,4,5,6,7,8,9,10" % hour
              for hour in (b"24022900", b"23022900", b"14102124", b"14103123", b"14113100", b"1410210",
                           b"99123123", b"00010100")]


@pytest.mark.parametrize("fmt, lines", [(CRITEO, EDGE_CRITEO), (AVAZU, EDGE_AVAZU)], ids=["criteo", "avazu"])
def test_edge_records_decode_or_are_rejected_as_the_decoder_does(criteo_deepfm, avazu_run, fmt, lines):
    bundle = criteo_deepfm[1] if fmt is CRITEO else avazu_run[2]
    spec = PortableModel(bundle / "portable").spec
    batch, rejected = decode_lines(b"\n".join(lines), fmt, "p", 0)
    good = batch.offset.tolist()
    assert good and rejected                  # both kinds are in the edge set
    keys, dense = record_inputs(spec, [lines[i] for i in good])
    assert np.array_equal(keys, batch.keys) and np.array_equal(dense, batch.dense)
    for r in rejected:                        # one line at a time: the same reason, named
        with pytest.raises(PortableError, match=f"first: record 0: {r.reason} "):
            record_inputs(spec, [lines[r.offset]])


def test_the_hash_reimplementation_equals_connectors_hashing(criteo_deepfm):
    hashing = Hashing.of(PortableModel(criteo_deepfm[1] / "portable").spec)
    rng = np.random.default_rng(7)
    tokens = [rng.integers(1, 256, size=n, dtype=np.uint8).tobytes() for n in rng.integers(0, 41, 400)]
    tokens += [b"", b"a", b"12345678", b"123456789", b"\x00inside\x00x"]
    for field in (0, 13, 38, 1000):
        ours = hashing.tokens(np.array(tokens, dtype=np.bytes_), np.full(len(tokens), field))
        assert np.array_equal(ours, hash_strings(tokens, field))
    values = np.concatenate([rng.integers(-(1 << 62), 1 << 62, 300), [0, -1, 2 ** 63 - 1, -2 ** 63]])
    missing = np.arange(len(values)) % 9 == 0
    for field in (0, 12, 21, 22):
        ours = hashing.ints(values, np.full(len(values), field), missing)
        assert np.array_equal(ours, hash_ints(values, np.int64(field), missing))
        assert (ours >= 0).all()


@pytest.mark.parametrize("dim", [10, 7, 1])
def test_the_unseen_key_formula_gives_the_stores_initial_rows(criteo_deepfm, dim):
    spec = PortableModel(criteo_deepfm[1] / "portable").spec
    spec = {**spec, "rows": {**spec["rows"], "dim": dim}, "unseen_key": {**spec["unseen_key"], "seed": 1234}}
    keys = np.concatenate([np.random.default_rng(1).integers(0, 1 << 63, 5000), [0, 1, (1 << 63) - 1]])
    ours = portable.initial_rows(keys, spec, Hashing.of(spec))
    theirs = init_rows(torch.from_numpy(keys), dim, spec["unseen_key"]["init_std"], 1234).numpy()
    assert ours.shape == theirs.shape == (len(keys), dim + 1) and (ours[:, dim] == 0).all()
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-9)   # float32 cos/sin/log: a last bit at most


def test_bad_records_and_bad_exports_are_clear_errors(criteo_deepfm, tmp_path):
    _, bundle, held, _ = criteo_deepfm
    with pytest.raises(PortableError, match=r"2 of 3 records do not decode as criteo records; first: "
                                            r"record 1: field_count"):
        score_numpy(bundle / "portable", [held[0], b"0\t1\t2", b"7" + held[0][1:]])
    with pytest.raises(PortableError, match="no portable export at .*spec.json"):
        PortableModel(tmp_path)
    with pytest.raises(PortableError, match="backend 'gpu': one of auto, onnx, numpy"):
        score_numpy(bundle / "portable", held[:2], backend="gpu")
    copy = tmp_path / "copy"
    write_portable(bundle, copy, network="torch")
    partial = (copy / "rows.npy").read_bytes()[:1000]
    (copy / "rows.npy").unlink()             # a hard link to the bundle's rows: replace, never truncate
    (copy / "rows.npy").write_bytes(partial)
    with pytest.raises(PortableError, match=r"rows.npy is missing or does not match spec.json"):
        PortableModel(copy)
    with pytest.raises(FileExistsError, match="not an empty directory"):
        write_portable(bundle, copy)
    assert score_numpy(bundle / "portable", []).shape == (0,)


def test_the_reference_scorer_runs_as_a_script(criteo_deepfm, tmp_path, capsys):
    tmp, bundle, held, reference = criteo_deepfm
    path = tmp_path / "held.tsv.gz"
    path.write_bytes(gzip.compress(b"\n".join(held) + b"\n"))
    assert portable.main([str(bundle / "portable"), str(path), "--backend", "numpy"]) == 0
    probs = np.loadtxt(capsys.readouterr().out.splitlines(), dtype=np.float32)
    assert np.abs(probs - reference).max() <= TOL
    assert portable.main([str(tmp_path / "none"), str(path)]) == 2
    assert "no portable export at" in capsys.readouterr().err


def test_a_schema_run_or_an_unknown_network_is_refused_before_anything_is_written(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    write_synthetic_json(log, 600, seed=3)
    cfg = small_config(tmp_path / "run", tiered=False)
    cfg.data.source, cfg.data.schema = f"json:{log}", schema_text(AD_LOG_SCHEMA, "test")
    train(cfg, show_progress=False)
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "b"), "--portable"]) == 2
    assert "declared schema" in capsys.readouterr().err and not (tmp_path / "b").exists()
    with pytest.raises(PortableExportError, match="--portable-network 'tf': one of auto, onnx, torch"):
        check_portable({"record_format": {}}, "tf")
    if not onnx_available():
        with pytest.raises(PortableExportError, match=r"pip install 'stream-ctr\[portable\]'"):
            check_portable({"record_format": {}}, "onnx")
