"""`stream-ctr serve`: the HTTP front end of a `Predictor`.

    POST /predict   records in the bundle's format -> {"model_version", "probabilities"}
                    (400 naming the bad records; 413 body too large; 503 queue full)
    GET  /healthz   {"status": "ok", "model_version", "step"}
    GET  /metrics   Prometheus text (serving/metrics.py)

The stack is the standard library's `ThreadingHTTPServer` (HTTP/1.1 keep-alive,
TCP_NODELAY, one thread per connection), chosen by measurement against aiohttp
(`stream-ctr bench serve --http stdlib,aiohttp`, BENCHMARKS.md "Serving"): the
lower latency at 1 record a request, the same records/s at 256. The time goes to
decoding and scoring, not to I/O an event loop could overlap, so the async stack
buys nothing here and would be a dependency more. `--http aiohttp` stays for the
comparison when aiohttp is installed (it is not a dependency).

A client cannot hang or crash the server (`Limits`): a connection waits at most
`idle_timeout_s` for its next request, and a request must arrive whole within
`request_timeout_s` of its first byte however slowly it trickles (408, closed);
POST /predict needs a numeric Content-Length (411 missing, 400 malformed, 413 over
`max_body_bytes`) and a Content-Type it can decode (415); past `max_connections`
open connections a new one is answered 503 and closed; the listen backlog is the
system's. Every malformed request is answered 4xx with a one-line JSON error, and
a client breaking its connection leaves nothing on stderr.

`Server.swap(scorer)` replaces the model while requests run (Predictor.swap).
`Server.close()` (on SIGTERM) refuses new connections and answers the requests already
received, for at most `request_timeout_s`, before it stops scoring.
"""
from __future__ import annotations

import asyncio
import io
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from stream_ctr.serving.options import HTTP_STACKS, Limits  # noqa: F401  (the CLI reads them without torch)
from stream_ctr.serving.predictor import Predictor
from stream_ctr.serving.scorer import Scorer

JSON = "application/json"
ROUTES = "GET /healthz, GET /metrics, POST /predict"
_METHOD_OF = {"/healthz": "GET", "/metrics": "GET", "/predict": "POST"}     # ROUTES, by path


# Bodies the predictor decodes (predictor.parse_body): a JSON array under any JSON type, or
# records as lines under a text type, none, octet-stream, or the form type that
# `curl --data-binary` sends unless told otherwise.
_LINE_TYPES = frozenset({"", "application/octet-stream", "application/x-www-form-urlencoded"})


def decodable(content_type: str) -> bool:
    """Whether POST /predict can decode a body sent with this Content-Type."""
    media = content_type.split(";")[0].strip().lower()
    kind, _, sub = media.partition("/")
    return media in _LINE_TYPES or kind == "text" or (kind == "application" and "json" in sub)


def _error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


def _quoted(text: str, at_most: int = 80) -> str:
    """A client's text, shortened, to echo in an error."""
    return repr(text if len(text) <= at_most else text[:at_most] + "...")


class _RequestReader(io.RawIOBase):
    """A connection's input under the server's timeouts: the wait for a request's first bytes
    may take `idle_timeout_s`; the rest of the request must come within `request_timeout_s`
    of them. A plain socket timeout restarts at every byte, so a client sending one byte a
    second would hold its connection forever."""

    def __init__(self, sock: socket.socket, limits: Limits) -> None:
        super().__init__()
        self._sock, self._limits = sock, limits
        self.deadline: float | None = None          # None: between requests
        self.request_timed_out = False              # a started request did not arrive in time

    def readable(self) -> bool:
        return True

    def next_request(self) -> None:
        """Wait for the next request: the idle timeout again, until its first bytes."""
        self.deadline, self.request_timed_out = None, False

    def readinto(self, buffer: Any) -> int:
        if self.deadline is None:
            timeout = self._limits.idle_timeout_s
        else:
            timeout = self.deadline - time.monotonic()
            if timeout <= 0:
                self.request_timed_out = True
                raise TimeoutError(f"request not complete within {self._limits.request_timeout_s:g} s")
        self._sock.settimeout(timeout)
        try:
            n = self._sock.recv_into(buffer)
        except TimeoutError:
            self.request_timed_out = self.deadline is not None
            raise
        if n and self.deadline is None:
            self.deadline = time.monotonic() + self._limits.request_timeout_s
        return n


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"              # keep-alive: a client reuses its connection
    # A request line too malformed to name its version is answered as HTTP/1.0, with a status
    # line: the stdlib's default, 0.9, answers a bare body a client cannot read a status from.
    default_request_version = "HTTP/1.0"
    # TCP_NODELAY: without it a small answer waits for the client's delayed ACK (Nagle),
    # ~40 ms a request on Linux; measured: p50 44 ms -> see BENCHMARKS.md.
    disable_nagle_algorithm = True
    predictor: Predictor                       # set on the subclass Server makes
    limits: Limits                             # likewise

    def setup(self) -> None:
        super().setup()
        self.rfile.close()                     # the stdlib's reader: replaced by one keeping deadlines
        self._reader = _RequestReader(self.connection, self.limits)
        self.rfile = io.BufferedReader(self._reader)

    def log_message(self, format: str, *args: Any) -> None:     # noqa: A002 - no access log
        pass

    def _send(self, status: int, body: bytes, content_type: str = JSON, close: bool = False,
              headers: tuple[tuple[str, str], ...] = ()) -> None:
        # The client takes its answer within the request timeout, or is dropped.
        self.connection.settimeout(self.limits.request_timeout_s)
        close = close or self.server.closing    # a server stopping serves no next request
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")             # and close_connection = True
        for name, value in headers:
            self.send_header(name, value)
        self._headers_buffer.append(b"\r\n")          # end_headers without its flush: one write
        self.wfile.write(b"".join(self._headers_buffer) + body)
        self._headers_buffer = []

    def _error(self, status: int, message: str, **headers: str) -> None:
        """Answer `status` with {"error": message} and close: the rest of what the client
        sent (a body left unread) cannot be told from its next request."""
        self._send(status, _error_body(message), close=True, headers=tuple(headers.items()))

    def _refuse_predict(self, status: int, message: str) -> None:
        self.predictor.metrics.requests.labels(str(status)).inc()
        self._error(status, message)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """What the stdlib's parser refuses (a bad request line or version, headers too long
        or too many, a request line too long) as one JSON line, like every other error."""
        text = message or HTTPStatus(code).phrase
        self._error(code, f"{text}: {explain}" if explain else text)

    def parse_request(self) -> bool:
        # From its request line on, a request is answered before a closing server exits
        # (counted before a "100 Continue" tells the client its headers were read).
        self.server.begin_request()
        self._in_flight = True
        if not super().parse_request():
            return False
        if self.command not in ("GET", "POST"):
            self._error(405, f"method {_quoted(self.command)} not allowed: {ROUTES}", Allow="GET, POST")
            return False
        return True

    def handle_one_request(self) -> None:
        self._in_flight = False
        try:
            self._handle_one_request()
        finally:
            if self._in_flight:
                self.server.end_request()

    def _handle_one_request(self) -> None:
        self._reader.next_request()
        # Not the previous request's, if this one never parses; send_response reads the last two.
        self.command = self.path = None
        self.requestline, self.request_version = "", self.default_request_version
        super().handle_one_request()            # a timeout closes the connection there
        if self._reader.request_timed_out:      # begun but not received whole: say why it closes
            message = (f"request not received within {self.limits.request_timeout_s:g} s of its first "
                       "byte (request_timeout_s): a body shorter than its Content-Length, or sent "
                       "too slowly; send the whole request at once")
            if self.command == "POST" and self.path == "/predict":
                self._refuse_predict(408, message)
            else:
                self._error(408, message)

    def do_GET(self) -> None:                   # noqa: N802 - http.server's name
        if self.path == "/healthz":
            self._send(200, self.predictor.health())
        elif self.path == "/metrics":
            self._send(200, generate_latest(self.predictor.metrics.registry), CONTENT_TYPE_LATEST)
        else:
            self._not_routed()

    def do_POST(self) -> None:                  # noqa: N802
        if self.path != "/predict":
            self._not_routed()
            return
        n = self._content_length()
        if n is None:
            return
        content_type = self.headers.get("Content-Type", "")
        if not decodable(content_type):
            self._refuse_predict(415, f"Content-Type {_quoted(content_type)} cannot be decoded: send "
                                 "records as lines (text/plain, or none) or as a JSON array "
                                 "(application/json)")
            return
        body = self.rfile.read(n)               # past the request deadline: TimeoutError, a 408
        if len(body) < n:                       # the client closed its side mid-body
            self._refuse_predict(400, f"body ended after {len(body):,} of the {n:,} bytes its "
                                 "Content-Length declares")
            return
        status, out = self.predictor.predict(body, content_type)
        self._send(status, out)

    def _not_routed(self) -> None:
        """404 for a path the server lacks; 405 naming the method of one it has (`GET /predict`
        was "not found", of the path every client uses). A POST's body is left unread: closed."""
        method = _METHOD_OF.get(self.path)
        if method is None:
            message, status, allow = f"not found: {self.command} {_quoted(self.path)}; {ROUTES}", 404, ()
        else:
            message, status, allow = (f"{self.command} {self.path} is not served: {method} it "
                                      f"({ROUTES})"), 405, (("Allow", method),)
        self._send(status, _error_body(message), close=self.command == "POST", headers=allow)

    def _content_length(self) -> int | None:
        """The POST body's declared size, or None once the request is refused for it."""
        if self.headers.get("Transfer-Encoding"):
            self._refuse_predict(411, f"Transfer-Encoding {_quoted(self.headers['Transfer-Encoding'])} "
                                 "is not supported: send the body with a Content-Length")
            return None
        values = {v.strip() for v in self.headers.get_all("Content-Length") or []}
        if not values:
            self._refuse_predict(411, "POST /predict needs a Content-Length header: the body's size "
                                 "in bytes")
            return None
        if len(values) > 1:
            self._refuse_predict(400, f"conflicting Content-Length headers: {_quoted(', '.join(sorted(values)))}")
            return None
        text = values.pop()
        if not (text.isascii() and text.isdigit()):
            why = "negative" if text.startswith("-") else "not a number"
            self._refuse_predict(400, f"Content-Length {_quoted(text)} is {why}: it must be the "
                                 "body's size in bytes, digits only")
            return None
        # More digits than the limit has is over it, without converting a 60,000-digit number.
        n = int(text) if len(text) <= len(str(self.limits.max_body_bytes)) else None
        if n is None or n > self.limits.max_body_bytes:
            self._refuse_predict(413, f"request body of {text if n is None else f'{n:,}'} bytes; at "
                                 f"most {self.limits.max_body_bytes:,} (--max-body-bytes): split "
                                 "the records over several requests")
            return None
        return n


# Over max_connections: the whole answer, sent from the accepting thread without waiting.
_BUSY_BODY = _error_body("too many open connections: retry shortly, or reuse a connection")
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
         b"Content-Length: %d\r\nConnection: close\r\nRetry-After: 1\r\n\r\n%s"
         % (len(_BUSY_BODY), _BUSY_BODY))


class _HTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with the system's listen backlog, at most `max_connections`
    connection threads, and no traceback for a connection its client broke."""

    # The stdlib's 5 made every sixth simultaneous connect wait for a SYN retransmit (~1 s).
    request_queue_size = socket.SOMAXCONN
    daemon_threads = True
    # close() returns without joining connection threads: an idle keep-alive connection
    # would hold it for the idle timeout; its own timeouts end each.
    block_on_close = False

    def __init__(self, address: tuple[str, int], handler: type, max_connections: int) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        self.closing = False                    # set by Server.close: answers say Connection: close
        self._in_flight = 0                     # requests read from their request line on, not yet answered
        self._idle = threading.Condition()
        super().__init__(address, handler)

    def begin_request(self) -> None:
        with self._idle:
            self._in_flight += 1

    def end_request(self) -> None:
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    def drain(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for the requests in flight to be answered; how many were not."""
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout_s)
            return self._in_flight

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    @staticmethod
    def _refuse(sock: socket.socket) -> None:
        try:
            sock.setblocking(False)
            try:
                # What already came is read: unread input at close resets the connection,
                # which could reach the client before it reads the 503.
                sock.recv(1 << 16)
            except BlockingIOError:
                pass
            sock.send(_BUSY)                    # a new connection's send buffer takes it whole
        except OSError:
            pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return                      # the client reset or left its connection: not the server's fault
        super().handle_error(request, client_address)


class Server:
    """A predictor served over HTTP on (host, port) from a background thread, within `limits`."""

    def __init__(self, scorer: Scorer, host: str = "127.0.0.1", port: int = 0, http: str = "stdlib",
                 limits: Limits | None = None, **batching: Any) -> None:
        if http not in HTTP_STACKS:
            raise ValueError(f"--http {http!r}: one of {', '.join(HTTP_STACKS)}")
        self.limits = limits or Limits()
        self.predictor = Predictor(scorer, **batching)
        self.http = http
        self._ready = threading.Event()
        if http == "stdlib":
            handler = type("Handler", (_Handler,), {"predictor": self.predictor, "limits": self.limits})
            self._httpd = _HTTPServer((host, port), handler, self.limits.max_connections)
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
        """Until the server stops (close). Joined in slices: the kernel may hand a SIGTERM to
        any thread, and its Python handler runs only once the main thread runs bytecode
        again, which a join without a timeout never let it do: the signal was ignored."""
        while self._thread.is_alive():
            self._thread.join(0.25)

    def close(self, drain_s: float | None = None) -> int:
        """Stop accepting connections, answer the requests already received (waiting at most
        `drain_s`, default the request timeout), then stop scoring; the number of requests
        left unanswered. (Closing at once dropped a request being scored: a SIGTERM that a
        supervisor sends to restart the server lost its clients' answers.)"""
        left = 0
        if self.http == "stdlib":
            self._httpd.closing = True
            self._httpd.shutdown()
            self._httpd.server_close()          # a new connection is refused from here on
            left = self._httpd.drain(self.limits.request_timeout_s if drain_s is None else drain_s)
        else:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)
        self.predictor.close()
        return left

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
            app = web.Application(client_max_size=self.limits.max_body_bytes)
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
