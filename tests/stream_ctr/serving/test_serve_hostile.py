"""`stream-ctr serve` against hostile clients: a real server process on a loopback port,
driven with raw sockets.

Must-show: a malformed Content-Length is a 400 and the server answers the next
request; a body shorter than declared, an idle connection and a request trickled a
byte at a time are closed by the (here short) timeouts; 30 simultaneous connections
are all answered, from a listen backlog the system's size; a type the server cannot
decode is a 415; past --max-connections a new connection is answered 503; every
malformed request is a 4xx with a JSON error; a SIGTERM answers the request in flight
before the server exits; and nothing of it puts a traceback on the server's stderr.
"""
from __future__ import annotations

import gzip
import json
import select
import signal
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from stream_ctr.cli.main import main
from stream_ctr.connectors.files import SAMPLE_PATHS
from stream_ctr.train.loop import train
from tests.stream_ctr.store.helpers import small_config

IDLE_S, REQUEST_S = 1.0, 2.0            # the test server's timeouts
WAIT_S = 30.0                           # the most any one step here waits: far past both


def a_record() -> bytes:
    with gzip.open(SAMPLE_PATHS["criteo"], "rb") as f:
        return f.readline().rstrip(b"\n")


@dataclass
class Served:
    proc: subprocess.Popen
    port: int
    stderr_path: Path

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


def start_serve(bundle: Path, tmp: Path, *flags: str) -> Served:
    """`stream-ctr serve BUNDLE --port 0 FLAGS` as a subprocess, stderr into a file."""
    stderr_path = tmp / "stderr.txt"
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "stream_ctr", "serve", str(bundle), "--port", "0",
                                 *flags], stdout=subprocess.PIPE, stderr=err, text=True)
    line = proc.stdout.readline()           # "serving VERSION on http://127.0.0.1:PORT ..."
    if not line.startswith("serving "):
        proc.kill()
        proc.wait(timeout=30)
        pytest.fail(f"serve did not start: {line!r}\n{stderr_path.read_text()}")
    return Served(proc, int(line.split("http://127.0.0.1:")[1].split()[0]), stderr_path)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("hostile")
    cfg = small_config(tmp / "run", tiered=False)
    cfg.data.limit_records = 20 * 128
    train(cfg, show_progress=False)
    assert main(["export", cfg.train.run_dir, "--out", str(tmp / "bundle"), "--quiet"]) == 0
    return tmp / "bundle"


@pytest.fixture(scope="module")
def served(bundle, tmp_path_factory):
    """A server with short timeouts, a 1 MiB body limit and room for 64 connections."""
    s = start_serve(bundle, tmp_path_factory.mktemp("served"), "--idle-timeout-s", str(IDLE_S),
                    "--request-timeout-s", str(REQUEST_S), "--max-body-bytes", "1MiB",
                    "--max-connections", "64")
    yield s
    s.stop()


# ------------------------------------------------------------------ raw HTTP on a socket
def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response: (status, headers lower-cased, body). AssertionError if the
    server closes first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection without an answer (got {data!r})"
        data += chunk
        assert len(data) < 1 << 20
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}
    n = int(headers.get("content-length", "0"))
    while len(body) < n:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-answer"
        body += chunk
    return status, headers, body[:n]


def exchange(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    with connect(port) as sock:
        sock.sendall(raw)
        return read_response(sock)


def post(body: bytes, content_type: str | None = "text/plain", length: str | None = None) -> bytes:
    head = "POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if content_type is not None:
        head += f"Content-Type: {content_type}\r\n"
    head += f"Content-Length: {len(body) if length is None else length}\r\n\r\n"
    return head.encode() + body


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded by WAIT_S)."""
    data = b""
    sock.settimeout(WAIT_S)
    while len(data) < 1 << 20:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        except TimeoutError:
            pytest.fail(f"the server kept the connection open {WAIT_S:g} s (got {data!r})")
        if not chunk:
            break
        data += chunk
    return data


def still_serves(s: Served) -> None:
    """The server answers a normal request, and has written no traceback."""
    status, _, body = exchange(s.port, post(a_record()))
    assert status == 200 and len(json.loads(body)["probabilities"]) == 1, body
    assert "Traceback" not in s.stderr(), s.stderr()


def error_of(body: bytes) -> str:
    return json.loads(body)["error"]


# ------------------------------------------------------------------ Content-Length and -Type
def test_a_content_length_that_is_not_a_number_is_a_400_and_the_server_goes_on(served):
    status, headers, body = exchange(served.port, post(b"hello", length="abc"))
    assert status == 400 and "Content-Length 'abc' is not a number" in error_of(body)
    assert headers["connection"] == "close"
    still_serves(served)


def test_a_negative_content_length_is_a_400(served):
    status, _, body = exchange(served.port, post(a_record(), length="-5"))
    assert status == 400 and "negative" in error_of(body)
    status, _, body = exchange(served.port, post(a_record(), length="10, 12"))
    assert status == 400
    twice = b"POST /predict HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!"
    status, _, body = exchange(served.port, twice)
    assert status == 400 and "conflicting Content-Length" in error_of(body)
    still_serves(served)


def test_a_post_without_a_content_length_is_a_411(served):
    status, _, body = exchange(served.port, b"POST /predict HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 411 and "Content-Length" in error_of(body)
    chunked = b"POST /predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    status, _, body = exchange(served.port, chunked)
    assert status == 411 and "Transfer-Encoding" in error_of(body)
    still_serves(served)


def test_a_body_over_the_limit_is_a_413_unread(served):
    status, _, body = exchange(served.port, post(b"", length=str(2 << 20)))
    assert status == 413 and "at most 1,048,576" in error_of(body)
    status, _, body = exchange(served.port, post(b"", length="9" * 5000))    # no int() of it
    assert status == 413
    still_serves(served)


def test_a_body_shorter_than_declared_is_closed_by_the_request_timeout(served):
    with connect(served.port) as sock:
        sock.sendall(post(b"0123456789", length="100"))
        data = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408 ") and b"request_timeout_s" in data, data
    still_serves(served)


def test_a_type_the_server_cannot_decode_is_a_415(served):
    status, _, body = exchange(served.port, post(a_record(), "image/png"))
    assert status == 415 and "image/png" in error_of(body)
    status, _, body = exchange(served.port, post(b"[" + json.dumps(a_record().decode()).encode() + b"]",
                                                 "application/json"))
    assert status == 200, body
    for accepted in (None, "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
                     "application/octet-stream", "application/x-ndjson"):
        status, _, body = exchange(served.port, post(a_record(), accepted))
        assert status == 200, (accepted, body)
    still_serves(served)


def test_bad_json_is_a_400(served):
    status, _, body = exchange(served.port, post(b'["unterminated', "application/json"))
    assert status == 400 and "not valid JSON" in error_of(body)
    still_serves(served)


@pytest.mark.parametrize("raw, want", [
    (b"GARBAGE\r\n\r\n", 400),                                              # one word
    (b"GET /healthz HTTP/1.x\r\n\r\n", 400),                                # bad version
    (b"GET /a /b /c HTTP/1.1\r\n\r\n", 400),                                # too many words
    (b"GET /healthz HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", 431),   # a header too long
    (b"GET /healthz HTTP/1.1\r\n" + b"X: 1\r\n" * 101 + b"\r\n", 431),      # too many headers
    (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414),                  # request line too long
    (b"DELETE /predict HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    (b"BREW /pot HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    (b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc", 404),
    (b"GET /predict HTTP/1.1\r\nHost: x\r\n\r\n", 405),                     # was a 404
    (b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc", 405),
], ids=["one-word", "version", "words", "long-header", "headers", "long-line", "delete", "brew",
        "get-path", "post-path", "get-predict", "post-healthz"])
def test_a_malformed_request_is_a_4xx_with_a_json_error(served, raw, want):
    status, headers, body = exchange(served.port, raw)
    assert status == want and headers["content-type"] == "application/json"
    assert error_of(body)
    if raw.startswith(b"GET /predict"):
        assert headers["allow"] == "POST" and "GET /predict is not served: POST it" in error_of(body)
    still_serves(served)


# ------------------------------------------------------------------ timeouts
def test_an_idle_connection_is_closed(served):
    with connect(served.port) as sock:
        assert read_until_closed(sock) == b""       # closed, and nothing said
    with connect(served.port) as sock:               # also after a request on the connection
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock)[0] == 200
        assert read_until_closed(sock) == b""
    still_serves(served)


def test_a_request_trickled_a_byte_at_a_time_is_closed(served):
    """Slowloris: one byte every 0.1 s, each well within the idle timeout; 400 bytes would
    take 40 s, far past the request timeout: the server closes the connection first."""
    trickle = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 400
    answer, closed = b"", False
    with connect(served.port) as sock:
        for byte in trickle:
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            readable, _, _ = select.select([sock], [], [], 0.1)
            if readable:
                answer = read_until_closed(sock)
                closed = True
                break
    assert closed, "the server still waited after the whole trickle"
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408 "), answer
    still_serves(served)


# ------------------------------------------------------------------ many connections
def test_thirty_simultaneous_connections_are_all_answered(served):
    n = 30
    start = threading.Barrier(n, timeout=WAIT_S)
    answers: list[int | str] = [0] * n

    def client(i: int) -> None:
        try:
            start.wait()
            answers[i] = exchange(served.port, post(a_record()))[0]
        except Exception as e:      # noqa: BLE001 - reported below, with the others
            answers[i] = repr(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * WAIT_S)
    assert answers == [200] * n
    still_serves(served)


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read a listen backlog")
def test_the_listen_backlog_is_the_systems(served):
    """The kernel's own record of the listening socket: ss shows its backlog as Send-Q."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{served.port}"], capture_output=True, text=True,
                         timeout=30, check=True).stdout.split()
    assert out[0] == "LISTEN" and int(out[2]) >= 128, out


def test_past_max_connections_a_new_connection_is_a_503(bundle, tmp_path):
    s = start_serve(bundle, tmp_path, "--max-connections", "2")
    held: list[socket.socket] = []
    try:
        for _ in range(2):                  # two keep-alive connections hold both slots
            sock = connect(s.port)
            held.append(sock)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(sock)[0] == 200
        with connect(s.port) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, body = read_response(sock)
            assert status == 503 and "too many open connections" in error_of(body)
            assert headers["connection"] == "close" and read_until_closed(sock) == b""
        held.pop().close()                  # a slot frees once the server sees the close
        give_up = time.monotonic() + WAIT_S
        while True:
            status = exchange(s.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")[0]
            if status == 200 or time.monotonic() > give_up:
                break
            time.sleep(0.05)
        assert status == 200
        assert "Traceback" not in s.stderr(), s.stderr()
    finally:
        for sock in held:
            sock.close()
        s.stop()


def test_a_client_that_leaves_mid_request_leaves_no_traceback(served):
    for raw in (post(a_record())[:-5], post(a_record()), b"GET /healthz HTTP/1.1\r\n"):
        with connect(served.port) as sock:
            sock.sendall(raw)
            # RST instead of FIN: the server's next read or write fails outright
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    still_serves(served)


def test_bad_limits_are_refused_by_name(bundle, capsys):
    assert main(["serve", str(bundle), "--port", "0", "--max-body-bytes", "1GiB"]) != 0
    assert "--max-body-bytes" in capsys.readouterr().err
    assert main(["serve", str(bundle), "--port", "0", "--request-timeout-s", "0"]) != 0
    assert "--request-timeout-s" in capsys.readouterr().err


# ------------------------------------------------------------------ stopping
def test_sigterm_answers_the_request_in_flight_then_exits(bundle, tmp_path):
    """SIGTERM while a request's body is still arriving: no new connection is accepted, the
    request is answered (200, Connection: close) and the server exits 0. It used to exit at
    once, the client's connection closed without an answer."""
    s = start_serve(bundle, tmp_path, "--request-timeout-s", str(WAIT_S))
    try:
        body = a_record() + b"\n" + a_record()
        with connect(s.port) as sock:
            head, _ = post(body).split(b"\r\n\r\n", 1)
            sock.sendall(head + b"\r\nExpect: 100-continue\r\n\r\n" + body[:-10])
            got = b""
            while b"\r\n\r\n" not in got:              # its headers are read: it is in flight
                chunk = sock.recv(1024)
                assert chunk, got
                got += chunk
            assert got.startswith(b"HTTP/1.1 100"), got
            s.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + WAIT_S
            while True:                                 # until the listening socket is closed
                try:
                    socket.create_connection(("127.0.0.1", s.port), timeout=WAIT_S).close()
                except (ConnectionRefusedError, ConnectionResetError):     # reset: in its backlog
                    break
                assert time.monotonic() < deadline and s.proc.poll() is None
                time.sleep(0.05)
            sock.sendall(body[-10:])
            status, headers, answer = read_response(sock)
        assert status == 200 and len(json.loads(answer)["probabilities"]) == 2, answer
        assert headers["connection"] == "close"
        assert s.proc.wait(timeout=WAIT_S) == 0
        assert "Traceback" not in s.stderr(), s.stderr()
    finally:
        s.stop()
