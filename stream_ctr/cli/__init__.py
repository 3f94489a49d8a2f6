"""`stream-ctr` on the command line: argument parsing and what each command prints.

The top layer: it may import every other part of stream_ctr, and nothing
imports it (except `stream_ctr.__main__`). Commands run the work of the layers
below and print one summary line, or one JSON object with `--json`.
"""
from stream_ctr.cli.main import main

__all__ = ["main"]
