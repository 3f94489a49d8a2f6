"""`stream-ctr export` and `stream-ctr predict`: the bundle commands. Each returns
(JSON summary, one line) for the CLI to print, as the benches do.

It lives in cli/, above train and distributed (tests/import_graph.py): it reads
checkpoints, single-process or a distributed job's, with their loaders. The
serving/ folder it drives (bundles, `Scorer`, the server) imports neither.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from stream_ctr.cli.output import auc_text
from stream_ctr.config import (HEAP_KEEP_RULE, Config, ConfigError, check_line_range, heap_keep_bytes_ok,
                               parse_bytes)
from stream_ctr.connectors.errors import SourceError
# The parsers need only these: the scoring stack (torch) and the decoders (numba) load
# in the command that runs.
from stream_ctr.serving.options import HTTP_STACKS, NETWORKS, PRECISIONS, Limits
from stream_ctr.train.heap import keep_heap

EXPORT_EPILOG = """examples:
  stream-ctr export --out bundles/ctr-v1                 # the newest checkpoint of runs/latest
  stream-ctr export runs/20261125-130846-deepfm-criteo-sample/checkpoints/ckpt-00000120 --out b120"""

PREDICT_EPILOG = """examples:
  stream-ctr predict bundles/ctr-v1 --out probs.txt      # the run's held-out lines
  stream-ctr predict bundles/ctr-v1 criteo:day_1.gz --out day_1.npy --stop 1000000"""


def add_serving_parsers(sub: argparse._SubParsersAction, add_common) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("export", help="write a serving bundle (dense weights, sorted rows, manifest) "
                       "of a checkpoint", epilog=EXPORT_EPILOG, formatter_class=fmt,
                       description="Write a self-contained, versioned serving bundle of a run's "
                       "checkpoint: the dense weights as plain tensors (torch.load weights_only), "
                       "the embedding rows as sorted keys.npy + rows.npy (weights and linear "
                       "column; no Adam moments), and manifest.json (model config, record format, "
                       "the checkpoint's step and source positions, precision, checksums). A "
                       "tiered store's LMDB table is read in chunks, never whole.")
    p.add_argument("run_dir", nargs="?", default="runs/latest",
                   help="run directory, checkpoint root or checkpoint directory (default: runs/latest)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the bundle directory to write; must be new or empty")
    p.add_argument("--portable", action="store_true", help="also write BUNDLE/portable: the model for "
                   "servers without stream-ctr (spec.json, rows as .npy, the network as ONNX or "
                   "torch.export; docs/serving-portable.md)")
    p.add_argument("--portable-network", choices=NETWORKS, default="auto", help="with --portable: the "
                   "network's format (auto: onnx where the onnx packages are installed, else torch)")
    add_common(p)
    p.set_defaults(func=cmd_export)

    q = sub.add_parser("predict", help="score a file offline with a serving bundle",
                       epilog=PREDICT_EPILOG, formatter_class=fmt,
                       description="Score records of a file with a bundle (the scoring code a "
                       "predict server uses) and write one click probability per record: text, "
                       "one per line, or float32 .npy when FILE ends in .npy. The summary line "
                       "gives AUC and logloss (the files carry labels).")
    q.add_argument("bundle", help="bundle directory (stream-ctr export)")
    q.add_argument("source", nargs="?", help="criteo:PATH, avazu:PATH, a path, json:PATH / csv:PATH "
                   "(decoded with the bundle's schema), or criteo:sample / avazu:sample (default: "
                   "the bundle's run's own source, and then only its held-out lines)")
    q.add_argument("--out", required=True, metavar="FILE", help="where the probabilities go "
                   "(.npy: float32 array; else text, one per line)")
    q.add_argument("--all", action="store_true", help="score every record of the source, also "
                   "those the run trained on")
    q.add_argument("--start", type=int, default=None, help="first data-line offset to score "
                   "(default: where the run's held-out lines start; 0 with --all or another source)")
    q.add_argument("--stop", type=int, default=None, help="stop before this data-line offset "
                   "(default: the end of the source)")
    q.add_argument("--device", default="cpu", help="torch device to score on")
    q.add_argument("--precision", choices=PRECISIONS, default=None, help="the dense model's matmuls "
                   "(default: the bundle's, the precision its run trained and tested in)")
    q.add_argument("--chunk-records", type=int, default=65536, help="records decoded and scored at a time")
    q.add_argument("--heap-keep-bytes", default="1GiB", metavar="BYTES",
                   help="freed heap kept for the next chunk instead of being faulted in again, as "
                   "train.heap_keep_bytes (0: glibc's defaults; default 1GiB)")
    add_common(q)
    q.set_defaults(func=cmd_predict)

    s = sub.add_parser("serve", help="serve a bundle over HTTP: POST /predict, GET /healthz, /metrics",
                       epilog=SERVE_EPILOG, formatter_class=fmt,
                       description="An HTTP predict server for a bundle (127.0.0.1 by default). "
                       "POST /predict takes records in the bundle's format, newline-delimited or "
                       "as a JSON array, and answers {\"model_version\", \"probabilities\"}; a "
                       "request with a record that does not decode is answered 400, naming the "
                       "records and why. Concurrent requests are coalesced into one scoring call. "
                       "GET /healthz, GET /metrics (Prometheus).")
    s.add_argument("bundle", nargs="?", help="bundle directory (stream-ctr export), or a publish "
                   "directory (train --publish: its newest version); default with --follow: the "
                   "followed directory")
    s.add_argument("--port", type=int, required=True, help="TCP port (0: any free one)")
    s.add_argument("--follow", metavar="DIR|kafka://HOST:PORT/TOPIC", help="apply what `stream-ctr "
                   "train --publish` publishes there (full snapshots and deltas) while serving, "
                   "without pausing requests")
    s.add_argument("--follow-wait-s", type=float, default=120.0, metavar="SECONDS",
                   help="with --follow kafka://...: how long to wait for the topic's first version "
                   "(default 120)")
    s.add_argument("--follow-poll-s", type=float, default=0.5, metavar="SECONDS",
                   help="how often --follow looks for a new version (default 0.5)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--device", default="cpu", help="torch device to score on")
    s.add_argument("--precision", choices=PRECISIONS, default=None, help="default: the bundle's")
    s.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: "
                   "on 2 shared vCPUs more intra-op threads spin against the HTTP threads; once "
                   "7x slower at 256 records a request, else within noise (BENCHMARKS.md); raise "
                   "it where the server has cores to itself)")
    s.add_argument("--max-batch-records", type=int, default=4096,
                   help="records one scoring call may coalesce from waiting requests")
    s.add_argument("--max-wait-ms", type=float, default=0.0, help="how long the scoring thread "
                   "waits for more requests once it has one (default 0: only those already waiting)")
    s.add_argument("--no-coalesce", action="store_true", help="score each request alone")
    s.add_argument("--http", choices=HTTP_STACKS, default="stdlib", help="HTTP stack (aiohttp: "
                   "for comparison, needs aiohttp installed)")
    s.add_argument("--idle-timeout-s", type=float, default=Limits.idle_timeout_s, metavar="SECONDS",
                   help="close a connection that waits this long for its next request (default "
                   f"{Limits.idle_timeout_s:g})")
    s.add_argument("--request-timeout-s", type=float, default=Limits.request_timeout_s,
                   metavar="SECONDS", help="a request must arrive whole within this long of its first "
                   f"byte, else 408 and closed (default {Limits.request_timeout_s:g})")
    s.add_argument("--max-body-bytes", default=str(Limits.max_body_bytes), metavar="BYTES",
                   help="larger POST /predict bodies are refused with 413, e.g. 16MiB (default "
                   f"and most: the decoder's limit, {Limits.max_body_bytes >> 20}MiB)")
    s.add_argument("--max-connections", type=int, default=Limits.max_connections,
                   help="connections served at once; one more is answered 503 and closed (default "
                   f"{Limits.max_connections})")
    add_common(s)
    s.set_defaults(func=cmd_serve)


SERVE_EPILOG = """examples:
  stream-ctr serve bundles/ctr-v1 --port 8500
  stream-ctr serve --follow published/ --port 8500        # beside: stream-ctr train ... --publish published/
  stream-ctr serve --follow kafka://127.0.0.1:9092/ctr-model --port 8500   # ... --publish kafka://...
  curl -s --data-binary @lines.tsv 127.0.0.1:8500/predict      # Criteo TSV lines, label column ignored
  curl -s -H 'Content-Type: application/json' -d '["0\\t1\\t...", "..."]' 127.0.0.1:8500/predict"""


def cmd_serve(args: argparse.Namespace) -> int:
    import shutil
    import signal
    import sys
    import torch
    from stream_ctr.serving.bundle import read_bundle
    from stream_ctr.serving.follower import Follower, initial_bundle
    from stream_ctr.serving.kafka_publish import KafkaMirror, is_kafka_target
    from stream_ctr.serving.scorer import Scorer
    from stream_ctr.serving.server import Server
    limits = server_limits(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: a TCP port is 0-65535 (0: any free one)")
    if args.bundle is None and args.follow is None:
        raise ConfigError("name a bundle to serve (stream-ctr serve BUNDLE --port P), or a publish "
                          "directory to follow (--follow DIR)")
    if args.follow_poll_s <= 0:
        raise ConfigError(f"--follow-poll-s must be > 0, got {args.follow_poll_s}")
    mirror, follow_spec = None, args.follow
    if is_kafka_target(args.follow):    # the topic rebuilt as a local publish directory
        import tempfile
        import time
        mirror = KafkaMirror(args.follow, tempfile.mkdtemp(prefix="stream-ctr-follow-")).start()
        deadline = time.monotonic() + args.follow_wait_s
        # Up to the topic's end as it was at start, so the first model served is the newest
        # one (the topic holds every older version and index before it).
        while not (mirror.caught_up.is_set() and (mirror.root / "PUBLISHED.json").exists()) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        args.follow = str(mirror.root)
    source = args.bundle or args.follow
    if args.follow and not (Path(args.follow) / "PUBLISHED.json").exists() and args.bundle is None:
        if mirror is not None:
            mirror.close()
        raise ConfigError(f"--follow {follow_spec}: nothing is published there yet (no PUBLISHED.json); "
                          "start the trainer with --publish first, or name a bundle to serve meanwhile")
    scorer = Scorer(read_bundle(initial_bundle(source)), args.device, args.precision)
    server = Server(scorer, args.host, args.port, http=args.http, limits=limits,
                    coalesce=not args.no_coalesce, max_batch_records=args.max_batch_records,
                    max_wait_s=args.max_wait_ms / 1000)
    follower = None
    published = args.follow or (source if (Path(source) / "PUBLISHED.json").exists() else None)
    if published:
        follower = Follower(published, server.predictor, args.device, args.precision, args.follow_poll_s)
        follower.poll()                 # the newest version (the chain applied) before the first request
        if args.follow:
            follower.start()

    def close() -> None:
        if follower is not None and args.follow:
            follower.close()
        if mirror is not None:
            mirror.close()
            shutil.rmtree(mirror.root, ignore_errors=True)
        left = server.close()           # the requests already received are answered first
        if left:
            print(f"stream-ctr serve: stopped with {left} request(s) unanswered after "
                  f"--request-timeout-s {limits.request_timeout_s:g}", file=sys.stderr, flush=True)
    server.start()
    signal.signal(signal.SIGTERM, lambda *_: close())
    # One line a supervisor (or a test) can wait for: where it listens, which model answers.
    following = f"; following {follow_spec}" if follow_spec else ""
    print(f"serving {server.predictor.model().version} on http://{server.host}:{server.port} "
          f"(POST /predict, GET /healthz, GET /metrics; {args.http}{following})", flush=True, file=sys.stdout)
    try:
        server.wait()
    except KeyboardInterrupt:
        close()
    return 0


def server_limits(args: argparse.Namespace) -> Limits:
    """`serve`'s --idle-timeout-s, --request-timeout-s, --max-body-bytes, --max-connections."""
    try:
        max_body = parse_bytes(args.max_body_bytes)
    except ValueError as e:
        raise ConfigError(f"--max-body-bytes: {e}") from None
    try:
        return Limits(args.idle_timeout_s, args.request_timeout_s, max_body, args.max_connections)
    except ValueError as e:
        raise ConfigError(f"serve: {e}") from None


def cmd_export(args: argparse.Namespace) -> tuple[dict, str]:
    from stream_ctr.distributed.job_checkpoint import find_job, is_job, load_any
    from stream_ctr.serving.export import checkpoint_record, export_bundle
    from stream_ctr.serving.portable_export import check_portable, write_portable
    from stream_ctr.train.checkpoint import resolve_checkpoint
    from stream_ctr.train.streaming import source_format
    state = load_any(args.run_dir)
    where = find_job(args.run_dir) if is_job(args.run_dir) else resolve_checkpoint(args.run_dir)
    cfg = Config.from_dict(state.config, origin=f"{args.run_dir} (checkpoint config)")
    # What the run trained and tested in: recorded in its checkpoints; resolved the way the
    # trainer resolves train.precision for older checkpoints that lack it.
    precision = state.extra.get("precision") or _resolved_precision(cfg)
    checkpoint = checkpoint_record(where, state.step, state.records_trained, state.extra.get("epoch", 0),
                                   state.positions)
    if args.portable:                   # refused before anything is written
        check_portable({"record_format": {"schema": cfg.data.schema}}, args.portable_network)
    manifest = export_bundle(state.tensors, state.config, args.out, source_format(cfg), checkpoint,
                             precision, held_out_lines(cfg))
    rows = manifest["rows"]["count"]
    summary = {"bundle": str(args.out), "checkpoint": checkpoint["path"], "step": state.step,
               "rows": rows, "precision": precision, "files": manifest["files"]}
    portable = ""
    if args.portable:
        spec = write_portable(args.out, network=args.portable_network)
        net = spec["network"]["onnx"] or spec["network"]["torch_export"]
        summary["portable"] = {"dir": str(Path(args.out) / "portable"), "network": net}
        portable = f", and its portable export ({net}) to {Path(args.out) / 'portable'}"
    return (summary, f"exported {Path(where).name} (step {state.step:,}, {state.records_trained:,} records "
                     f"trained) with {rows:,} embedding rows to {args.out}{portable}")


def _resolved_precision(cfg: Config) -> str:
    from stream_ctr.models.scoring import resolve_precision
    from stream_ctr.train.trainer import resolve_device
    try:
        return resolve_precision(cfg.train.precision, resolve_device(cfg.train.device))
    except ConfigError:             # trained on a GPU this machine lacks: bf16 unless fp32 was asked
        return "fp32" if cfg.train.precision == "fp32" else "bf16"


def held_out_lines(cfg: Config) -> dict | None:
    """The run's held-out lines ({"source", "start", "stop"}) if it held some out of a
    file that is still there; else None."""
    from stream_ctr.connectors.files import count_records, detect_format
    from stream_ctr.train.inputs import held_out_start
    if cfg.data.holdout_fraction <= 0 or "://" in cfg.data.source:
        return None
    try:
        fmt, path = detect_format(cfg.data.source, cfg.data.schema)
        n = count_records(path, fmt)
    except SourceError:             # the run's file is gone or moved
        return None
    return {"source": cfg.data.source, "path": str(path.resolve()),
            "start": held_out_start(n, cfg.data.holdout_fraction), "stop": n}


def _lines(args: argparse.Namespace, run: dict, path: Path) -> tuple[int, int | None, str]:
    """(start, stop, which rows) to score, as `stream-ctr eval` picks them."""
    held = run.get("held_out")
    check_line_range(args.start, args.stop)
    if args.start is not None or args.stop is not None:
        return args.start or 0, args.stop, "the given range"
    if args.all or held is None or Path(held["path"]) != path.resolve():
        return 0, None, "all records"
    return held["start"], held["stop"], f"the run's held-out last {run['holdout_fraction']:g}"


def cmd_predict(args: argparse.Namespace) -> tuple[dict, str]:
    from stream_ctr.connectors.files import detect_format
    from stream_ctr.connectors.schema import parse_schema
    from stream_ctr.serving.bundle import read_bundle
    from stream_ctr.serving.scorer import Scorer, score_file
    from stream_ctr.train.evaluation import accuracy
    if args.chunk_records < 1:
        raise ConfigError(f"--chunk-records {args.chunk_records}: records scored at a time must be >= 1")
    try:
        keep_bytes = parse_bytes(args.heap_keep_bytes)
    except ValueError as e:
        raise ConfigError(f"--heap-keep-bytes: {e}") from None
    if not heap_keep_bytes_ok(keep_bytes):
        raise ConfigError(f"--heap-keep-bytes {args.heap_keep_bytes}: must be {HEAP_KEEP_RULE}")
    # Each chunk allocates and frees the same large blocks: 1.47M -> 0.25M page faults and
    # 6.6 -> 5.7 s for 500K Criteo rows on the 2-vCPU EPYC.
    keep_heap(keep_bytes)
    bundle = read_bundle(args.bundle)
    scorer = Scorer(bundle, args.device, args.precision)
    run = bundle.manifest["run"]
    source = args.source or run["source"]
    if "://" in source:
        schema = bundle.manifest["record_format"].get("schema", "")
        prefix = parse_schema(schema).encoding if schema else bundle.manifest["record_format"]["name"]
        raise ConfigError(f"the bundle's run trained on a stream ({source}); name a file to score: "
                          f"stream-ctr predict BUNDLE {prefix}:PATH --out FILE")
    fmt, path = detect_format(source, bundle.manifest["record_format"].get("schema", ""))
    if fmt.name != bundle.manifest["record_format"]["name"]:
        raise ConfigError(f"the bundle's model takes {bundle.manifest['record_format']['name']} records, "
                          f"{source} holds {fmt.name}")
    start, stop, rows = _lines(args, run, path)
    out = Path(args.out)
    if not out.parent.is_dir():          # before scoring, not after it
        raise ConfigError(f"--out {out}: the directory {out.parent} does not exist")
    offsets: list[np.ndarray] = []
    probs, labels, rejected = score_file(scorer, path, fmt, start, stop, args.chunk_records, offsets)
    if rejected and not len(probs):
        raise SourceError(f"none of the {rejected:,} records of {source} (lines {start:,}-) decoded "
                          f"under the bundle's {fmt.name or 'schema'} layout: is it the layout the run "
                          "trained on? Nothing was written")
    end = start + len(probs) + rejected             # the lines read: up to stop, or the end
    # One value per line read, NaN where the line did not decode: the output lines up
    # with the input (row i of the output is data line start + i).
    at = np.concatenate(offsets) - start if offsets else np.zeros(0, np.int64)
    per_line = np.full(max(end - start, int(at.max()) + 1 if len(at) else 0), np.nan, np.float32)
    per_line[at] = probs
    if out.suffix == ".npy":
        np.save(out, per_line)
    else:
        np.savetxt(out, per_line, fmt="%.9g")       # 9 digits: the exact float32; nan for a reject
    acc = accuracy(probs, labels).as_dict() if len(probs) else {}
    summary = {"bundle": str(bundle.path), "model_version": scorer.version, "source": source,
               "start": start, "stop": end, "rows": rows, "records": int(len(probs)),
               "rejected": rejected, "precision": scorer.precision, "out": str(out), **acc}
    metrics = f"{auc_text(acc, 6)} logloss {acc['logloss']:.6f} on " if acc else ""
    return (summary, f"{metrics}{len(probs):,} records ({rejected:,} rejected): {rows}, lines "
                     f"{start:,}-{end:,} of {source}; model {scorer.version}; probabilities in {out}, "
                     f"one per line read{' (nan: did not decode)' if rejected else ''}")
