"""Several replicas of one job under torchrun (docs/distributed.md).

    context         the process group, collectives that fail clearly on a lost rank
    merge           k-step merging of dense replicas (and hierarchical node groups)
    sharded_store   sparse rows with one owner each, exchanged all-to-all per step
    job_checkpoint  one job manifest naming every rank's shard
    run             a rank's `Job` (a train Run plus store, merges, job checkpoints), its
                    lockstep loop, and `--distributed` on one machine

May import train, serving, store, telemetry, models, config, connectors and ops;
only cli and bench import it.
"""
