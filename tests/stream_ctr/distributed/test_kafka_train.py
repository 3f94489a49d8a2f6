"""End to end with Kafka: 2 ranks in one consumer group read a 4-partition topic of the
real Criteo sample (a real broker, tests/kafka_broker.py); crash one rank, resume."""
import json
import os

import numpy as np

from stream_ctr.connectors.kafka.replay import replay_file
from stream_ctr.config import Config
from tests.kafka_broker import TEST_KAFKA
from tests.stream_ctr.distributed.harness import run_ranks, values

TRAIN_RECORDS = 13044          # the first 90% of the Criteo sample; the rest is the test set
PARTITIONS = 4


def kafka_job_config(run_dir, source: str, batch_size: int = 64) -> dict:
    cfg = Config()
    cfg.data.source = source
    cfg.data.batch_size = batch_size
    cfg.data.max_batch_delay_s = 1e9          # batches by size; the idle end flushes the rest
    cfg.model.mlp_dims = (32, 32)
    cfg.train.run_dir = str(run_dir)
    cfg.train.threads = 1
    cfg.train.checkpoint_every_batches = 20
    cfg.distributed.merge_every_k_steps = 4
    cfg.distributed.timeout_s = 60
    for name, value in TEST_KAFKA.items():
        setattr(cfg.kafka, name, value)
    cfg.kafka.stop_when_idle_s = 3.0
    return cfg.to_dict()


def kafka_rank(rank: int, world: int, cfg: dict, resume: str | None = None,
               crash: tuple[int, int] | None = None, join_late: str | None = None) -> dict:
    """One rank; returns the (partition, offset) of every row it trained. `crash`:
    (rank, step) after which that rank dies; `join_late` (a file path): rank 1 joins
    the consumer group only after rank 0 trained 4 batches (then writes that file),
    so rank 0 first trains every partition and then hands some over."""
    from pathlib import Path
    from stream_ctr.distributed.run import Job, train_distributed
    from stream_ctr.distributed.context import DistributedError
    from stream_ctr.train.loop import Run
    trained: list[str] = []
    record, step, next_batch = Run.record, Job.step, Job.next_batch

    def joining_late(self, stop):
        if rank == 1 and join_late and not Path(join_late).exists():
            return None
        return next_batch(self, stop)

    def recording(self, batch, result):
        names = np.asarray(batch.partitions)[batch.partition]
        trained.extend(f"{n}@{o}" for n, o in zip(names, batch.offset))
        record(self, batch, result)
        if rank == 0 and join_late and len(trained) >= 4 * len(batch):
            Path(join_late).touch()

    def crashing(self, batch):
        step(self, batch)
        if crash is not None and (self.ctx.rank, self.global_step) == crash:
            os._exit(17)

    Run.record, Job.step = recording, crashing
    Job.next_batch = joining_late
    try:
        s = train_distributed(Config.from_dict(cfg), resume=resume, show_progress=False)
    except DistributedError as e:
        return {"error": str(e), "trained": trained}
    return {"summary": s.as_dict(), "trained": trained}


def file_replica(rank: int, world: int, cfg: dict) -> float:
    from stream_ctr.train.loop import train
    return train(Config.from_dict(cfg), show_progress=False).test["auc"]


def all_records(topic: str) -> list[str]:
    # replay_file spreads lines round-robin over the partitions
    per = [len(range(p, TRAIN_RECORDS, PARTITIONS)) for p in range(PARTITIONS)]
    return sorted(f"{topic}/{p}@{o}" for p in range(PARTITIONS) for o in range(per[p]))


def assert_exactly_once(trained: list[str], expected: list[str]) -> None:
    """Every expected record trained once; on failure a short account (not two 13K-line lists)."""
    from collections import Counter
    counts, want = Counter(trained), set(expected)
    missing = sorted(want - set(counts))
    repeated = sorted(r for r, n in counts.items() if n > 1)
    unexpected = sorted(set(counts) - want)
    per_partition = Counter(r.split("@")[0] for r in trained)
    assert not (missing or repeated or unexpected), (
        f"{len(missing)} missing (e.g. {missing[:5]}), {len(repeated)} trained twice "
        f"(e.g. {repeated[:5]}), {len(unexpected)} unexpected (e.g. {unexpected[:5]}); "
        f"rows trained per partition: {dict(sorted(per_partition.items()))}")


def test_two_ranks_train_a_topic_exactly_once_with_the_accuracy_of_one_replica(kafka, tmp_path):
    from stream_ctr.distributed.job_checkpoint import load_any
    from stream_ctr.train.loop import evaluate_checkpoint
    topic = kafka.topic(partitions=PARTITIONS)
    replay_file("criteo:sample", kafka.url(topic), limit=TRAIN_RECORDS)
    cfg = kafka_job_config(tmp_path / "job", kafka.url(topic, "dist"))
    # rank 1 joins the group late: rank 0 hands half of the partitions over mid-stream
    results = values(run_ranks(kafka_rank, 2, cfg, None, None, str(tmp_path / "joined"), timeout_s=240))
    trained = [r["trained"] for r in results]
    assert_exactly_once(trained[0] + trained[1], all_records(topic))
    assert trained[0] and trained[1]                       # the group split the partitions
    assert results[0]["summary"]["records_trained"] == TRAIN_RECORDS
    # the group's committed offsets are those of the last job checkpoint
    assert kafka.committed("dist", topic, PARTITIONS) == {f"{topic}/{p}": len(range(p, TRAIN_RECORDS, PARTITIONS))
                                                          for p in range(PARTITIONS)}
    job_auc = evaluate_checkpoint(load_any(str(tmp_path / "job")), str(tmp_path / "job"), "criteo:sample", start=TRAIN_RECORDS)["auc"]

    one = Config.from_dict(kafka_job_config(tmp_path / "one", "criteo:sample", batch_size=128))
    one.data.holdout_fraction = 0.1
    one_auc = values(run_ranks(file_replica, 1, one.to_dict()))[0]
    assert job_auc > 0.65
    assert abs(job_auc - one_auc) < 0.03, (job_auc, one_auc)


def test_kafka_job_resumes_after_a_rank_dies_with_nothing_lost_or_repeated(kafka, tmp_path):
    topic = kafka.topic(partitions=PARTITIONS)
    replay_file("criteo:sample", kafka.url(topic), limit=TRAIN_RECORDS)
    cfg = kafka_job_config(tmp_path, kafka.url(topic, "crash"))
    # The rule's ramp for the first 60 steps: each batch of 64 trains as 2 pieces of 32
    # rows, each a step of the job; the kill and the resume's hand-over fall inside it.
    cfg["optim"].update(scale_from_batch=4, ramp_samples=60 * 32)
    crashed = run_ranks(kafka_rank, 2, cfg, None, (1, 50), timeout_s=240)
    assert crashed[1].exitcode == 17
    assert crashed[0].ok and "another rank stopped" in crashed[0].value["error"]
    root = tmp_path / "checkpoints"
    manifest = json.loads((root / (root / "LATEST_JOB").read_text() / "job.json").read_text())
    assert manifest["global_step"] == 40

    # Rank 1 joins late: rank 0 trains past the checkpoint on every partition, then the
    # group hands rank 1 its share, which must continue after rank 0, not at the checkpoint.
    resumed = values(run_ranks(kafka_rank, 2, cfg, str(tmp_path), None, str(tmp_path / "joined"),
                               timeout_s=240))
    # In the model: what the manifest's positions cover, plus what the resumed job trained.
    from stream_ctr.distributed.job_checkpoint import Job, merged_stream_positions
    done = merged_stream_positions(Job(root, manifest))
    before = [f"{topic}/{p}@{o}" for p in range(PARTITIONS) for o in range(done.get(f"{topic}/{p}", 0))]
    after = resumed[0]["trained"] + resumed[1]["trained"]
    assert_exactly_once(before + after, all_records(topic))
    assert resumed[0]["summary"]["records_trained"] == TRAIN_RECORDS - len(before)
