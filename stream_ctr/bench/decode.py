"""`stream-ctr bench decode`: records/s of one decoding thread, per layout and decoder.

Rows: Criteo TSV and Avazu CSV through their hand-written fast decoders and
through the general schema decoder with their built-in schemas, and the
synthetic JSON ad log (`connectors/synth_json.py`, 16 leaves a record, 14
decoded) through its schema.
The data is generated in memory (Criteo, JSON) or repeated from the bundled
sample (Avazu) and decoded in chunks of `--chunk` records on this thread, best
of `--repeats`: one core's rate, by the thread's CPU time (the compiled
decoders are single-threaded too; the wall-clock rate is shown beside it, which
on a shared machine also counts others' use of the core).  Reading and
decompressing the file are not included.  The JSON log is decoded with the
compiled scan (the default) and, for reference, with a per-line parser alone.
"""
from __future__ import annotations

import argparse
import gzip
import tempfile
import time
from pathlib import Path
from typing import Callable

DEFAULT_RECORDS = 200_000


def add_bench_decode_parser(bsub: argparse._SubParsersAction, add_common) -> None:
    b = bsub.add_parser("decode", help="decoder throughput: Criteo, Avazu, a JSON log (records/s, one core)",
                        description=__doc__.split("\n\n")[0])
    b.add_argument("--records", type=int, default=DEFAULT_RECORDS,
                   help=f"records per layout (default {DEFAULT_RECORDS:,})")
    b.add_argument("--chunk", type=int, default=65536, help="records decoded per call (default 65536)")
    b.add_argument("--repeats", type=int, default=3, help="timed passes; the best is reported (default 3)")
    add_common(b)
    b.set_defaults(func=cmd_bench_decode)


def cmd_bench_decode(args: argparse.Namespace) -> tuple[dict, str]:
    from stream_ctr.config import ConfigError
    if args.records < 1 or args.chunk < 1 or args.repeats < 1:
        raise ConfigError("bench decode: --records, --chunk and --repeats must be >= 1")
    rows = bench_decode(args.records, args.chunk, args.repeats)
    if not args.json:
        print(format_decode_table(rows))
    best = max((r for r in rows if r["layout"] == "json ad log"), key=lambda r: r["records_per_s"])
    return ({"bench": "decode", "machine": _machine(), "rows": rows},
            f"bench decode: JSON ad log {best['records_per_s']:,.0f} records/s on one core ({best['decoder']})")


def bench_decode(n_records: int, chunk: int, repeats: int) -> list[dict]:
    from stream_ctr.connectors import schema_decode
    from stream_ctr.connectors.decode import _JIT, decode_lines
    from stream_ctr.connectors.files import SAMPLE_PATHS
    from stream_ctr.connectors.formats import AVAZU, CRITEO
    from stream_ctr.connectors.schema import parse_schema
    from stream_ctr.connectors.schema_builtin import AVAZU_SCHEMA, CRITEO_SCHEMA
    from stream_ctr.connectors.synth import write_synthetic_criteo
    from stream_ctr.connectors.synth_json import AD_LOG_SCHEMA, write_synthetic_json
    with tempfile.TemporaryDirectory(prefix="stream_ctr_bench_decode_") as tmp:
        write_synthetic_criteo(Path(tmp) / "c.tsv", n_records, write_probs=False)
        write_synthetic_json(Path(tmp) / "j.jsonl", n_records, write_probs=False)
        criteo = (Path(tmp) / "c.tsv").read_bytes().splitlines(keepends=True)
        ad_log = (Path(tmp) / "j.jsonl").read_bytes().splitlines(keepends=True)
    sample = gzip.decompress(SAMPLE_PATHS["avazu"].read_bytes()).splitlines(keepends=True)[1:]
    avazu = (sample * (n_records // len(sample) + 1))[:n_records]
    fast = "compiled (numba)" if _JIT is not None else "numpy"
    ad_schema = parse_schema(AD_LOG_SCHEMA)
    parser = schema_decode.JSON_PARSER
    cases: list[tuple[str, str, list[bytes], Callable[[bytes], object]]] = [
        ("criteo", f"fast path, {fast}", criteo, lambda d: decode_lines(d, CRITEO, "p", 0)),
        ("criteo", "schema (built-in)", criteo, lambda d: schema_decode.decode_records(d, CRITEO_SCHEMA, "p", 0)),
        ("avazu", f"fast path, {fast}", avazu, lambda d: decode_lines(d, AVAZU, "p", 0)),
        ("avazu", "schema (built-in)", avazu, lambda d: schema_decode.decode_records(d, AVAZU_SCHEMA, "p", 0)),
        ("json ad log", "schema, compiled scan", ad_log, lambda d: schema_decode.decode_records(d, ad_schema, "p", 0)),
    ]
    rows = [_measure(layout, decoder, lines, decode, chunk, repeats)
            for layout, decoder, lines, decode in cases]
    for name in dict.fromkeys([parser, "json"]):          # the per-line parsers, without the scan
        with schema_decode.json_parser(name):
            rows.append(_measure("json ad log", f"schema, {'stdlib json' if name == 'json' else name} per line",
                                 ad_log, lambda d: schema_decode.decode_records(d, ad_schema, "p", 0),
                                 chunk, repeats))
    return rows


def _measure(layout: str, decoder: str, lines: list[bytes], decode: Callable[[bytes], object],
             chunk: int, repeats: int) -> dict:
    chunks = [b"".join(lines[i:i + chunk]) for i in range(0, len(lines), chunk)]
    decode(chunks[0])                                      # compile / warm up
    best = best_wall = float("inf")
    for _ in range(repeats):
        t0, wall0 = time.thread_time(), time.perf_counter()
        for data in chunks:
            decode(data)
        best = min(best, time.thread_time() - t0)
        best_wall = min(best_wall, time.perf_counter() - wall0)
    best = max(best, 1e-9)
    n_bytes = sum(map(len, chunks))
    # Per core: the decoding thread's CPU time (on a shared machine the wall clock also counts
    # the time other processes held the core); the wall-clock rate is reported beside it.
    return {"layout": layout, "decoder": decoder, "records": len(lines),
            "bytes_per_record": round(n_bytes / max(len(lines), 1)), "cpu_seconds": round(best, 4),
            "records_per_s": len(lines) / best, "mb_per_s": n_bytes / best / 1e6,
            "wall_records_per_s": len(lines) / max(best_wall, 1e-9)}


def format_decode_table(rows: list[dict]) -> str:
    head = (f"{'layout':<12} {'decoder':<30} {'records':>9} {'B/rec':>6} {'records/s':>12} {'MB/s':>7} "
            f"{'wall rec/s':>12}")
    lines = [f"bench decode (one thread; records/s per core of CPU time) on {_machine()}", head,
             "-" * len(head)]
    lines += [f"{r['layout']:<12} {r['decoder']:<30} {r['records']:>9,} {r['bytes_per_record']:>6} "
              f"{r['records_per_s']:>12,.0f} {r['mb_per_s']:>7.1f} {r['wall_records_per_s']:>12,.0f}"
              for r in rows]
    return "\n".join(lines)


def _machine() -> str:
    from stream_ctr.bench.ingest import _machine as machine
    return machine()

