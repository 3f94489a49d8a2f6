"""`stream-ctr serve`: the HTTP front end of a `Predictor`.

    POST /predict   records in the bundle's format -> {"model_version", "probabilities"}
                    (400 naming the bad records; 413 body too large; 503 queue full)
    GET  /healthz   {"status": "ok", "model_version", "step"}
    GET  /metrics   Prometheus text (serving/metrics.py)

The stack is the standard library's `ThreadingHTTPServer` (HTTP/1.1 keep-alive,
TCP_NODELAY, one thread per connection), chosen by measurement against aiohttp
3.14 (BENCHMARKS.md "Serving", `stream-ctr bench serve --http stdlib,aiohttp`,
6 runs, 4 clients): at 1 record a request it had the lower p50 in 6 runs of 6
(2.6-3.9 ms vs 2.8-5.4) and the lower p99 in 5; at 256 a request the two
overlapped (38-70K vs 44-57K records/s). The time goes to decoding and scoring,
not to I/O an event loop could overlap, so the async stack buys nothing here and
would be a dependency more. `--http aiohttp` stays for the comparison when
aiohttp is installed (it is not a dependency).

`Server.swap(scorer)` replaces the model while requests run (Predictor.swap).
"""
from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from stream_ctr.serving.predictor import MAX_BODY_BYTES, Predictor, RequestError
from stream_ctr.serving.scorer import Scorer

HTTP_STACKS = ("stdlib", "aiohttp")
JSON = "application/json"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"              # keep-alive: a client reuses its connection
    # TCP_NODELAY: without it a small answer waits for the client's delayed ACK (Nagle),
    # ~40 ms a request on Linux; measured: p50 44 ms -> see BENCHMARKS.md.
    disable_nagle_algorithm = True
    predictor: Predictor                       # set on the subclass Server makes

    def log_message(self, format: str, *args: Any) -> None:     # noqa: A002 - no access log
        pass

    def _send(self, status: int, body: bytes, content_type: str = JSON) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self._headers_buffer.append(b"\r\n")          # end_headers without its flush: one write
        self.wfile.write(b"".join(self._headers_buffer) + body)
        self._headers_buffer = []

    def do_GET(self) -> None:                   # noqa: N802 - http.server's name
        if self.path == "/healthz":
            self._send(200, self.predictor.health())
        elif self.path == "/metrics":
            self._send(200, generate_latest(self.predictor.metrics.registry), CONTENT_TYPE_LATEST)
        else:
            self._send(404, b'{"error": "not found: GET /healthz, GET /metrics, POST /predict"}')

    def do_POST(self) -> None:                  # noqa: N802
        if self.path != "/predict":
            self._send(404, b'{"error": "not found: POST /predict"}')
            return
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY_BYTES:
            self.close_connection = True
            self._send(413, RequestError(f"request body of {n:,} bytes; at most "
                                         f"{MAX_BODY_BYTES:,}", 413).body())
            return
        status, body = self.predictor.predict(self.rfile.read(n), self.headers.get("Content-Type", ""))
        self._send(status, body)


class Server:
    """A predictor served over HTTP on (host, port) from a background thread."""

    def __init__(self, scorer: Scorer, host: str = "127.0.0.1", port: int = 0, http: str = "stdlib",
                 **batching: Any) -> None:
        if http not in HTTP_STACKS:
            raise ValueError(f"--http {http!r}: one of {', '.join(HTTP_STACKS)}")
        self.predictor = Predictor(scorer, **batching)
        self.http = http
        self._ready = threading.Event()
        if http == "stdlib":
            handler = type("Handler", (_Handler,), {"predictor": self.predictor})
            self._httpd = ThreadingHTTPServer((host, port), handler)
            self._httpd.daemon_threads = True
            self.host, self.port = self._httpd.server_address[:2]
            self._thread = threading.Thread(target=self._httpd.serve_forever, name="stream-ctr-http",
                                            daemon=True)
        else:
            self.host, self.port = host, port
            self._thread = threading.Thread(target=self._run_aiohttp, name="stream-ctr-http",
                                            daemon=True)

    def start(self) -> "Server":
        self._thread.start()
        if self.http == "aiohttp":
            self._ready.wait(30)
        return self

    def swap(self, scorer: Scorer) -> Scorer:
        """Answer with `scorer` from the next scoring call on; returns the old one."""
        return self.predictor.swap(scorer)

    def wait(self) -> None:
        self._thread.join()

    def close(self) -> None:
        if self.http == "stdlib":
            self._httpd.shutdown()
            self._httpd.server_close()
        else:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)
        self.predictor.close()

    # ------------------------------------------------------------ aiohttp (comparison only)
    def _run_aiohttp(self) -> None:
        from aiohttp import web                 # not a dependency: --http aiohttp needs it installed
        predictor = self.predictor

        async def predict(request: "web.Request") -> "web.Response":
            body = await request.read()
            loop = asyncio.get_running_loop()
            # decode and wait in a thread: the event loop keeps accepting while the scorer works
            status, out = await loop.run_in_executor(None, predictor.predict, body,
                                                     request.content_type)
            return web.Response(status=status, body=out, content_type=JSON)

        async def health(_: "web.Request") -> "web.Response":
            return web.Response(body=predictor.health(), content_type=JSON)

        async def metrics(_: "web.Request") -> "web.Response":
            return web.Response(body=generate_latest(predictor.metrics.registry),
                                headers={"Content-Type": CONTENT_TYPE_LATEST})

        async def main() -> None:
            app = web.Application(client_max_size=MAX_BODY_BYTES)
            app.add_routes([web.post("/predict", predict), web.get("/healthz", health),
                            web.get("/metrics", metrics)])
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]      # the port bound for port 0
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self._ready.set()
            await self._stop.wait()
            await runner.cleanup()

        asyncio.run(main())
