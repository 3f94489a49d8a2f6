"""bench train --peer deepctr: the peer's inputs, and a clear error where it is not installed."""
import importlib.util

import numpy as np
import pytest

from stream_ctr.bench.peer import deepctr_inputs
from stream_ctr.cli.main import main

INSTALLED = all(importlib.util.find_spec(m) for m in ("deepctr_torch", "sklearn"))


def test_the_peer_sees_each_fields_keys_as_a_vocabulary_and_our_numeric_columns():
    keys = np.array([[9_000_000_000_000, 5], [7, 5], [9_000_000_000_000, 6]], np.int64)
    dense = np.array([[0.5], [1.5], [2.5]], np.float32)
    x, vocab = deepctr_inputs(keys, dense)
    assert vocab == [2, 2]
    assert x["C0"].tolist() == [1, 0, 1] and x["C1"].tolist() == [0, 0, 1]   # same key, same id
    assert x["I0"].tolist() == [0.5, 1.5, 2.5]


@pytest.mark.skipif(INSTALLED, reason="deepctr-torch is installed here")
def test_without_deepctr_the_bench_says_what_to_install(capsys):
    assert main(["bench", "train", "--records", "2000", "--batch-sizes", "1024", "--peer", "deepctr"]) == 2
    assert "pip install deepctr-torch==0.3.0 scikit-learn" in capsys.readouterr().err
