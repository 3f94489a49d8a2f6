"""Serving: the model a predictor loads, and the code that scores with it.

    bundle     the serving bundle on disk: write it (sorted rows in chunks), read and
               verify it (manifest, format version, checksums); no pickles
    scorer     vectorized scoring of decoded batches with a loaded bundle: the one path
               `stream-ctr predict` and the HTTP server share
    predictor  the server's core, free of any HTTP stack: request bodies -> decoded
               records -> a queue whose one scoring thread coalesces waiting requests;
               `swap` replaces the model under a brief lock
    metrics    the server's Prometheus metrics (latency, records, model version and age)
    server     `stream-ctr serve`: stdlib ThreadingHTTPServer front end (aiohttp for comparison)
    export     a checkpoint (in-memory table, or tiered rows in LMDB read generation-exact
               in chunks) -> a bundle
    commands   the `export`, `predict` and `serve` subcommands (argument parsing, summaries)

bundle, scorer and export may import store, models, config, connectors and ops
(and torch, numpy), never train, distributed, bench or cli: scoring must not need
the trainer. The package sits below train (a trainer may publish bundles later);
`commands` alone sits above it, beside bench (tests/import_graph.py), because it
reads checkpoints and reports AUC with the trainer's metric code.
"""
