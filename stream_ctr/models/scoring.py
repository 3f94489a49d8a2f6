"""Scoring a model on decoded records: precision, the forward, a file's scores.

The one path from decoded rows to click probabilities that training's held-out
scoring, `stream-ctr eval`, `predict` and `serve` share; the trainer's step runs
the same `logits`. What differs between them is only where a key's row comes
from (the live store, or a bundle's table), so that is the caller's `rows`.

Mixed precision: bf16 keeps fp32's exponent range, so it needs no loss scaling.
Only the model's forward runs under `torch.autocast`, which casts matmul-like ops
(the DNN's and cross nets' Linear layers) to bf16 and leaves element-wise work in
its input dtype: the FM term and the linear logit, on fp32 embedding rows, stay
fp32. The master weights, embedding rows, Adam moments, CowClip and the loss are
fp32.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from stream_ctr.connectors.batch import Batch
from stream_ctr.connectors.dead_letter import rejection_note
from stream_ctr.connectors.errors import SourceError
from stream_ctr.connectors.files import FileSource
from stream_ctr.models.field_inputs import FieldRows, batch_keys, field_inputs
from stream_ctr.ops.unique import unique_keys

PRECISIONS = ("auto", "fp32", "bf16")       # train.precision; a model runs in one of the last two


def cpu_runs_bf16_fast() -> bool:
    """True where the CPU has bf16 dot-product instructions (AMX-BF16 or AVX512-BF16):
    there a bf16 matmul beats fp32 (measured: DeepFM's MLP 2.6x on AVX512-BF16);
    elsewhere oneDNN emulates bf16 and it is slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_precision(name: str, device: torch.device) -> str:
    """`auto` -> bf16 where the hardware runs it fast (a CUDA GPU of compute capability
    8.0+ or a CPU with AMX/AVX512-BF16), fp32 elsewhere; "fp32"/"bf16" as asked."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bf16" if torch.cuda.get_device_capability(device) >= (8, 0) else "fp32"
    return "bf16" if cpu_runs_bf16_fast() else "fp32"


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context the model's forward runs in for `precision` ("fp32": none)."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def host_to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`. To a GPU through pinned memory: a pageable copy blocks
    the host and runs at a fraction of the bus (6.8 ms of a 22 ms step at batch 131,072
    on an H200); from pinned memory it runs beside the kernels. torch's caching host
    allocator reuses the pinned blocks, and holds each until its copy has finished, so
    `a` may be reused at once. On the CPU the tensor is `a`'s memory (no copy)."""
    t = torch.from_numpy(a)
    if device.type != "cuda":
        return t.to(device)
    if not t.is_pinned():           # (a decoding thread may have pinned it: `pinned`)
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def pinned(batch: Batch) -> Batch:
    """`batch` with its labels, dense features, keys and weights copied into pinned host
    memory, for `host_to_device` to copy to a GPU without a copy of its own. A decoding
    thread calls it (`ReadAhead`'s `finish`), so the training thread's share of moving a
    batch to the GPU is launching the copies; slices of the batch stay pinned. The
    memory is torch's caching host allocator's, reused once the arrays are dropped."""
    def pin(a: np.ndarray | None) -> np.ndarray | None:
        if a is None:
            return None
        out = torch.empty(a.shape, dtype=torch.from_numpy(a[:0]).dtype, pin_memory=True).numpy()
        np.copyto(out, a)
        return out
    return dataclasses.replace(batch, labels=pin(batch.labels), dense=pin(batch.dense),
                               keys=pin(batch.keys), weight=pin(batch.weight))


def working_set(batch: Batch, field_rows: FieldRows | None,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's sorted unique keys (fixed fields, then every multi-hot value), each
    key's index into them, and in-batch counts."""
    return unique_keys(host_to_device(batch_keys(batch, field_rows), device))


def logits(model: torch.nn.Module, rows: torch.Tensor, inverse: torch.Tensor, batch: Batch,
           dense: torch.Tensor, dim: int, field_rows: FieldRows | None, precision: str,
           device: torch.device, n_inputs: int | None = None) -> torch.Tensor:
    """fp32 logits [B] from the unique rows [U, dim + 1] of a batch's keys and each key's
    index into them (`working_set`): the model sees [B, F + M] fields, the M multi-hot
    ones pooled, its forward under `precision`. ValueError when the batch gives other
    than the `n_inputs` fields the model takes."""
    emb, lin = field_inputs(rows, inverse, batch, dim, field_rows)
    if n_inputs is not None and emb.shape[1] != n_inputs:
        raise ValueError(f"batch has {batch.n_fields} key and {batch.n_multi} multi-hot fields, "
                         f"the model takes {n_inputs} fields")
    with autocast(precision, device):
        out = model(emb, lin, dense)
    return out.float()


@torch.no_grad()
def probabilities(model: torch.nn.Module, rows_of: Callable[[torch.Tensor], torch.Tensor], batch: Batch,
                  dim: int, field_rows: FieldRows | None, precision: str,
                  device: torch.device, n_inputs: int | None = None) -> np.ndarray:
    """Click probabilities float32 [B] of a decoded batch, `model` in eval mode;
    `rows_of(unique keys)` gives their rows (an absent key: its initial row)."""
    uniq, inverse, _ = working_set(batch, field_rows, device)
    dense = host_to_device(batch.dense, device)
    was_training = model.training
    model.eval()
    try:
        out = logits(model, rows_of(uniq), inverse, batch, dense, dim, field_rows, precision, device, n_inputs)
    finally:
        model.train(was_training)
    return torch.sigmoid(out).cpu().numpy()


def score_file(score: Callable[[Batch], np.ndarray], path: str | Path, fmt, start: int = 0,
               stop: int | None = None, chunk_records: int = 65536,
               rejected: Counter[str] | None = None,
               offsets: list[np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(probabilities, labels) of data lines [start, stop) of a file, `score` applied a
    chunk at a time. Lines that do not decode are skipped, as training skips them;
    `rejected` (if given) counts them by reason; `offsets` (if given) receives the data
    line of each probability, a chunk's array at a time."""
    probs, labels = [], []
    rejected = Counter() if rejected is None else rejected
    with FileSource(path, fmt, start_offset=start, chunk_records=chunk_records, stop_offset=stop) as src:
        while not src.exhausted:
            chunk, bad = src.read()
            rejected.update(r.reason for r in bad)
            if len(chunk):
                probs.append(score(chunk))
                labels.append(chunk.labels)
                if offsets is not None:
                    offsets.append(np.asarray(chunk.offset, np.int64))
    if not probs:
        return np.zeros(0, np.float32), np.zeros(0, np.float32)
    return np.concatenate(probs), np.concatenate(labels)


def no_records_error(path: str | Path, start: int, rejected: Counter[str]) -> SourceError:
    """What `eval` says when nothing from `start` on decoded."""
    why = ""
    if rejected:
        why = (f": all {sum(rejected.values()):,} records there were rejected ({rejection_note(rejected)}); "
               "is it the layout and schema the run trained on?")
    return SourceError(f"no records to evaluate in {path} from offset {start}{why}")
