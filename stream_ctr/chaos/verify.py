"""The verdict of a chaos run: what must hold after any fault schedule.

- exactly once: the model's own counter (records in the last checkpoint, and
  the last trainer's summary) equals the good records produced; the
  checkpoint's offsets are the end of every partition (read as `KafkaPositions`:
  a partition the source gave up in a rebalance stays in them, marked given up,
  which is bookkeeping); the group's committed offsets equal them;
- dead letters: every malformed message is on the dead-letter topic exactly
  once (a message read again after a kill is not dead-lettered again:
  connectors/dead_letter.py), and no good one;
- the model: equal, tensor for tensor (dense weights, optimizer state,
  embedding rows and their moments, the prequential window), to the
  fault-free reference's -- what `kafka.deterministic_batches` promises (a
  tiered store's rows are read from each run's LMDB at its checkpoint's
  generation and compared by key: weights and linear column);
- no checkpoint left unreadable: every complete checkpoint directory loads and
  matches its checksums (half-written ``.tmp-*`` directories are never read).
"""
from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from stream_ctr.chaos.stream import KnownStream
from stream_ctr.connectors.kafka.positions import KafkaPositions, committed_offsets
from stream_ctr.config import Config
from stream_ctr.serving.export import tiered_rows
from stream_ctr.train.checkpoint import CheckpointError, CheckpointState, load_checkpoint

# Where a tiered store's rows live, not what they are: differs between two runs.
_STORE_PLACE = ("store_id", "store_dir", "generation", "nonce")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def same_tensors(a, b) -> bool:
    """Nested dicts/lists of tensors and plain values, equal bit for bit."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tensors(a[k], b[k]) for k in a)
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b))
    return a == b


def same_model(a: CheckpointState, b: CheckpointState) -> bool:
    """The trainer state of two checkpoints equal; a tiered store's rows compared by key."""
    ta, tb = a.tensors["trainer"], b.tensors["trainer"]
    sa, sb = ta.get("store", {}), tb.get("store", {})
    if sa.get("kind") != "tiered":
        return same_tensors(ta, tb)
    def placeless(t: dict) -> dict:
        return {**t, "store": {k: v for k, v in t["store"].items() if k not in _STORE_PLACE}}
    if not same_tensors(placeless(ta), placeless(tb)):
        return False
    keys_a, rows_a = _all_rows(sa, Config.from_dict(a.config))
    keys_b, rows_b = _all_rows(sb, Config.from_dict(b.config))
    return np.array_equal(keys_a, keys_b) and np.array_equal(rows_a, rows_b)


def _all_rows(store: dict, cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """Every (key, row) of a tiered checkpoint, in key order (small tables: a chaos run's)."""
    chunks = list(tiered_rows(store, cfg, 1 << 16))
    if not chunks:
        return np.zeros(0, np.uint64), np.zeros((0, 0), np.float32)
    return np.concatenate([k for k, _ in chunks]), np.concatenate([r for _, r in chunks])


def dead_letter_topic(topic: str, reference: bool = False) -> str:
    """Where the trainers of a chaos run on `topic` dead-letter: the fault-free reference
    has a topic of its own, so each topic holds one run's dead letters."""
    return f"{topic}.{'reference-' if reference else ''}dead-letter"


def dead_letters(bootstrap: str, topic: str, quiet_s: float = 10.0, timeout_s: float = 120.0,
                 reference: bool = False) -> Counter:
    """(partition, offset) of every record on `topic`'s dead-letter topic, counted.

    Read up to the end offsets the broker reports, then on until it hands over nothing
    for `quiet_s` (tansu may report an end behind its log): a slow fetch on a loaded
    machine must not end the read early and look like a dead letter lost.  A broker
    that never reaches its reported end within `timeout_s` is an error, not a verdict."""
    from kafka import KafkaConsumer, TopicPartition
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                             auto_offset_reset="earliest")
    out: Counter = Counter()
    try:
        dead = dead_letter_topic(topic, reference)
        tps = [TopicPartition(dead, p) for p in sorted(consumer.partitions_for_topic(dead) or set())]
        if not tps:
            return out
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        deadline, last_record = time.monotonic() + timeout_s, time.monotonic()
        while True:
            polled = consumer.poll(timeout_ms=500)
            for records in polled.values():
                for record in records:
                    value = json.loads(record.value)
                    out[(int(value["partition"]), int(value["offset"]))] += 1
            now = time.monotonic()
            if polled:
                last_record = now
            behind = [tp for tp in tps if consumer.position(tp) < ends[tp]]
            if not behind and now - last_record >= quiet_s:
                return out
            if now > deadline:
                raise RuntimeError(f"dead-letter topic {dead}: read up to "
                                   f"{ {tp.partition: consumer.position(tp) for tp in behind} } of the "
                                   f"reported ends { {tp.partition: ends[tp] for tp in behind} } in "
                                   f"{timeout_s:.0f} s; the broker did not hand the rest over")
    finally:
        consumer.close()


def readable_checkpoints(run_dir: Path) -> tuple[int, list[str]]:
    """(complete checkpoints found, the ones that do not load)."""
    bad, n = [], 0
    for ckpt in sorted((run_dir / "checkpoints").glob("ckpt-*")):
        if not (ckpt / "manifest.json").exists():
            continue                    # a delete interrupted by a kill: not a checkpoint
        n += 1
        try:
            load_checkpoint(ckpt)
        except (CheckpointError, OSError, RuntimeError, ValueError) as e:
            bad.append(f"{ckpt.name}: {e}")
    return n, bad


def positions_check(positions: dict[str, int], ends: dict[str, int]) -> Check:
    """The checkpoint's offsets (`positions`, as the checkpoint stores them) are the
    partition ends: what the contract promises, read as `KafkaPositions` whatever else
    the checkpoint keeps beside them (a partition the source released in a rebalance is
    marked given up: bookkeeping). A message trained in part (rows_done > 0) is not at
    its end."""
    typed = KafkaPositions.from_checkpoint(positions)
    trained = {name: p.offset if not p.rows_done else f"{p.offset} (rows_done={p.rows_done})"
               for name, p in typed.partitions.items()}
    given_up = sorted(typed.given_up)
    return Check("exactly once (positions)", trained == ends,
                 f"checkpoint offsets {trained}, partition ends {ends}"
                 + (f" (given up in a rebalance at some point: {given_up})" if given_up else ""))


def dead_letters_check(bad: dict[tuple[int, int], str], letters: Counter) -> Check:
    """Every malformed message (`bad`: (partition, offset) -> kind) on the dead-letter topic
    exactly once (`letters`: (partition, offset) -> times), and no good one."""
    missing = set(bad) - set(letters)
    foreign = set(letters) - set(bad)
    again = {key: n for key, n in letters.items() if n > 1}
    return Check("dead letters (exactly once)", not missing and not foreign and not again,
                 f"{len(bad)} malformed, {len(missing)} missing, {len(foreign)} good ones dead-lettered, "
                 f"{len(again)} dead-lettered more than once"
                 + (f" (missing (partition, offset): kind {dict(sorted((k, bad[k]) for k in missing)[:10])})"
                    if missing else "")
                 + (f" ((partition, offset): times {dict(sorted(again.items())[:10])})" if again else ""))


def verify_run(stream: KnownStream, bootstrap: str, group: str, run_dir: Path, reference_dir: Path,
               code: int, summary: dict, ref_code: int, ref_summary: dict) -> list[Check]:
    checks = [Check("reference run", ref_code == 0 and ref_summary.get("records_trained_total") == stream.good,
                    f"exit {ref_code}, {ref_summary.get('records_trained_total')} of {stream.good:,} records"),
              Check("last trainer", code == 0, f"exit {code}")]
    ends = {f"{stream.topic}/{p}": n for p, n in enumerate(stream.messages)}
    try:
        final, reference = load_checkpoint(run_dir), load_checkpoint(reference_dir)
    except (CheckpointError, OSError) as e:
        return checks + [Check("checkpoints", False, str(e))]
    checks.append(Check("exactly once (model counter)", final.records_trained == stream.good
                        and summary.get("records_trained_total") == stream.good,
                        f"checkpoint {final.records_trained:,}, summary {summary.get('records_trained_total')}, "
                        f"produced {stream.good:,}"))
    checks.append(positions_check(final.positions, ends))
    group_offsets = committed_offsets(bootstrap, group, stream.topic, stream.partitions)
    checks.append(Check("group offsets", group_offsets == ends, f"committed {group_offsets}"))
    checks.append(dead_letters_check(stream.bad, dead_letters(bootstrap, stream.topic)))
    same = same_model(final, reference)
    window = same_tensors(final.tensors["window"], reference.tensors["window"])
    checks.append(Check("model equals the fault-free run's", same and window and final.step == reference.step,
                        f"trainer tensors {'equal' if same else 'DIFFER'}, window {'equal' if window else 'DIFFERS'}, "
                        f"steps {final.step} / {reference.step}"))
    n, bad = readable_checkpoints(run_dir)
    checks.append(Check("no unreadable checkpoint", not bad, f"{n} checkpoints load" + (f"; {bad}" if bad else "")))
    return checks
