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
    table      the rows a scorer reads: a full bundle's memory-mapped table under the rows
               deltas replaced since
    published  the publish directory's contract: versions, the index (full snapshot + chain
               of deltas), atomic replacement
    publisher  `train --publish`: a full snapshot, then deltas, after durable checkpoints
    follower   `serve --follow`: applies new versions to a running predictor (brief-lock swap)
    kafka_publish  the publish directory carried by a Kafka topic (sender and mirror)
    portable   a numpy-only reference scorer of a portable export (spec.json, key and row
               arrays, the dense network): copy it next to the files and it runs alone
    portable_export  `export --portable`: writes those files from a bundle (ONNX or .pt2)
    options    what the serving commands (cli/serving.py) accept (precisions, network formats, HTTP stacks, the
               server's per-client limits): plain values, so the parser loads no torch

May import store, telemetry, models (the forward and precision are
`models.scoring`, shared with the trainer), config, connectors and ops (and
torch, numpy); never train, distributed, bench or cli: scoring must not need the
trainer. The package sits below train (the train loop calls the publisher); the
commands that read checkpoints live in cli/serving.py (tests/test_layout.py
checks both the modules and the folders).
"""
