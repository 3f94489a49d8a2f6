"""`stream-ctr schema infer SOURCE` (a schema guessed from a sample, as commented TOML), and
reading the --schema FILE of train, eval and replay."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stream_ctr.config import ConfigError, read_schema_file  # noqa: F401  (the CLI reads --schema with it)

INFER_EPILOG = """examples:
  stream-ctr schema infer json:clicks.jsonl --label clicked > schema.toml
  stream-ctr train json:clicks.jsonl --schema schema.toml --holdout-fraction 0.1
  stream-ctr schema infer csv:impressions.csv.gz --records 50000 --out schema.toml"""


def add_schema_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("schema", help="declared schemas of your own logs: infer one from a sample")
    ssub = p.add_subparsers(dest="schema_command", required=True, metavar="COMMAND")
    i = ssub.add_parser("infer", help="print a schema (TOML) guessed from the first records of a file",
                        description="Read a sample of SOURCE and print a schema for it, one comment per "
                                    "field explaining the guess. It trains as it is (--schema FILE); "
                                    "edit it to change what a field becomes.",
                        epilog=INFER_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    i.add_argument("source", help="json:PATH (one JSON object per line) or csv:PATH (first line: the "
                   "column names), plain or gzip; or kafka://HOST:PORT/TOPIC (JSON message values, read "
                   "from the earliest offsets without a consumer group)")
    i.add_argument("--records", type=int, default=10_000, metavar="N",
                   help="records to sample from the start of the file (default 10,000)")
    i.add_argument("--label", metavar="FIELD", help="the label's field (JSON: its dotted path); "
                   "default: a field of booleans or 0/1 values")
    i.add_argument("--out", metavar="FILE", help="write the schema here instead of stdout")
    i.add_argument("--quiet", action="store_true", help="no summary line on stderr")
    i.set_defaults(func=cmd_schema_infer)


def cmd_schema_infer(args: argparse.Namespace) -> int:
    from stream_ctr.connectors.schema import SchemaError
    from stream_ctr.connectors.schema_infer import format_inferred, infer_from_lines, infer_schema
    if args.records < 1:
        raise ConfigError(f"--records must be >= 1, got {args.records}")
    try:
        if args.source.lower().startswith("kafka://"):
            from stream_ctr.connectors.kafka.options import parse_kafka_url
            from stream_ctr.connectors.kafka.sample import sample_records
            records = sample_records(parse_kafka_url(args.source), args.records)
            if not records:
                raise ConfigError(f"schema infer: no records arrived from {args.source}")
            schema, comments = infer_from_lines(records, "json", args.records, args.label, args.source)
        else:
            encoding, path = _source(args.source)
            schema, comments = infer_schema(path, encoding, args.records, args.label)
    except SchemaError as exc:
        raise ConfigError(str(exc)) from None
    text = format_inferred(schema, comments, args.source, args.records)
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    if not args.quiet:
        print(f"stream-ctr: {schema.n_keys} key columns, {schema.n_dense} dense, label "
              f"{schema.label.name!r}, event time "
              f"{schema.event_time.name if schema.event_time else 'none'}"
              + (f"; written to {args.out}" if args.out else ""), file=sys.stderr)
    return 0


def _source(spec: str) -> tuple[str, Path]:
    prefix, colon, rest = spec.partition(":")
    builtin = prefix.lower() if colon else next(
        (name for name in ("criteo", "avazu") if name in Path(spec).name.lower()), None)
    if builtin in ("criteo", "avazu"):
        raise ConfigError(f"schema infer: {spec!r} is a {builtin} file, whose layout is built in: "
                          f"train it as {builtin}:PATH, without a schema")
    if colon and prefix.lower() in ("json", "csv"):
        encoding, path = prefix.lower(), Path(rest).expanduser()
    else:
        path = Path(spec).expanduser()
        name = path.name.lower().removesuffix(".gz")
        if name.endswith((".json", ".jsonl", ".ndjson")):
            encoding = "json"
        elif name.endswith((".csv", ".tsv", ".txt")):
            encoding = "csv"
        else:
            raise ConfigError(f"schema infer: cannot tell the encoding of {spec!r}; write json:{spec} "
                              f"or csv:{spec}")
    if not path.is_file():
        raise ConfigError(f"schema infer: no such file: {path}")
    return encoding, path
