"""The first step starts at the base rate: its prequential scores average the batch's CTR."""
import numpy as np
import pytest

from stream_ctr.train.loop import configure_torch
from stream_ctr.train.trainer import Trainer
from tests.stream_ctr.store.helpers import criteo_batches, small_config


@pytest.mark.parametrize("init_from_data", [True, False])
def test_first_predictions_sit_at_the_first_batchs_click_rate(tmp_path, init_from_data):
    batches = criteo_batches(2, tmp=tmp_path)
    cfg = small_config(tmp_path / "run", tiered=False)
    cfg.optim.init_bias_from_data = init_from_data
    configure_torch(cfg)
    trainer = Trainer(cfg, batches[0].n_fields, batches[0].n_dense)
    first = trainer.train_step(batches[0]).probs.numpy()
    clicks, n = float(batches[0].labels.sum()), len(batches[0])
    ctr = clicks / n
    assert 0.05 < ctr < 0.5                                  # the bundled sample: a real base rate
    if init_from_data:
        assert abs(first.mean() - (clicks + 1) / (n + 2)) < 1e-4     # Laplace-smoothed CTR
        # Numeric features reach ~13 after log1p; the zero numeric kernel keeps the
        # first scores near the base rate instead of spread over (0, 1).
        assert np.percentile(first, 95) < 3 * ctr and np.percentile(first, 5) > ctr / 3
    else:
        assert abs(first.mean() - ctr) > 0.05                # off: the bias starts at 0


def test_a_first_batch_without_clicks_starts_low_but_not_at_zero(tmp_path):
    batches = criteo_batches(1, tmp=tmp_path)
    no_clicks = batches[0]
    no_clicks.labels[:] = 0
    cfg = small_config(tmp_path / "run", tiered=False)
    configure_torch(cfg)
    trainer = Trainer(cfg, no_clicks.n_fields, no_clicks.n_dense)
    first = trainer.train_step(no_clicks).probs.numpy()
    assert abs(first.mean() - 1 / (len(no_clicks) + 2)) < 1e-4   # 1/130, not 1e-4
