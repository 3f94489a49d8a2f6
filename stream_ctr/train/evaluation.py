"""Prequential (test-then-train) accuracy: AUC, logloss and calibration.

Each batch is scored by the model as it was *before* training on that batch
(the training forward pass computes exactly those scores), so these numbers
are the honest online accuracy of a streaming model. A sliding window keeps
the most recent `window_records` predictions; totals cover the whole run.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

_EPS = 1e-7


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve with tied scores ranked by their average rank.

    NaN when only one class is present.
    """
    labels = np.asarray(labels, dtype=np.float64)
    n_pos = labels.sum()
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    sorted_scores = np.asarray(scores)[order]
    # Average rank of each run of tied scores (ranks are 1-based).
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], sorted_scores.size]
    avg_rank = (starts + ends + 1) / 2.0
    ranks = np.repeat(avg_rank, ends - starts)
    pos_rank_sum = ranks[labels[order] > 0.5].sum()
    return float((pos_rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def log_loss(probs: np.ndarray, labels: np.ndarray) -> float:
    p = np.clip(np.asarray(probs, dtype=np.float64), _EPS, 1 - _EPS)
    y = np.asarray(labels, dtype=np.float64)
    if y.size == 0:
        return float("nan")
    return float(-(y * np.log(p) + (1 - y) * np.log1p(-p)).mean())


@dataclass
class Accuracy:
    auc: float
    logloss: float
    calibration: float    # mean predicted CTR / observed CTR; 1.0 is perfect
    records: int
    # Normalized entropy (He et al. 2014): logloss / the logloss of always predicting the
    # observed CTR. Below 1 the model beats the base rate; comparable across CTR levels.
    ne: float = float("nan")

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        return {f"{prefix}auc": self.auc, f"{prefix}logloss": self.logloss,
                f"{prefix}calibration": self.calibration, f"{prefix}records": self.records,
                f"{prefix}ne": self.ne}


def accuracy(probs: np.ndarray, labels: np.ndarray) -> Accuracy:
    mean_label = float(np.mean(labels)) if len(labels) else float("nan")
    calibration = float(np.mean(probs)) / mean_label if len(labels) and mean_label > 0 else float("nan")
    logloss = log_loss(probs, labels)
    return Accuracy(roc_auc(probs, labels), logloss, calibration, int(len(labels)),
                    logloss / base_rate_entropy(mean_label))


def base_rate_entropy(ctr: float) -> float:
    """Logloss (nats) of predicting `ctr` for every record of a set whose CTR is `ctr`;
    NaN when it is 0 or 1 (or NaN): no record mix to normalize by."""
    if not 0.0 < ctr < 1.0:
        return float("nan")
    return -(ctr * math.log(ctr) + (1.0 - ctr) * math.log1p(-ctr))


class PrequentialWindow:
    """Ring buffer of the latest predictions and labels, plus whole-run totals."""

    def __init__(self, window_records: int, refresh_every_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_records = window_records
        # The window's AUC sorts every score in it (~10 ms for 100K): per batch, that
        # halved training speed at batch 64. `latest()` recomputes at most this often.
        self.refresh_every_s = refresh_every_s
        self.clock = clock
        self._cached: Accuracy | None = None
        self._cached_at = -math.inf
        self._stale = True
        self.probs = np.zeros(window_records, np.float32)
        self.labels = np.zeros(window_records, np.float32)
        self.filled = 0
        self.head = 0
        self.total_records = 0
        self.total_logloss_sum = 0.0
        self.total_prob_sum = 0.0
        self.total_label_sum = 0.0

    def add(self, probs: np.ndarray, labels: np.ndarray) -> None:
        n = len(probs)
        self._stale = True
        p = np.clip(probs.astype(np.float64), _EPS, 1 - _EPS)
        self.total_records += n
        self.total_logloss_sum += float(-(labels * np.log(p) + (1 - labels) * np.log1p(-p)).sum())
        self.total_prob_sum += float(probs.sum())
        self.total_label_sum += float(labels.sum())
        if n >= self.window_records:
            self.probs[:] = probs[-self.window_records:]
            self.labels[:] = labels[-self.window_records:]
            self.head, self.filled = 0, self.window_records
            return
        idx = (self.head + np.arange(n)) % self.window_records
        self.probs[idx] = probs
        self.labels[idx] = labels
        self.head = (self.head + n) % self.window_records
        self.filled = min(self.window_records, self.filled + n)

    def window(self) -> Accuracy:
        """The accuracy of the window as it is now (exact; sorts the window)."""
        acc = accuracy(self.probs[: self.filled], self.labels[: self.filled]) if self.filled \
            else Accuracy(float("nan"), float("nan"), float("nan"), 0)
        self._cached, self._cached_at, self._stale = acc, self.clock(), False
        return acc

    def latest(self) -> Accuracy:
        """The window's accuracy, recomputed only when records came in and the last
        computation is `refresh_every_s` old: what progress lines, the time series and
        the metric gauges show (each at most once a second by default)."""
        if self._cached is None or (self._stale and self.clock() - self._cached_at >= self.refresh_every_s):
            return self.window()
        return self._cached

    def totals(self) -> dict[str, float]:
        n = max(self.total_records, 1)
        return {"records": self.total_records, "logloss": self.total_logloss_sum / n,
                "calibration": (self.total_prob_sum / self.total_label_sum)
                if self.total_label_sum > 0 else float("nan")}

    def state_dict(self) -> dict:
        """Window contents oldest-first plus totals; restores the exact same window."""
        idx = (self.head + np.arange(self.window_records)) % self.window_records
        keep = idx[self.window_records - self.filled:]
        return {"probs": self.probs[keep].copy(), "labels": self.labels[keep].copy(),
                "total_records": self.total_records, "total_logloss_sum": self.total_logloss_sum,
                "total_prob_sum": self.total_prob_sum, "total_label_sum": self.total_label_sum}

    def load_state_dict(self, state: dict) -> None:
        self.__init__(self.window_records, self.refresh_every_s, self.clock)  # type: ignore[misc]
        probs = np.asarray(state["probs"], np.float32)
        labels = np.asarray(state["labels"], np.float32)
        if len(probs):
            keep = min(len(probs), self.window_records)
            self.probs[:keep] = probs[-keep:]
            self.labels[:keep] = labels[-keep:]
            self.filled, self.head = keep, keep % self.window_records
        for k in ("total_records", "total_logloss_sum", "total_prob_sum", "total_label_sum"):
            setattr(self, k, state[k])
