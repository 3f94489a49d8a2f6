"""`stream-ctr bench ...`: benchmarks a user runs on their own hardware.

    train     end-to-end training throughput, with and without decoding
    ingest    Kafka consuming + decoding against a bare client loop
    store     the tiered embedding store: hit rates, lookups/s, LMDB rows/s, RSS
    merge     k-step merging: bytes and ms per step, AUC per k, 2 and 4 ranks
    kernels   each op in ops/: ms per call, GB/s vs a device copy
    step      whole DeepFM steps, torch reference vs Triton (CUDA) or CPU loops

May import distributed, train, store, telemetry, models, config, connectors
and ops; nothing in the core imports a bench. Each bench returns its rows (and
prints its table); the CLI prints the summary line.
"""
