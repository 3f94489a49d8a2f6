"""`stream-ctr bench scaling`: does a larger batch learn as well as a small one, on your data?

For every (rule, batch, seed) the same records train a fresh model and the
held-out tail (the last `holdout_fraction` of the file) is scored; the table
gives test AUC (mean and range over seeds), its gap to the smallest batch of
the same rule, steps, samples/s, the share of present embedding rows CowClip
clipped, and calibration. A PNG plots AUC against batch, one line per rule.

Two protocols:
  * single pass (`--epochs 1`, the default): the streaming case, every record
    seen once, so a batch s times larger takes s times fewer steps;
  * N epochs over the same records (`--epochs N`): the paper's protocol.

Rules (s = batch / --base-batch; the configured optimizer values are those of
the base batch):
  none     every value as configured, at every batch;
  sqrt     both learning rates x sqrt(s); L2 and CowClip as configured;
  linear   both learning rates x s;
  cowclip  the product's rule (`stream-ctr train --scale-from BASE`, docs/large-batches.md),
           with whatever optim.* options the base config sets (e.g. the per-row
           count rule); the three baselines always use one embedding lr for every row.

When the source has the true click probability of every row beside it (a
`stream-ctr synth` sidecar), the Bayes AUC of the held-out rows is printed
and every cell's gap to it. Results are appended to OUT/results.jsonl as each
run ends; a study started again with the same OUT skips the cells it has.

Matrix mode (`--synth SPECS` instead of SOURCE): how much a batch loses on
streams with and without interactions, and how that changes with the rows.
A spec is `interaction` (the default synthetic teacher) or `additive` (no
interactions), optionally followed by `:key=value` overrides of the teacher
(seed, zipf, vocab, fields, interaction, dim, nonlinear; see `stream-ctr synth
--help`), e.g. `interaction:seed=1:zipf=1.2`. For every spec and every size in
`--rows` the stream is written once to OUT/data/<stream>-<rows>.tsv (with its
true-probability sidecar; reused by later runs), the study above runs in
OUT/<stream>-<rows>/, and OUT/matrix.txt and OUT/matrix.json gather every
(stream, rows, rule, batch) cell, with, per stream and rule, the AUC against
the smallest batch as rows x batch.

  stream-ctr bench scaling --synth interaction,additive --rows 2000000,8000000 \\
      --batches 1024,8192,32768,131072 --seeds 3 --rules cowclip --out runs/matrix
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from stream_ctr.config import Config, validate

if TYPE_CHECKING:
    from stream_ctr.connectors.synth import Teacher

RULES = ("none", "sqrt", "linear", "cowclip")
STREAM_NAMES = ("interaction", "additive")
# The short keys of a --synth spec and the Teacher fields they set.
SPEC_KEYS = {"seed": "seed", "zipf": "zipf_exponent", "vocab": "vocab_per_field", "fields": "fields",
             "interaction": "interaction", "dim": "interaction_dim", "nonlinear": "nonlinear"}
DEFAULT_MATRIX_ROWS = (2_000_000, 8_000_000)


def add_bench_scaling_parser(bsub: argparse._SubParsersAction, add_common) -> None:
    b = bsub.add_parser("scaling", help="test AUC per batch size and scaling rule (table + PNG)",
                        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("source", nargs="?", help="criteo:PATH, avazu:PATH, json:PATH / csv:PATH with --schema, "
                   "or a path (e.g. from `stream-ctr synth`); or --synth instead")
    b.add_argument("--synth", metavar="SPECS", help="instead of SOURCE: a matrix over synthetic streams, "
                   "comma-separated specs `interaction` or `additive`, each optionally followed by "
                   ":key=value teacher overrides (seed, zipf, vocab, fields, interaction, dim, nonlinear)")
    b.add_argument("--rows", metavar="N,...", help="with --synth: the stream sizes, comma-separated "
                   f"(default {','.join(str(r) for r in DEFAULT_MATRIX_ROWS)})")
    b.add_argument("--schema", metavar="FILE", help="the declared schema of a json:/csv: source "
                   "(or a [schema] table in --config)")
    b.add_argument("--batches", default="1024,8192,32768,131072", help="batch sizes, comma-separated")
    b.add_argument("--rules", default="none,cowclip", help=f"comma-separated, of {', '.join(RULES)}")
    b.add_argument("--seeds", type=int, default=3, help="seeds per cell (default 3)")
    b.add_argument("--epochs", type=int, default=1, help="1 = single pass (default); N = the paper's protocol")
    b.add_argument("--base-batch", type=int, default=1024, help="the batch the configured lr/L2 are for")
    b.add_argument("--holdout-fraction", type=float, default=0.1, help="held-out tail (default 0.1)")
    b.add_argument("--limit", type=int, default=0, help="train on at most N records (0: all before the tail)")
    b.add_argument("--out", default="runs/scaling", help="results.jsonl, table.txt, auc_vs_batch.png")
    b.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    b.add_argument("--config", help="base TOML config (the optimizer values of --base-batch; default: the built-in defaults)")
    b.add_argument("--set", action="append", default=[], metavar="SECTION.NAME=VALUE",
                   help="override a base config option (repeatable)")
    add_common(b)
    b.set_defaults(func=cmd_bench_scaling)


def cmd_bench_scaling(args: argparse.Namespace) -> tuple[dict, str]:
    """The bench command: prints the table; returns (JSON summary, one line) for the CLI to emit."""
    from stream_ctr.config import ConfigError, load_config
    if (args.source is None) == (args.synth is None):
        raise ConfigError("bench scaling: give either a SOURCE (one study) or --synth SPECS (a matrix of "
                          "synthetic streams), not both and not neither")
    if args.synth is None and args.rows is not None:
        raise ConfigError("bench scaling: --rows sizes the --synth streams; to train on fewer records "
                          "of a SOURCE use --limit")
    if args.synth is not None and args.schema:
        raise ConfigError("bench scaling: --schema is for a json:/csv: SOURCE; --synth streams are "
                          "Criteo TSV and need none")
    base = load_config(args.config, args.set)
    if args.schema:
        from stream_ctr.config import read_schema_file
        base.data.schema = read_schema_file(args.schema)
    if args.source is not None:
        base.data.source = args.source
    base.data.epochs = args.epochs
    base.data.holdout_fraction = args.holdout_fraction
    base.data.limit_records = args.limit
    base.train.threads = args.threads
    base.metrics.timeseries_every_s = 0.0
    batches = _int_list("--batches", args.batches)
    rules = [r for r in args.rules.split(",") if r]
    if not batches or min(batches) < 1 or args.seeds < 1 or args.base_batch < 1:
        raise ConfigError("bench scaling: --batches, --seeds and --base-batch must be >= 1")
    unknown = [r for r in rules if r not in RULES]
    if unknown or not rules:
        raise ConfigError(f"bench scaling: unknown rule(s) {unknown} (known: {', '.join(RULES)})")
    if args.synth is not None:
        return _cmd_matrix(args, base, sorted(batches), rules)
    summary = study(base, sorted(batches), rules, args.seeds, args.base_batch,
                    Path(args.out), show_progress=not args.quiet)
    if not args.json:
        print(format_scaling_table(summary))
    return ({"bench": "scaling", **{k: v for k, v in summary.items() if k != "rows"}},
            f"bench scaling: {len(summary['rows'])} runs; table {Path(args.out) / 'table.txt'}, "
            f"plot {summary['png']}")


def rule_config(base: Config, rule: str, batch_size: int, base_batch: int) -> Config:
    """The config that trains `batch_size` under `rule`, from the base batch's values."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r} (known: {', '.join(RULES)})")
    cfg = Config.from_dict(base.to_dict())
    cfg.data.batch_size = batch_size
    s = batch_size / base_batch
    if rule == "sqrt":
        cfg.optim.lr_dense *= math.sqrt(s)
        cfg.optim.lr_embed *= math.sqrt(s)
    elif rule == "linear":
        cfg.optim.lr_dense *= s
        cfg.optim.lr_embed *= s
    elif rule == "cowclip":
        cfg.optim.scale_from_batch = base_batch
    if rule != "cowclip":             # the baselines use no part of the product's rule
        cfg.optim.scale_from_batch = 0
        cfg.optim.embed_lr_rule = "constant"
    return validate(cfg)


def run_cell(base: Config, rule: str, batch_size: int, base_batch: int, seed: int,
             work_dir: Path) -> dict:
    from stream_ctr.train.loop import train      # torch: imported when a study runs, not at parse
    cfg = rule_config(base, rule, batch_size, base_batch)
    cfg.train.seed = seed
    cfg.train.run_dir = str(work_dir / f"{rule}-{batch_size}-{seed}")
    t0 = time.perf_counter()
    s = train(cfg, show_progress=False)
    shutil.rmtree(cfg.train.run_dir, ignore_errors=True)      # a study keeps numbers, not models
    if s.stopped:       # a cut-short run is no cell: stop here, a restart runs it again
        raise KeyboardInterrupt
    return {"rule": rule, "batch": batch_size, "seed": seed, "auc": s.test.get("auc", float("nan")),
            "logloss": s.test.get("logloss", float("nan")),
            "calibration": s.test.get("calibration", float("nan")),
            "test_records": s.test.get("records", 0), "records": s.records_trained, "steps": s.batches,
            "samples_per_s": s.samples_per_s, "clipped_row_fraction": s.clipped_row_fraction,
            "clip_ratio_p50_le": s.clip_ratio.get("p50_le"), "clip_ratio_p99_le": s.clip_ratio.get("p99_le"),
            # what the rule made of the optimizer for this batch (after --scale-from)
            "lr_dense": s.optim.get("lr_dense"), "lr_embed": s.optim.get("lr_embed"), "l2": s.optim.get("l2"),
            "epochs": cfg.data.epochs, "bayes_auc": s.test.get("bayes_auc"),
            "seconds": time.perf_counter() - t0}


def study(base: Config, batches: list[int], rules: list[str], seeds: int, base_batch: int,
          out_dir: Path, show_progress: bool = True) -> dict:
    """Run every missing (rule, batch, seed) cell; returns the summary of all of them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / "results.jsonl"
    done = _load(results_path, base)
    for rule in rules:
        rule_config(base, rule, batches[0], base_batch)       # a bad rule fails before any run
    for rule in rules:
        for batch in batches:
            for seed in range(seeds):
                key = (rule, batch, seed)
                if key in done:
                    continue
                row = run_cell(base, rule, batch, base_batch, base.train.seed + seed, out_dir / "work")
                row["study"] = _study_key(base)
                done[key] = row
                with open(results_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
                if show_progress:
                    print(f"bench scaling: {rule} batch {batch:,} seed {seed}: test AUC {row['auc']:.4f} "
                          f"in {row['steps']:,} steps, {row['samples_per_s']:,.0f} samples/s, "
                          f"clipped {row['clipped_row_fraction']:.2%}", file=sys.stderr, flush=True)
    rows = [done[(r, b, s)] for r in rules for b in batches for s in range(seeds)]
    bayes = next((r["bayes_auc"] for r in rows if r.get("bayes_auc") is not None), None)
    summary = {"source": base.data.source, "epochs": base.data.epochs, "base_batch": base_batch,
               "seeds": seeds, "bayes_auc": bayes, "cells": summarize(rows, bayes), "rows": rows}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    (out_dir / "table.txt").write_text(format_scaling_table(summary) + "\n")
    summary["png"] = str(plot_scaling(summary, out_dir / "auc_vs_batch.png"))
    return summary


def summarize(rows: list[dict], bayes: float | None) -> list[dict]:
    """One cell per (rule, batch): AUC mean/min/max over seeds and its gaps."""
    cells: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        cells.setdefault((r["rule"], r["batch"]), []).append(r)
    out = []
    for (rule, batch), rs in cells.items():
        aucs = np.array([r["auc"] for r in rs])
        out.append({"rule": rule, "batch": batch, "auc_mean": float(aucs.mean()),
                    "auc_min": float(aucs.min()), "auc_max": float(aucs.max()), "seeds": len(rs),
                    "steps": rs[0]["steps"], "samples_per_s": float(np.median([r["samples_per_s"] for r in rs])),
                    "clipped_row_fraction": float(np.mean([r["clipped_row_fraction"] for r in rs])),
                    "calibration": float(np.mean([r["calibration"] for r in rs])),
                    "gap_to_bayes": None if bayes is None else float(bayes - aucs.mean())})
    for c in out:
        smallest = min((o for o in out if o["rule"] == c["rule"]), key=lambda o: o["batch"])
        c["gap_to_smallest"] = smallest["auc_mean"] - c["auc_mean"]
    return out


def format_scaling_table(summary: dict) -> str:
    bayes = summary["bayes_auc"]
    head = (f"{summary['source']}: {summary['epochs']} epoch(s), {summary['seeds']} seed(s), "
            f"base batch {summary['base_batch']:,}"
            + (f"; Bayes AUC of the held-out rows {bayes:.4f}" if bayes is not None else ""))
    cols = ["rule", "batch", "seeds", "test AUC mean [min, max]", "vs smallest (pt)", "steps", "samples/s",
            "clipped rows", "calibration"] + (["gap to Bayes (pt)"] if bayes is not None else [])
    table = [cols]
    for c in summary["cells"]:
        row = [c["rule"], f"{c['batch']:,}", str(c["seeds"]),
               f"{c['auc_mean']:.4f} [{c['auc_min']:.4f}, {c['auc_max']:.4f}]",
               f"{0.0 - 100 * c['gap_to_smallest']:+.2f}", f"{c['steps']:,}", f"{c['samples_per_s']:,.0f}",
               f"{c['clipped_row_fraction']:.2%}", f"{c['calibration']:.3f}"]
        if bayes is not None:
            row.append(f"{100 * c['gap_to_bayes']:.2f}")
        table.append(row)
    return head + "\n" + _grid(table)


def _grid(table: list[list[str]]) -> str:
    """Right-aligned columns, the first row a header underlined."""
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = [" | ".join(v.rjust(w) for v, w in zip(r, widths)) for r in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_scaling(summary: dict, path: Path) -> Path:
    """AUC against batch (log scale), one line per rule with the seeds' range as error bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for rule in dict.fromkeys(c["rule"] for c in summary["cells"]):
        cs = sorted((c for c in summary["cells"] if c["rule"] == rule), key=lambda c: c["batch"])
        x = [c["batch"] for c in cs]
        y = np.array([c["auc_mean"] for c in cs])
        err = np.array([[m - c["auc_min"] for c, m in zip(cs, y)], [c["auc_max"] - m for c, m in zip(cs, y)]])
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=rule)
    if summary["bayes_auc"] is not None:
        ax.axhline(summary["bayes_auc"], color="grey", linestyle="--", label="Bayes (true probabilities)")
    ax.set_xscale("log", base=2)
    batches = sorted({c["batch"] for c in summary["cells"]})
    ax.set_xticks(batches, [f"{b // 1024}K" if b % 1024 == 0 else f"{b:,}" for b in batches])
    ax.minorticks_off()
    ax.set_xlabel("batch size (records per step)")
    ax.set_ylabel("test AUC (held-out tail)")
    ax.set_title(f"{Path(summary['source']).name}: {summary['epochs']} epoch(s), "
                 f"{summary['seeds']} seed(s) per point")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _study_key(base: Config) -> dict:
    """What makes two studies' cells comparable (everything but the rule, batch and seed)."""
    d = base.to_dict()
    d["train"] = {k: v for k, v in d["train"].items() if k not in ("run_dir", "seed", "threads")}
    return json.loads(json.dumps({"config": d}))       # as it reads back (tuples become lists)


def _load(path: Path, base: Config) -> dict[tuple[str, int, int], dict]:
    if not path.exists():
        return {}
    key = _study_key(base)
    done = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("study") == key:
            done[(row["rule"], row["batch"], row["seed"] - base.train.seed)] = row
    return done


def _int_list(option: str, text: str) -> list[int]:
    from stream_ctr.config import ConfigError
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"bench scaling: {option} {text!r}: give whole numbers, comma-separated") from None


@dataclass(frozen=True)
class StreamSpec:
    """One synthetic stream of a matrix: its canonical spec (the name plus the knobs that
    differ from that name's teacher, in SPEC_KEYS order), a file-name slug, and its teacher."""
    name: str
    slug: str
    teacher: Teacher


def parse_stream_spec(spec: str) -> StreamSpec:
    """`interaction` or `additive`, then `:key=value` overrides (keys of SPEC_KEYS).
    Raises ConfigError naming the part of `spec` that is wrong."""
    from stream_ctr.config import ConfigError
    from stream_ctr.connectors.synth import ADDITIVE_TEACHER, DEFAULT_TEACHER
    bases = {"interaction": DEFAULT_TEACHER, "additive": ADDITIVE_TEACHER}
    where = f"bench scaling: --synth stream {spec!r}"
    name, *overrides = [part.strip() for part in spec.split(":")]
    if name not in bases:
        raise ConfigError(f"{where}: unknown stream {name!r}; start a spec with one of "
                          f"{', '.join(STREAM_NAMES)}")
    teacher, seen = bases[name], set()
    for part in overrides:
        key, eq, value = (x.strip() for x in part.partition("="))
        if not eq or key not in SPEC_KEYS:
            raise ConfigError(f"{where}: {part!r} is not key=value with a key of {', '.join(SPEC_KEYS)}")
        if key in seen:
            raise ConfigError(f"{where}: {key} is set twice")
        seen.add(key)
        field = SPEC_KEYS[key]
        kind = type(getattr(teacher, field))
        try:
            v = kind(value)
        except ValueError:
            v = None
        if v is None or (kind is float and not math.isfinite(v)):
            raise ConfigError(f"{where}: {key}={value!r} is not "
                              f"{'a whole number' if kind is int else 'a finite number'}")
        teacher = dataclasses.replace(teacher, **{field: v})
    if teacher.seed < 0:
        raise ConfigError(f"{where}: seed must be >= 0, got {teacher.seed}")
    try:
        teacher.check()
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    # Only the knobs that differ from the named teacher: two spellings of one stream share its files.
    diff = [(k, getattr(teacher, f)) for k, f in SPEC_KEYS.items()
            if getattr(teacher, f) != getattr(bases[name], f)]
    return StreamSpec(name=":".join([name] + [f"{k}={v!r}" for k, v in diff]),
                      slug="-".join([name] + [f"{k}{v!r}" for k, v in diff]), teacher=teacher)


def parse_stream_specs(text: str) -> list[StreamSpec]:
    """The comma-separated specs of --synth; ConfigError for a bad one or the same teacher twice."""
    from stream_ctr.config import ConfigError
    specs = [parse_stream_spec(x) for x in text.split(",") if x.strip()]
    if not specs:
        raise ConfigError(f"bench scaling: --synth {text!r} names no stream; give e.g. interaction,additive")
    for i, a in enumerate(specs):
        for b in specs[:i]:
            if a.teacher == b.teacher:
                raise ConfigError(f"bench scaling: --synth lists one stream twice ({b.name!r} and "
                                  f"{a.name!r} have the same teacher); drop one")
    return specs


def ensure_stream(spec: StreamSpec, rows: int, data_dir: Path, show_progress: bool = True) -> Path:
    """DATA_DIR/<slug>-<rows>.tsv with its sidecar, written unless a complete one is there.

    Complete means: the sidecar (renamed into place last) holds `rows` probabilities and
    <file>.teacher.json names the same teacher. The data is written under a temporary
    name first, so an interrupted write never passes for the stream."""
    from stream_ctr.connectors.synth import probs_path, write_synthetic_criteo
    path = data_dir / f"{spec.slug}-{rows}.tsv"
    sidecar, meta = probs_path(path), path.with_name(path.name + ".teacher.json")
    want = {"teacher": dataclasses.asdict(spec.teacher), "rows": rows}
    if path.exists() and _sidecar_rows(sidecar) == rows and _read_json(meta) == want:
        return path
    if show_progress:
        print(f"bench scaling: writing {path} ({rows:,} rows of {spec.name})", file=sys.stderr, flush=True)
    sidecar.unlink(missing_ok=True)        # from here on the old file is no longer complete
    tmp = path.with_name(path.name + ".partial")
    write_synthetic_criteo(tmp, rows, seed=spec.teacher.seed, teacher=spec.teacher)
    os.replace(tmp, path)
    meta.write_text(json.dumps(want) + "\n")
    os.replace(probs_path(tmp), sidecar)
    return path


def _sidecar_rows(path: Path) -> int:
    try:
        return int(np.load(path, mmap_mode="r").shape[0])
    except (OSError, ValueError, IndexError):       # missing, truncated or not an .npy
        return -1


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _cmd_matrix(args: argparse.Namespace, base: Config, batches: list[int], rules: list[str]) -> tuple[dict, str]:
    from stream_ctr.config import ConfigError
    specs = parse_stream_specs(args.synth)
    sizes = sorted(set(_int_list("--rows", args.rows))) if args.rows is not None else list(DEFAULT_MATRIX_ROWS)
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"bench scaling: --rows {args.rows!r}: give stream sizes >= 1, comma-separated")
    out = Path(args.out)
    result = matrix(base, specs, sizes, batches, rules, args.seeds, args.base_batch, out,
                    show_progress=not args.quiet)
    if not args.json:
        print(format_matrix(result))
    runs = len(result["cells"]) * args.seeds
    return ({"bench": "scaling", **result},
            f"bench scaling: {len(specs)} stream(s) x {len(sizes)} size(s), {runs} runs; "
            f"matrix {out / 'matrix.txt'}")


def matrix(base: Config, specs: list[StreamSpec], sizes: list[int], batches: list[int], rules: list[str],
           seeds: int, base_batch: int, out_dir: Path, show_progress: bool = True) -> dict:
    """`study` for every (stream, rows) pair in OUT/<slug>-<rows>/, on streams written once to
    OUT/data/; writes and returns the matrix (OUT/matrix.json, OUT/matrix.txt)."""
    for rule in rules:
        rule_config(base, rule, batches[0], base_batch)       # a bad rule fails before any stream is written
    pairs, cells = [], []
    for spec in specs:
        for rows in sizes:
            path = ensure_stream(spec, rows, out_dir / "data", show_progress)
            cfg = Config.from_dict(base.to_dict())
            cfg.data.source = f"criteo:{path}"
            if show_progress:
                print(f"bench scaling: {spec.name}, {rows:,} rows -> {out_dir / f'{spec.slug}-{rows}'}",
                      file=sys.stderr, flush=True)
            s = study(cfg, batches, rules, seeds, base_batch, out_dir / f"{spec.slug}-{rows}", show_progress)
            pairs.append({"stream": spec.name, "rows": rows, "source": s["source"],
                          "dir": str(out_dir / f"{spec.slug}-{rows}"), "bayes_auc": s["bayes_auc"],
                          "png": s["png"]})
            cells += [{"stream": spec.name, "rows": rows, **c, "bayes_auc": s["bayes_auc"]}
                      for c in s["cells"]]
    result = {"epochs": base.data.epochs, "base_batch": base_batch, "seeds": seeds, "rules": rules,
              "batches": batches, "rows": sizes,
              "streams": [{"stream": sp.name, "slug": sp.slug, "teacher": dataclasses.asdict(sp.teacher),
                           "describe": sp.teacher.describe()} for sp in specs],
              "pairs": pairs, "cells": cells, "pivots": pivots(cells, specs, sizes, batches, rules)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "matrix.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / "matrix.txt").write_text(format_matrix(result) + "\n")
    return result


def pivots(cells: list[dict], specs: list[StreamSpec], sizes: list[int], batches: list[int],
           rules: list[str]) -> list[dict]:
    """Per (stream, rule): test AUC minus the smallest batch's, in points, as
    `vs_smallest_points[i][j]` for rows sizes[i] and batch batches[j] (< 0: that batch loses)."""
    by_key = {(c["stream"], c["rows"], c["rule"], c["batch"]): c for c in cells}
    return [{"stream": sp.name, "rule": rule, "smallest_batch": batches[0], "rows": sizes, "batches": batches,
             "vs_smallest_points": [[0.0 - 100 * by_key[(sp.name, rows, rule, b)]["gap_to_smallest"]
                                     for b in batches] for rows in sizes]}
            for sp in specs for rule in rules]


def format_matrix(result: dict) -> str:
    head = [f"bench scaling matrix: {result['epochs']} epoch(s), {result['seeds']} seed(s), "
            f"base batch {result['base_batch']:,}; test AUC on each stream's held-out tail",
            "streams:"] + [f"  {s['stream']}: {s['describe']}" for s in result["streams"]]
    table = [["stream", "rows", "rule", "batch", "test AUC mean [min, max]", "vs smallest (pt)",
              "gap to Bayes (pt)", "steps", "calibration"]]
    for c in result["cells"]:
        table.append([c["stream"], f"{c['rows']:,}", c["rule"], f"{c['batch']:,}",
                      f"{c['auc_mean']:.4f} [{c['auc_min']:.4f}, {c['auc_max']:.4f}]",
                      f"{0.0 - 100 * c['gap_to_smallest']:+.2f}",
                      "-" if c["gap_to_bayes"] is None else f"{100 * c['gap_to_bayes']:.2f}",
                      f"{c['steps']:,}", f"{c['calibration']:.3f}"])
    parts = ["\n".join(head), _grid(table),
             "test AUC vs the smallest batch of the same stream, rows and rule (points; < 0: the "
             "larger batch loses), rows down, batch across:"]
    for p in result["pivots"]:
        grid = [["rows"] + [f"{b:,}" for b in p["batches"]]]
        grid += [[f"{rows:,}"] + [f"{v:+.2f}" for v in vals] for rows, vals in zip(p["rows"], p["vs_smallest_points"])]
        parts.append(f"{p['stream']}, {p['rule']}:\n{_grid(grid)}")
    return "\n\n".join(parts)
