"""The scaling rule's ramp: under --scale-from at s > ramp_scale, the first ramp_samples
samples train in sub-batches of ramp_scale x the base batch, each a step under the rule
for that sub-batch; then each batch is one step."""
import math

import numpy as np
import torch

from stream_ctr.config import Config, ramp_optim, resolve_optim
from stream_ctr.train.loop import configure_torch
from stream_ctr.train.trainer import Trainer
from tests.stream_ctr.store.helpers import criteo_batches, small_config


def test_the_rule_ramps_at_large_scales_only():
    cfg = Config()
    cfg.optim.scale_from_batch, cfg.data.batch_size = 1024, 131072
    run = resolve_optim(cfg)
    assert (run.ramp_batch, run.ramp_steps) == (8192, 256)          # 2,097,152 samples / 8,192
    sub = ramp_optim(cfg, run)
    assert (sub.batch_size, sub.scale) == (8192, 8.0)
    assert math.isclose(sub.lr_dense, cfg.optim.lr_dense * math.sqrt(8))
    assert math.isclose(sub.beta2, 0.999 ** 8)
    assert run.count_lr_s == sub.count_lr_s == 8            # the run's cap, sqrt(128 / 2)
    cfg.data.batch_size = 32768
    assert ramp_optim(cfg, resolve_optim(cfg)).count_lr_s == 4      # sqrt(32 / 2), not 8
    cfg.data.batch_size = 131072
    assert sub.warmup_samples == run.warmup_samples == 500_000      # one warm-up over samples
    from stream_ctr.config import describe_optim
    assert ("warm-up 500,000 samples (62 steps), the first 2,097,152 samples in sub-batches of "
            "8,192 (256 steps)") in describe_optim(run)
    cfg.data.batch_size = 8192                                      # s = ramp_scale: nothing to ramp
    assert resolve_optim(cfg).ramp_batch == 0 and ramp_optim(cfg, resolve_optim(cfg)) is None
    cfg.data.batch_size, cfg.optim.ramp_samples = 131072, 0
    assert resolve_optim(cfg).ramp_steps == 0
    cfg.optim.ramp_samples, cfg.optim.scale_from_batch = 2_097_152, 0      # no rule, no ramp
    assert resolve_optim(cfg).ramp_batch == 0


def test_samples_and_the_dense_warm_up_count_the_ramps_steps_at_its_sub_batch():
    cfg = Config()
    cfg.optim.scale_from_batch, cfg.data.batch_size = 1024, 131072
    t = Trainer(cfg, n_fields=3, n_dense=2)
    assert t.samples_at(256) == 2_097_152 and t.samples_at(258) == 2_097_152 + 2 * 131072
    assert t.samples_at(61) == 61 * 8192
    # The warm-up (500,000 samples) ends inside the ramp, at the ramp's own lr.
    assert math.isclose(t.dense_lr(61), t.ramp.lr_dense * 61 * 8192 / 500_000)
    assert math.isclose(t.dense_lr(62), t.ramp.lr_dense) and math.isclose(t.dense_lr(256), t.ramp.lr_dense)
    # After the ramp the lr climbs from the ramp's to the run's over another 500,000 samples.
    climb = t.optim.lr_dense - t.ramp.lr_dense
    assert math.isclose(t.dense_lr(257), t.ramp.lr_dense + climb * 131072 / 500_000)
    assert math.isclose(t.dense_lr(259), t.ramp.lr_dense + climb * 3 * 131072 / 500_000)
    assert math.isclose(t.dense_lr(260), t.optim.lr_dense) and math.isclose(t.dense_lr(600), t.optim.lr_dense)


def _ramp_config(tmp_path):
    cfg = small_config(tmp_path / "run", tiered=False)
    cfg.data.batch_size = 512
    cfg.optim.scale_from_batch, cfg.optim.ramp_scale, cfg.optim.ramp_samples = 16, 8.0, 256
    return cfg                                            # sub-batch 128, 2 ramp steps


def test_a_ramp_batch_trains_exactly_as_its_sub_batches_one_by_one(tmp_path):
    batch = criteo_batches(4, tmp=tmp_path)
    from stream_ctr.connectors.batch import Batch
    batch = Batch.concat(batch)                           # 512 rows
    cfg = _ramp_config(tmp_path)
    configure_torch(cfg)
    whole = Trainer(cfg, batch.n_fields, batch.n_dense)
    assert (whole.ramp.batch_size, whole.ramp.ramp_steps) == (128, 2)
    result = whole.train_step(batch)
    # Two ramp steps of 128 rows, then the ramp is over: the other 256 rows are one step.
    assert whole.step == 3 and len(result.probs) == 512 and not bool(result.skipped)

    parts = Trainer(cfg, batch.n_fields, batch.n_dense)
    probs, losses = [], []
    for start, stop in ((0, 128), (128, 256), (256, 512)):
        r = parts.train_step(batch.slice(start, stop))
        probs.append(r.probs)
        losses.append(float(r.loss) * (stop - start))
    assert parts.step == 3
    assert torch.equal(result.probs, torch.cat(probs))             # the same prequential scores
    assert math.isclose(float(result.loss), sum(losses) / 512, rel_tol=1e-6)
    for a, b in zip(whole.model.parameters(), parts.model.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(whole.store.weight, parts.store.weight)
    # The ramp's steps ran under the sub-batch's rule, the last one under the run's.
    assert whole.dense_opt.param_groups[0]["betas"][1] == whole.optim.beta2
    assert whole.ramp.beta2 != whole.optim.beta2

    # After the ramp a batch is one step.
    nxt = Batch.concat(criteo_batches(8, tmp=tmp_path)[4:])
    whole.train_step(nxt)
    assert whole.step == 4


def test_without_the_rule_a_batch_is_one_step(tmp_path):
    batch = criteo_batches(1, tmp=tmp_path)[0]
    cfg = small_config(tmp_path / "run", tiered=False)
    configure_torch(cfg)
    t = Trainer(cfg, batch.n_fields, batch.n_dense)
    assert t.ramp is None
    t.train_step(batch)
    assert t.step == 1 and np.isfinite(float(t.dense_lr(1)))
