"""bf16 matmuls (train.precision): what runs in bf16, what stays fp32, and the choice by hardware."""
import numpy as np
import pytest
import torch

from stream_ctr.config import ConfigError, validate
from stream_ctr.train.loop import configure_torch
from stream_ctr.models.scoring import cpu_runs_bf16_fast, resolve_precision
from stream_ctr.train.trainer import Trainer
from tests.stream_ctr.store.helpers import criteo_batches, small_config


def test_auto_picks_bf16_only_where_the_cpu_has_bf16_instructions():
    cpu = torch.device("cpu")
    assert resolve_precision("fp32", cpu) == "fp32" and resolve_precision("bf16", cpu) == "bf16"
    assert resolve_precision("auto", cpu) == ("bf16" if cpu_runs_bf16_fast() else "fp32")


def test_an_unknown_precision_is_a_config_error(tmp_path):
    cfg = small_config(tmp_path, tiered=False)
    cfg.train.precision = "fp16"
    with pytest.raises(ConfigError, match="train.precision"):
        validate(cfg)


def trained(tmp_path, precision, batches):
    cfg = small_config(tmp_path / precision, tiered=False)
    cfg.train.precision = precision
    configure_torch(cfg)
    trainer = Trainer(cfg, batches[0].n_fields, batches[0].n_dense)
    probs = [trainer.train_step(b).probs for b in batches]
    return trainer, probs


def test_bf16_scores_like_fp32_and_keeps_fp32_state(tmp_path):
    batches = criteo_batches(20, tmp=tmp_path)
    t32, p32 = trained(tmp_path, "fp32", batches)
    t16, p16 = trained(tmp_path, "bf16", batches)
    assert t16.precision == "bf16"
    # The first batch: same initial weights, only the matmuls' rounding differs.
    assert torch.allclose(p16[0], p32[0], atol=5e-3)
    assert not torch.equal(p16[0], p32[0])                    # bf16 really ran
    # After 20 steps the two runs still agree closely on every score.
    assert (p16[-1] - p32[-1]).abs().mean() < 0.02
    # Master weights, Adam moments and embedding rows stay fp32.
    assert all(p.dtype == torch.float32 for p in t16.model.parameters())
    assert all(v.dtype == torch.float32 for s in t16.dense_opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)
    assert t16.store.weight.dtype == torch.float32
    assert p16[-1].dtype == torch.float32 and torch.isfinite(p16[-1]).all()


def test_the_checkpoint_records_the_precision_and_a_resume_that_changes_it_says_so(tmp_path, capsys):
    from stream_ctr.config import Config
    from stream_ctr.train.checkpoint import load_checkpoint
    from stream_ctr.train.loop import train
    cfg = Config()
    cfg.model.mlp_dims = (16,)
    cfg.train.run_dir, cfg.train.threads = str(tmp_path / "run"), 1
    cfg.data.limit_records, cfg.train.precision = 640, "bf16"
    train(cfg, show_progress=False)
    assert load_checkpoint(cfg.train.run_dir).extra["precision"] == "bf16"
    cfg.train.precision = "fp32"
    train(cfg, resume=cfg.train.run_dir, show_progress=False)
    assert "trained with bf16 matmuls, this run uses fp32" in capsys.readouterr().err
    assert load_checkpoint(cfg.train.run_dir).extra["precision"] == "fp32"


def test_a_compiled_dense_model_trains_as_the_eager_one(tmp_path):
    """train.compile (inductor) beside the eager path: same scores within float tolerance,
    same state_dict keys (checkpoints and bundles do not see the compile)."""
    from stream_ctr.train.loop import configure_torch
    from stream_ctr.train.trainer import Trainer
    from tests.stream_ctr.store.helpers import criteo_batches, small_config
    batches = criteo_batches(3, tmp=tmp_path)
    trainers = []
    for compiled in (False, True):
        cfg = small_config(tmp_path / f"run{compiled}", tiered=False)
        cfg.train.precision, cfg.train.compile = "fp32", compiled
        configure_torch(cfg)
        trainers.append(Trainer(cfg, batches[0].n_fields, batches[0].n_dense))
    eager, compiled = trainers
    for b in batches:
        torch.testing.assert_close(compiled.train_step(b).probs, eager.train_step(b).probs,
                                   rtol=1e-4, atol=1e-5)
    assert compiled.state_tensors()["model"].keys() == eager.state_tensors()["model"].keys()
    np.testing.assert_allclose(compiled.predict(batches[0]), eager.predict(batches[0]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_host_arrays_reach_the_device_unchanged(device):
    # On a GPU the copy goes through pinned memory and returns before it has run: the host
    # array may be reused at once (a decoder's buffer) without changing the copy. On the
    # CPU the tensor is the array's memory: nothing is copied.
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from stream_ctr.models.scoring import host_to_device
    src = np.arange(1 << 20, dtype=np.int64).reshape(-1, 16)
    expected = torch.from_numpy(src.copy())
    out = host_to_device(src, torch.device(device))
    assert out.device.type == device and torch.equal(out.cpu(), expected)
    src[:] = -1
    if device == "cuda":
        assert torch.equal(out.cpu(), expected)
    else:
        assert out.data_ptr() == src.ctypes.data


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_a_pinned_batch_holds_the_same_rows_and_reaches_the_gpu_unchanged():
    # What a GPU run's decoding threads hand the trainer: its arrays in pinned memory,
    # slices of it too, copied to the device without another host copy.
    from stream_ctr.models.scoring import host_to_device, pinned
    from tests.stream_ctr.store.helpers import criteo_batches
    batch = criteo_batches(1)[0]
    p = pinned(batch)
    for name in ("labels", "dense", "keys", "event_time_ms", "offset"):
        assert np.array_equal(getattr(p, name), getattr(batch, name))
    half = p.slice(0, len(p) // 2)
    for a in (p.keys, p.dense, p.labels, half.keys):
        assert torch.from_numpy(a).is_pinned()
    cuda = torch.device("cuda")
    assert torch.equal(host_to_device(half.keys, cuda).cpu(), torch.from_numpy(batch.keys[:len(half)]))
