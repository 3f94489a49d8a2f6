"""Synthetic Criteo-format click logs with realistic skew, for scale tests and benchmarks.

Never a substitute for the real samples in accuracy checks: the teacher below is a
known model, and a stream drawn from it says how close a trainer gets to that
model, not how it fares on real clicks.

Each row is a Criteo TSV line (label, I1..I13, C1..C26):
- categorical ids are Zipf-distributed ranks per field over a bounded
  vocabulary (``min(vocab_per_field, Criteo's real cardinality of the field)``),
  sampled by inverting the continuous Zipf CDF so a vocabulary of any size
  costs nothing; each (field, rank) is rendered as an 8-hex token; fields go
  missing at Criteo's real per-field rates;
- integer features are log-normal counts (heavy right tail, some -1 in I2),
  missing at Criteo's real per-field rates (about 21% on average);
- labels come from a hidden teacher (`Teacher`), a logistic model whose logit
  is the sum of
  * one random weight per (field, id), derived by hashing, and small dense
    weights (the additive part: a linear model learns it);
  * FM-style pairwise interactions: every (field, id) has a hidden vector
    (`interaction_dim` wide, derived by hashing), and the logit adds the dot
    product of every pair of the row's vectors, scaled so the term's standard
    deviation is about `interaction` (0: the additive teacher). Only
    embeddings can learn it: a click depends on which ids meet;
  * optionally (`nonlinear` > 0) a small hidden tanh network of the same
    vectors, for a term no factorization model expresses exactly;
  its bias calibrated so the mean CTR is about 0.2.  The default teacher has
  interactions (`DEFAULT_TEACHER`); `Teacher(interaction=0)` is the additive one.

Beside the data, `probs_path(path)` (PATH + ".probs.npy") receives the
teacher's TRUE click probability of every row, float32 [n_records] in file
order (`numpy.load`, or `mmap_mode="r"`). The label of row i was drawn from
probs[i], so the AUC of probs on any split is that split's Bayes AUC: the
ceiling a model can reach there (`bayes_auc`).

Everything is vectorized per chunk of rows and deterministic for a seed.
"""
from __future__ import annotations

import dataclasses
import gzip as gzip_module
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from stream_ctr.connectors.hashing import hash_ints

CHUNK_ROWS = 32_768
BASE_CTR = 0.2
# Criteo Kaggle cardinality of C1..C26 (bounds the vocabulary of each field).
CRITEO_CARDINALITY = np.array([1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145,
                               5683, 8351593, 3194, 27, 14992, 5461306, 10, 5652, 2173, 4,
                               7046547, 18, 15, 286181, 105, 142572], dtype=np.int64)
# Missing-value shares from the real sample (SOURCES.md).
CAT_MISSING = np.array([0, 0, 3.5, 3.5, 0, 13.5, 0, 0, 0, 0, 0, 3.5, 0, 0, 0, 3.5, 0, 0,
                        44.8, 44.8, 3.5, 79.8, 0, 3.5, 44.8, 44.8]) / 100
INT_MISSING = np.array([44.3, 0.0, 21.0, 21.7, 4.4, 24.5, 4.7, 0.1, 4.7, 44.3, 4.7, 77.0,
                        21.7]) / 100
# Rough medians of I1..I13 in Criteo; values are lognormal around them.
INT_MEDIAN = np.array([1, 3, 10, 5, 3000, 50, 10, 10, 50, 1, 3, 1, 5], dtype=np.float64)
INT_LOG_SIGMA = 1.3
WEIGHT_STD = 0.3               # teacher weight per (field, id)
DENSE_WEIGHT_STD = 0.15
N_FIELDS = 26
NONLINEAR_HIDDEN = 16
MISSING_INT = np.iinfo(np.int64).min     # an empty I-field in `render_criteo_lines`
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_TAB, _LF, _ZERO, _MINUS = 9, 10, 48, 45


@dataclass(frozen=True)
class Teacher:
    """The hidden model that draws a synthetic stream's labels (see the module doc).

    Every knob changes the stream; the same `Teacher` always writes the same file."""
    seed: int = 0
    zipf_exponent: float = 1.05     # of the ids' ranks in every field
    vocab_per_field: int = 10**6    # cap on each field's cardinality (else Criteo's own)
    fields: int = N_FIELDS          # C1..C<fields> carry signal; the rest are ids with no effect
    interaction: float = 1.0        # std of the pairwise-interaction term (logit units); 0 = additive
    interaction_dim: int = 4        # width of the hidden per-(field, id) vectors
    nonlinear: float = 0.0          # std of the hidden tanh network's term; 0 = none

    def check(self) -> None:
        """Raise ValueError naming the first knob out of range."""
        for ok, what in ((self.zipf_exponent > 0, f"zipf exponent must be > 0, got {self.zipf_exponent}"),
                         (self.vocab_per_field >= 1, f"vocab per field must be >= 1, got {self.vocab_per_field}"),
                         (1 <= self.fields <= N_FIELDS, f"fields must be 1..{N_FIELDS}, got {self.fields}"),
                         (self.interaction >= 0, f"interaction must be >= 0, got {self.interaction}"),
                         (1 <= self.interaction_dim <= 64,
                          f"interaction dim must be 1..64, got {self.interaction_dim}"),
                         (self.nonlinear >= 0, f"nonlinear must be >= 0, got {self.nonlinear}")):
            if not ok:
                raise ValueError(f"synthetic teacher: {what}")

    def describe(self) -> str:
        parts = [f"seed {self.seed}", f"zipf {self.zipf_exponent:g}", f"{self.fields} fields"]
        if self.vocab_per_field < 10**6:
            parts.append(f"vocab <= {self.vocab_per_field:,}")
        parts.append(f"interactions {self.interaction:g} (dim {self.interaction_dim})"
                     if self.interaction else "additive")
        if self.nonlinear:
            parts.append(f"nonlinear {self.nonlinear:g}")
        return ", ".join(parts)


DEFAULT_TEACHER = Teacher()
ADDITIVE_TEACHER = Teacher(interaction=0.0)


def probs_path(path: str | Path) -> Path:
    """The sidecar of a synthetic file: its rows' true click probabilities (float32 .npy)."""
    return Path(str(path) + ".probs.npy")


def write_synthetic_criteo(path: str | Path, n_records: int, seed: int = 0,
                           zipf_exponent: float | None = None, vocab_per_field: int | None = None,
                           gzip: bool = False, write_probs: bool = True,
                           teacher: Teacher | None = None) -> int:
    """Write `n_records` synthetic Criteo TSV lines to `path`; returns the count written.

    The labels come from `teacher` (default `DEFAULT_TEACHER`, with interactions);
    `seed`, `zipf_exponent` and `vocab_per_field`, when given, replace the teacher's.
    Deterministic for a given teacher, and the file for n records is a prefix of
    the file for more.  With ``gzip=True`` the file is a gzip stream (level 1,
    mtime 0). With `write_probs`, `probs_path(path)` gets each row's true click
    probability.
    """
    t = dataclasses.replace(teacher or DEFAULT_TEACHER, seed=seed)
    if zipf_exponent is not None:
        t = dataclasses.replace(t, zipf_exponent=zipf_exponent)
    if vocab_per_field is not None:
        t = dataclasses.replace(t, vocab_per_field=vocab_per_field)
    t.check()
    vocab = np.minimum(CRITEO_CARDINALITY, t.vocab_per_field)
    hidden = _Hidden.draw(t)
    bias = _calibrate_bias(np.random.default_rng([t.seed, 2]), vocab, t, hidden)

    def chunk(index: int, first: int, n: int) -> tuple[bytes, np.ndarray]:
        # Whole chunks from their own stream: a file is a prefix of any longer one.
        rng = np.random.default_rng([t.seed, 3, index])
        ranks, ints = _sample_features(rng, CHUNK_ROWS, vocab, t.zipf_exponent)
        p = 1.0 / (1.0 + np.exp(-(bias + _teacher_logit(ranks, ints, t, hidden))))
        labels = (rng.random(CHUNK_ROWS) < p).astype(np.int64)
        return render_criteo_lines(labels[:n], ints[:n], _tokens(ranks[:n], t.seed)), p[:n]

    return write_chunked(path, n_records, CHUNK_ROWS, chunk, gzip, write_probs)


def write_chunked(path: str | Path, n_records: int, chunk_rows: int,
                  chunk: Callable[[int, int, int], tuple[bytes, np.ndarray]],
                  gzip: bool, write_probs: bool) -> int:
    """Write a synthetic file chunk by chunk: `chunk(index, first_row, n)` returns the
    chunk's bytes and its rows' true click probabilities, which go to `probs_path(path)`
    (a memory-mapped .npy: no n_records-sized array in RAM) when `write_probs`.
    gzip: level 1, mtime 0, so a seed always gives the same bytes. Returns n_records."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    probs = (np.lib.format.open_memmap(probs_path(path), mode="w+", dtype=np.float32,
                                       shape=(n_records,)) if write_probs else None)
    with open(path, "wb") as raw:
        out = gzip_module.GzipFile(fileobj=raw, mode="wb", compresslevel=1, mtime=0) if gzip else raw
        try:
            for index, first in enumerate(range(0, n_records, chunk_rows)):
                n = min(chunk_rows, n_records - first)
                data, p = chunk(index, first, n)
                out.write(data)
                if probs is not None:
                    probs[first:first + n] = p
        finally:
            if gzip:
                out.close()
    if probs is not None:
        probs.flush()
        del probs
    return n_records


def bayes_auc(path: str | Path, labels: np.ndarray, start: int = 0) -> float:
    """AUC of the true probabilities of rows [start, start + len(labels)) of a synthetic
    file against those rows' labels: the best AUC any model can reach on them."""
    probs = np.load(probs_path(path), mmap_mode="r")[start:start + len(labels)]
    return _auc(np.asarray(probs, dtype=np.float64), np.asarray(labels))


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    # Mann-Whitney with average ranks for ties (numpy only: connectors do not import stream_ctr).
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty(len(s), dtype=np.float64)
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    ends = np.r_[starts[1:], len(s)]
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    pos = labels > 0
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def _sample_features(rng: np.random.Generator, n: int, vocab: np.ndarray,
                     zipf_exponent: float) -> tuple[np.ndarray, np.ndarray]:
    """Zipf ranks int64 [n, 26] (0 = missing) and integer features [n, 13] (MISSING_INT = missing)."""
    ranks = zipf_ranks(rng.random((n, 26)), vocab, zipf_exponent)
    ranks[rng.random((n, 26)) < CAT_MISSING] = 0
    log_v = np.log1p(INT_MEDIAN) + INT_LOG_SIGMA * rng.standard_normal((n, 13))
    ints = np.floor(np.expm1(log_v)).astype(np.int64)
    ints[:, 1] = np.where(rng.random(n) < 0.05, -1, ints[:, 1])
    ints[rng.random((n, 13)) < INT_MISSING] = MISSING_INT
    return ranks, ints


def zipf_ranks(u: np.ndarray, vocab: np.ndarray, exponent: float) -> np.ndarray:
    """Ranks 1..vocab from uniforms `u` by inverting the continuous Zipf(exponent) CDF."""
    top = (vocab + 1).astype(np.float64)
    if abs(exponent - 1.0) < 1e-9:
        x = np.exp(u * np.log(top))
    else:
        a = 1.0 - exponent
        x = (1.0 + u * (top ** a - 1.0)) ** (1.0 / a)
    return np.clip(np.floor(x).astype(np.int64), 1, vocab)


@dataclass(frozen=True)
class _Hidden:
    """The teacher's weights that are not per id: dense weights, the interaction scale
    and the hidden network's matrices (drawn from the seed)."""
    dense_w: np.ndarray                 # [13]
    vector_scale: float                 # each vector component ~ U(-a, a), a from `interaction`
    net_in: np.ndarray                  # [fields * dim, NONLINEAR_HIDDEN]
    net_out: np.ndarray                 # [NONLINEAR_HIDDEN]

    @staticmethod
    def draw(t: Teacher) -> "_Hidden":
        dense_w = np.random.default_rng([t.seed, 1]).normal(0.0, DENSE_WEIGHT_STD, 13)
        # Components ~ U(-a, a) have variance a^2/3; a pair's dot product then has variance
        # dim * (a^2/3)^2, and the ~fields^2/2 pairs of a full row add up: solve for a so the
        # term's std is about `interaction` (missing fields make it a little smaller).
        pairs = max(t.fields * (t.fields - 1) / 2, 1.0)
        var = (t.interaction / np.sqrt(pairs * t.interaction_dim)) if t.interaction else 1.0
        rng = np.random.default_rng([t.seed, 4])
        width = t.fields * t.interaction_dim
        net_in = rng.normal(0.0, 1.0 / np.sqrt(width * var), (width, NONLINEAR_HIDDEN))
        net_out = rng.normal(0.0, t.nonlinear / np.sqrt(NONLINEAR_HIDDEN * 0.4), NONLINEAR_HIDDEN)
        return _Hidden(dense_w, float(np.sqrt(3.0 * var)), net_in, net_out)


def _unit_uniform(ranks: np.ndarray, fields: np.ndarray) -> np.ndarray:
    """U(-1, 1) per (field, id) from a 64-bit hash: the same id of a field always gets the same."""
    h = hash_ints(ranks, fields).view(np.uint64)
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 52) * 2.0 - 1.0


def _teacher_logit(ranks: np.ndarray, ints: np.ndarray, t: Teacher, hidden: _Hidden) -> np.ndarray:
    """Hidden-model logit without bias: per-(field, id) weights, dense weights, and the
    pairwise interactions (and hidden network) of per-(field, id) vectors."""
    salt = 1000 * (t.seed % 1_000_003 + 1)
    signal = ranks[:, :t.fields]
    present = signal > 0
    cat = np.where(present, _unit_uniform(signal, np.arange(t.fields) + salt) * (np.sqrt(3.0) * WEIGHT_STD),
                   0.0).sum(axis=1)
    ints_present = ints != MISSING_INT
    centered = np.log1p(np.maximum(ints, 0)) - np.log1p(INT_MEDIAN)
    logit = cat + (np.where(ints_present, centered, 0.0) * hidden.dense_w).sum(axis=1)
    if not (t.interaction or t.nonlinear):
        return logit
    # Vectors [n, fields, dim]: component c of field f's vector is salted apart from the
    # weights above (and from the tokens' salt, + 500) by 100_000 * (c + 1).
    comp = np.arange(t.interaction_dim) * 100_000 + 100_000 + salt
    v = _unit_uniform(signal[:, :, None], np.arange(t.fields)[:, None] + comp[None, :]) * hidden.vector_scale
    v *= present[:, :, None]                                    # a missing id has no vector
    if t.interaction:
        total = v.sum(axis=1)                                   # FM: sum over pairs i<j of <v_i, v_j>
        logit = logit + 0.5 * ((total * total).sum(axis=1) - (v * v).sum(axis=(1, 2)))
    if t.nonlinear:
        logit = logit + np.tanh(v.reshape(len(v), -1) @ hidden.net_in) @ hidden.net_out
    return logit


def _calibrate_bias(rng: np.random.Generator, vocab: np.ndarray, t: Teacher, hidden: _Hidden,
                    n: int = 50_000) -> float:
    """Bias making the mean teacher CTR about BASE_CTR on a calibration sample."""
    ranks, ints = _sample_features(rng, n, vocab, t.zipf_exponent)
    z = _teacher_logit(ranks, ints, t, hidden)
    lo, hi = -20.0, 20.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.mean(1 / (1 + np.exp(-(z + mid)))) < BASE_CTR else (lo, mid)
    return (lo + hi) / 2


def _tokens(ranks: np.ndarray, seed: int) -> np.ndarray:
    """32-bit token value per (field, rank); rendered later as 8 hex characters."""
    fields = np.arange(26) + 1000 * (seed % 1_000_003 + 1) + 500
    return np.where(ranks > 0, hash_ints(ranks, fields) & 0xFFFFFFFF, -1)


def render_criteo_lines(labels: np.ndarray, ints: np.ndarray, tokens: np.ndarray) -> bytes:
    """Criteo TSV bytes of labels [n] (0/1), ints [n, 13] and tokens [n, 26].

    An int equal to MISSING_INT and a token of -1 are rendered as empty fields;
    other tokens (0 .. 2**32-1) as 8 lowercase hex digits.
    """
    n = len(labels)
    neg = ints < 0
    present = ints != MISSING_INT
    mag = np.where(present, np.abs(np.where(present, ints, 0)), 0)
    n_digits = np.where(present, _decimal_digits(mag) + neg, 0)
    cat_present = tokens >= 0
    lengths = np.concatenate([np.ones((n, 1), np.int64), n_digits, 8 * cat_present], axis=1)
    line_len = lengths.sum(axis=1) + lengths.shape[1]              # fields + 39 tabs + LF
    line_start = np.concatenate([[0], np.cumsum(line_len)[:-1]])
    field_start = line_start[:, None] + np.concatenate(
        [np.zeros((n, 1), np.int64), np.cumsum(lengths + 1, axis=1)[:, :-1]], axis=1)
    out = np.full(int(line_len.sum()), _TAB, dtype=np.uint8)
    out[line_start + line_len - 1] = _LF
    out[field_start[:, 0]] = _ZERO + labels
    _render_ints(out, field_start[:, 1:14], mag, neg & present, n_digits)
    _render_hex(out, field_start[:, 14:], tokens, cat_present)
    return out.tobytes()


def _decimal_digits(mag: np.ndarray) -> np.ndarray:
    """Number of decimal digits of non-negative ints (1 for 0)."""
    digits = np.ones(mag.shape, dtype=np.int64)
    bound = 10
    while True:
        more = mag >= bound
        if not more.any():
            return digits
        digits += more
        bound *= 10


def _render_ints(out: np.ndarray, start: np.ndarray, mag: np.ndarray, neg: np.ndarray,
                 n_chars: np.ndarray) -> None:
    out[start[neg]] = _MINUS
    n_digits = n_chars - neg
    first = start + neg
    for k in range(int(n_digits.max(initial=0))):
        m = n_digits > k
        power = 10 ** (n_digits[m] - 1 - k)
        out[first[m] + k] = _ZERO + (mag[m] // power) % 10


def _render_hex(out: np.ndarray, start: np.ndarray, tokens: np.ndarray, present: np.ndarray) -> None:
    pos, tok = start[present], tokens[present]
    for k in range(8):
        out[pos + k] = _HEX[(tok >> (28 - 4 * k)) & 0xF]
