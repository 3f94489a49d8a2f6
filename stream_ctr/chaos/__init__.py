"""`stream-ctr chaos`: a known stream trained under a seeded fault schedule, then verified.

    stream      the known stream: good Criteo lines and malformed messages at a rate,
                produced into a topic of several partitions (what is where is recorded)
    schedule    the seeded fault schedule (kills, kills inside checkpoint writes,
                pauses, broker restarts, a second group member joining and leaving,
                a full checkpoint disk)
    harness     the trainer processes, the broker (durable: tansu on s3rver), the faults
    disk        a checkpoint disk that fills up (a size-capped tmpfs)
    verify      exactly-once, dead letters, the fault-free model, readable checkpoints
    commands    the `chaos` subcommand

May import train, serving (reading a tiered checkpoint's rows), config and
connectors (the trainer itself runs as a child
process, `python -m stream_ctr train`, the way a supervisor runs it); never cli,
bench or distributed.
"""
