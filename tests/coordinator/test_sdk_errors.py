"""SDK errors: every failed call raises the `steerspec.SteerSpecError` subclass for its status, sync and
asyncio, streaming or not, and stays a `grpc.RpcError` with `code()` / `details()`.

A real grpc.aio CoordinatorService on 127.0.0.1 plays a script named by the request's prompt: abort with
a status code (after one chunk when max_new_tokens == 2), end the stream without a summary, or replay
different tokens on a resume.
"""

from __future__ import annotations

import asyncio
import collections
import pickle
import socket
from typing import Callable

import grpc
import pytest

import steerspec
from coordinator import client as client_module
from coordinator.exceptions import from_rpc_error
from steerspec import (Aborted, Cancelled, Chunk, Client, DeadlineExceeded, FailedPrecondition, InternalError,
                       InvalidArgument, MissingSummary, OutOfRange, PermissionDenied, ResourceExhausted,
                       ResumeMismatch, SteerSpecError, Summary, Unauthenticated, Unavailable)
from steerspec.serving.security import ClientSecurity
from steerspec.v1 import coordinator_pb2, coordinator_pb2_grpc

pytestmark = pytest.mark.timeout(60)
CALL_S = 10.0  # every call's deadline
RETRIES = 2

EXPECTED = {
    "INVALID_ARGUMENT": InvalidArgument, "OUT_OF_RANGE": OutOfRange, "FAILED_PRECONDITION": FailedPrecondition,
    "UNAUTHENTICATED": Unauthenticated, "PERMISSION_DENIED": PermissionDenied,
    "RESOURCE_EXHAUSTED": ResourceExhausted, "UNAVAILABLE": Unavailable, "ABORTED": Aborted,
    "DEADLINE_EXCEEDED": DeadlineExceeded, "CANCELLED": Cancelled, "INTERNAL": InternalError,
    "UNKNOWN": InternalError, "DATA_LOSS": InternalError, "NOT_FOUND": SteerSpecError,
    "UNIMPLEMENTED": SteerSpecError,
}


def _chunk(seq, ids):
    return coordinator_pb2.GenerateResponse(chunk=coordinator_pb2.TokenChunk(
        seq=seq, token_ids=ids, text="".join(chr(96 + i) for i in ids), accepted=len(ids), drafted=len(ids)))


def _summary(session_id, ids):
    return coordinator_pb2.GenerateResponse(summary=coordinator_pb2.GenerationSummary(
        session_id=session_id, token_ids=ids, text="".join(chr(96 + i) for i in ids), finish_reason="length"))


def message_for(name: str) -> str:
    return f"the server says {name.lower()}"


class Scripted(coordinator_pb2_grpc.CoordinatorServiceServicer):
    def __init__(self) -> None:
        self.attempts = collections.Counter()

    async def Generate(self, request, context):
        self.attempts[request.session_id] += 1
        attempt, script = self.attempts[request.session_id], request.prompt
        if script == "OK":
            yield _chunk(0, [1, 2])
            yield _summary(request.session_id, [1, 2])
        elif script == "NO_SUMMARY":
            yield _chunk(0, [1, 2])
        elif script == "MISMATCH":  # the first attempt fails mid-stream; the "resume" replays other tokens
            yield _chunk(0, [1, 2, 3] if attempt == 1 else [1, 9, 9, 4])
            if attempt == 1:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
            yield _summary(request.session_id, [1, 9, 9, 4])
        elif script == "HANG":
            await asyncio.sleep(CALL_S)
        else:
            if request.max_new_tokens == 2:
                yield _chunk(0, [5])
            await context.abort(grpc.StatusCode[script], message_for(script))


@pytest.fixture
async def server():
    servicer = Scripted()
    srv = grpc.aio.server()
    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        await srv.stop(grace=0)


def make_client(target: str) -> Client:
    return Client(target, retries=RETRIES, backoff_s=0.01, max_backoff_s=0.02, security=ClientSecurity())


def with_client(target: str, call: Callable[[Client], object]) -> Callable[[], object]:
    """`call(client)` on a fresh sync client, closed after."""
    def run():
        with make_client(target) as client:
            return call(client)

    return run


def caught(fn: Callable[[], object]) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - returned for the test to check
        return exc
    raise AssertionError("the call did not fail")


async def in_thread(fn: Callable[[], object]) -> object:
    """A sync client call, off the loop that runs the server (bounded)."""
    return await asyncio.wait_for(asyncio.to_thread(fn), CALL_S + 5)


def check(exc: BaseException, cls: type, name: str, message: str) -> None:
    assert type(exc) is cls, repr(exc)
    assert isinstance(exc, SteerSpecError) and isinstance(exc, grpc.RpcError)
    assert exc.code() is grpc.StatusCode[name] and exc.status_code is grpc.StatusCode[name]
    assert exc.details() == exc.message == message
    assert str(exc) == f"{name}: {message}"


def expected_attempts(name: str) -> int:
    return 1 + RETRIES if grpc.StatusCode[name] in client_module.RETRYABLE else 1


@pytest.mark.parametrize("name", sorted(EXPECTED))
async def test_sync_calls_raise_the_class_for_the_status(server, name):
    target, servicer = server

    def calls():
        with make_client(target) as client:
            return (caught(lambda: client.complete(name, max_new_tokens=4, timeout=CALL_S, session_id="a")),
                    caught(lambda: client.generate_text(name, max_new_tokens=4, timeout=CALL_S)),
                    caught(lambda: list(client.generate(name, max_new_tokens=4, timeout=CALL_S))))

    for exc in await in_thread(calls):
        check(exc, EXPECTED[name], name, message_for(name))
        assert isinstance(exc.__cause__, grpc.RpcError) and not isinstance(exc.__cause__, SteerSpecError)
        assert exc.__cause__.code() is exc.code()
    assert servicer.attempts["a"] == expected_attempts(name)


@pytest.mark.parametrize("name", sorted(EXPECTED))
async def test_async_calls_raise_the_class_for_the_status(server, name):
    target, servicer = server
    async with make_client(target) as client:
        excs = [await _acaught(client.acomplete(name, max_new_tokens=4, timeout=CALL_S, session_id="a")),
                await _acaught(_drain(client.agenerate(name, max_new_tokens=4, timeout=CALL_S)))]
    for exc in excs:
        check(exc, EXPECTED[name], name, message_for(name))
        assert isinstance(exc, grpc.aio.AioRpcError)  # as before: `except grpc.aio.AioRpcError` still catches it
        assert isinstance(exc.__cause__, grpc.aio.AioRpcError) and not isinstance(exc.__cause__, SteerSpecError)
    assert servicer.attempts["a"] == expected_attempts(name)


async def _drain(items):
    return [item async for item in items]


async def _acaught(awaitable) -> BaseException:
    try:
        await asyncio.wait_for(awaitable, CALL_S + 5)
    except BaseException as exc:  # noqa: BLE001 - returned for the test to check
        return exc
    raise AssertionError("the call did not fail")


@pytest.mark.parametrize("name", ["FAILED_PRECONDITION", "UNAVAILABLE"])
async def test_a_stream_fails_after_its_first_chunk(server, name):
    """Chunks already yielded stay delivered; the error comes next, sync and async alike."""
    target, _ = server

    def sync_stream():
        got = []
        with make_client(target) as client:
            exc = caught(lambda: [got.append(i) for i in client.generate(name, max_new_tokens=2, timeout=CALL_S)])
        return got, exc

    got, exc = await in_thread(sync_stream)
    assert [c.token_ids for c in got] == [[5]] and all(isinstance(c, Chunk) for c in got)
    check(exc, EXPECTED[name], name, message_for(name))

    got = []
    async with make_client(target) as client:
        async def consume():
            async for item in client.agenerate(name, max_new_tokens=2, timeout=CALL_S):
                got.append(item)

        exc = await _acaught(consume())
    assert [c.token_ids for c in got] == [[5]]
    check(exc, EXPECTED[name], name, message_for(name))


async def test_success_is_unchanged(server):
    target, _ = server
    text = await in_thread(with_client(target, lambda c: c.generate_text("OK", max_new_tokens=2, timeout=CALL_S)))
    assert text == "ab"
    async with make_client(target) as client:
        summary = await client.acomplete("OK", max_new_tokens=2, timeout=CALL_S)
    assert isinstance(summary, Summary) and summary.token_ids == [1, 2]


async def test_a_stream_without_a_summary(server):
    target, _ = server
    exc = await in_thread(with_client(target, lambda c: caught(lambda: c.complete("NO_SUMMARY", timeout=CALL_S))))
    async with make_client(target) as client:
        aexc = await _acaught(client.acomplete("NO_SUMMARY", timeout=CALL_S))
    for e in (exc, aexc):
        check(e, MissingSummary, "INTERNAL", "the coordinator ended the stream without a summary")
        assert isinstance(e, InternalError) and isinstance(e, RuntimeError)  # `except RuntimeError` still works


async def test_a_resume_that_replays_other_tokens(server):
    """Attempt 1 streams [1, 2, 3] then UNAVAILABLE; the retry replays [1, 9, ...]: ResumeMismatch."""
    target, servicer = server
    message = ("the resumed session replayed different tokens than were received (it was not checkpointed); "
               "retry with a new session")

    def sync_call():
        with make_client(target) as client:
            return caught(lambda: client.complete("MISMATCH", timeout=CALL_S, session_id="s"))

    exc = await in_thread(sync_call)
    async with make_client(target) as client:
        aexc = await _acaught(client.acomplete("MISMATCH", timeout=CALL_S, session_id="as"))
    for e in (exc, aexc):
        check(e, ResumeMismatch, "DATA_LOSS", message)
        assert isinstance(e, RuntimeError) and e.__cause__ is None
    assert servicer.attempts["s"] == servicer.attempts["as"] == 2  # no retry after the mismatch
    assert client_module.ResumeMismatch is ResumeMismatch  # importable from coordinator.client, as before


async def test_the_client_deadline_is_deadline_exceeded(server):
    target, _ = server

    def sync_call():
        with make_client(target) as client:
            return caught(lambda: client.complete("HANG", timeout=0.3))

    exc = await in_thread(sync_call)
    async with make_client(target) as client:
        aexc = await _acaught(client.acomplete("HANG", timeout=0.3))
    for e in (exc, aexc):
        assert type(e) is DeadlineExceeded and e.code() is grpc.StatusCode.DEADLINE_EXCEEDED and e.message


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_nothing_listening_is_unavailable_once_retries_run_out():
    target = f"127.0.0.1:{_free_port()}"
    exc = await in_thread(with_client(target, lambda c: caught(lambda: c.complete("OK", timeout=CALL_S))))
    async with make_client(target) as client:
        aexc = await _acaught(client.acomplete("OK", timeout=CALL_S))
    for e in (exc, aexc):
        assert type(e) is Unavailable and e.code() is grpc.StatusCode.UNAVAILABLE and e.message


def test_bad_arguments_stay_value_errors_before_any_call():
    client = make_client(f"127.0.0.1:{_free_port()}")
    with pytest.raises(ValueError, match="exactly one"):
        client.complete("x", prompt_ids=[1], timeout=CALL_S)


async def test_from_rpc_error_maps_grpc_call_errors(server):
    """grpc's own errors (a sync call's and an aio call's) map to the class for their status, the original
    kept as __cause__; the result is a grpc.RpcError that pickles."""
    target, _ = server
    request = coordinator_pb2.GenerateRequest(prompt="PERMISSION_DENIED", session_id="raw")

    def sync_raw():
        with grpc.insecure_channel(target) as channel:
            return caught(lambda: list(coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(
                request, timeout=CALL_S)))

    raw_sync = await in_thread(sync_raw)
    async with grpc.aio.insecure_channel(target) as channel:
        raw_aio = await _acaught(_drain(coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(
            request, timeout=CALL_S)))
    for raw in (raw_sync, raw_aio):
        assert isinstance(raw, grpc.RpcError) and not isinstance(raw, SteerSpecError)
        mapped = from_rpc_error(raw)
        check(mapped, PermissionDenied, "PERMISSION_DENIED", message_for("PERMISSION_DENIED"))
        assert mapped.__cause__ is raw and from_rpc_error(mapped) is mapped
        again = pickle.loads(pickle.dumps(mapped))
        assert type(again) is PermissionDenied and again.message == mapped.message and again.code() is mapped.code()


def test_the_names_are_exported_from_steerspec():
    for name in ("Client", "Chunk", "Summary", "SteerSpecError", "from_rpc_error", *{c.__name__ for c in
                                                                                     EXPECTED.values()}):
        assert name in steerspec.__all__ and getattr(steerspec, name) is not None
    assert issubclass(InvalidArgument, ValueError)
