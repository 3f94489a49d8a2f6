"""The reference scorer of a portable export: records -> click probabilities with numpy alone.

A portable export (`stream-ctr export RUN --out BUNDLE --portable`, written by
`portable_export`) is a directory any runtime can serve from::

    spec.json    how a record becomes the network's inputs: columns, field hashing (with
                 its constants), integer buckets, dense transform, the unseen-key row
    keys.npy     int64 [N], strictly increasing embedding keys
    rows.npy     float32 [N, dim + 1]: each key's embedding, then its linear weight
    dense.npz    the dense network's weights as float32 arrays (torch state_dict names)
    dense.onnx   the dense network as ONNX (or dense.pt2, torch.export, without onnx)

This module is that spec made executable. It imports numpy and the standard
library only, nothing else of stream_ctr, so it can be copied beside an export
and used where stream_ctr is not installed; onnxruntime, when installed, runs
dense.onnx, and otherwise a numpy forward of dense.npz runs DeepFM, W&D and LR.
`python portable.py EXPORT_DIR LINES_FILE` prints one probability per line.

Contract: `score_numpy(export_dir, records)` returns, for records in the model's
text format, the probabilities `stream-ctr predict --precision fp32` gives the
same lines, within 1e-6 (float32 rounding of the network's sums; the keys, rows
and dense inputs are the same bits). Records are whole lines, label column
included (its value must be 0 or 1 and is ignored); a line that predict would
skip as malformed raises `PortableError` naming it.
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

FORMAT = "stream-ctr-portable"
FORMAT_VERSION = 1
NUMPY_MODELS = ("deepfm", "wdl", "lr")      # what the numpy forward computes
BACKENDS = ("auto", "onnx", "numpy")
FIELD_KINDS = ("token", "integer_bucket", "hour_of_day", "day_of_week")
_MASK64 = (1 << 64) - 1


class PortableError(ValueError):
    """A portable export that cannot be read or a record that cannot be scored; the
    message names the file or the record and what to do."""


def _u64(value: str | int) -> np.uint64:
    """A constant of the spec ("0x..." hex text or an int) as uint64."""
    return np.uint64((int(value, 16) if isinstance(value, str) else int(value)) & _MASK64)


@dataclass(frozen=True)
class Hashing:
    """The spec's "hash" section: 63-bit keys of (field id, token) in uint64 arithmetic
    (numpy arrays wrap modulo 2**64)."""
    golden: np.uint64
    seed: np.uint64
    int_tag: np.uint64
    m1: np.uint64
    m2: np.uint64
    shifts: tuple[int, int, int]
    sign_mask: np.uint64

    @staticmethod
    def of(spec: dict[str, Any]) -> "Hashing":
        h = spec["hash"]
        m1, m2 = h["mix64"]["multipliers"]
        return Hashing(_u64(h["golden"]), _u64(h["seed"]), _u64(h["int_tag"]), _u64(m1), _u64(m2),
                       tuple(h["mix64"]["shifts"]), _u64(h["sign_mask"]))

    def mix64(self, x: np.ndarray) -> np.ndarray:
        """The splitmix64 finalizer of a uint64 array (a new array)."""
        s1, s2, s3 = (np.uint64(s) for s in self.shifts)
        x = x ^ (x >> s1)
        x = x * self.m1
        x = x ^ (x >> s2)
        x = x * self.m2
        return x ^ (x >> s3)

    def salt(self, field_ids: np.ndarray) -> np.ndarray:
        f = np.asarray(field_ids, dtype=np.int64).astype(np.uint64)
        return self.mix64(f * self.golden ^ self.seed)

    def tokens(self, tokens: np.ndarray, field_ids: np.ndarray) -> np.ndarray:
        """int64 keys of byte-string tokens [n] (dtype S) in fields `field_ids` [n]."""
        tokens = np.ascontiguousarray(tokens).reshape(-1)
        if tokens.dtype.kind != "S":
            raise PortableError(f"tokens must be byte strings (dtype S), got {tokens.dtype}")
        if tokens.dtype.itemsize == 0:
            tokens = tokens.astype("S1")
        n, width = len(tokens), tokens.dtype.itemsize
        padded = np.zeros((n, max(-(-width // 8), 1) * 8), np.uint8)     # zero bytes past each token
        padded[:, :width] = tokens.view(np.uint8).reshape(n, width)
        words = padded.view("<u8")                                       # little-endian 8-byte chunks
        length = np.char.str_len(tokens).astype(np.uint64)
        state = self.mix64((self.salt(field_ids) + length * self.golden) ^ words[:, 0])
        for c in range(1, words.shape[1]):          # chunk positions, never records
            state = np.where(length > 8 * c, self.mix64(state ^ words[:, c]), state)
        return (state & self.sign_mask).view(np.int64)

    def ints(self, values: np.ndarray, field_ids: np.ndarray, missing: np.ndarray) -> np.ndarray:
        """int64 keys of integer tokens [n] (their two's complement word); a missing one
        gets the field's empty-token key."""
        salt = self.salt(field_ids)
        int_salt = salt + np.uint64((int(self.int_tag) * int(self.golden)) & _MASK64)
        word = np.asarray(values, dtype=np.int64).view(np.uint64)
        state = np.where(missing, salt, int_salt ^ word)
        return (self.mix64(state) & self.sign_mask).view(np.int64)


def criteo_buckets(values: np.ndarray) -> np.ndarray:
    """v if v <= 2 else floor(ln(v)**2), the logarithm in float64."""
    logs = np.log(np.maximum(values, 2).astype(np.float64))
    return np.where(values <= 2, values, np.floor(logs * logs).astype(np.int64))


def signed_log1p(values: np.ndarray) -> np.ndarray:
    """sign(x) * log1p(|x|) of x = float32(v), in float32 (0 stays 0)."""
    x = values.astype(np.float32)
    return np.copysign(np.log1p(np.abs(x)), x)


def initial_rows(keys: np.ndarray, spec: dict[str, Any], hashing: Hashing) -> np.ndarray:
    """float32 [n, dim + 1] rows of keys the export lacks: N(0, init_std) embedding by
    Box-Muller on a counter hash of (key, seed, column), linear weight 0."""
    init = spec["unseen_key"]
    dim, std = int(spec["rows"]["dim"]), np.float32(init["init_std"])
    salt = np.uint64((int(init["seed"]) * int(_u64(init["seed_multiplier"]))) & _MASK64)
    cols = np.arange(2 * ((dim + 1) // 2), dtype=np.uint64)
    k = np.asarray(keys, dtype=np.int64).view(np.uint64)
    h = hashing.mix64(((k ^ salt) * _u64(init["key_multiplier"]))[:, None]
                      + cols[None, :] * _u64(init["column_multiplier"]))
    u = (((h >> np.uint64(8)) & np.uint64(0xFFFFFF)).astype(np.float32) + np.float32(1)) / np.float32(1 << 24)
    u1, u2 = u[:, 0::2], u[:, 1::2]
    radius = np.sqrt(np.float32(-2) * np.log(u1))
    angle = np.float32(2 * np.pi) * u2
    normal = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)], axis=1)
    out = np.zeros((len(k), dim + 1), np.float32)
    out[:, :dim] = normal[:, :dim] * std
    return out


def split_lines(records: Sequence[str | bytes] | np.ndarray, delimiter: bytes,
                n_columns: int) -> tuple[np.ndarray, np.ndarray]:
    """(columns S [B, n_columns], ok bool [B]) of text lines: one LF and one CR before it
    may end a line; a line without exactly n_columns fields is not ok."""
    lines = np.asarray(records)
    if lines.size == 0:
        lines = lines.astype("S1")
    if lines.dtype.kind == "U":
        lines = np.char.encode(lines, "utf-8")
    if lines.dtype.kind != "S" or lines.ndim != 1:
        raise PortableError("records must be a list of text lines (all str or all bytes)")
    for end in (b"\n", b"\r"):
        head, sep, tail = np.moveaxis(np.char.rpartition(lines, end), -1, 0)
        lines = np.where((sep != b"") & (tail == b""), head, lines)
    columns, ok = [], np.char.find(lines, b"\n") < 0        # one record is one line
    rest = lines
    for c in range(n_columns):              # columns, never records
        head, sep, rest = np.moveaxis(np.char.partition(rest, delimiter), -1, 0)
        columns.append(head)
        ok &= (sep != b"") if c < n_columns - 1 else (sep == b"")
    return np.stack(columns, axis=1), ok


def parse_integers(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values int64, ok, missing) of decimal tokens: an optional '-', then 1 to 18 ASCII
    digits; empty is missing (value 0); anything else is not ok."""
    missing = tokens == b""
    negative = np.char.startswith(tokens, b"-")
    digits = np.where(negative, np.char.replace(tokens, b"-", b"", 1), tokens)
    size = np.char.str_len(digits)
    ok = np.char.isdigit(digits) & (size >= 1) & (size <= 18)
    values = np.where(ok, tokens, b"0").astype(np.int64).reshape(np.shape(tokens))
    return values, ok | missing, missing


def utc_hours(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hours since 1970-01-01T00 UTC, ok) of YYMMDDHH tokens (year 20YY)."""
    values, ok, _ = parse_integers(tokens)
    ok &= (np.char.str_len(tokens) == 8) & ~np.char.startswith(tokens, b"-")
    values = np.where(ok, values, 0)
    yy, mm, dd, hh = values // 1_000_000, values // 10_000 % 100, values // 100 % 100, values % 100
    month = ((2000 + yy - 1970) * 12 + np.clip(mm, 1, 12) - 1).astype("datetime64[M]")
    first_day = month.astype("datetime64[D]")
    month_days = ((month + 1).astype("datetime64[D]") - first_day).astype(np.int64)
    ok &= (mm >= 1) & (mm <= 12) & (dd >= 1) & (dd <= month_days) & (hh <= 23)
    hours = (first_day.astype(np.int64) + dd - 1) * 24 + hh
    return np.where(ok, hours, 0), ok


def record_inputs(spec: dict[str, Any], records: Sequence[str | bytes] | np.ndarray,
                  hashing: Hashing | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(keys int64 [B, n_fields], dense float32 [B, n_dense]) of text records, following
    the spec's "records", "fields" and "dense" sections. PortableError names the first
    record that does not decode, as `stream-ctr predict` would reject it."""
    hashing = hashing or Hashing.of(spec)
    rec = spec["records"]
    cols, ok = split_lines(records, rec["delimiter"].encode(), len(rec["columns"]))
    bad = np.full(len(cols), "", dtype=object)
    bad[~ok] = "field_count"
    b = len(cols)

    def reject(where: np.ndarray, reason: str) -> None:
        bad[where & (bad == "")] = reason

    for check in rec["checks"]:
        tok = cols[:, check["column"]]
        if check["kind"] == "label":
            reject(~np.isin(tok, [b"0", b"1"]), "bad_label")
        elif check["kind"] == "time":
            reject(~utc_hours(tok)[1], "bad_time")
        else:
            raise PortableError(f"spec.json: record check {check['kind']!r} is not one this scorer "
                                "knows (label, time); use the stream-ctr that wrote it")
    fields = spec["fields"]
    unknown = {f["kind"] for f in fields} - set(FIELD_KINDS)
    if unknown:
        raise PortableError(f"spec.json: field kinds {sorted(unknown)} are not ones this scorer knows "
                            f"({', '.join(FIELD_KINDS)}); use the stream-ctr that wrote it")
    keys = np.zeros((b, len(fields)), np.int64)
    parsed: dict[int, tuple[np.ndarray, np.ndarray]] = {}       # column -> (values, missing)
    for kind in FIELD_KINDS:
        idx = [i for i, f in enumerate(fields) if f["kind"] == kind]
        if not idx:
            continue
        columns = np.array([fields[i]["column"] for i in idx])
        field_ids = np.broadcast_to(np.array([fields[i]["field_id"] for i in idx]), (b, len(idx)))
        tok = cols[:, columns]
        if kind == "token":
            keys[:, idx] = hashing.tokens(tok, field_ids.reshape(-1)).reshape(b, len(idx))
        elif kind == "integer_bucket":
            values, int_ok, missing = parse_integers(tok)
            reject(~int_ok.all(axis=1), "bad_integer")
            parsed.update({int(c): (values[:, j], missing[:, j]) for j, c in enumerate(columns)})
            keys[:, idx] = hashing.ints(criteo_buckets(values).reshape(-1), field_ids.reshape(-1),
                                        missing.reshape(-1)).reshape(b, len(idx))
        else:
            hours, time_ok = utc_hours(tok)
            reject(~time_ok.all(axis=1), "bad_time")
            value = hours % 24 if kind == "hour_of_day" else (hours // 24 + 3) % 7   # Monday = 0
            keys[:, idx] = hashing.ints(value.reshape(-1), field_ids.reshape(-1),
                                        np.zeros(value.size, bool)).reshape(b, len(idx))
    dense = np.zeros((b, len(spec["dense"])), np.float32)
    for j, d in enumerate(spec["dense"]):
        if d["transform"] != "signed_log1p":
            raise PortableError(f"dense feature {d['name']!r}: transform {d['transform']!r} is not "
                                "one this scorer knows (signed_log1p); use the stream-ctr that wrote it")
        values, missing = parsed[d["column"]]
        dense[:, j] = np.where(missing, np.float32(0), signed_log1p(values))
    if (bad != "").any():
        first = int(np.flatnonzero(bad != "")[0])
        why = {"field_count": f"expected {len(rec['columns'])} {rec['delimiter']!r}-separated columns: "
                              f"{', '.join(rec['columns'][:3])}, ...",
               "bad_label": "the label column must be 0 or 1 (any; it is ignored)",
               "bad_integer": "an integer column holds something else than an optional '-' and 1-18 digits",
               "bad_time": "the hour column is not YYMMDDHH of a real date and hour"}[bad[first]]
        raise PortableError(f"{int((bad != '').sum())} of {b} records do not decode as {rec['format']} "
                            f"records; first: record {first}: {bad[first]} ({why})")
    return keys, dense


def sha256(path: Path) -> str:
    # Not the bundle's or the checkpoint's helper: this module imports nothing from
    # stream_ctr, so it can be copied next to an export and run alone.
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class PortableModel:
    """A portable export opened for scoring: spec, rows memory-mapped, the dense weights."""

    def __init__(self, root: str | Path, verify: bool = False) -> None:
        """Open the export at `root`; every file's size is checked against spec.json, and
        with `verify` its sha256 too."""
        self.root = Path(root)
        try:
            self.spec = json.loads((self.root / "spec.json").read_text())
        except FileNotFoundError:
            raise PortableError(f"no portable export at {self.root}: expected spec.json (written by "
                                "`stream-ctr export RUN --out BUNDLE --portable`, in BUNDLE/portable)") from None
        except (OSError, ValueError) as e:
            raise PortableError(f"{self.root}/spec.json is unreadable (corrupt?): {e}") from None
        if self.spec.get("format") != FORMAT or self.spec.get("format_version") != FORMAT_VERSION:
            raise PortableError(f"{self.root}/spec.json is not a {FORMAT} spec of version {FORMAT_VERSION}: "
                                "re-export it with this scorer's stream-ctr version")
        for name, want in self.spec["files"].items():
            path = self.root / name
            if not path.is_file() or path.stat().st_size != want["bytes"] or (verify and sha256(path) != want["sha256"]):
                raise PortableError(f"{path} is missing or does not match spec.json (corrupt or partial copy)")
        self.hashing = Hashing.of(self.spec)
        self.keys = np.load(self.root / self.spec["rows"]["keys"], mmap_mode="r")
        self.rows = np.load(self.root / self.spec["rows"]["rows"], mmap_mode="r")
        with np.load(self.root / self.spec["network"]["arrays"]) as z:
            self.weights = {k: z[k].astype(np.float32) for k in z.files}
        self.dim = int(self.spec["rows"]["dim"])
        self._onnx: Any = None

    @property
    def model_name(self) -> str:
        return self.spec["model"]["name"]

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """float32 rows [*keys.shape, dim + 1]: the export's, else the unseen-key row."""
        uniq, inverse = np.unique(keys, return_inverse=True)
        pos = np.searchsorted(self.keys, uniq).clip(max=max(len(self.keys) - 1, 0))
        found = (np.asarray(self.keys[pos]) == uniq) if len(self.keys) else np.zeros(len(uniq), bool)
        rows = np.empty((len(uniq), self.dim + 1), np.float32)
        rows[found] = self.rows[pos[found]]
        rows[~found] = initial_rows(uniq[~found], self.spec, self.hashing)
        return rows[inverse.reshape(keys.shape)]

    def logits(self, emb: np.ndarray, lin: np.ndarray, dense: np.ndarray, backend: str = "auto") -> np.ndarray:
        """float32 logits [B] of the network's inputs, by onnxruntime or the numpy forward."""
        if backend not in BACKENDS:
            raise PortableError(f"backend {backend!r}: one of {', '.join(BACKENDS)}")
        onnx_file = self.spec["network"].get("onnx")
        if backend != "numpy" and onnx_file and _has_onnxruntime():
            session, feeds = self._onnx_session(), {"emb": emb, "lin": lin, "dense": dense}
            # an input the network never reads (dense, without dense features) may be left out
            return session.run(["logit"], {i.name: feeds[i.name] for i in session.get_inputs()})[0]
        if backend == "onnx":
            raise PortableError(f"{self.root}: backend onnx needs onnxruntime (pip install onnxruntime) "
                                "and an export with dense.onnx" + ("" if onnx_file else
                                                                   " (this one has none: re-export with onnx installed)"))
        if self.model_name not in NUMPY_MODELS:
            raise PortableError(f"model {self.model_name!r}: the numpy forward covers "
                                f"{', '.join(NUMPY_MODELS)}; score it with onnxruntime "
                                "(pip install onnxruntime) on dense.onnx, or torch on dense.pt2")
        return numpy_forward(self.weights, self.model_name, emb, lin, dense)

    def _onnx_session(self) -> Any:
        if self._onnx is None:
            import onnxruntime
            self._onnx = onnxruntime.InferenceSession(str(self.root / self.spec["network"]["onnx"]),
                                                      providers=["CPUExecutionProvider"])
        return self._onnx

    def score(self, records: Sequence[str | bytes] | np.ndarray, backend: str = "auto") -> np.ndarray:
        """Click probabilities float32 [B] of text records."""
        if not len(records):
            return np.zeros(0, np.float32)
        keys, dense = record_inputs(self.spec, records, self.hashing)
        rows = self.lookup(keys)
        emb, lin = np.ascontiguousarray(rows[:, :, :self.dim]), np.ascontiguousarray(rows[:, :, self.dim])
        logit = self.logits(emb, lin, dense, backend).astype(np.float32)
        with np.errstate(over="ignore"):            # exp(-logit) = inf: probability 0
            return (np.float32(1) / (np.float32(1) + np.exp(-logit))).astype(np.float32)


def _has_onnxruntime() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def numpy_forward(w: dict[str, np.ndarray], name: str, emb: np.ndarray, lin: np.ndarray,
                  dense: np.ndarray) -> np.ndarray:
    """Logits [B] of DeepFM / W&D / LR in float32 from the weights of dense.npz:
    sum_f lin + dense @ linear.kernel + linear.bias, plus for wdl and deepfm
    out(relu MLP(concat(emb flattened, dense))), plus for deepfm the FM term."""
    logit = lin.sum(axis=1) + w["linear.bias"]
    if "linear.kernel.weight" in w:
        logit = logit + dense @ w["linear.kernel.weight"][0]
    if name == "lr":
        return logit
    x = np.concatenate([emb.reshape(len(emb), -1), dense], axis=1)
    layer = 0
    while f"dnn.{layer}.weight" in w:               # Linear, ReLU, Linear, ReLU, ...
        x = np.maximum(x @ w[f"dnn.{layer}.weight"].T + w[f"dnn.{layer}.bias"], np.float32(0))
        layer += 2
    interaction = x @ w["out.weight"][0]
    if name == "deepfm":
        s = emb.sum(axis=1)
        interaction = np.float32(0.5) * (s * s - (emb * emb).sum(axis=1)).sum(axis=1) + interaction
    return logit + interaction


def score_numpy(export_dir: str | Path, records: Sequence[str | bytes] | np.ndarray,
                backend: str = "auto") -> np.ndarray:
    """Click probabilities float32 [B] of text records with the portable export at
    `export_dir` (backend: auto = onnxruntime when installed, else numpy)."""
    return PortableModel(export_dir).score(records, backend)


def main(argv: list[str] | None = None) -> int:
    """python portable.py EXPORT_DIR FILE [--backend auto|onnx|numpy]: one probability per
    line of FILE (.gz read as gzip; a header line skipped for formats that have one)."""
    import argparse
    import gzip
    p = argparse.ArgumentParser(description="Score text records with a stream-ctr portable export.")
    p.add_argument("export_dir")
    p.add_argument("file", help="records, one per line, in the model's format (- for stdin)")
    p.add_argument("--backend", choices=BACKENDS, default="auto")
    args = p.parse_args(argv)
    try:
        model = PortableModel(args.export_dir)
        if args.file == "-":
            data = sys.stdin.buffer.read()
        else:
            with (gzip.open if args.file.endswith(".gz") else open)(args.file, "rb") as f:
                data = f.read()
        lines = data.splitlines()[1 if model.spec["records"]["has_header"] else 0:]
        probs = model.score(np.array(lines, dtype=np.bytes_), args.backend) if lines else np.zeros(0, np.float32)
    except (PortableError, OSError) as e:
        print(f"portable: error: {e}", file=sys.stderr)
        return 2
    np.savetxt(sys.stdout, probs, fmt="%.9g")
    return 0


if __name__ == "__main__":
    sys.exit(main())
