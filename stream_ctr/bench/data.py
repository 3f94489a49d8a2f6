"""The rows a throughput bench trains on: a source spec, decoded into micro-batches up front."""
from __future__ import annotations

from stream_ctr.connectors.batch import Batch
from stream_ctr.connectors.files import FileSource, detect_format
from stream_ctr.train.batcher import MicroBatcher


def bench_source(data: str) -> str:
    """`--data`'s source spec: as given when it names its format (criteo:, avazu:, json:,
    csv:), else a Criteo file (what `stream-ctr synth` writes)."""
    return data if data.split(":", 1)[0] in ("criteo", "avazu", "json", "csv") else f"criteo:{data}"


def decoded_batches(source: str, schema: str, batch_size: int) -> list[Batch]:
    """Every full batch of `source` (a last partial batch is dropped: each bench times
    whole batches of the size it names)."""
    fmt, p = detect_format(source, schema)
    batcher, out = MicroBatcher(batch_size), []
    with FileSource(p, fmt, chunk_records=max(65536, batch_size)) as src:
        while not src.exhausted:
            out.extend(batcher.add(src.read()[0]))
    return out
