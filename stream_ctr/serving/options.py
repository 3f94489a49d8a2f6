"""What the serving commands accept: their choices and the server's per-client limits.

Plain values and one dataclass, no torch or numpy: the command line builds its
parser from them, and `stream-ctr --help` must not load the scoring stack.
The modules that act on them (scorer, server, predictor, portable_export)
import them from here.
"""
from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("fp32", "bf16")               # the dense model's matmuls when scoring
NETWORKS = ("auto", "onnx", "torch")        # `export --portable`: the network's file format
HTTP_STACKS = ("stdlib", "aiohttp")         # `serve --http`
MAX_BODY_BYTES = 64 << 20                   # the most a POST /predict body may hold (decoder's limit)


@dataclass(frozen=True)
class Limits:
    """What one client may hold of the server (the stdlib stack; aiohttp takes max_body_bytes).

    idle_timeout_s     a connection waiting this long for its next request is closed (the
                       default outlives a load balancer's usual 60 s keep-alive, so the
                       balancer, not the server, ends an idle connection)
    request_timeout_s  a request's line, headers and body must arrive within this long of its
                       first byte, and its answer be taken within as long, or it is dropped (408)
    max_body_bytes     a larger POST /predict body is refused unread (413); at most the
                       decoder's own limit, MAX_BODY_BYTES
    max_connections    connections served at once; one more is answered 503 and closed
    """
    idle_timeout_s: float = 75.0
    request_timeout_s: float = 30.0
    max_body_bytes: int = MAX_BODY_BYTES
    max_connections: int = 256

    def __post_init__(self) -> None:
        if not self.idle_timeout_s > 0:
            raise ValueError(f"idle timeout {self.idle_timeout_s} s: must be > 0 (--idle-timeout-s)")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request timeout {self.request_timeout_s} s: must be > 0 "
                             "(--request-timeout-s)")
        if not 0 < self.max_body_bytes <= MAX_BODY_BYTES:
            raise ValueError(f"max body {self.max_body_bytes:,} bytes: must be 1-{MAX_BODY_BYTES:,} "
                             "(--max-body-bytes; the decoder takes no more)")
        if self.max_connections < 1:
            raise ValueError(f"max connections {self.max_connections}: must be >= 1 (--max-connections)")
