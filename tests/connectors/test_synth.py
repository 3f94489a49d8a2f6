"""Synthetic Criteo generator: valid format, requested size, Zipf skew, learnable labels."""
import numpy as np
import pytest

from stream_ctr.connectors.files import FileSource, count_records
from stream_ctr.connectors.formats import CRITEO
from stream_ctr.connectors.synth import bayes_auc, probs_path, write_synthetic_criteo, zipf_ranks

N = 40_000


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    path = tmp_path_factory.mktemp("synth") / "synth_criteo.tsv"
    assert write_synthetic_criteo(path, N, seed=3) == N
    with FileSource(path, CRITEO) as source:
        batch, rejected = source.read(max_records=10**6)
    return path, batch, rejected


def test_synth_decodes_with_no_rejects(synth):
    path, batch, rejected = synth
    assert rejected == [] and len(batch) == N and count_records(path, CRITEO) == N
    assert 0.12 < batch.labels.mean() < 0.3


def test_synth_is_deterministic_and_gzip_matches(tmp_path, synth):
    path, batch, _ = synth
    write_synthetic_criteo(tmp_path / "again.tsv", N, seed=3)
    assert (tmp_path / "again.tsv").read_bytes() == path.read_bytes()
    write_synthetic_criteo(tmp_path / "other.tsv", 1000, seed=4)
    assert (tmp_path / "other.tsv").read_bytes() != path.read_bytes()[:len((tmp_path / "other.tsv").read_bytes())]
    write_synthetic_criteo(tmp_path / "small.tsv.gz", 1000, seed=3, gzip=True)
    with FileSource(tmp_path / "small.tsv.gz", CRITEO) as source:
        small, _ = source.read()
    assert (small.keys == batch.keys[:1000]).all() and (small.labels == batch.labels[:1000]).all()


def test_synth_ids_are_skewed_and_integers_partly_missing(synth):
    path, batch, _ = synth
    big_field = 13 + 2                                     # C3: ~10M ids in Criteo
    _, counts = np.unique(batch.keys[:, big_field], return_counts=True)
    counts = np.sort(counts)[::-1]
    assert len(counts) > 5000                              # long tail of ids
    assert counts[:10].sum() > 0.1 * N                     # ... and a fat head
    lines = path.read_bytes().splitlines()[:2000]
    ints = np.array([[f == b"" for f in line.split(b"\t")[1:14]] for line in lines])
    assert 0.15 < ints.mean() < 0.28


def test_zipf_ranks_stay_in_vocabulary():
    u = np.random.default_rng(0).random((10000, 3))
    vocab = np.array([3, 1000, 10**7])
    for s in (1.0, 1.05, 1.5):
        r = zipf_ranks(u, vocab, s)
        assert (r >= 1).all() and (r <= vocab).all()
        assert (r == 1).mean(axis=0)[1] > (r == 2).mean(axis=0)[1]


def test_labels_follow_the_ids(synth):
    # Per-id click rates from the first half predict the second half: a model can learn.
    _, batch, _ = synth
    half = N // 2
    score = np.zeros(N - half)
    prior = batch.labels[:half].mean()
    for f in range(13, 39):
        keys, inverse = np.unique(batch.keys[:, f], return_inverse=True)
        clicks = np.bincount(inverse[:half], weights=batch.labels[:half], minlength=len(keys))
        shows = np.bincount(inverse[:half], minlength=len(keys))
        rate = (clicks + 10 * prior) / (shows + 10)
        score += np.log(rate / (1 - rate))[inverse[half:]]
    assert _auc(batch.labels[half:], score) > 0.6


def _auc(labels: np.ndarray, score: np.ndarray) -> float:
    ranks = np.argsort(np.argsort(score)) + 1
    pos = labels == 1
    return (ranks[pos].sum() - pos.sum() * (pos.sum() + 1) / 2) / (pos.sum() * (~pos).sum())


def test_synth_sidecar_holds_true_probabilities(tmp_path, synth):
    path, batch, _ = synth
    probs = np.load(probs_path(path))
    assert probs.dtype == np.float32 and probs.shape == (N,)
    assert ((probs > 0) & (probs < 1)).all()
    # The labels were drawn from them: calibrated, and ranked well above chance.
    assert abs(probs.mean() - batch.labels.mean()) < 0.01
    assert 0.7 < bayes_auc(path, batch.labels) < 0.9
    assert bayes_auc(path, batch.labels[N // 2:], start=N // 2) > 0.7
    # A shorter file's sidecar is the prefix of a longer one's; gzip gets one too.
    write_synthetic_criteo(tmp_path / "short.tsv.gz", 1000, seed=3, gzip=True)
    assert (np.load(probs_path(tmp_path / "short.tsv.gz")) == probs[:1000]).all()
