"""Chaos soak: N concurrent SDK clients generate greedy against real services while parts are killed.

Two verifier replicas, two drafters, a coordinator and a real `redis-server` run as their own
processes on 127.0.0.1 (fixed free ports, so a restarted part comes back where it was). For
`--duration` seconds (longer only until a session completes after the last fault), `--clients`
SDK clients each run greedy generations back to back, while a
fault injector (seeded) waits a random gap, then either SIGKILLs one part (a verifier, a drafter,
Redis or the coordinator) and restarts it `--down-s` later, or sends malformed (garbage bytes) or
oversized requests to the servers. At the end every streamed token is checked against the
verifier-only greedy output of its prompt (`engine.autoregressive_generate`): tokens lost,
repeated or wrong must all be 0. Reports sessions completed, p50/p99 session latency, faults
injected and survived, errors by status code (table, or `--json`; `--out` writes the JSON).

A kill is survived when the part is serving again and a session that started after that
completed with the right tokens; a malformed or oversized request when every server answered it
with the expected status code and still passes its health check. Exit code 1 when a token is
lost, repeated or wrong or a fault was not survived.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.cli import eos_ids_of
from coordinator.client import Chunk, Client, Summary
from steerspec.bench.processes import READY_TIMEOUT_S, Part, free_port
from steerspec.decoding.engine import DecodeConfig, autoregressive_generate
from steerspec.decoding.sampling import SamplingParams
from steerspec.errors import UsageError
from steerspec.models import load_model
from steerspec.models.checkpoints import resolve_model_dir
from steerspec.models.loading import load_tokenizer
from steerspec.observability.trace_summary import percentile
from steerspec.v1 import coordinator_pb2, coordinator_pb2_grpc

KILLS = ("verifier", "drafter", "redis", "coordinator")
PROBES = ("malformed", "oversized")
FAULTS = KILLS + PROBES
GARBAGE = b"\xff\xff\xff\xff\x0f garbage, not a protobuf message"
FALLBACK_PROMPTS = ["def fibonacci(n):", "class Queue:", "import os\nimport sys\n", "def is_prime(n):",
                    "for name in sorted(", "def binary_search(items, target):", "class Stack:", "# Read a CSV file"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=300.0, help="seconds the clients generate (default 300)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent SDK clients (default 16)")
    parser.add_argument("--verifier", default="verifier", help="bundled name or checkpoint directory")
    parser.add_argument("--drafter", default="pretrained", help="bundled name or checkpoint directory")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per generation (default 32)")
    parser.add_argument("--k", type=int, default=4, help="draft length per block")
    parser.add_argument("--prompts", type=int, default=16, help="distinct prompts the clients draw from")
    parser.add_argument("--prompt-set", default="indist", help="bundled eval set (falls back to built-in prompts)")
    parser.add_argument("--fault-every-s", type=float, default=30.0,
                        help="mean gap between faults (each gap uniform in [0.5, 1.5] times this)")
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help=f"fault kinds to inject, comma-separated (default: {','.join(FAULTS)})")
    parser.add_argument("--down-s", type=float, default=1.0, help="how long a killed part stays down")
    parser.add_argument("--session-timeout-s", type=float, default=120.0, help="deadline of one generation")
    parser.add_argument("--seed", type=int, default=0, help="seeds prompt choice and the fault schedule")
    parser.add_argument("--redis-server", default=None, help="redis-server binary (default: the one on PATH)")
    parser.add_argument("--workdir", default=None, help="keep the services' logs here (default: a temp dir)")
    parser.add_argument("--out", "--json-out", dest="out", default=None, help="write the JSON report here")
    parser.add_argument("--json", action="store_true", help="print the JSON report instead of the table")


# ---------------------------------------------------------------------------------- processes


class Deployment:
    """Redis, 2 verifiers, 2 drafters and a coordinator as processes on loopback."""

    def __init__(self, args, workdir: Path, redis_binary: str) -> None:
        py = [sys.executable, "-m", "steerspec", "serve"]
        common = ["--threads", "1", "--log-level", "warning"]
        self.redis = Part("redis", "redis", [], free_port(), workdir)
        self.redis.argv = [redis_binary, "--bind", "127.0.0.1", "--port", str(self.redis.port), "--save", "",
                           "--appendonly", "no", "--dir", str(workdir), "--protected-mode", "yes"]
        self.verifiers = [Part(f"verifier-{i}", "verifier", [], free_port(), workdir) for i in range(2)]
        self.drafters = [Part(f"drafter-{i}", "drafter", [], free_port(), workdir) for i in range(2)]
        for part in self.verifiers:
            part.argv = py + ["verifier", "--port", str(part.port), "--model", str(args.verifier), *common]
        for part in self.drafters:
            part.argv = py + ["drafter", "--port", str(part.port), "--model", str(args.drafter), *common]
        self.coordinator = Part("coordinator", "coordinator", [], free_port(), workdir)
        self.coordinator.argv = py + [
            "coordinator", "--port", str(self.coordinator.port), "--tokenizer", str(args.verifier),
            "--verifier", ",".join(p.address for p in self.verifiers),
            "--drafter", ",".join(p.address for p in self.drafters),
            "--redis-url", f"redis://127.0.0.1:{self.redis.port}/0", "--heartbeat-ttl-s", "3", "--grace-s", "1",
            "--log-level", "warning"]

    @property
    def parts(self) -> List[Part]:
        return [self.redis, *self.verifiers, *self.drafters, self.coordinator]

    def of_kind(self, kind: str) -> List[Part]:
        return [p for p in self.parts if p.kind == kind]

    async def start(self) -> None:
        """Start everything (the coordinator once Redis answers); UsageError naming a part that failed."""
        for part in self.parts[:-1]:
            part.start()
        for part in self.parts[:-1]:
            if not await part.wait_ready():
                raise UsageError(f"{part.name} did not start: {part.tail(300).strip().splitlines()[-1:]}")
        self.coordinator.start()
        if not await self.coordinator.wait_ready():
            raise UsageError(f"the coordinator did not start: {self.coordinator.tail(300).strip().splitlines()[-1:]}")

    def stop(self) -> None:
        """SIGTERM everything at once, then reap (SIGKILL what is still up after 10 s)."""
        for part in self.parts:
            if part.proc is not None and part.proc.poll() is None:
                part.proc.terminate()
        for part in reversed(self.parts):
            part.stop()


# ---------------------------------------------------------------------------------- clients


@dataclass
class Session:
    """One generation as a client saw it."""

    client: int
    prompt: int
    session_id: str
    start: float
    end: float = 0.0
    streamed: List[int] = field(default_factory=list)
    summary_ids: Optional[List[int]] = None
    finish_reason: str = ""
    retries: int = 0
    resumes: int = 0
    error: str = ""  # status code name (or exception type) when it did not complete


class Clock:
    """When clients stop starting sessions: at `stop_at`, or later while the last fault has not yet
    been followed by a completed session (so a fault near the end can still be seen survived);
    never after `hard_stop`."""

    def __init__(self, stop_at: float, hard_stop: float) -> None:
        self.stop_at, self.hard_stop = stop_at, hard_stop
        self.injecting = True
        self.last_fault_end = 0.0
        self.completed_after_fault = True

    def fault_ended(self) -> None:
        self.last_fault_end = time.monotonic()
        self.completed_after_fault = False

    def completed(self, session: "Session") -> None:
        if session.start >= self.last_fault_end:
            self.completed_after_fault = True

    def more(self) -> bool:
        now = time.monotonic()
        if now < self.stop_at:
            return True
        return now < self.hard_stop and (self.injecting or not self.completed_after_fault)


async def _client_loop(index: int, target: str, prompts: Sequence[List[int]], args, clock: Clock,
                       sessions: List[Session], seed: int) -> None:
    rng = random.Random(seed)
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.initial_reconnect_backoff_ms", 200),
               ("grpc.min_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]
    async with Client(target, retries=40, backoff_s=0.2, max_backoff_s=2.0, options=options) as client:
        while clock.more():
            which = rng.randrange(len(prompts))
            session = Session(client=index, prompt=which, session_id=uuid.uuid4().hex, start=time.monotonic())
            sessions.append(session)
            try:
                async for item in client.agenerate(prompt_ids=prompts[which], max_new_tokens=args.max_new_tokens,
                                                   k=args.k, temperature=0.0, seed=0, session_id=session.session_id,
                                                   timeout=args.session_timeout_s):
                    if isinstance(item, Chunk):
                        session.streamed.extend(item.token_ids)
                    elif isinstance(item, Summary):
                        session.summary_ids, session.finish_reason = list(item.token_ids), item.finish_reason
                        session.retries, session.resumes = item.retries, item.resumes
            except grpc.aio.AioRpcError as exc:
                session.error = exc.code().name
            except asyncio.CancelledError:
                session.error = "CANCELLED"
                raise
            except Exception as exc:  # noqa: BLE001 - recorded and reported (e.g. ResumeMismatch)
                session.error = type(exc).__name__
            finally:
                session.end = time.monotonic()
            if session.summary_ids is None and not session.error:
                session.error = "NO_SUMMARY"
            if not session.error:
                clock.completed(session)


# ---------------------------------------------------------------------------------- faults


@dataclass
class Fault:
    kind: str
    target: str
    at_s: float  # since the clients started
    recovered_s: Optional[float] = None  # kills: when the part was serving again
    codes: Dict[str, str] = field(default_factory=dict)  # probes: what each server answered
    expected: Dict[str, List[str]] = field(default_factory=dict)
    healthy_after: bool = True
    done: bool = False  # the kill-restart or the probe ran to its end
    error: str = ""  # why the injector could not finish it
    survived: bool = False


async def _code_of(call) -> str:
    """The status code name a call ended with ("OK" when it answered)."""
    try:
        if hasattr(call, "write"):  # a client-streaming call: send the garbage now
            await call.write(GARBAGE)
            await call.read()
            await call.done_writing()
        else:
            async for _ in call:
                pass
        return (await call.code()).name
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    except asyncio.InvalidStateError:
        return (await call.code()).name
    finally:
        call.cancel()


async def _healthy(address: str) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def _malformed(fault: Fault, deployment: Deployment, rng: random.Random) -> None:
    """Garbage bytes on the coordinator's Generate and a verifier's and a drafter's streams."""
    ident = lambda b: b  # noqa: E731 - raw bytes both ways
    verifier, drafter = rng.choice(deployment.verifiers), rng.choice(deployment.drafters)
    targets = [("coordinator", deployment.coordinator.address, "/steerspec.v1.CoordinatorService/Generate", False),
               (verifier.name, verifier.address, "/steerspec.v1.VerifierService/Verify", True),
               (drafter.name, drafter.address, "/steerspec.v1.DrafterService/Draft", True)]
    fault.target = ",".join(t[0] for t in targets)
    for name, address, method, streaming in targets:
        async with grpc.aio.insecure_channel(address) as channel:
            if streaming:
                call = channel.stream_stream(method, request_serializer=ident, response_deserializer=ident)(timeout=10)
            else:
                call = channel.unary_stream(method, request_serializer=ident, response_deserializer=ident)(
                    GARBAGE, timeout=10)
            fault.codes[name] = await _code_of(call)
        fault.expected[name] = ["INVALID_ARGUMENT"]
        fault.healthy_after = fault.healthy_after and await _healthy(address)


async def _oversized(fault: Fault, deployment: Deployment) -> None:
    """A 3 MB text prompt, 200k prompt ids (both past the context) and a message past the 16 MB limit."""
    fault.target = "coordinator"
    requests = {"text_3mb": coordinator_pb2.GenerateRequest(prompt="def f():\n    return 1\n" * 140_000,
                                                             max_new_tokens=8),
                "ids_200k": coordinator_pb2.GenerateRequest(prompt_ids=[5] * 200_000, max_new_tokens=8),
                "message_17mb": coordinator_pb2.GenerateRequest(prompt="x" * (17 << 20), max_new_tokens=8)}
    expected = {"text_3mb": ["OUT_OF_RANGE"], "ids_200k": ["OUT_OF_RANGE"], "message_17mb": ["RESOURCE_EXHAUSTED"]}
    options = [("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(deployment.coordinator.address, options=options) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        for name, request in requests.items():
            fault.codes[name] = await _code_of(stub.Generate(request, timeout=30))
            fault.expected[name] = expected[name]
    fault.healthy_after = await _healthy(deployment.coordinator.address)


async def _kill_and_restart(fault: Fault, part: Part, down_s: float, t0: float) -> None:
    part.kill()
    await asyncio.sleep(down_s)
    part.start()
    if await part.wait_ready():
        fault.recovered_s = time.monotonic() - t0


async def _inject(deployment: Deployment, kinds: Sequence[str], args, t0: float, clock: Clock,
                  faults: List[Fault]) -> None:
    """Faults at seeded random gaps, kinds in shuffled rounds, none in the last stretch (so that
    sessions after the last one show it was survived)."""
    try:
        await _inject_until(deployment, kinds, args, t0, clock, faults)
    finally:
        clock.injecting = False


async def _inject_until(deployment: Deployment, kinds: Sequence[str], args, t0: float, clock: Clock,
                        faults: List[Fault]) -> None:
    rng = random.Random(args.seed + 1)
    last = clock.stop_at - max(8.0, 0.15 * args.duration)
    order: List[str] = []
    while True:
        gap = rng.uniform(0.5, 1.5) * args.fault_every_s
        if time.monotonic() + gap > last:
            return
        await asyncio.sleep(gap)
        if not order:
            order = list(kinds)
            rng.shuffle(order)
        kind = order.pop()
        fault = Fault(kind=kind, target="", at_s=round(time.monotonic() - t0, 2))
        faults.append(fault)
        try:
            if kind in KILLS:
                part = rng.choice(deployment.of_kind(kind))
                fault.target = part.name
                await _kill_and_restart(fault, part, args.down_s, t0)
            elif kind == "malformed":
                await _malformed(fault, deployment, rng)
            else:
                await _oversized(fault, deployment)
            fault.done = True
        except Exception as exc:  # noqa: BLE001 - the fault is reported as not survived; the soak goes on
            fault.error = f"{type(exc).__name__}: {exc}"[:300]
        clock.fault_ended()


# ---------------------------------------------------------------------------------- checking


def _prompts(args, tokenizer) -> List[List[int]]:
    texts: List[str] = []
    eval_file = Path(__file__).resolve().parent.parent / "assets" / "eval" / f"{args.prompt_set}.jsonl"
    if eval_file.is_file():
        texts = [json.loads(line)["prompt"] for line in eval_file.read_text().splitlines() if line.strip()]
    texts = texts or list(FALLBACK_PROMPTS)
    prompts = [list(tokenizer(texts[i % len(texts)], add_special_tokens=False)["input_ids"])
               for i in range(args.prompts)]
    return [p for p in prompts if p] or [[1, 2, 3]]


def _references(args, prompts: Sequence[List[int]], used: Sequence[int], eos: Tuple[int, ...]) -> Dict[int, List[int]]:
    """The verifier-only greedy output of every prompt used (autoregressive, EOS included)."""
    model = load_model(args.verifier)
    config = DecodeConfig(max_new_tokens=args.max_new_tokens, sampling=SamplingParams(temperature=0.0),
                          eos_token_ids=eos)
    return {i: list(autoregressive_generate(model, prompts[i], config).token_ids) for i in sorted(set(used))}


def check(sessions: Sequence[Session], references: Dict[int, List[int]]) -> Dict[str, int]:
    """Tokens checked, lost, repeated and wrong over all sessions.

    Every streamed token is compared with the reference at its position (wrong); a completed
    session must also have streamed exactly the reference (missing tail: lost; extra: repeated)
    and its summary must list the same tokens."""
    out = {"tokens_checked": 0, "tokens_lost": 0, "tokens_repeated": 0, "tokens_wrong": 0, "sessions_bad": 0}
    for s in sessions:
        want = references[s.prompt]
        got = s.streamed
        wrong = sum(1 for a, b in zip(got, want) if a != b)
        lost = repeated = 0
        if s.summary_ids is not None:
            lost = max(0, len(want) - len(got))
            repeated = max(0, len(got) - len(want))
            if s.summary_ids != got:
                wrong += max(1, sum(1 for a, b in zip(s.summary_ids, got) if a != b))
        elif len(got) > len(want):
            repeated = len(got) - len(want)
        out["tokens_checked"] += len(got)
        out["tokens_lost"] += lost
        out["tokens_repeated"] += repeated
        out["tokens_wrong"] += wrong
        out["sessions_bad"] += int(bool(lost or repeated or wrong))
    return out


def _survived(fault: Fault, completed_ok: Sequence[Session], t0: float) -> bool:
    if not fault.done:
        return False
    if fault.kind in KILLS:
        if fault.recovered_s is None:
            return False
        return any(s.start - t0 >= fault.recovered_s for s in completed_ok)
    return fault.healthy_after and all(fault.codes.get(n) in codes for n, codes in fault.expected.items())


# ---------------------------------------------------------------------------------- running


def _parse_kinds(text: str) -> List[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in FAULTS]
    if bad or not kinds:
        raise UsageError(f"--faults takes kinds from {','.join(FAULTS)}, got '{text}'")
    return kinds


def _validate(args) -> Tuple[List[str], str]:
    if not (args.duration > 0 and args.clients >= 1 and args.max_new_tokens >= 1 and args.k >= 1
            and args.prompts >= 1 and args.fault_every_s > 0 and args.down_s >= 0 and args.session_timeout_s > 0):
        raise UsageError("--duration, --fault-every-s and --session-timeout-s must be > 0, --down-s >= 0, "
                         "--clients, --max-new-tokens, --k and --prompts >= 1")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise UsageError(f"--out: directory {Path(args.out).resolve().parent} does not exist")
    binary = args.redis_server or shutil.which("redis-server")
    if not binary or not Path(binary).is_file():
        raise UsageError("redis-server not found: install it (apt-get install redis-server) or pass --redis-server")

    args.verifier, args.drafter = str(resolve_model_dir(args.verifier)), str(resolve_model_dir(args.drafter))
    return _parse_kinds(args.faults), binary


async def _soak(args, kinds: Sequence[str], redis_binary: str, workdir: Path) -> Dict[str, object]:
    tokenizer = load_tokenizer(args.verifier)
    prompts = _prompts(args, tokenizer)
    eos = eos_ids_of(Path(args.verifier), tokenizer)
    deployment = Deployment(args, workdir, redis_binary)
    sessions: List[Session] = []
    faults: List[Fault] = []
    try:
        startup = time.monotonic()
        await deployment.start()
        startup_s = time.monotonic() - startup
        t0 = time.monotonic()
        clock = Clock(t0 + args.duration, t0 + args.duration + READY_TIMEOUT_S)
        clients = [asyncio.create_task(_client_loop(i, deployment.coordinator.address, prompts, args, clock,
                                                    sessions, args.seed * 1000 + i)) for i in range(args.clients)]
        injector = asyncio.create_task(_inject(deployment, kinds, args, t0, clock, faults))
        await asyncio.wait(clients, timeout=args.duration + READY_TIMEOUT_S + args.session_timeout_s + 30)
        injector.cancel()
        for task in clients:
            task.cancel()
        await asyncio.gather(injector, *clients, return_exceptions=True)
        wall_s = time.monotonic() - t0
    finally:
        deployment.stop()
    started = time.monotonic()
    references = _references(args, prompts, [s.prompt for s in sessions], eos)
    report = _report(args, sessions, faults, references, t0, wall_s, startup_s, kinds)
    report["reference_s"] = round(time.monotonic() - started, 2)
    return report


def _report(args, sessions, faults, references, t0, wall_s, startup_s, kinds) -> Dict[str, object]:
    counts = check(sessions, references)
    completed = [s for s in sessions if s.summary_ids is not None]
    good = [s for s in completed if s.streamed == references[s.prompt] == s.summary_ids]
    for fault in faults:
        fault.survived = _survived(fault, good, t0)
    errors: Dict[str, int] = {}
    for s in sessions:
        if s.error:
            errors[s.error] = errors.get(s.error, 0) + 1
    latencies = [s.end - s.start for s in completed]
    command = (f"steerspec bench soak --duration {args.duration:g} --clients {args.clients} --seed {args.seed} "
               f"--fault-every-s {args.fault_every_s:g} --faults {','.join(kinds)}")
    return {
        "command": command, "duration_s": args.duration, "wall_s": round(wall_s, 2),
        "startup_s": round(startup_s, 2), "clients": args.clients, "max_new_tokens": args.max_new_tokens,
        "k": args.k, "verifier": args.verifier, "drafter": args.drafter,
        "sessions_started": len(sessions), "sessions_completed": len(completed),
        "sessions_failed": len(sessions) - len(completed), **counts,
        "latency_s": {"p50": round(percentile(latencies, 50), 3) if latencies else None,
                      "p99": round(percentile(latencies, 99), 3) if latencies else None,
                      "max": round(max(latencies), 3) if latencies else None},
        "client_retries": sum(s.retries for s in completed), "resumes": sum(s.resumes for s in completed),
        "faults_injected": len(faults), "faults_survived": sum(f.survived for f in faults),
        "faults": [asdict(f) for f in faults], "errors_by_code": dict(sorted(errors.items())),
        "cpus": os.cpu_count(),
    }


def _print_table(report: Dict[str, object]) -> None:
    lat = report["latency_s"]
    rows = [("sessions completed", f"{report['sessions_completed']} of {report['sessions_started']}"),
            ("tokens checked", f"{report['tokens_checked']:,}"),
            ("lost / repeated / wrong",
             f"{report['tokens_lost']} / {report['tokens_repeated']} / {report['tokens_wrong']}"),
            ("latency p50 / p99 (s)", f"{lat['p50']} / {lat['p99']}"),
            ("faults survived", f"{report['faults_survived']} / {report['faults_injected']}"),
            ("client retries / resumes", f"{report['client_retries']} / {report['resumes']}"),
            ("errors by code", ", ".join(f"{k} {v}" for k, v in report["errors_by_code"].items()) or "none")]
    try:
        # lazy and optional: a plain listing when rich is missing
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for name, value in rows:
            print(f"{name:>26}  {value}")
        for f in report["faults"]:
            print(f"  {f['at_s']:>8.1f}s {f['kind']:<12} {f['target']:<24} survived={f['survived']}")
        return
    table = Table(title=f"chaos soak: {report['clients']} clients, {report['duration_s']:g} s ({report['command']})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    faults = Table(title="faults")
    for name in ("at s", "kind", "target", "recovered s", "answers", "survived"):
        faults.add_column(name)
    for f in report["faults"]:
        answers = ", ".join(f"{k} {v}" for k, v in f["codes"].items())
        faults.add_row(f"{f['at_s']:.1f}", f["kind"], f["target"],
                       "" if f["recovered_s"] is None else f"{f['recovered_s']:.1f}", answers, str(f["survived"]))
    console = Console()
    console.print(table)
    console.print(faults)


def run(args: argparse.Namespace) -> int:
    kinds, redis_binary = _validate(args)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="steerspec-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report = asyncio.run(_soak(args, kinds, redis_binary, workdir))
    if args.workdir:
        report["workdir"] = str(workdir)  # the parts' logs
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    lossless = report["tokens_lost"] == report["tokens_repeated"] == report["tokens_wrong"] == 0
    return 0 if lossless and report["faults_survived"] == report["faults_injected"] else 1
