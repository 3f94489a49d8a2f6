"""What a run tells the people watching it.

    catalogue   every Prometheus metric name, kind, labels and help (data only)
    metrics     TrainerMetrics (what a rank updates) and the /metrics endpoint
    collectors  values other components own, read at scrape time
    monitor     the train loop's one object for all of the above
    timeseries  RUN_DIR/timeseries.jsonl with size-bounded rotation
    report      `stream-ctr report`: PNG plots and one HTML page of a run
    progress    the live progress line on stderr

May import config and connectors; never train, store, models, distributed,
bench or cli (the store and sources are read through duck-typed collectors).
"""
