"""End to end: ranks train the real bundled Criteo sample (file striping), crash, resume.

The 2-rank job with a holdout is the reference run of this module (a
fixture): every record trained exactly once, AUC within noise of one
replica, and the crashed-and-resumed job must end bit-identical to it.
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from stream_ctr.train.checkpoint import CheckpointError, load_checkpoint
from stream_ctr.config import Config, ConfigError
from tests.stream_ctr.distributed.harness import run_ranks, values

N_RECORDS = 14493                  # the bundled Criteo sample
HOLDOUT = 0.2
TRAIN_END = N_RECORDS - int(round(N_RECORDS * HOLDOUT))


def job_config(run_dir, batch_size: int = 128, **data) -> dict:
    cfg = Config()
    cfg.model.mlp_dims = (32, 32)
    cfg.data.batch_size = batch_size
    cfg.data.holdout_fraction = HOLDOUT
    cfg.train.run_dir = str(run_dir)
    cfg.train.threads = 1
    cfg.train.checkpoint_every_batches = 10
    cfg.distributed.merge_every_k_steps = 4
    cfg.distributed.timeout_s = 30
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg.to_dict()


def train_rank(rank: int, world: int, cfg: dict, resume: str | None = None,
               crash: tuple[int, int] | None = None) -> dict:
    """One rank of a job; records the offsets it trained. `crash` = (rank, step) exits hard."""
    from stream_ctr.distributed.run import Job, train_distributed
    from stream_ctr.distributed.context import DistributedError
    from stream_ctr.train.loop import Run
    trained: list[np.ndarray] = []
    record, step = Run.record, Job.step

    def recording(self, batch, result):
        trained.append(batch.offset.copy())
        record(self, batch, result)

    def crashing(self, batch):
        step(self, batch)
        if crash is not None and (self.ctx.rank, self.global_step) == crash:
            os._exit(17)                  # no cleanup, no checkpoint: a dead process

    Run.record, Job.step = recording, crashing
    offsets = lambda: np.concatenate(trained).tolist() if trained else []   # noqa: E731
    try:
        s = train_distributed(Config.from_dict(cfg), resume=resume, show_progress=False)
    except DistributedError as e:
        return {"error": str(e), "offsets": offsets()}
    return {"summary": s.as_dict(), "offsets": offsets()}


def plain_and_one_rank(rank: int, world: int, cfg_plain: dict, cfg_job: dict) -> tuple[str, str]:
    """The same records trained without torch.distributed and as a 1-rank job."""
    from stream_ctr.distributed.run import train_distributed
    from stream_ctr.train.loop import train
    a = train(Config.from_dict(cfg_plain), show_progress=False)
    b = train_distributed(Config.from_dict(cfg_job), show_progress=False)
    return a.checkpoint, b.checkpoint


def one_replica(rank: int, world: int, cfg: dict) -> dict:
    from stream_ctr.train.loop import train
    return train(Config.from_dict(cfg), show_progress=False).as_dict()


def rank_state(job_dir: str, rank: int) -> dict:
    manifest = json.loads(open(os.path.join(job_dir, "job.json")).read())
    return load_checkpoint(os.path.join(job_dir, manifest["ranks"][rank]["checkpoint"])).tensors["trainer"]


def equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def reference_job(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("two_ranks")
    results = values(run_ranks(train_rank, 2, job_config(run_dir)))
    return run_dir, results


def ramp_config(run_dir, **data) -> dict:
    """Batches of 128 at 16 x a base of 8: the rule's ramp trains the first 640 samples
    of each rank in pieces of 64 rows (10 steps), then each batch is one step."""
    cfg = job_config(run_dir, **data)
    cfg["optim"].update(scale_from_batch=8, ramp_samples=640)
    return cfg


@pytest.mark.parametrize("ramp", [False, True], ids=["one-step-batches", "ramp"])
def test_one_rank_job_equals_plain_training_exactly(tmp_path, ramp):
    """With the ramp, 5 batches train in 10 pieces, then 7 batches: 17 steps, each piece a
    step of the job."""
    config = ramp_config if ramp else job_config
    plain = config(tmp_path / "plain", limit_records=12 * 128)
    job = config(tmp_path / "job", limit_records=12 * 128)
    plain_ckpt, job_dir = values(run_ranks(plain_and_one_rank, 1, plain, job))[0]
    a = load_checkpoint(plain_ckpt).tensors["trainer"]
    b = rank_state(job_dir, 0)
    assert a["step"] == b["step"] == (10 + 7 if ramp else 12)
    assert equal(a["model"], b["model"])
    assert equal(a["store"], b["store"])
    assert equal(a["dense_opt"]["state"], b["dense_opt"]["state"])


def test_a_job_killed_inside_the_ramp_resumes_exactly_once_and_bit_identical(tmp_path):
    """Two ranks ramp together, each piece a lockstep step. Checkpoints every 3 steps fall
    between the two pieces of a batch (steps 3 and 9), and rank 1 dies at step 8: the
    resumed job trains the rest of the half-trained batch and ends bit for bit where the
    job without a kill did."""
    ref_cfg = ramp_config(tmp_path / "ref", limit_records=4096)
    ref_cfg["train"]["checkpoint_every_batches"] = 3
    ref = values(run_ranks(train_rank, 2, ref_cfg))
    # 2,048 rows a rank: 5 batches in 10 pieces, then 11 batches of 128.
    assert [len(r["offsets"]) for r in ref] == [2048, 2048]
    assert ref[0]["summary"]["steps"] == 10 + 11
    cfg = ramp_config(tmp_path / "run", limit_records=4096)
    cfg["train"]["checkpoint_every_batches"] = 3
    crashed = run_ranks(train_rank, 2, cfg, None, (1, 8))
    assert crashed[1].exitcode == 17
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "job-00000002" / "job.json").read_text())
    assert manifest["global_step"] == 6
    third = json.loads((tmp_path / "run" / "checkpoints" / "job-00000001" / "job.json").read_text())
    # Step 3 ended the first piece of rank r's second batch: 128 + 64 of its rows.
    assert [e["positions"]["file:criteo_kaggle_sample_14493.tsv.gz"] for e in third["ranks"]] == [383, 384]
    before = [np.arange(r, e["positions"]["file:criteo_kaggle_sample_14493.tsv.gz"], 2)
              for r, e in enumerate(manifest["ranks"])]
    # data.limit_records counts the records of one invocation: the rest of the 4,096.
    cfg["data"]["limit_records"] = 4096 - sum(map(len, before))
    resumed = values(run_ranks(train_rank, 2, cfg, str(tmp_path / "run")))
    after = [np.asarray(r["offsets"]) for r in resumed]
    assert np.array_equal(np.sort(np.concatenate(before + after)), np.arange(4096))
    final, ref_final = resumed[0]["summary"]["checkpoint"], ref[0]["summary"]["checkpoint"]
    for rank in range(2):
        a, b = rank_state(final, rank), rank_state(ref_final, rank)
        assert a["step"] == b["step"] == 21
        assert equal(a["model"], b["model"]) and equal(a["store"], b["store"])
        assert equal(a["dense_opt"]["state"], b["dense_opt"]["state"])


def test_two_ranks_train_every_record_exactly_once(reference_job):
    run_dir, results = reference_job
    offsets = np.concatenate([r["offsets"] for r in results])
    assert np.array_equal(np.sort(offsets), np.arange(TRAIN_END))
    # rank r trained its stripe: offset % 2 == r
    assert all((np.asarray(r["offsets"]) % 2 == i).all() for i, r in enumerate(results))
    s = results[0]["summary"]
    assert s["records_trained"] == TRAIN_END and s["world_size"] == 2
    assert s["merges"] >= TRAIN_END // (2 * 128 * 4)
    assert s["merge_sent_bytes"] > 0 and s["exchange_sent_bytes"] > 0


@pytest.mark.parametrize("hierarchical", [False, True], ids=["flat", "hierarchical"])
@pytest.mark.parametrize("ramp", [False, True], ids=["one-step-batches", "ramp"])
def test_every_rank_counts_the_job_steps(tmp_path, hierarchical, ramp):
    """12,319 training records: stripes of 6,160 and 6,159 rows, batches of 2,053, so
    rank 1 sits idle in the last of 4 steps. Its warm-up, bias corrections and
    checkpointed step still count the job's steps (they used to count its own: 3).
    Hierarchical (both ranks on one node): the idle rank still takes the node's dense
    step, its collectives in the training ranks' order (else this deadlocks). With a
    ramp of 2 steps of 1,024 rows, each first batch is 3 pieces (1,024, 1,024, 5): 6 steps."""
    cfg = job_config(tmp_path, batch_size=2053, holdout_fraction=0.15)
    cfg["distributed"]["hierarchical"] = hierarchical
    if ramp:
        cfg["optim"].update(scale_from_batch=128, ramp_samples=2048)
    results = values(run_ranks(train_rank, 2, cfg, local_world=2))
    assert [len(r["offsets"]) for r in results] == [6160, 6159]
    final = results[0]["summary"]["checkpoint"]
    manifest = json.loads(open(os.path.join(final, "job.json")).read())
    steps = 6 if ramp else 4
    assert manifest["global_step"] == steps
    assert [rank_state(final, rank)["step"] for rank in range(2)] == [steps, steps]


def test_two_ranks_auc_is_within_noise_of_one_replica(reference_job, tmp_path):
    run_dir, results = reference_job
    two = results[0]["summary"]
    assert results[1]["summary"]["test_auc"] == two["test_auc"]     # one model, seen from both ranks
    # One replica with the same global batch (2 x 128) takes the same number of steps.
    one = values(run_ranks(one_replica, 1, job_config(tmp_path, batch_size=256)))[0]
    assert two["test_records"] == one["test_records"] == N_RECORDS - TRAIN_END
    assert two["test_auc"] > 0.6
    assert abs(two["test_auc"] - one["test_auc"]) < 0.02


def test_crash_of_one_rank_then_resume_loses_and_repeats_nothing(reference_job, tmp_path):
    ref_dir, ref = reference_job
    cfg = job_config(tmp_path)
    # Rank 1 dies at step 25; the last job checkpoint is the one at step 20.
    crashed = run_ranks(train_rank, 2, cfg, None, (1, 25))
    assert crashed[1].exitcode == 17
    assert crashed[0].ok and "another rank stopped or is unreachable" in crashed[0].value["error"]
    manifest = json.loads((tmp_path / "checkpoints" / "job-00000002" / "job.json").read_text())
    assert manifest["global_step"] == 20
    assert (tmp_path / "checkpoints" / "LATEST_JOB").read_text() == "job-00000002"

    resumed = values(run_ranks(train_rank, 2, cfg, str(tmp_path)))
    # In the model exactly once: what the manifest's positions cover, plus what the resumed job trained.
    before = [np.arange(r, e["positions"]["file:criteo_kaggle_sample_14493.tsv.gz"], 2)
              for r, e in enumerate(manifest["ranks"])]
    after = [np.asarray(r["offsets"]) for r in resumed]
    assert np.array_equal(np.sort(np.concatenate(before + after)), np.arange(TRAIN_END))
    # ... and the job ends exactly where the uninterrupted one did, bit for bit.
    final, ref_final = resumed[0]["summary"]["checkpoint"], ref[0]["summary"]["checkpoint"]
    for rank in range(2):
        a, b = rank_state(final, rank), rank_state(ref_final, rank)
        assert a["step"] == b["step"]
        assert equal(a["model"], b["model"]) and equal(a["store"], b["store"])
        assert equal(a["dense_opt"]["state"], b["dense_opt"]["state"])
    assert resumed[0]["summary"]["test_auc"] == ref[0]["summary"]["test_auc"]


def test_a_dead_rank_stops_the_others_with_a_clear_error(tmp_path):
    outcomes = run_ranks(train_rank, 4, job_config(tmp_path, batch_size=64), None, (2, 3),
                         timeout_s=90)
    assert outcomes[2].exitcode == 17
    for o in (outcomes[0], outcomes[1], outcomes[3]):
        assert o.ok, o.error
        message = o.value["error"]
        assert message.startswith(f"rank {o.rank}: ") and "another rank stopped or is unreachable" in message
        assert "--resume" in message


def test_resume_with_another_world_size_is_refused_clearly(reference_job):
    from stream_ctr.distributed.job_checkpoint import open_job
    run_dir, _ = reference_job
    assert open_job(run_dir, 2).manifest["world_size"] == 2
    with pytest.raises(ConfigError, match="written by 2 ranks but this job has 3.*resume with exactly 2"):
        open_job(run_dir, 3)
    with pytest.raises(CheckpointError, match="distributed job"):
        load_checkpoint(run_dir)                       # a single-process resume says what it is


def test_cli_launches_ranks_with_torchrun(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run(
        [sys.executable, "-m", "stream_ctr", "train", "--distributed", "--nproc-per-node", "2",
         "--limit", "1024", "--batch-size", "128", "--set", "model.mlp_dims=16",
         "--run-dir", str(tmp_path), "--merge-every", "2", "--json", "--quiet"],
        capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["records_trained"] == 1024 and summary["world_size"] == 2
    assert summary["steps"] == 4 and summary["merges"] == 2
    assert summary["optim"]["batch_size"] == 128          # the resolved settings, as one process says
    assert (tmp_path / "checkpoints" / "LATEST_JOB").exists()


def test_a_job_publishes_full_snapshots_that_serve_its_final_checkpoints_export(tmp_path):
    """--publish in a 2-rank job: rank 0 publishes each job checkpoint's shards as one full
    snapshot; the newest version scores exactly as an export of the final job checkpoint,
    and a resumed job publishes the checkpoint it resumed from before it trains."""
    from stream_ctr.cli.main import main
    from stream_ctr.serving.bundle import read_bundle
    from stream_ctr.serving.published import PublishInfo, read_index, version_dirs
    from stream_ctr.serving.scorer import Scorer
    from stream_ctr.connectors.decode import decode_lines
    from stream_ctr.connectors.formats import CRITEO
    from tests.stream_ctr.serving.test_serve import sample_lines
    pub = tmp_path / "pub"
    cfg = job_config(tmp_path / "run", limit_records=4096)
    cfg["serving"]["publish"] = str(pub)
    started_s = time.time()
    results = values(run_ranks(train_rank, 2, cfg))
    assert all("error" not in r for r in results), results
    # 4,096 records, 2 ranks, batches of 128: 16 job steps, checkpoints at 10 and at the end.
    index = read_index(pub)
    assert index.latest == 2 and index.full == 2 and index.chain == []
    kinds = {v: PublishInfo.from_manifest(read_bundle(p).manifest, p).kind for v, p in version_dirs(pub).items()}
    assert set(kinds.values()) == {"full"} and 2 in kinds
    # Freshness: the newest read of a trained batch on any rank (the sample has no event time).
    info = PublishInfo.from_manifest(read_bundle(version_dirs(pub)[2]).manifest, version_dirs(pub)[2])
    assert started_s < info.newest_arrival_s < info.created_s and info.newest_event_ms is None
    job = results[0]["summary"]["checkpoint"]
    assert main(["export", job, "--out", str(tmp_path / "final"), "--quiet"]) == 0
    batch = decode_lines(b"\n".join(sample_lines()[:2000]) + b"\n", CRITEO, "t", 0)[0]
    published, final = read_bundle(version_dirs(pub)[2]), read_bundle(tmp_path / "final")
    assert len(published.keys) == len(final.keys)
    assert np.array_equal(Scorer(published).score(batch), Scorer(final).score(batch))
    # Resumed for 4,096 more records (job steps 17-32): version 3 is the job it resumed from,
    # published before it trains, then the checkpoints at steps 20 and 30 and the end.
    again = values(run_ranks(train_rank, 2, cfg, job))
    assert all("error" not in r for r in again), again
    assert read_index(pub).latest == 6 and sorted(version_dirs(pub)) == [5, 6]
    assert [read_bundle(version_dirs(pub)[v]).manifest["checkpoint"]["step"] for v in (5, 6)] == [30, 32]
    job2 = again[0]["summary"]["checkpoint"]
    assert main(["export", job2, "--out", str(tmp_path / "final2"), "--quiet"]) == 0
    assert np.array_equal(Scorer(read_bundle(version_dirs(pub)[6])).score(batch),
                          Scorer(read_bundle(tmp_path / "final2")).score(batch))


def test_resuming_a_finished_job_trains_nothing_and_writes_no_checkpoint(reference_job):
    """Every rank did its pass: a restart (a supervisor's, say) says so, steps nothing and
    leaves the job's checkpoints as they were, and its summary still scores the holdout."""
    from stream_ctr.distributed.job_checkpoint import last_seq
    run_dir, ref = reference_job
    before = last_seq(run_dir / "checkpoints")
    resumed = values(run_ranks(train_rank, 2, job_config(run_dir), str(run_dir)))
    assert last_seq(run_dir / "checkpoints") == before
    for r in resumed:
        s = r["summary"]
        assert r["offsets"] == [] and s["records_trained"] == 0 and s["steps"] == ref[0]["summary"]["steps"]
        assert s["already_finished"].startswith("the run finished its 1 pass over criteo_kaggle_sample")
        assert s["checkpoint"] == ref[0]["summary"]["checkpoint"]
        assert s["test_auc"] == ref[0]["summary"]["test_auc"]
