"""Replicas register themselves in Redis: placement from the registry alone, load metadata, withdrawal
before the graceful stop, TTL expiry of a replica that stops heartbeating, and the CLI flags."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
import uuid
from dataclasses import replace

import grpc
import pytest

from coord_helpers import greedy_reference, kill, load_cached, spawn_service, wait_ready
from coordinator.server import Coordinator, serve as serve_coordinator
from steerspec.serving.identity import ModelIdentity, describe
from steerspec.serving.store import RedisStore
from service_helpers import open_verifier, wait_for_stats as poll  # polls any async getter
from steerspec.cli import main
from steerspec.serving.registration import advertised_address, announce
from steerspec.v1 import coordinator_pb2, coordinator_pb2_grpc, verifier_pb2_grpc

PROMPT = [5, 17, 42, 9]
TTL_S = 1.5  # registry TTL of the shared replicas: heartbeats every 0.5 s, slack for a loaded 2-core CI box


@pytest.fixture
def prefix() -> str:
    return f"test-reg-{uuid.uuid4().hex[:8]}:"


@pytest.fixture
async def registry(redis_url, prefix):
    """A RedisStore over this test's keys (what a coordinator reads)."""
    store = RedisStore(redis_url, prefix=prefix)
    yield store
    await store.close()


async def start_replica(kind: str, model_dir, redis_url: str, prefix: str, ttl_s: float):
    """A verifier or drafter server on 127.0.0.1:0 registered in Redis -> (RunningServer, Registration)."""
    if kind == "verifier":
        from verifier_service.server import VerifierConfig, serve

        running, servicer = await serve(load_cached(model_dir), VerifierConfig(), host="127.0.0.1", port=0)
    else:
        from drafter_service.server import DrafterConfig, serve

        running, servicer = await serve(load_cached(model_dir), DrafterConfig(), host="127.0.0.1", port=0)
    registration = await announce(running, kind, load=lambda: len(servicer.table), redis_url=redis_url,
                                  ttl_s=ttl_s, prefix=prefix)
    return running, registration


@pytest.fixture
async def replicas(tiny_pair, redis_url, prefix):
    """A registered verifier and drafter (TTL 1.5 s: heartbeats every 0.5 s); stopped afterwards."""
    started = [await start_replica(kind, model_dir, redis_url, prefix, ttl_s=TTL_S)
               for kind, model_dir in zip(("verifier", "drafter"), tiny_pair)]
    yield started
    for running, _ in started:
        await running.stop(grace=0.5)


def addresses(endpoints) -> list:
    return [e.address for e in endpoints]


# ----------------------------------------------------------------------------- placement


async def test_coordinator_places_on_registered_replicas_only(replicas, redis_url, prefix, tiny_pair):
    (verifier, v_reg), (drafter, d_reg) = replicas
    assert v_reg.address == verifier.target and d_reg.address == drafter.target
    coordinator = Coordinator(store=RedisStore(redis_url, prefix=prefix))  # no static replicas
    running = await serve_coordinator(coordinator, host="127.0.0.1", port=0)
    try:
        async with grpc.aio.insecure_channel(running.target) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            responses = [r async for r in stub.Generate(coordinator_pb2.GenerateRequest(
                prompt_ids=PROMPT, max_new_tokens=16, k=4), timeout=60)]
        summary = responses[-1].summary
        assert list(summary.token_ids) == greedy_reference(tiny_pair[0], PROMPT, 16)
        assert summary.drafted > 0  # speculative: the registered drafter was used
        record = await coordinator.store.get_session(summary.session_id)
        assert record.placement == {"verifier": verifier.target, "drafter": drafter.target}
    finally:
        await running.stop(grace=0.5)


async def test_entries_carry_active_sessions(replicas, registry):
    (verifier, _), (drafter, _) = replicas
    assert [(e.address, e.meta) for e in await registry.live("verifier")] == [(verifier.target, {"active_sessions": 0})]
    assert [(e.address, e.meta) for e in await registry.live("drafter")] == [(drafter.target, {"active_sessions": 0})]
    async with grpc.aio.insecure_channel(verifier.target) as channel:
        call, opened = await open_verifier(verifier_pb2_grpc.VerifierServiceStub(channel), PROMPT)
        assert opened.WhichOneof("kind") == "ready", opened
        live = await poll(lambda: registry.live("verifier"),
                          lambda es: es and es[0].meta["active_sessions"] == 1, 4 * TTL_S)
        assert live[0].meta == {"active_sessions": 1}
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
    live = await poll(lambda: registry.live("verifier"),
                      lambda es: es and es[0].meta["active_sessions"] == 0, 4 * TTL_S)
    assert live[0].meta == {"active_sessions": 0}


# ----------------------------------------------------------------------------- leaving the registry


async def test_graceful_stop_withdraws_before_draining(tiny_pair, redis_url, prefix, registry):
    """TTL 30 s: only the withdrawal can remove the entry; it goes while an in-flight stream still runs."""
    verifier, registration = await start_replica("verifier", tiny_pair[0], redis_url, prefix, ttl_s=30.0)
    async with grpc.aio.insecure_channel(verifier.target) as channel:
        call, opened = await open_verifier(verifier_pb2_grpc.VerifierServiceStub(channel), PROMPT)
        assert opened.WhichOneof("kind") == "ready", opened
        assert addresses(await registry.live("verifier")) == [verifier.target]
        stopping = asyncio.create_task(verifier.stop(grace=10.0))
        live = await poll(lambda: registry.live("verifier"), lambda es: not es, 2.0)
        assert live == []
        assert not stopping.done()  # still draining the in-flight session
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        await asyncio.wait_for(stopping, 5.0)
    assert registration.task is None
    await asyncio.sleep(0.1)
    assert await registry.live("verifier") == []  # no heartbeat brought it back


@pytest.mark.slow
async def test_replica_that_stops_heartbeating_expires_after_its_ttl(replicas, registry):
    (verifier, registration), (drafter, _) = replicas
    await asyncio.sleep(1.5 * TTL_S)  # past the TTL: alive thanks to the heartbeats
    assert addresses(await registry.live("verifier")) == [verifier.target]
    registration.task.cancel()  # as if the process froze or died: no withdrawal
    cancelled = time.monotonic()
    assert addresses(await registry.live("verifier")) == [verifier.target]
    live = await poll(lambda: registry.live("verifier"), lambda es: not es, 3 * TTL_S)
    assert live == [] and time.monotonic() - cancelled < TTL_S + 1.0
    assert addresses(await registry.live("drafter")) == [drafter.target]  # the other one still heartbeats


def test_advertised_address():
    assert advertised_address("127.0.0.1", 50061) == "127.0.0.1:50061"
    assert advertised_address("0.0.0.0", 50061) == f"{socket.gethostname()}:50061"
    assert advertised_address("::", 7) == f"{socket.gethostname()}:7"
    assert advertised_address("::1", 7) == "[::1]:7"
    assert advertised_address("0.0.0.0", 50061, "edge-3.lan:9000") == "edge-3.lan:9000"


# ----------------------------------------------------------------------------- CLI


def run_cli(capsys, argv):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse errors
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("kind", ["verifier", "drafter"])
def test_unreachable_redis_fails_before_the_model_loads(kind, capsys):
    """A model that cannot load: the error is about Redis, so Redis was checked first."""
    start = time.monotonic()
    code, err = run_cli(capsys, ["serve", kind, "--redis-url", "redis://127.0.0.1:1", "--port", "0",
                                 "--model", "/nonexistent/model"])
    assert code == 2 and time.monotonic() - start < 5.0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "cannot reach Redis at redis://127.0.0.1:1" in lines[0], err


@pytest.mark.parametrize("argv, needle", [
    (["--heartbeat-ttl-s", "0"], "--heartbeat-ttl-s"),
    (["--heartbeat-ttl-s", "nan"], "--heartbeat-ttl-s"),
    (["--redis-url", "redis://127.0.0.1:1", "--advertise", "nohost"], "--advertise expects"),
    (["--redis-url", "redis://127.0.0.1:1", "--advertise", "a:1,b:2"], "--advertise expects one"),
    (["--advertise", "edge:9000"], "--advertise needs --redis-url"),
    (["--redis-url", "http://127.0.0.1:1"], "bad --redis-url"),
])
@pytest.mark.parametrize("kind", ["verifier", "drafter"])
def test_serve_rejects_bad_registration_flags(kind, argv, needle, capsys):
    code, err = run_cli(capsys, ["serve", kind, "--port", "0", "--model", "/nonexistent/model", *argv])
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err


@pytest.mark.parametrize("kind", ["verifier", "drafter", "coordinator"])
@pytest.mark.parametrize("port", ["99999", "65536", "-1"])
def test_serve_port_out_of_range_is_refused(kind, port, capsys):
    """grpc would bind some other port for these; the CLI refuses them before loading anything."""
    extra = ["--verifier", "127.0.0.1:1"] if kind == "coordinator" else ["--model", "/nonexistent/model"]
    code, err = run_cli(capsys, ["serve", kind, "--port", port, *extra])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "--port must be in [0, 65535]" in lines[0], err


@pytest.fixture
def taken_port():
    """A loopback port another socket is listening on."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


@pytest.mark.parametrize("kind", ["verifier", "drafter", "coordinator"])
def test_serve_on_a_taken_port_is_one_line(kind, taken_port, tiny_pair, capsys):
    model = {"verifier": tiny_pair[0], "drafter": tiny_pair[1]}.get(kind)
    extra = ["--verifier", "127.0.0.1:1"] if kind == "coordinator" else ["--model", str(model)]
    code, err = run_cli(capsys, ["serve", kind, "--port", str(taken_port), *extra])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and f"cannot bind 127.0.0.1:{taken_port}" in lines[0], err


@pytest.mark.parametrize("argv, needle", [(["--metrics-port", "99999"], "--metrics-port must be in"),
                                          (["--metrics-port", "TAKEN"], "cannot serve metrics on 127.0.0.1:")])
def test_coordinator_bad_metrics_port_is_one_line(argv, needle, taken_port, capsys):
    argv = [str(taken_port) if a == "TAKEN" else a for a in argv]
    code, err = run_cli(capsys, ["serve", "coordinator", "--port", "0", "--verifier", "127.0.0.1:1", *argv])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], err


def test_coordinator_without_replicas_or_registry_is_refused(capsys):
    code, err = run_cli(capsys, ["serve", "coordinator", "--port", "0"])
    assert code == 2 and "--redis-url" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_serve_verifier_registers_and_withdraws_on_sigterm(tiny_pair, redis_url):
    """The real CLI: registered under the default prefix once it prints its address; gone at SIGTERM
    long before its 30 s TTL."""
    proc, log = spawn_service("verifier", tiny_pair[0], "--redis-url", redis_url, "--heartbeat-ttl-s", "30")
    try:
        target = wait_ready(proc, log)

        async def check() -> None:
            store = RedisStore(redis_url)
            try:
                live = await store.live("verifier")
                assert target in addresses(live), live
                meta = next(e for e in live if e.address == target).meta
                assert meta["active_sessions"] == 0
                identity = ModelIdentity.from_dict(meta["identity"])  # what placement pairs sessions by
                assert identity == replace(describe(tiny_pair[0]), name=str(tiny_pair[0]))
                proc.send_signal(signal.SIGTERM)
                live = await poll(lambda: store.live("verifier"), lambda es: target not in addresses(es), 10.0)
                assert target not in addresses(live)
            finally:
                await store.close()

        asyncio.run(check())
        assert proc.wait(timeout=20) == 0
    finally:
        kill(proc)
