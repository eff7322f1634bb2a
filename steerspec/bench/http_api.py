"""The HTTP API beside the gRPC SDK at the same load: N concurrent streaming clients, time per output token and
throughput through each, the two interleaved over repeats, against one verifier, drafter and coordinator
(service processes on loopback; the coordinator serves both APIs).

    steerspec bench http --clients 8 --max-tokens 48 --repeats 3 --json docs/results/data/http/http-vs-grpc.json

Every client streams one greedy completion of the same prompt through either API, so both APIs generate the
same tokens; TPOT is a client's (last token's arrival - first token's) / (tokens - 1), throughput the round's
tokens over its wall time (first request sent to last token received).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Tuple

from steerspec.bench.processes import Part, free_port

PROMPTS = ("def fibonacci(n):", "class Queue:", "import os\n", "for i in range(10):", "def parse_args(argv):",
           "with open(path) as f:", "async def fetch(url):", "if __name__ == \"__main__\":")
APIS = ("grpc", "http")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", default="verifier", help="bundled name or checkpoint directory")
    parser.add_argument("--drafter", default="pretrained", help="bundled name or checkpoint directory")
    parser.add_argument("--clients", type=int, default=8, help="concurrent streaming clients per round")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per completion")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per block")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per API (interleaved: grpc, http, http, grpc...)")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="emulated coordinator-verifier round trip")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per service process")
    parser.add_argument("--json", default=None, help="write the measurements here")


def grpc_client(target: str, prompt: str, args) -> Tuple[float, List[Tuple[float, int]]]:
    """One streamed generation through the gRPC SDK: (start, [(arrival, tokens)...])."""
    # lazy: the SDK is the coordinator's (a layer above bench's imports at CLI start-up)
    from coordinator.client import Chunk, Client

    arrivals = []
    with Client(target, retries=0) as client:
        start = time.perf_counter()
        for item in client.generate(prompt, max_new_tokens=args.max_tokens, k=args.k, temperature=0.0, timeout=600):
            if isinstance(item, Chunk) and item.token_ids:
                arrivals.append((time.perf_counter(), len(item.token_ids)))
    return start, arrivals


def http_client(address: str, model: str, prompt: str, args) -> Tuple[float, List[Tuple[float, int]]]:
    """One streamed completion through the HTTP API (plain http.client, server-sent events): (start, arrivals);
    the text chunks' arrivals, the last one credited with the tokens the usage chunk counts beyond them."""
    host, port = address.rsplit(":", 1)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}, "k": args.k})
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    reply = conn.getresponse()
    if reply.status != 200:
        raise RuntimeError(f"HTTP {reply.status}: {reply.read()[:500]!r}")
    arrivals, total = [], 0
    for raw in reply:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("choices") and event["choices"][0].get("text"):
            arrivals.append([time.perf_counter(), 1])
        if event.get("usage"):
            total = event["usage"]["completion_tokens"]
    conn.close()
    if arrivals:  # text chunks carry no token counts: spread the usage over them (the last gets the rest)
        arrivals[-1][1] = max(1, total - (len(arrivals) - 1))
    return start, [tuple(a) for a in arrivals]


def one_round(api: str, targets: Dict[str, str], model: str, args) -> Dict[str, object]:
    """args.clients concurrent streamed generations through `api`: per-client TTFT and TPOT, the round's throughput."""
    results, errors = [None] * args.clients, []

    def run(i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        try:
            results[i] = grpc_client(targets["grpc"], prompt, args) if api == "grpc" else \
                http_client(targets["http"], model, prompt, args)
        except Exception as exc:  # noqa: BLE001 - reported after the round
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(900)
    if errors:
        raise RuntimeError(f"{api}: {errors[0]}")
    ttft, tpot, tokens = [], [], 0
    first_start, last_end = min(r[0] for r in results), max(r[1][-1][0] for r in results)
    for start, arrivals in results:
        n = sum(count for _, count in arrivals)
        tokens += n
        ttft.append(arrivals[0][0] - start)
        if n > 1:
            tpot.append((arrivals[-1][0] - arrivals[0][0]) / (n - 1))
    return {"api": api, "tokens": tokens, "wall_s": last_end - first_start,
            "throughput_tok_s": tokens / (last_end - first_start), "ttft_s": ttft, "tpot_s": tpot}


def _parts(args, workdir: Path) -> List[Part]:
    py = [sys.executable, "-m", "steerspec", "serve"]
    v_port, d_port, c_port, h_port = free_port(), free_port(), free_port(), free_port()
    common = ["--threads", str(args.threads)]
    verifier = Part("verifier", "verifier", py + ["verifier", "--port", str(v_port), "--model", args.verifier] + common,
                    v_port, workdir, threads=args.threads)
    drafter = Part("drafter", "drafter", py + ["drafter", "--port", str(d_port), "--model", args.drafter] + common,
                   d_port, workdir, threads=args.threads)
    coordinator = Part("coordinator", "coordinator",
                       py + ["coordinator", "--port", str(c_port), "--verifier", verifier.address, "--drafter",
                             drafter.address, "--http-port", str(h_port), "--rtt-ms", str(args.rtt_ms)],
                       c_port, workdir)
    coordinator.http_port = h_port
    return [verifier, drafter, coordinator]


def summarise(rounds: List[Dict[str, object]]) -> Dict[str, Dict[str, float]]:
    out = {}
    for api in APIS:
        mine = [r for r in rounds if r["api"] == api]
        tpot = sorted(t for r in mine for t in r["tpot_s"])
        ttft = sorted(t for r in mine for t in r["ttft_s"])
        throughput = [r["throughput_tok_s"] for r in mine]
        out[api] = {"rounds": len(mine), "tpot_ms_p50": 1e3 * statistics.median(tpot),
                    "tpot_ms_p90": 1e3 * tpot[int(0.9 * (len(tpot) - 1))],
                    "ttft_ms_p50": 1e3 * statistics.median(ttft),
                    "throughput_tok_s_mean": statistics.fmean(throughput),
                    "throughput_tok_s_min": min(throughput), "throughput_tok_s_max": max(throughput)}
    return out


async def _start(parts: List[Part]) -> None:
    for part in parts:
        part.start()
        if not await part.wait_ready():
            raise RuntimeError(f"{part.name} did not start: {part.tail()}")


def run(args: argparse.Namespace) -> int:
    if args.clients < 1 or args.repeats < 1 or args.max_tokens < 2:
        print("steerspec bench http: --clients and --repeats must be >= 1, --max-tokens >= 2", file=sys.stderr)
        return 2
    command = "steerspec bench http " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "http"] else ""
    workdir = Path(tempfile.mkdtemp(prefix="steerspec-bench-http-"))
    parts = _parts(args, workdir)
    try:
        asyncio.run(_start(parts))
        targets = {"grpc": parts[2].address, "http": f"127.0.0.1:{parts[2].http_port}"}
        conn = http.client.HTTPConnection("127.0.0.1", parts[2].http_port, timeout=60)
        conn.request("GET", "/v1/models")
        model = json.loads(conn.getresponse().read())["data"][0]["id"]
        conn.close()
        one_round("grpc", targets, model, argparse.Namespace(**{**vars(args), "clients": 1}))  # warm-up
        one_round("http", targets, model, argparse.Namespace(**{**vars(args), "clients": 1}))
        rounds = []
        for repeat in range(args.repeats):
            for api in (APIS if repeat % 2 == 0 else APIS[::-1]):  # interleaved: neither API always goes first
                rounds.append(one_round(api, targets, model, args))
                r = rounds[-1]
                print(f"round {repeat} {api:>4}: {r['tokens']} tokens in {r['wall_s']:.2f} s = "
                      f"{r['throughput_tok_s']:.1f} tok/s, TPOT p50 {1e3 * statistics.median(r['tpot_s']):.1f} ms",
                      flush=True)
    finally:
        for part in parts:
            part.stop()
    summary = summarise(rounds)
    print(f"\n{'API':<5} {'TPOT p50 ms':>12} {'TPOT p90 ms':>12} {'TTFT p50 ms':>12} {'tok/s mean':>11} {'(min-max)':>14}")
    for api, s in summary.items():
        print(f"{api:<5} {s['tpot_ms_p50']:>12.1f} {s['tpot_ms_p90']:>12.1f} {s['ttft_ms_p50']:>12.1f} "
              f"{s['throughput_tok_s_mean']:>11.1f} {s['throughput_tok_s_min']:>6.1f}-{s['throughput_tok_s_max']:.1f}")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if not callable(v)}
        Path(args.json).write_text(json.dumps({"command": command, "args": settings, "summary": summary,
                                               "rounds": rounds}, indent=1, default=float) + "\n")
    return 0
