"""Kafka: consuming a topic into batches, producing into one, and their positions.

    source        KafkaSource: group membership, exactly-once hand-over, outages
    listener      the rebalance listener (kafka-python's IO thread; confluent: the polling thread)
    client        opening consumers (kafka-python, or confluent through `confluent`)
    confluent     librdkafka behind kafka-python's calls and errors
    decode        message values -> decoded rows (one line, packed lines, JSON)
    positions     typed per-partition positions (next offset, rows done), and the checkpoint form
    options       the [kafka] options and kafka:// URLs
    sink          producers: dead letters, topic creation
    replay        a file replayed into a topic in event order
    local_broker  the tansu broker binary started on 127.0.0.1 (tests, benches)
    local_s3      s3rver on 127.0.0.1: the storage that keeps tansu's data across restarts

May import the other connectors modules; never the rest of stream_ctr.
"""
