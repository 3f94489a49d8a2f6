"""End-to-end training on the real bundled samples: resume bit-identity, holdout, dead letters."""
import gzip
import json
from pathlib import Path

import pytest
import torch

from stream_ctr.connectors.files import SAMPLE_PATHS
from stream_ctr.train.checkpoint import CheckpointError, load_checkpoint
from stream_ctr.config import Config, ConfigError
from stream_ctr.train.loop import train


def small_config(tmp_path, **data) -> Config:
    cfg = Config()
    cfg.model.mlp_dims = (32, 32)
    cfg.data.batch_size = 128
    cfg.train.run_dir = str(tmp_path / "run")
    cfg.train.threads = 1
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def tensors_equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(tensors_equal(a[k], b[k]) for k in a)
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("read_ahead, chunk, decode_threads", [(0, 65536, 1), (2, 300, 1), (2, 300, 3)])
def test_resume_is_bit_identical(tmp_path, read_ahead, chunk, decode_threads):
    """With chunks read ahead on a thread, or decoded on three (small chunks: many of
    them in flight when the first run stops at its limit), the resume point is still
    the last trained row."""
    # N + M batches in one run ...
    whole = small_config(tmp_path / "whole", limit_records=20 * 128, read_ahead_chunks=read_ahead,
                         chunk_records=chunk, decode_threads=decode_threads)
    s = train(whole, show_progress=False)
    assert s.records_trained == 20 * 128 and s.batches == 20
    # ... equal N batches, stop, resume, M more.
    part = small_config(tmp_path / "part", limit_records=8 * 128, read_ahead_chunks=read_ahead,
                        chunk_records=chunk, decode_threads=decode_threads)
    train(part, show_progress=False)
    part.data.limit_records = 12 * 128
    s2 = train(part, resume=part.train.run_dir, show_progress=False)
    assert s2.records_trained == 12 * 128 and s2.records_trained_total == 20 * 128
    a = load_checkpoint(whole.train.run_dir).tensors["trainer"]
    b = load_checkpoint(part.train.run_dir).tensors["trainer"]
    assert a["step"] == b["step"] == 20
    assert tensors_equal(a["model"], b["model"])
    assert tensors_equal(a["store"], b["store"])
    assert tensors_equal(a["dense_opt"]["state"], b["dense_opt"]["state"])
    assert load_checkpoint(whole.train.run_dir).positions == {"file:criteo_kaggle_sample_14493.tsv.gz": 2560}


def test_holdout_is_never_trained(tmp_path):
    cfg = small_config(tmp_path, holdout_fraction=0.1)
    s = train(cfg, show_progress=False)
    assert s.records_trained == 14493 - 1449
    assert s.test["records"] == 1449
    assert 0.5 < s.test["auc"] < 1.0
    ckpt = load_checkpoint(cfg.train.run_dir)
    assert ckpt.positions == {}          # the epoch over the training part completed
    assert ckpt.extra["epoch"] == 1


def test_avazu_sample_trains(tmp_path):
    cfg = small_config(tmp_path, source="avazu:sample", holdout_fraction=0.2)
    s = train(cfg, show_progress=False)
    assert s.records_trained == 9999 - 2000 and s.test["records"] == 2000


def test_bad_lines_are_dead_lettered_not_dropped(tmp_path):
    lines = gzip.open(SAMPLE_PATHS["criteo"], "rb").read().split(b"\n")[:1000]
    lines[10] = b"1\t2\t3"                                  # wrong field count
    lines[20] = b"x" + lines[20][1:]                          # bad label
    path = tmp_path / "criteo_bad.tsv"
    path.write_bytes(b"\n".join(lines) + b"\n")
    cfg = small_config(tmp_path, source=f"criteo:{path}")
    s = train(cfg, show_progress=False)
    assert s.records_trained == 998 and s.records_rejected == 2
    assert s.rejected_by_reason == {"field_count": 1, "bad_label": 1}
    dead = [json.loads(x) for x in open(s.dead_letter_path)]
    assert [d["line"] for d in dead] == [11, 21]


def test_a_stopped_and_resumed_run_dead_letters_each_bad_line_once(tmp_path):
    """The run stops at a limit inside the chunk that holds the later bad lines: those
    lines are the resumed run's to dead-letter (they used to be written by both)."""
    lines = gzip.open(SAMPLE_PATHS["criteo"], "rb").read().split(b"\n")[:1000]
    for at in (10, 500, 900):
        lines[at] = b"1\t2\t3"
    path = tmp_path / "criteo_bad.tsv"
    path.write_bytes(b"\n".join(lines) + b"\n")
    cfg = small_config(tmp_path, source=f"criteo:{path}", limit_records=256)
    first = train(cfg, show_progress=False)
    cfg.data.limit_records = 0
    train(cfg, resume=cfg.train.run_dir, show_progress=False)
    dead = [json.loads(x) for x in open(first.dead_letter_path)]
    assert [d["line"] for d in dead] == [11, 501, 901]


def test_resume_from_corrupt_checkpoint_fails_clearly(tmp_path):
    cfg = small_config(tmp_path, limit_records=256)
    s = train(cfg, show_progress=False)
    (tmp_path / "run" / "checkpoints" / "ckpt-00000002" / "tensors.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="corrupt checkpoint .*tensors.pt"):
        train(cfg, resume=cfg.train.run_dir, show_progress=False)
    # No checkpoint at the resume path: a new run, which --run-dir's existing run refuses.
    with pytest.raises(ConfigError, match="already holds a run"):
        train(cfg, resume=str(tmp_path / "nowhere"), show_progress=False)


def test_bad_config_value_is_named(tmp_path):
    cfg = small_config(tmp_path)
    cfg.data.batch_size = 0
    with pytest.raises(ConfigError, match="data.batch_size"):
        train(cfg, show_progress=False)


def _ckpt(step: int, records: int):
    from stream_ctr.train.checkpoint import CheckpointState
    return CheckpointState(step=step, records_trained=records, positions={}, config={},
                           tensors={"x": torch.full((2,), float(records))})


class _PowerLoss(BaseException):
    """A crash: not an OSError, so save_checkpoint does not clean up after it."""


@pytest.mark.parametrize("crash_at", ["rename", "replace", "rmtree"])
def test_crash_while_resaving_a_step_leaves_latest_loadable(tmp_path, monkeypatch, crash_at):
    # The end-of-run checkpoint often lands on the step of a periodic one.
    import os
    import shutil

    from stream_ctr.train.checkpoint import save_checkpoint
    root = tmp_path / "ckpts"
    save_checkpoint(root, _ckpt(7, 10))

    module = shutil if crash_at == "rmtree" else os
    real = getattr(module, crash_at)

    def crash(path, *args, **kwargs):
        if crash_at == "rmtree" and not Path(path).name.startswith("ckpt-"):
            return real(path, *args, **kwargs)     # the stale temporary directory
        raise _PowerLoss()
    monkeypatch.setattr(module, crash_at, crash)
    with pytest.raises(_PowerLoss):
        save_checkpoint(root, _ckpt(7, 11))
    monkeypatch.undo()
    # Before the LATEST switch the old checkpoint is current, after it the new one.
    assert load_checkpoint(root).records_trained == (11 if crash_at == "rmtree" else 10)
    save_checkpoint(root, _ckpt(7, 12))       # the next save still works and cleans up
    assert load_checkpoint(root).records_trained == 12
    assert len([p for p in root.iterdir() if p.name.startswith("ckpt-00000007")]) == 1


def test_resaving_a_step_replaces_it_and_keep_counts_saves_in_order(tmp_path):
    from stream_ctr.train.checkpoint import save_checkpoint
    root = tmp_path / "ckpts"
    for step in (10, 20):
        save_checkpoint(root, _ckpt(step, step), keep=2)
    # Resumed from ckpt-10 explicitly (rolling back a bad model): the steps go down again.
    save_checkpoint(root, _ckpt(15, 15), keep=2)
    last = save_checkpoint(root, _ckpt(12, 12), keep=2)
    assert load_checkpoint(root).step == 12 and last.exists()
    assert sorted(p.name for p in root.glob("ckpt-*")) == ["ckpt-00000012", "ckpt-00000015"]
    again = save_checkpoint(root, _ckpt(12, 13), keep=2)
    assert again != last and not last.exists()
    assert load_checkpoint(root).records_trained == 13
    assert load_checkpoint(root / "ckpt-00000015").step == 15


def test_resume_without_a_source_goes_on_with_the_runs_file_and_holdout(tmp_path):
    """It used to fall back to the bundled Criteo sample and train the held-out lines."""
    avazu = small_config(tmp_path, source="avazu:sample", holdout_fraction=0.2, limit_records=1024)
    train(avazu, show_progress=False)
    again = small_config(tmp_path)            # no source, no holdout: the defaults
    s = train(again, resume=again.train.run_dir, show_progress=False)
    n_train = 9999 - int(round(9999 * 0.2))
    assert s.records_trained_total == n_train and s.test["records"] == 9999 - n_train


def test_resume_past_a_larger_holdout_or_with_another_format_is_one_clear_error(tmp_path):
    cfg = small_config(tmp_path, limit_records=14000)
    train(cfg, show_progress=False)
    wider = small_config(tmp_path, holdout_fraction=0.1)
    with pytest.raises(ConfigError, match="already trained .* up to line 14,000"):
        train(wider, resume=wider.train.run_dir, show_progress=False)
    other = small_config(tmp_path, source="avazu:sample")
    with pytest.raises(ConfigError, match="trained on criteo records"):
        train(other, resume=other.train.run_dir, show_progress=False)


def test_a_full_disk_while_checkpointing_is_one_clear_error(tmp_path, monkeypatch):
    """torch.save reports a failed write as a RuntimeError, not an OSError."""
    from stream_ctr.train.checkpoint import save_checkpoint
    root = tmp_path / "ckpts"
    save_checkpoint(root, _ckpt(1, 10))

    def full_disk(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4544 vs 4484")
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match="is the disk full") as err:
        save_checkpoint(root, _ckpt(2, 20))
    assert "it needs about" in str(err.value) and "MiB free" in str(err.value)
    assert "ckpt-00000001, is still valid" in str(err.value)
    monkeypatch.undo()
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]     # nothing left behind
    assert load_checkpoint(root).records_trained == 10


def test_epochs_report_held_out_accuracy_per_pass_and_label_the_reread_window(tmp_path, capsys):
    """With --epochs 2 the window after the first pass scores trained rows: the progress
    line says so, the epoch gauge counts passes, and each pass has its held-out AUC."""
    from stream_ctr.train.loop import Run
    cfg = small_config(tmp_path, source="criteo:sample", epochs=2, holdout_fraction=0.1)
    cfg.train.log_every_s = 0.0                      # a progress line per batch
    s = train(cfg, show_progress=True)
    err = capsys.readouterr().err
    assert "(prequential window)" in err and "re-read rows, pass 2 of 2: not held out" in err
    assert [e["epoch"] for e in s.test_per_epoch] == [1, 2]
    assert s.test_per_epoch[-1]["auc"] == s.test["auc"] and 0.5 < s.test_per_epoch[0]["auc"] < 1
    single = small_config(tmp_path / "one", source="criteo:sample", holdout_fraction=0.1)
    single.train.log_every_s = 0.0
    one = train(single, show_progress=True)
    assert one.test_per_epoch == []                  # a single pass: the test AUC says it all
    assert "re-read" not in capsys.readouterr().err
    assert Run.window_label.__doc__


@pytest.mark.parametrize("read_ahead, store", [(0, "memory"), (2, "memory"), (2, "tiered")])
def test_a_stop_mid_pass_resumes_with_the_rest_of_that_pass(tmp_path, monkeypatch, read_ahead, store):
    """SIGTERM after a few batches: the pass is not over (the closed source must not
    count as a finished epoch), so the resumed run trains exactly the rows left."""
    import os
    import signal

    from stream_ctr.train import loop
    cfg = small_config(tmp_path, read_ahead_chunks=read_ahead, chunk_records=500, holdout_fraction=0.1)
    cfg.store.kind = store
    record = loop.Run.record

    def record_then_stop(self, batch, result):
        record(self, batch, result)
        if self.summary.batches == 5:
            os.kill(os.getpid(), signal.SIGTERM)          # as a supervisor would
    monkeypatch.setattr(loop.Run, "record", record_then_stop)
    first = train(cfg, show_progress=False)
    assert first.stopped and first.records_trained == 5 * 128
    monkeypatch.setattr(loop.Run, "record", record)
    rest = train(cfg, resume=cfg.train.run_dir, show_progress=False)
    assert rest.records_trained == 13_044 - 5 * 128 and rest.records_trained_total == 13_044


def test_a_resumed_run_says_where_it_goes_on(tmp_path, capsys):
    cfg = small_config(tmp_path, limit_records=640)
    first = train(cfg, show_progress=False)
    capsys.readouterr()
    train(small_config(tmp_path, limit_records=320), resume=cfg.train.run_dir, show_progress=True)
    err = capsys.readouterr().err
    assert (f"resumed from {first.checkpoint} (step 5, 640 records trained) at line 640 of "
            "criteo_kaggle_sample_14493.tsv.gz") in err


def test_a_large_batch_that_leaves_few_steps_says_so(tmp_path, capsys):
    cfg = small_config(tmp_path, limit_records=2048)
    cfg.data.batch_size, cfg.optim.scale_from_batch = 512, 128
    train(cfg, show_progress=True)
    err = capsys.readouterr().err
    assert "note: batch 512 gives 4 steps over the 2,048 records to train; with under 100 steps" in err
    train(small_config(tmp_path / "plain", limit_records=2048), show_progress=True)   # no rule: no note
    assert "feature interactions" not in capsys.readouterr().err


def test_the_ramps_steps_count_toward_the_few_steps_note(tmp_path, capsys):
    # batch 4,096 = 256 x base 16: the ramp trains in sub-batches of 128, 100 steps over
    # 12,800 records; without it the same run is 4 steps.
    cfg = small_config(tmp_path / "ramp", limit_records=12_800)
    cfg.data.batch_size, cfg.optim.scale_from_batch = 4096, 16
    summary = train(cfg, show_progress=True)
    err = capsys.readouterr().err
    assert "sub-batches of 128 (16,384 steps)" in err and "feature interactions" not in err
    assert summary.records_trained == 12_800
    cfg = small_config(tmp_path / "no_ramp", limit_records=12_800)
    cfg.data.batch_size, cfg.optim.scale_from_batch, cfg.optim.ramp_samples = 4096, 16, 0
    train(cfg, show_progress=True)
    assert "note: batch 4,096 gives 4 steps over the 12,800 records" in capsys.readouterr().err
