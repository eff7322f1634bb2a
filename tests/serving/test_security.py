"""TLS, mutual TLS, bearer tokens, exclusive ports and malformed requests on real servers (issue 15).

Reproductions (before): servers only called `add_insecure_port` and the SDK only `insecure_channel`,
so anyone reaching a service could use it; a second `serve` on a taken port printed "serving on"
and shared it (SO_REUSEPORT); garbage request bytes gave UNKNOWN (DecodeError).
Certificates are generated here with `cryptography` (no key in the repo).
"""

from __future__ import annotations

import socket
import subprocess
import sys

import grpc
import pytest

from coord_helpers import ROOT, greedy_reference, service_env
from pki_helpers import make_pki
from coordinator.client import Client
from coordinator.local import LocalCluster
from steerspec.serving import security
from steerspec.errors import UsageError
from steerspec.serving.grpc_common import start_server
from steerspec.v1 import coordinator_pb2_grpc

pytestmark = pytest.mark.timeout(120)
PROMPT = [5, 17, 42, 9]
TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1/localhost, a client certificate, and a rogue CA's client."""
    return make_pki(tmp_path_factory.mktemp("pki"), TOKEN)


@pytest.fixture(autouse=True)
def _reset_security():
    security.reset()
    yield
    security.reset()


async def _secure_cluster(tiny_pair, pki, *, client_ca: bool):
    cert, key = pki["server"]
    security.configure(
        server=security.server_security(cert, key, pki["ca"] if client_ca else None, pki["tokens"]),
        client=security.client_security(pki["ca"], cert if client_ca else None, key if client_ca else None,
                                        token=TOKEN))
    return LocalCluster(str(tiny_pair[0]), str(tiny_pair[1]), eos_ids=())


async def test_tls_and_token_end_to_end(tiny_pair, pki):
    """TLS + tokens on all three services (coordinator -> verifier/drafter too); SDK with and without them."""
    want = greedy_reference(tiny_pair[0], PROMPT, 12)
    async with await _secure_cluster(tiny_pair, pki, client_ca=False) as cluster:
        async with Client(cluster.target, tls_ca=pki["ca"], token=TOKEN, retries=0) as client:
            summary = await client.acomplete(prompt_ids=PROMPT, max_new_tokens=12, k=4)
        assert summary.token_ids == want
        async with Client(cluster.target, tls_ca=pki["ca"], token="wrong", retries=0) as client:
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await client.acomplete(prompt_ids=PROMPT, max_new_tokens=4)
        assert bad.value.code() == grpc.StatusCode.UNAUTHENTICATED and "not one this server accepts" in bad.value.details()
        async with Client(cluster.target, tls_ca=pki["ca"], security=security.client_security(pki["ca"]),
                          retries=0) as client:
            with pytest.raises(grpc.aio.AioRpcError) as none:
                await client.acomplete(prompt_ids=PROMPT, max_new_tokens=4)
        assert none.value.code() == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in none.value.details()
        # plaintext against the TLS port never reaches the service
        async with Client(cluster.target, security=security.ClientSecurity(token=TOKEN), retries=0) as client:
            with pytest.raises(grpc.aio.AioRpcError) as plain:
                await client.acomplete(prompt_ids=PROMPT, max_new_tokens=4, timeout=5)
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_refuses_other_clients(tiny_pair, pki):
    """--tls-client-ca: a client certificate from that CA works, one from another CA or none does not."""
    async with await _secure_cluster(tiny_pair, pki, client_ca=True) as cluster:
        good = security.client_security(pki["ca"], *pki["client"], token=TOKEN)
        async with Client(cluster.target, security=good, retries=0) as client:
            summary = await client.acomplete(prompt_ids=PROMPT, max_new_tokens=6, k=4)
        assert len(summary.token_ids) == 6
        for cert_key in (pki["rogue"], (None, None)):
            other = security.client_security(pki["ca"], *cert_key, token=TOKEN)
            async with Client(cluster.target, security=other, retries=0) as client:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await client.acomplete(prompt_ids=PROMPT, max_new_tokens=4, timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_sync_client_sends_the_token(tiny_pair, pki):
    """The sync SDK path (grpc.intercept_channel) carries the bearer token over TLS too."""
    import asyncio
    import threading

    ready, done = threading.Event(), threading.Event()
    box = {}

    async def serve():
        async with await _secure_cluster(tiny_pair, pki, client_ca=False) as cluster:
            box["target"] = cluster.target
            ready.set()
            while not done.is_set():
                await asyncio.sleep(0.05)

    thread = threading.Thread(target=lambda: asyncio.run(serve()))
    thread.start()
    try:
        assert ready.wait(60)
        with Client(box["target"], tls_ca=pki["ca"], token=TOKEN, retries=0) as client:
            assert len(client.complete(prompt_ids=PROMPT, max_new_tokens=5).token_ids) == 5
        with Client(box["target"], tls_ca=pki["ca"], token="nope", retries=0) as client:
            with pytest.raises(grpc.RpcError) as bad:
                client.complete(prompt_ids=PROMPT, max_new_tokens=5)
            assert bad.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        done.set()
        thread.join(60)


async def test_health_needs_no_token(pki):
    """Orchestrator probes (grpc.health.v1) pass without a token; everything else needs one."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    running = await start_server([], ["x"], security=security.ServerSecurity(tokens=frozenset({TOKEN})))
    try:
        async with grpc.aio.insecure_channel(running.target) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await running.stop(0)


def test_non_loopback_plaintext_needs_insecure(pki):
    """Plaintext is the default on loopback only; another address needs TLS or an explicit --insecure."""
    with pytest.raises(UsageError, match="--insecure"):
        security.ServerSecurity().check_bind("0.0.0.0")
    security.ServerSecurity(insecure=True).check_bind("0.0.0.0")
    security.ServerSecurity(cert=b"x", key=b"y").check_bind("10.1.2.3")
    for host in ("127.0.0.1", "localhost", "::1", "[::1]"):
        security.ServerSecurity().check_bind(host)
    with pytest.raises(UsageError, match="go together"):
        security.server_security(cert=pki["server"][0])


def test_cli_refuses_plaintext_on_all_interfaces(capsys):
    """`steerspec serve coordinator --host 0.0.0.0` without TLS exits 2 with one line, before any load."""
    from steerspec.cli import main

    assert main(["serve", "coordinator", "--host", "0.0.0.0", "--port", "0", "--verifier", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--insecure" in err and len(err.splitlines()) == 1


async def test_taken_port_is_a_usage_error():
    """Two servers on one port: the second is refused (grpc.so_reuseport off), not silently sharing it."""
    first = await start_server([], ["x"])
    try:
        with pytest.raises(UsageError, match="in use"):
            await start_server([], ["x"], port=first.port)
    finally:
        await first.stop(0)


@pytest.mark.slow
def test_serve_on_a_taken_port_exits_2():
    """`steerspec serve coordinator --port P` with P taken by another process: exit 2, one line."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        proc = subprocess.run([sys.executable, "-m", "steerspec", "serve", "coordinator", "--port", str(port),
                               "--verifier", "127.0.0.1:1", "--tokenizer", ""], capture_output=True, text=True,
                              env=service_env(), cwd=str(ROOT), timeout=90)
    finally:
        holder.close()
    assert proc.returncode == 2, proc.stderr
    assert "in use" in proc.stderr and "serving" not in proc.stdout


async def test_garbage_bytes_are_invalid_argument(tiny_pair):
    """Bytes that are not a GenerateRequest get INVALID_ARGUMENT (was UNKNOWN: DecodeError); serving goes on."""
    async with LocalCluster(str(tiny_pair[0]), str(tiny_pair[1]), eos_ids=()) as cluster:
        async with grpc.aio.insecure_channel(cluster.target) as channel:
            raw = channel.unary_stream("/steerspec.v1.CoordinatorService/Generate",
                                       request_serializer=lambda b: b, response_deserializer=lambda b: b)
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                async for _ in raw(b"\xff\xff\xff\xff\x0f garbage", timeout=10):
                    pass
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid protobuf" in bad.value.details()
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            assert stub is not None
        result = await cluster.generate(PROMPT, max_new_tokens=4, k=4)
        assert len(result.token_ids) == 4


@pytest.mark.parametrize("method", ["/steerspec.v1.VerifierService/Verify", "/steerspec.v1.DrafterService/Draft"])
@pytest.mark.parametrize("after_open", [False, True])
async def test_streamed_garbage_is_invalid_argument(tiny_pair, method, after_open):
    """Garbage bytes on a streaming method (first message, or after a valid open) get INVALID_ARGUMENT.

    Reproduction (before, issue 15 item 7): the Verify and Draft streams answered garbage with
    UNKNOWN (the DecodeError escaped the stream's read); only unary requests were guarded."""
    from steerspec.v1 import common_pb2, drafter_pb2, verifier_pb2

    async with LocalCluster(str(tiny_pair[0]), str(tiny_pair[1]), eos_ids=()) as cluster:
        verify = method.endswith("Verify")
        target = cluster.verifier_targets[0] if verify else cluster.drafter_targets[0]
        sampling = common_pb2.SamplingParams(temperature=0.0, top_p=1.0)
        opening = (verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(prompt_ids=PROMPT, sampling=sampling))
                   if verify else drafter_pb2.DraftRequest(open=drafter_pb2.DraftOpen(
                       prompt_ids=PROMPT, sampling=sampling, k=2, max_new_tokens=8)))
        async with grpc.aio.insecure_channel(target) as channel:
            call = channel.stream_stream(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)(
                timeout=20)
            if after_open:
                await call.write(opening.SerializeToString())
                assert await call.read() is not grpc.aio.EOF
            await call.write(b"\xff\xff\xff\xff\x0f garbage")
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                while await call.read() is not grpc.aio.EOF:
                    pass
                await call.wait_for_connection()
                raise AssertionError(f"stream ended with {await call.code()}")
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad.value
            assert "not a valid protobuf" in bad.value.details()
        result = await cluster.generate(PROMPT, max_new_tokens=4, k=2)  # both still serve
        assert len(result.token_ids) == 4
