"""Scoring with a bundle: decoded batches -> click probabilities, vectorized.

The path of one batch is the trainer's `predict`: both are
`models.scoring.probabilities`, so the numbers are the same bit for bit
(tests/stream_ctr/serving/test_export_predict.py). Only the rows differ in where
they come from: here a binary search in the bundle's sorted keys, an absent key
getting its initial row from `init_rows` as `store.peek` does. No Python loop
over records. `stream-ctr predict` and `serve` share this class.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import torch

from stream_ctr.config import ConfigError, ModelConfig
from stream_ctr.connectors.batch import Batch
from stream_ctr.connectors.formats import RecordFormat
from stream_ctr.connectors.schema import SchemaError, parse_schema
from stream_ctr.models.networks import build_model
from stream_ctr.models.field_inputs import field_rows
from stream_ctr.models.scoring import probabilities, score_file as score_source
from stream_ctr.serving.bundle import Bundle, BundleError, model_config_fields
from stream_ctr.serving.options import PRECISIONS  # noqa: F401  (defined where the CLI reads it without torch)
from stream_ctr.serving.table import RowTable
from stream_ctr.store.embedding import init_rows



class Scorer:
    """A bundle's model, ready to score batches of its record format."""

    def __init__(self, bundle: Bundle, device: str | torch.device = "cpu",
                 precision: str | None = None, table: RowTable | None = None) -> None:
        """`table`: the rows to score with (a follower's full snapshot with deltas applied);
        default the bundle's own."""
        m = bundle.manifest
        self.bundle = bundle
        self.table = table if table is not None else RowTable.of(bundle.keys, bundle.rows)
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: torch sees no CUDA GPU here; score with --device cpu")
        self.precision = precision or m["precision"]
        if self.precision not in PRECISIONS:
            raise BundleError(f"{bundle.path}: precision {self.precision!r} is not one of {PRECISIONS}")
        try:                                # the manifest's model section, as the trainer wrote it
            self.model_cfg = ModelConfig(**model_config_fields(m))
        except TypeError as e:              # a key ModelConfig does not know
            raise BundleError(f"{bundle.path}/manifest.json: model section not understood ({e}): "
                              "re-export the bundle with this stream-ctr") from None
        self.n_fields, self.n_dense = int(m["n_fields"]), int(m["n_dense"])
        self.dim = self.model_cfg.embed_dim
        self.seed, self.init_std = int(m["init"]["seed"]), float(m["init"]["init_std"])
        if self.table.cols != self.dim + 1:
            raise BundleError(f"{bundle.path}: rows have {self.table.cols} columns, "
                              f"model.embed_dim {self.dim} needs {self.dim + 1}")
        # A declared schema's wide fields (per-field embed_dim) take k rows each, as in training.
        schema = (m.get("record_format") or {}).get("schema")
        try:
            self.field_rows = field_rows(parse_schema(schema), self.dim) if schema else None
        except SchemaError as e:
            raise BundleError(f"{bundle.path}: the manifest's schema: {e}") from None
        n_inputs = self.field_rows.n_inputs if self.field_rows is not None else self.n_fields
        try:
            self.model = build_model(self.model_cfg, n_inputs, self.n_dense)
        except (TypeError, ValueError, RuntimeError) as e:     # a model section of other values (mlp_dims: "x", [-1])
            raise BundleError(f"{bundle.path}/manifest.json: its model section does not build a model "
                              f"({e}): re-export the bundle with this stream-ctr") from None
        try:
            self.model.load_state_dict(bundle.dense)
        except RuntimeError as e:
            raise BundleError(f"{bundle.path}/dense.pt does not fit the manifest's model: "
                              f"{str(e).splitlines()[0]}") from None
        self.model.to(self.device).eval()
        # Freshness: the newest arrival at the trainer (s) / event time (ms) of the records
        # this model trained on (a follower sets them over the versions it applied), and
        # when a server began answering with it (Predictor sets that).
        published = m.get("publish") or {}
        self.newest_arrival_s: float | None = published.get("newest_arrival_s")
        self.newest_event_ms: int | None = published.get("newest_event_ms")
        self.live_since_s: float | None = None

    @property
    def version(self) -> str:
        return self.bundle.version

    def rows(self, keys: torch.Tensor) -> torch.Tensor:
        """Rows [U, dim + 1] for sorted unique keys [U]: the bundle's, else the initial row."""
        found, out = self.table.lookup(keys.cpu().numpy())
        rows = torch.from_numpy(out).to(self.device)
        absent = torch.from_numpy(~found).to(self.device)
        if bool(absent.any()):
            rows[absent] = init_rows(keys[absent], self.dim, self.init_std, self.seed)
        return rows

    def score(self, batch: Batch) -> np.ndarray:
        """Click probabilities float32 [B] of a decoded batch."""
        if batch.n_fields + batch.n_multi != self.n_fields or batch.n_dense != self.n_dense:
            raise BundleError(f"records with {batch.n_fields + batch.n_multi} key and {batch.n_dense} dense fields, "
                              f"the bundle's model takes {self.n_fields} and {self.n_dense} "
                              f"({self.bundle.manifest['record_format']['name']} records)")
        return probabilities(self.model, self.rows, batch, self.dim, self.field_rows, self.precision, self.device)


def score_file(scorer: Scorer, path: str | Path, fmt: RecordFormat, start: int = 0,
               stop: int | None = None, chunk_records: int = 65536,
               offsets: list[np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """(probabilities, labels, rejected lines) of data lines [start, stop) of a file.
    Lines that do not decode are skipped (and counted), as training skips them;
    `offsets` (if given) receives the data line of each probability, an array a chunk."""
    rejected: Counter[str] = Counter()
    probs, labels = score_source(scorer.score, path, fmt, start, stop, chunk_records, rejected, offsets)
    return probs, labels, sum(rejected.values())
