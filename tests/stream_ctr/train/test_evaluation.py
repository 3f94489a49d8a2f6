import numpy as np

from stream_ctr.train.evaluation import PrequentialWindow, accuracy, log_loss, roc_auc


def naive_auc(s, y):
    pos, neg = s[y > 0], s[y == 0]
    greater = (pos[:, None] > neg[None, :]).sum()
    ties = (pos[:, None] == neg[None, :]).sum()
    return (greater + 0.5 * ties) / (len(pos) * len(neg))


def test_auc_matches_naive_with_ties():
    rng = np.random.default_rng(1)
    s = rng.random(500)
    y = (rng.random(500) < s).astype(np.float32)
    assert np.isclose(roc_auc(s, y), naive_auc(s, y))
    s1 = np.round(s, 1)
    assert np.isclose(roc_auc(s1, y), naive_auc(s1, y))
    assert np.isnan(roc_auc(s, np.zeros(500)))


def test_logloss_and_calibration():
    p = np.array([0.9, 0.1, 0.8, 0.3])
    y = np.array([1, 0, 1, 0], dtype=np.float32)
    assert np.isclose(log_loss(p, y), -np.mean(np.log([0.9, 0.9, 0.8, 0.7])))
    acc = accuracy(p, y)
    assert np.isclose(acc.calibration, p.mean() / 0.5) and acc.auc == 1.0
    # NE: logloss over the logloss of predicting the set's CTR (0.5 here: ln 2)
    assert np.isclose(acc.ne, log_loss(p, y) / np.log(2))


def test_normalized_entropy_is_one_at_the_base_rate_and_nan_without_a_mix():
    y = (np.random.default_rng(3).random(10_000) < 0.03).astype(np.float32)
    assert np.isclose(accuracy(np.full(len(y), y.mean()), y).ne, 1.0)
    assert accuracy(np.full(len(y), 0.5), y).ne > 1.0            # worse than the base rate
    assert np.isnan(accuracy(np.full(8, 0.2), np.zeros(8, np.float32)).ne)


def test_window_keeps_latest_and_restores():
    rng = np.random.default_rng(2)
    s = rng.random(1000).astype(np.float32)
    y = (rng.random(1000) < s).astype(np.float32)
    w = PrequentialWindow(300)
    for i in range(0, 1000, 128):
        w.add(s[i:i + 128], y[i:i + 128])
    ref = accuracy(s[-300:], y[-300:])
    assert np.isclose(w.window().auc, ref.auc) and w.window().records == 300
    assert w.totals()["records"] == 1000
    restored = PrequentialWindow(300)
    restored.load_state_dict(w.state_dict())
    assert restored.window().auc == w.window().auc
    assert restored.totals() == w.totals()


def test_latest_recomputes_the_window_only_when_due_and_equals_it_then():
    """Progress, time series and gauges read `latest()`: at most one sort per refresh period."""
    rng = np.random.default_rng(0)
    now = [0.0]
    w = PrequentialWindow(1000, refresh_every_s=1.0, clock=lambda: now[0])
    calls = []
    exact = w.window
    w.window = lambda: calls.append(now[0]) or exact()            # count the sorts
    p, y = rng.random(64).astype(np.float32), (rng.random(64) < 0.3).astype(np.float32)
    w.add(p, y)
    first = w.latest()
    for _ in range(50):                                           # 50 batches within the second
        now[0] += 0.01
        w.add(rng.random(64).astype(np.float32), (rng.random(64) < 0.3).astype(np.float32))
        assert w.latest() is first
    now[0] += 1.0
    fresh = w.latest()
    assert calls == [0.0, now[0]]
    now[0] += 2.0
    assert w.latest() is fresh and len(calls) == 2                 # nothing new came in: no sort
    assert fresh.auc == exact().auc and fresh.records == 1000       # the window as it is now
    zero = PrequentialWindow(1000, refresh_every_s=0.0)
    zero.add(p, y)
    a = zero.latest()
    zero.add(p, 1 - y)
    assert zero.latest().auc != a.auc                              # 0 s: after every batch
