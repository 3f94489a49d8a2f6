"""`stream-ctr monitoring export DIR` and `stream-ctr config example`: the files shipped in the package."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from stream_ctr.cli.output import emit
from stream_ctr.config import ConfigError, load_config, validate
from stream_ctr.resources import example_config_text, export_monitoring, runbook_url_ok


def add_resource_parsers(sub: argparse._SubParsersAction,
                         add_common: Callable[[argparse.ArgumentParser], None]) -> None:
    mon = sub.add_parser("monitoring", help="the Prometheus and Grafana files shipped with stream_ctr")
    msub = mon.add_subparsers(dest="monitoring_command", required=True, metavar="ACTION")
    exp = msub.add_parser("export", help="write the dashboard, alert rules and Prometheus configs to DIR",
                          description="Write prometheus.yml, prometheus-ranks.yml, alerts.yml, "
                                      "alerts_test.yml and grafana/ (dashboard JSON and provisioning) "
                                      "into DIR, e.g. to mount into Prometheus and Grafana.")
    exp.add_argument("directory", help="where to write them (created if missing)")
    exp.add_argument("--runbook-url", metavar="URL",
                     help="where the runbook page (RUNBOOK.md) is served, e.g. your Git host's or "
                          "wiki's page: each alert's runbook_url is URL#<alert name> (default: "
                          "file:// of DIRECTORY/RUNBOOK.md, a link on this machine only)")
    exp.add_argument("--force", action="store_true", help="overwrite files that exist")
    add_common(exp)
    exp.set_defaults(func=cmd_monitoring_export)

    cfg = sub.add_parser("config", help="configuration files")
    csub = cfg.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    ex = csub.add_parser("example", help="print (or write) a commented example TOML config")
    ex.add_argument("--out", "-o", help="write it to this file (default: stdout)")
    # An older name of --out: still accepted, not shown (one name per option).
    ex.add_argument("--output", dest="out", help=argparse.SUPPRESS)
    ex.add_argument("--force", action="store_true", help="overwrite the file if it exists")
    ex.set_defaults(func=cmd_config_example)


def cmd_monitoring_export(args: argparse.Namespace) -> int:
    runbook = args.runbook_url or (Path(args.directory) / "RUNBOOK.md").resolve().as_uri()
    why = runbook_url_ok(runbook)
    if why is not None:
        raise ConfigError(f"--runbook-url {runbook}: {why}")
    written = export_monitoring(args.directory, overwrite=args.force, runbook_url=runbook)
    emit(args, {"directory": str(args.directory), "files": [str(p) for p in written],
                "runbook_url": runbook},
         f"wrote {len(written)} monitoring files to {args.directory} "
         f"(prometheus --config.file={Path(args.directory) / 'prometheus.yml'}); the alerts link "
         f"the runbook at {runbook}")
    return 0


def cmd_config_example(args: argparse.Namespace) -> int:
    text = example_config_text()
    if args.out:
        out = Path(args.out)
        if out.exists() and not args.force:
            raise ConfigError(f"--out {out} exists: it may be your config; name another file, "
                              "or add --force to overwrite it")
        out.write_text(text)
        validate(load_config(out))          # what we ship must load as it is
        print(f"wrote an example config to {out} (stream-ctr train --config {out})")
    else:
        print(text, end="")
    return 0
