"""One training run: source -> micro-batches -> prequential score + step -> checkpoint.

    loop        `train()`, the run in one screen, and checkpoint evaluation
    batches     file micro-batches, the look-ahead batch, the stop signal
    batcher     rows -> batches of the configured size
    streaming   Kafka sources: latency-bounded batches, dead letters
    offset_batches  Kafka batches as a function of offsets (kafka.deterministic_batches)
    trainer     the model, its store and both optimizers; one step
    heap        glibc malloc kept from returning a step's memory to the kernel
    checkpoint  atomic, checksummed checkpoints with the source position
    evaluation  AUC, logloss, calibration, the prequential window

May import serving (to publish), store, telemetry, models, config, connectors and
ops; never distributed, bench or cli.
"""
