"""A synthetic JSON ad log: one impression per line, labels from a hidden teacher.

Never a substitute for the real samples in accuracy checks (its labels come
from a teacher of a known form, not from people clicking);
it is what a user's own log looks like, for the schema path end to end.
A record (16 leaves, one nested object, one list)::

    {"event_id": "e000000000000001", "ts": 1704067200123, "user_id": "u123",
     "ad_id": "a45", "campaign_id": "c2", "creative_id": "cr7", "site": "site19.example",
     "placement": "feed", "device": {"os": "android", "model": "m12", "type": 1},
     "country": "DE", "price": 0.0123, "position": 3, "history": [45, 7, 1003],
     "clicked": true}

Ids are Zipf-distributed; `campaign_id` is a function of `ad_id`; `ts` grows
(ms since the epoch, a few ms apart); `history` holds 0-50 ad ids the user
clicked before (a multi-hot feature).

The teacher: a logistic model with one hashed weight per (field, id) of
user, ad, site, placement, os, model and country, a position and a price
term, and the mean of per-id weights over the history; its bias is set so
the click rate is about BASE_CTR.  As with `synth`, `probs_path(path)` gets
every row's true click probability (float32 .npy), so the AUC of those
probabilities is the split's Bayes AUC (`synth.bayes_auc`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from stream_ctr.connectors.hashing import hash_ints
from stream_ctr.connectors.synth import write_chunked, zipf_ranks

CHUNK_ROWS = 16_384
BASE_CTR = 0.15
START_MS = 1_704_067_200_000                 # 2024-01-01T00:00:00Z
VOCAB = {"user": 200_000, "ad": 5_000, "creative": 20_000, "site": 2_000, "model": 300}
PLACEMENTS = ("feed", "banner_top", "banner_side", "interstitial", "search", "video")
OSES = ("android", "ios", "windows", "linux")
COUNTRIES = ("US", "DE", "FR", "GB", "JP", "BR", "IN", "CA", "ES", "IT", "NL", "SE")
MAX_HISTORY = 50
WEIGHT_STD = 0.5


def write_synthetic_json(path: str | Path, n_records: int, seed: int = 0, gzip: bool = False,
                         write_probs: bool = True) -> int:
    """Write `n_records` JSON ad-log lines to `path` (gzip if asked); returns the count.

    Deterministic for a seed; with `write_probs`, `probs_path(path)` receives
    each row's true click probability.
    """
    bias = _calibrate_bias(seed)

    def chunk(index: int, first: int, n: int) -> tuple[bytes, np.ndarray]:
        rng = np.random.default_rng([seed, 7, index])
        cols = _sample(rng, n, first)
        p = 1.0 / (1.0 + np.exp(-(bias + _teacher_logit(cols, seed))))
        return _render(cols, rng.random(n) < p), p

    return write_chunked(path, n_records, CHUNK_ROWS, chunk, gzip, write_probs)


def _sample(rng: np.random.Generator, n: int, first: int) -> dict[str, np.ndarray | list]:
    user = zipf_ranks(rng.random(n), np.int64(VOCAB["user"]), 1.05)
    ad = zipf_ranks(rng.random(n), np.int64(VOCAB["ad"]), 1.1)
    n_hist = np.minimum(rng.geometric(0.08, n) - 1, MAX_HISTORY)
    hist_flat = zipf_ranks(rng.random(int(n_hist.sum())), np.int64(VOCAB["ad"]), 1.1)
    hist_ends = np.cumsum(n_hist)
    return {
        "event": first + np.arange(n, dtype=np.int64) + 1,
        "ts": START_MS + (first + np.arange(n)) * 5 + rng.integers(0, 5, n),
        "user": user, "ad": ad, "campaign": ad // 25 + 1,
        "creative": zipf_ranks(rng.random(n), np.int64(VOCAB["creative"]), 1.0),
        "site": zipf_ranks(rng.random(n), np.int64(VOCAB["site"]), 1.1),
        "placement": rng.integers(0, len(PLACEMENTS), n),
        "os": rng.choice(len(OSES), n, p=[0.55, 0.35, 0.07, 0.03]),
        "model": zipf_ranks(rng.random(n), np.int64(VOCAB["model"]), 1.2),
        "type": rng.integers(1, 4, n),
        "country": zipf_ranks(rng.random(n), np.int64(len(COUNTRIES)), 1.0) - 1,
        "price": np.round(np.exp(rng.normal(-4.0, 1.0, n)), 6),
        "position": rng.integers(1, 11, n),
        "hist_flat": hist_flat, "hist_ends": hist_ends, "n_hist": n_hist,
    }


def _weights(ids: np.ndarray, field: int, seed: int) -> np.ndarray:
    """A hashed uniform weight per (field, id), std WEIGHT_STD."""
    h = hash_ints(ids, np.int64(field + 1000 * (seed % 1_000_003 + 7))).view(np.uint64)
    u = (h >> np.uint64(11)).astype(np.float64) / float(1 << 52) * 2.0 - 1.0
    return u * (np.sqrt(3.0) * WEIGHT_STD)


def _teacher_logit(c: dict, seed: int) -> np.ndarray:
    z = sum(_weights(c[name], i, seed) for i, name in
            enumerate(("user", "ad", "site", "placement", "os", "model", "country")))
    z = z - 0.15 * (c["position"] - 1) + 0.2 * (np.log(c["price"]) + 4.0)
    hist_w = 2.0 * _weights(c["hist_flat"], 99, seed)
    rows = np.repeat(np.arange(len(z)), c["n_hist"])
    hist_mean = np.bincount(rows, weights=hist_w, minlength=len(z)) / np.maximum(c["n_hist"], 1)
    return z + hist_mean


def _calibrate_bias(seed: int, n: int = 20_000) -> float:
    cols = _sample(np.random.default_rng([seed, 8]), n, 0)
    z = _teacher_logit(cols, seed)
    lo, hi = -20.0, 20.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.mean(1 / (1 + np.exp(-(z + mid)))) < BASE_CTR else (lo, mid)
    return (lo + hi) / 2


def _render(c: dict, clicked: np.ndarray) -> bytes:
    """JSON lines of one chunk (a per-record format: the generator is not a hot path)."""
    starts = (c["hist_ends"] - c["n_hist"]).tolist()
    hist = c["hist_flat"].tolist()
    rows = zip(c["event"].tolist(), c["ts"].tolist(), c["user"].tolist(), c["ad"].tolist(),
               c["campaign"].tolist(), c["creative"].tolist(), c["site"].tolist(),
               c["placement"].tolist(), c["os"].tolist(), c["model"].tolist(), c["type"].tolist(),
               c["country"].tolist(), c["price"].tolist(), c["position"].tolist(), starts,
               c["n_hist"].tolist(), clicked.tolist())
    lines = [
        f'{{"event_id":"e{ev:015x}","ts":{ts},"user_id":"u{u}","ad_id":"a{a}","campaign_id":"c{cp}",'
        f'"creative_id":"cr{cr}","site":"site{s}.example","placement":"{PLACEMENTS[pl]}",'
        f'"device":{{"os":"{OSES[os_]}","model":"m{m}","type":{t}}},"country":"{COUNTRIES[co]}",'
        f'"price":{pr!r},"position":{po},"history":[{",".join(map(str, hist[h0:h0 + nh]))}],'
        f'"clicked":{"true" if y else "false"}}}'
        for ev, ts, u, a, cp, cr, s, pl, os_, m, t, co, pr, po, h0, nh, y in rows]
    return ("\n".join(lines) + "\n").encode()


# The schema a person would write for this log (what `stream-ctr schema infer` proposes, give or
# take the comments): 15 decoded fields, the history list a multi-hot field (mean-pooled).
AD_LOG_SCHEMA = """\
[schema]
encoding = "json"

[schema.fields.clicked]
kind = "label"

[schema.fields.event_id]
kind = "ignore"

[schema.fields.ts]
kind = "event_time"
unit = "ms"

[schema.fields.user_id]
kind = "categorical"

[schema.fields.ad_id]
kind = "categorical"

[schema.fields.campaign_id]
kind = "categorical"

[schema.fields.creative_id]
kind = "categorical"

[schema.fields.site]
kind = "categorical"

[schema.fields.placement]
kind = "categorical"

[schema.fields.os]
kind = "categorical"
path = "device.os"

[schema.fields.model]
kind = "categorical"
path = "device.model"

[schema.fields.device_type]
kind = "categorical"
path = "device.type"

[schema.fields.country]
kind = "categorical"
default = "unknown"

[schema.fields.price]
kind = "numeric"
transform = "log1p"

[schema.fields.position]
kind = "categorical"

[schema.fields.history]
kind = "multi_hot"
pooling = "mean"
"""
