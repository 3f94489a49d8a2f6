"""Sources and sinks (installed as `stream_ctr.connectors`).

    batch         the Batch contract: columnar rows with their source positions
    formats       record layouts (Criteo TSV, Avazu CSV)
    hashing       64-bit feature signs of (field, token)
    decode        vectorized numpy line decoder; decode_jit its compiled twin;
                  decode_tables what both share
    schema        a declared feature schema (TOML): field kinds, validation
    schema_decode JSON lines / delimited text under a schema -> Batch;
                  schema_columns its per-kind vectorized converters;
                  json_scan the compiled scan of JSON lines it uses;
                  schema_builtin Criteo and Avazu in the schema language;
                  schema_infer a schema guessed from a sample
    files         file sources (plain or gzip), bundled samples
    errors        SourceError, EmptySource, DamagedFile (files re-exports them)
    read_ahead    a source decoded on background threads, in file order, a bounded queue ahead
    dead_letter   where records that did not decode go
    synth         synthetic Criteo-format streams with a hidden teacher;
                  synth_json a synthetic JSON ad log
    kafka/        the Kafka consumer source, sink, replay and positions

Depends on numpy (and kafka clients for kafka/), never on the rest of
stream_ctr: the trainer imports connectors, not the other way round.
"""
