"""The evaluated model averages the dense weights over a horizon in samples."""
import math

import numpy as np
import torch

from stream_ctr.train.loop import configure_torch
from stream_ctr.train.trainer import Trainer
from tests.stream_ctr.store.helpers import criteo_batches, small_config


def _trainer(tmp_path, horizon_samples: int, batch) -> Trainer:
    cfg = small_config(tmp_path / "run", tiered=False)
    cfg.train.average_dense_samples = horizon_samples
    configure_torch(cfg)
    return Trainer(cfg, batch.n_fields, batch.n_dense)


def test_the_average_starts_as_the_mean_and_becomes_exponential(tmp_path):
    batches = criteo_batches(6, tmp=tmp_path)
    horizon = 3 * len(batches[0])
    trainer = _trainer(tmp_path, horizon, batches[0])
    ema_weight = 1 - math.exp(-trainer.optim.batch_size / horizon)     # 0.28
    expected = None
    for t, b in enumerate(batches, start=1):
        trainer.train_step(b)
        live = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        weight = max(ema_weight, 1 / t)            # 1 (a copy), 1/2, 1/3, then 0.28
        expected = {n: expected[n] + weight * (live[n] - expected[n]) if expected else live[n] for n in live}
    assert trainer.average_updates == len(batches)
    got = dict(trainer.eval_model.named_parameters())
    for n, p in expected.items():
        torch.testing.assert_close(got[n], p)
        assert not got[n].requires_grad
    # It differs from the live model after several steps: the live one took them whole.
    assert any(not torch.equal(got[n], p) for n, p in trainer.model.named_parameters())


def test_predict_scores_with_the_average_and_training_with_the_live_weights(tmp_path):
    batches = criteo_batches(3, tmp=tmp_path)
    averaged = _trainer(tmp_path / "a", 10 * len(batches[0]), batches[0])
    live = _trainer(tmp_path / "b", 0, batches[0])
    for b in batches[:2]:
        pa, pl = averaged.train_step(b).probs, live.train_step(b).probs
        torch.testing.assert_close(pa, pl)          # same steps: the prequential scores agree
    assert live.eval_model is live.model and live.average_model is None
    assert not np.allclose(averaged.predict(batches[2]), live.predict(batches[2]))


def test_the_average_survives_a_checkpoint(tmp_path):
    batches = criteo_batches(3, tmp=tmp_path)
    trainer = _trainer(tmp_path / "a", 5 * len(batches[0]), batches[0])
    for b in batches[:2]:
        trainer.train_step(b)
    state = trainer.state_tensors()
    assert "model_average" in state
    restored = _trainer(tmp_path / "b", 5 * len(batches[0]), batches[0])
    restored.load_state_tensors(state)
    np.testing.assert_array_equal(restored.predict(batches[2]), trainer.predict(batches[2]))
    # A checkpoint without an average (averaging off, or written before it existed)
    # evaluates the live weights until the next step starts one.
    state.pop("model_average")
    state.pop("average_updates")
    restored.load_state_tensors(state)
    assert restored.eval_model is restored.model
    restored.train_step(batches[2])
    assert restored.eval_model is restored.average_model and restored.average_updates == 1


def test_a_fresh_trainer_evaluates_the_live_weights(tmp_path):
    batches = criteo_batches(1, tmp=tmp_path)
    trainer = _trainer(tmp_path, 1000, batches[0])
    assert trainer.eval_model is trainer.model and "model_average" not in trainer.state_tensors()
