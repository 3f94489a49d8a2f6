"""The distributed pieces that need no process group: config, owner hash, striping, job files."""
import numpy as np
import pytest
import torch

from stream_ctr.connectors.files import FileSource, detect_format
from stream_ctr.config import Config, ConfigError, load_config, validate
from stream_ctr.train.inputs import StripedSource
from stream_ctr.distributed.job_checkpoint import find_job
from stream_ctr.store.key_index import _slot_hash
from stream_ctr.distributed.sharded_store import owner_of


@pytest.mark.parametrize("option, value, message", [
    ("distributed.merge_every_k_steps", "0", "distributed.merge_every_k_steps must be >= 1"),
    ("distributed.timeout_s", "0", "distributed.timeout_s must be > 0"),
    ("distributed.backend", "mpi", "distributed.backend must be auto, gloo or nccl"),
])
def test_distributed_options_are_validated(option, value, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, [f"{option}={value}"]))


def test_distributed_section_round_trips_through_a_checkpoint_config():
    cfg = load_config(None, ["distributed.merge_every_k_steps=32", "distributed.hierarchical=true"])
    again = Config.from_dict(cfg.to_dict())
    assert again.distributed.merge_every_k_steps == 32 and again.distributed.hierarchical


def test_owners_are_uniform_and_independent_of_the_key_index_slots():
    keys = torch.randint(0, 1 << 62, (200_000,), generator=torch.Generator().manual_seed(0))
    owners = owner_of(keys, 4)
    share = torch.bincount(owners, minlength=4).double() / keys.numel()
    assert (share - 0.25).abs().max() < 0.01
    # The keys one rank owns still spread evenly over its index's slots.
    slots = _slot_hash(keys[owners == 0], (1 << 20) - 1) % 4
    assert (torch.bincount(slots, minlength=4).double() / slots.numel() - 0.25).abs().max() < 0.01
    assert torch.equal(owner_of(keys, 1), torch.zeros_like(keys))


def test_file_stripes_cover_every_record_once():
    fmt, path = detect_format("criteo:sample")
    seen = []
    for rank in range(3):
        with StripedSource(FileSource(path, fmt, chunk_records=1000, stop_offset=5000), rank, 3) as src:
            while not src.exhausted:
                batch, rejected = src.read()
                assert (batch.offset % 3 == rank).all() and not rejected
                seen.append(batch.offset)
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(5000))


def test_a_single_process_checkpoint_is_not_taken_for_a_job(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "LATEST").write_text("ckpt-00000001")
    with pytest.raises(ConfigError, match="single-process checkpoint"):
        find_job(tmp_path)


def test_deterministic_batches_are_refused_in_a_job_with_the_reason():
    from stream_ctr.distributed.run import refuse_deterministic_batches
    cfg = Config()
    cfg.data.source = "kafka://127.0.0.1:9/clicks?group=g"
    refuse_deterministic_batches(cfg)                  # fetch-order batches: fine
    cfg.kafka.deterministic_batches = True
    with pytest.raises(ConfigError, match="single-process runs.*share the run directory"):
        refuse_deterministic_batches(cfg)
    cfg.data.source = "criteo:sample"                  # a file: the option is about streams
    refuse_deterministic_batches(cfg)
