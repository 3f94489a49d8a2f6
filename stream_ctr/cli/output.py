"""What every command prints: one summary line (or one JSON object), and Kafka log lines."""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from typing import Any


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    return x


def emit(args: argparse.Namespace, summary: dict, line: str) -> None:
    """The summary line, or with --json the summary as JSON (NaN and inf as null)."""
    print(json.dumps(_finite(summary)) if args.json else line, flush=True)


def auc_text(acc: dict, digits: int = 4) -> str:
    """'AUC 0.7812' of scored rows (`acc`: auc, records), or why there is none: AUC ranks
    clicks above non-clicks, so it needs at least one of each."""
    auc = acc.get("auc")
    auc = float("nan") if auc is None else float(auc)
    if math.isfinite(auc):
        return f"AUC {auc:.{digits}f}"
    if not acc.get("records"):
        return "AUC n/a (no rows scored)"
    return "AUC n/a (needs both a click and a non-click among the scored rows)"


LOG_LEVELS = ("debug", "info", "warning", "error")
_chosen_level: int | None = None            # --log-level, when given


def set_log_level(name: str | None) -> None:
    """--log-level: every stream_ctr logger at that level on stderr (None: as the commands
    choose, INFO for a Kafka run's lines and WARNING elsewhere)."""
    global _chosen_level
    if name is None:
        return
    _chosen_level = getattr(logging, name.upper())
    root = logging.getLogger("stream_ctr")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("stream-ctr: %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(_chosen_level)


def configure_logging(quiet: bool = False) -> None:
    """Our Kafka log lines (outages, rebalances, positions) on stderr; kafka-python's own
    per-connection errors only with STREAM_CTR_KAFKA_DEBUG=1 (our lines say the same once)."""
    ours = logging.getLogger("stream_ctr.connectors.kafka")
    if not ours.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("stream-ctr: %(message)s"))
        ours.addHandler(handler)
        ours.propagate = False
    ours.setLevel(_chosen_level if _chosen_level is not None else logging.WARNING if quiet else logging.INFO)
    client = logging.getLogger("kafka")
    if os.environ.get("STREAM_CTR_KAFKA_DEBUG"):
        if ours.handlers[0] not in client.handlers:
            client.addHandler(ours.handlers[0])
        client.setLevel(logging.INFO)
    else:
        client.setLevel(logging.CRITICAL)
