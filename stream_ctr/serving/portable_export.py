"""A serving bundle -> a portable export: the model in files other runtimes load.

`write_portable(bundle, out)` writes the directory that `portable` (the numpy
reference scorer) reads and docs/serving-portable.md describes:

    spec.json    the record -> inputs contract, with every constant: columns, field ids,
                 the token and integer hashes (connectors/hashing.py), Criteo's integer
                 buckets and signed log1p, Avazu's calendar keys, the unseen-key row
                 (store/embedding.py `init_rows`), the network's inputs and outputs,
                 the size and sha256 of each file
    keys.npy     the bundle's int64 sorted keys      (a hard link to the bundle's file
    rows.npy     its float32 [N, dim + 1] rows         where the file system allows)
    dense.npz    the dense network's weights, float32, under their state_dict names
    dense.onnx   the network (emb, lin, dense) -> (logit, probability) as ONNX, by
                 torch.onnx's torch.export-based exporter, which needs the onnx and
                 onnxscript packages (the `portable` extra); without them
    dense.pt2    the same network by torch.export (torch.export.load reads it)

The network always runs in float32: a bundle that scores in bf16 gives, exported,
the scores of `stream-ctr predict --precision fp32`. Only the named record
formats (criteo, avazu) have a portable spec; a declared schema's records
(json:/csv: sources) do not yet.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stream_ctr.config import ConfigError, ModelConfig
from stream_ctr.connectors import hashing
from stream_ctr.connectors.formats import RecordFormat, format_by_name
from stream_ctr.models.networks import build_model
from stream_ctr.serving.bundle import Bundle, model_config_fields, read_bundle
from stream_ctr.serving.options import NETWORKS  # noqa: F401  (defined where the CLI reads it without torch)
from stream_ctr.serving.portable import FORMAT, FORMAT_VERSION, sha256

_EXAMPLE_BATCH = 4                  # traced batch; the batch dimension stays dynamic
_CRITEO_CHECKS = [{"column": 0, "kind": "label"}]


class PortableExportError(ConfigError):
    """A bundle or option a portable export cannot be written for (a usage error)."""


def onnx_available() -> bool:
    """Whether torch.onnx's exporter can run here (it needs onnx and onnxscript)."""
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError:
        return False
    return True


def check_portable(manifest: dict[str, Any], network: str = "auto") -> None:
    """PortableExportError unless a bundle of `manifest` can be exported with `network`."""
    if network not in NETWORKS:
        raise PortableExportError(f"--portable-network {network!r}: one of {', '.join(NETWORKS)}")
    rf = manifest.get("record_format") or {}
    if rf.get("schema"):
        raise PortableExportError("--portable: the model's records follow a declared schema (a json:/csv: "
                                  "source); a portable spec covers the criteo and avazu formats only: "
                                  "serve it with `stream-ctr serve`")
    if network == "onnx" and not onnx_available():
        raise PortableExportError("--portable-network onnx needs the onnx and onnxscript packages: "
                                  "pip install 'stream-ctr[portable]' (or --portable-network torch)")


def write_portable(bundle_dir: str | Path, out: str | Path | None = None,
                   network: str = "auto") -> dict[str, Any]:
    """Write the portable export of the bundle at `bundle_dir` to `out` (default
    BUNDLE/portable), new or empty; returns its spec. `network`: "onnx", "torch"
    (torch.export .pt2) or "auto" (onnx where its packages are installed). The
    directory appears whole or not at all (written beside it, then renamed)."""
    bundle = read_bundle(bundle_dir, verify=False)
    check_portable(bundle.manifest, network)
    out = Path(out) if out is not None else bundle.path / "portable"
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory: choose a new portable "
                              "export directory")
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for name in ("keys.npy", "rows.npy"):
            _link_or_copy(bundle.path / name, tmp / name)
        model = _network(bundle)
        np.savez(tmp / "dense.npz", **{k: v.detach().float().numpy() for k, v in model.state_dict().items()})
        use_onnx = network == "onnx" or (network == "auto" and onnx_available())
        net_file = "dense.onnx" if use_onnx else "dense.pt2"
        (_export_onnx if use_onnx else _export_pt2)(model, bundle, tmp / net_file)
        spec = portable_spec(bundle, net_file)
        files = {"keys.npy": bundle.manifest["files"]["keys.npy"],
                 "rows.npy": bundle.manifest["files"]["rows.npy"]}
        for name in ("dense.npz", net_file):
            files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": sha256(tmp / name)}
        spec["files"] = files
        with open(tmp / "spec.json", "w") as f:
            json.dump(spec, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if out.exists():
            out.rmdir()                         # empty (checked above)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return spec


def _link_or_copy(src: Path, dst: Path) -> None:
    # A bundle's files are never rewritten, so a hard link is a copy that costs no disk.
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


class _Scoring(torch.nn.Module):
    """The network a server runs: (emb, lin, dense) -> (logit, probability)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, emb: torch.Tensor, lin: torch.Tensor,
                dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logit = self.model(emb, lin, dense)
        return logit, torch.sigmoid(logit)


def _network(bundle: Bundle) -> torch.nn.Module:
    m = bundle.manifest
    model = build_model(ModelConfig(**model_config_fields(m)), int(m["n_fields"]), int(m["n_dense"]))
    model.load_state_dict({k: v.float() for k, v in bundle.dense.items()})
    return model.eval()


def _example(bundle: Bundle) -> tuple[tuple[torch.Tensor, ...], tuple[dict, ...]]:
    m = bundle.manifest
    f, d, n_dense = int(m["n_fields"]), int(m["model"]["embed_dim"]), int(m["n_dense"])
    batch = torch.export.Dim("batch")
    args = (torch.zeros(_EXAMPLE_BATCH, f, d), torch.zeros(_EXAMPLE_BATCH, f),
            torch.zeros(_EXAMPLE_BATCH, n_dense))
    return args, ({0: batch}, {0: batch}, {0: batch})


def _export_onnx(model: torch.nn.Module, bundle: Bundle, path: Path) -> None:
    args, dynamic = _example(bundle)
    quiet = logging.getLogger("torch.onnx")
    level = quiet.level
    quiet.setLevel(logging.ERROR)               # per-op registration notes, not problems
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(_Scoring(model), args, str(path), dynamo=True, external_data=False,
                              input_names=["emb", "lin", "dense"], output_names=["logit", "probability"],
                              dynamic_shapes=dynamic, verbose=False)
    finally:
        quiet.setLevel(level)


def _export_pt2(model: torch.nn.Module, bundle: Bundle, path: Path) -> None:
    args, dynamic = _example(bundle)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(_Scoring(model), args, dynamic_shapes=dynamic)
    torch.export.save(program, str(path))


def _hex(x: np.uint64 | int) -> str:
    return f"0x{int(x):016X}"


def _fields(fmt: RecordFormat) -> tuple[list[dict], list[dict], list[dict]]:
    """(fields, dense features, record checks) of a named format, in model order."""
    col = {name: i for i, name in enumerate(fmt.field_names)}
    if fmt.name == "criteo":
        fields = [{"name": n, "field_id": i, "column": col[n],
                   "kind": "integer_bucket" if n.startswith("I") else "token"}
                  for i, n in enumerate(fmt.key_fields)]
        dense = [{"name": n, "column": col[n], "transform": "signed_log1p"} for n in fmt.key_fields[:13]]
        return fields, dense, _CRITEO_CHECKS
    if fmt.name == "avazu":
        fields = [{"name": n, "field_id": i, "column": col.get(n, col["hour"]),
                   "kind": n if n in ("hour_of_day", "day_of_week") else "token"}
                  for i, n in enumerate(fmt.key_fields)]
        return fields, [], [{"column": col["click"], "kind": "label"}, {"column": col["hour"], "kind": "time"}]
    raise PortableExportError(f"--portable: no portable spec for record format {fmt.name!r}")


KINDS = {
    "token": "the column's raw bytes (no decoding, no trimming) hashed as a token; an empty "
             "column is the empty token, the field's missing key",
    "integer_bucket": "the column as a decimal integer v (optional '-', then 1 to 18 ASCII digits; "
                      "anything else rejects the record); key = int_hash(v if v <= 2 else "
                      "floor(ln(v)**2), ln in float64); an empty column is missing: the field's "
                      "empty-token key",
    "hour_of_day": "hours % 24 as an integer token (int_hash), hours = whole hours since "
                   "1970-01-01T00 UTC of the YYMMDDHH column (year 20YY)",
    "day_of_week": "(hours // 24 + 3) % 7 as an integer token (int_hash): Monday = 0",
}

CHECKS = {
    "label": "the column is exactly '0' or '1' (its value is ignored when scoring)",
    "time": "the column is 8 ASCII digits YYMMDDHH of a real date (20YY) and hour <= 23",
}


def portable_spec(bundle: Bundle, net_file: str) -> dict[str, Any]:
    """spec.json of a bundle (without "files"), every rule with its constants."""
    m = bundle.manifest
    fmt = format_by_name(m["record_format"]["name"])
    fields, dense, checks = _fields(fmt)
    dim = int(m["model"]["embed_dim"])
    if len(fields) != int(m["n_fields"]) or len(dense) != int(m["n_dense"]):
        raise PortableExportError(f"{bundle.path}: the manifest's {m['n_fields']} fields and {m['n_dense']} "
                                  f"dense features do not match the {fmt.name} format")
    mult = [_hex(hashing._M1), _hex(hashing._M2)]
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "model": {**m["model"], "n_fields": len(fields), "n_dense": len(dense)},
        "source": {"bundle": str(bundle.path.resolve()), "model_version": bundle.version,
                   "bundle_precision": m["precision"], "created_by": m.get("created_by")},
        "records": {
            "format": fmt.name, "delimiter": fmt.delimiter, "has_header": fmt.has_header,
            "columns": list(fmt.field_names),
            "line": "one record per line; one LF, and one CR before it, end a line; a line with "
                    "another number of columns than `columns` is rejected",
            "checks": checks, "check_rules": {c["kind"]: CHECKS[c["kind"]] for c in checks}},
        "fields": fields,
        "field_rules": {f["kind"]: KINDS[f["kind"]] for f in fields},
        "dense": dense,
        "dense_rules": {"signed_log1p": "x = float32(v), v the column's integer as parsed for "
                        "integer_bucket (0 if missing): sign(x) * log1p(|x|) in float32"} if dense else {},
        "hash": {
            "golden": _hex(hashing.GOLDEN), "seed": _hex(hashing.SEED), "int_tag": _hex(hashing.INT_TAG),
            "sign_mask": _hex(hashing._SIGN_MASK),
            "mix64": {"shifts": [30, 27, 31], "multipliers": mult,
                      "rule": "x ^= x >> 30; x *= multipliers[0]; x ^= x >> 27; x *= multipliers[1]; "
                              "x ^= x >> 31 (uint64, wrapping)"},
            "salt": "salt(f) = mix64((f * golden) ^ seed) of the field id f",
            "token": "state = salt(f) + len(bytes) * golden (uint64, wrapping, as everywhere here); for each 8-byte little-endian chunk of "
                     "the bytes, the last one zero-padded (one zero chunk if empty): state = "
                     "mix64(state ^ chunk); key = state & sign_mask",
            "int": "state = (salt(f) + int_tag * golden) ^ uint64(v) (two's complement); key = "
                   "mix64(state) & sign_mask",
            "missing": "key = mix64(salt(f)) & sign_mask: the empty token's key"},
        "rows": {"keys": "keys.npy", "rows": "rows.npy", "count": int(m["rows"]["count"]), "dim": dim,
                 "linear_column": dim,
                 "rule": f"a key's row is rows[i] where keys[i] == key (keys strictly increasing: binary "
                         f"search); columns [0, {dim}) its embedding, column {dim} its linear weight"},
        "unseen_key": {
            "seed": int(m["init"]["seed"]), "init_std": float(m["init"]["init_std"]),
            "seed_multiplier": _hex(hashing.GOLDEN), "key_multiplier": _hex(hashing.GOLDEN),
            "column_multiplier": _hex(hashing._M1),
            "rule": ["salt = seed * seed_multiplier (uint64, wrapping)",
                     "for c in 0 .. 2 * ((dim + 1) // 2) - 1: h_c = mix64((key ^ salt) * key_multiplier "
                     "+ c * column_multiplier)",
                     "u_c = (float32((h_c >> 8) & 0xFFFFFF) + 1) / 2**24, in (0, 1]",
                     "pairs j: r_j = sqrt(-2 ln u_{2j}), a_j = float32(2 pi) * u_{2j+1}, all in float32",
                     "normal = [r_j cos a_j for each j] then [r_j sin a_j for each j]",
                     "row = normal[:dim] * float32(init_std), then the linear weight 0"]},
        "network": {
            "arrays": "dense.npz", "onnx": net_file if net_file.endswith(".onnx") else None,
            "torch_export": net_file if net_file.endswith(".pt2") else None, "precision": "fp32",
            "inputs": {"emb": ["batch", len(fields), dim], "lin": ["batch", len(fields)],
                       "dense": ["batch", len(dense)]},
            "outputs": {"logit": ["batch"], "probability": ["batch"]},
            "rule": "emb[b, f] = row of field f's key [0, dim); lin[b, f] = its linear weight; "
                    "dense[b] = the dense features; probability = sigmoid(logit)"},
    }


__all__ = ["NETWORKS", "PortableExportError", "check_portable", "onnx_available", "portable_spec",
           "write_portable"]
