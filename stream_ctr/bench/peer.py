"""`stream-ctr bench train --peer deepctr`: deepctr-torch's DeepFM on the same rows.

The peer is deepctr-torch (pip install deepctr-torch==0.3.0 scikit-learn; not a
dependency of stream_ctr). It trains the same architecture as our default
DeepFM (embedding dim 10, MLP 400-400-400, Adam, binary log loss) on the same
decoded rows: each field's 63-bit keys are relabelled 0..V-1 (deepctr needs a
vocabulary) and the numeric columns are our transformed ones. That preparation
is not timed; `model.fit(..., epochs=1)` is -- the peer's own training loop,
data loader included, as its users run it. The peer runs in fp32 (it has no
mixed precision); our trainer runs in its configured precision. Both run in a
process of their own with the same number of torch threads.

deepctr-torch 0.3.0 starts a thread at import that asks pypi.python.org for
its latest version. This machine must not reach out, so `requests` is replaced
by a module whose `get` fails at once before the import (the peer then prints
its "check the latest version manually" line and carries on).
"""
from __future__ import annotations

import sys
import time
import types

import numpy as np


def check_installed() -> None:
    """ConfigError unless deepctr-torch and scikit-learn can be found (without importing them:
    the import has side effects, see the module docstring)."""
    import importlib.util
    from stream_ctr.config import ConfigError
    missing = [m for m in ("deepctr_torch", "sklearn") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"bench train --peer deepctr needs {' and '.join(missing)}: "
                          f"pip install deepctr-torch==0.3.0 scikit-learn")


def _offline_requests() -> None:
    """Make deepctr-torch's version check fail locally instead of calling PyPI."""
    stub = types.ModuleType("requests")

    def get(url, *args, **kwargs):
        raise ConnectionError(f"stream-ctr bench: no network access for {url}")

    stub.get = get                                      # type: ignore[attr-defined]
    stub.codes = types.SimpleNamespace(ok=200)          # type: ignore[attr-defined]
    sys.modules["requests"] = stub


def import_deepctr():
    """deepctr-torch's DeepFM, SparseFeat and DenseFeat, imported offline; ConfigError (a
    usage error: the peer was asked for) says how to install it."""
    from stream_ctr.config import ConfigError
    _offline_requests()
    try:
        import deepctr_torch                            # noqa: F401
        from deepctr_torch.inputs import DenseFeat, SparseFeat
        from deepctr_torch.models import DeepFM
    except ImportError as exc:
        raise ConfigError(f"bench train --peer deepctr needs deepctr-torch, which did not import "
                          f"({exc}): pip install deepctr-torch==0.3.0 scikit-learn") from None
    return DeepFM, SparseFeat, DenseFeat


def deepctr_inputs(keys: np.ndarray, dense: np.ndarray) -> tuple[dict[str, np.ndarray], list[int]]:
    """deepctr's named inputs: per field, the keys relabelled 0..V-1; per numeric column, floats."""
    x: dict[str, np.ndarray] = {}
    vocab = []
    for f in range(keys.shape[1]):
        _, x[f"C{f}"] = np.unique(keys[:, f], return_inverse=True)
        vocab.append(int(x[f"C{f}"].max()) + 1)
    for j in range(dense.shape[1]):
        x[f"I{j}"] = dense[:, j].astype(np.float32)
    return x, vocab


def deepctr_samples_per_s(source: str, schema: str, batch_size: int, threads: int, embed_dim: int = 10,
                          hidden: tuple[int, ...] = (400, 400, 400)) -> dict:
    """Train deepctr-torch's DeepFM for one epoch over `source`; samples/s of fit()."""
    import torch
    from stream_ctr.bench.data import decoded_batches
    from stream_ctr.config import ConfigError
    from stream_ctr.connectors.batch import Batch
    DeepFM, SparseFeat, DenseFeat = import_deepctr()
    if threads:
        torch.set_num_threads(threads)
    whole = Batch.concat(decoded_batches(source, schema, batch_size))
    if whole.n_multi:
        raise ConfigError("bench train --peer deepctr: the source has multi-hot fields, which this "
                          "comparison does not give the peer; use a source of fixed fields")
    x, vocab = deepctr_inputs(whole.keys, whole.dense)
    columns = ([SparseFeat(f"C{f}", vocabulary_size=v, embedding_dim=embed_dim) for f, v in enumerate(vocab)]
               + [DenseFeat(f"I{j}", 1) for j in range(whole.dense.shape[1])])
    torch.manual_seed(0)
    model = DeepFM(columns, columns, dnn_hidden_units=hidden, task="binary", device="cpu", seed=0)
    model.compile("adam", "binary_crossentropy")
    t0 = time.perf_counter()
    model.fit(x, whole.labels.astype(np.float32), batch_size=batch_size, epochs=1, verbose=0, shuffle=False)
    seconds = time.perf_counter() - t0
    return {"peer": "deepctr-torch", "batch_size": batch_size, "records": len(whole),
            "threads": torch.get_num_threads(), "precision": "fp32", "seconds": seconds,
            "samples_per_s": len(whole) / seconds, "data": source}


def _peer_worker(source: str, schema: str, batch_size: int, threads: int, queue) -> None:
    import contextlib
    from stream_ctr.config import ConfigError
    try:
        # deepctr prints to stdout (its device, "Train on N samples"): keep --json output clean
        with contextlib.redirect_stdout(sys.stderr):
            queue.put(deepctr_samples_per_s(source, schema, batch_size, threads))
    except ConfigError as exc:
        queue.put({"error": str(exc)})
