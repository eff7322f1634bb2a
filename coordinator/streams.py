"""gRPC plumbing of the session loop: shared channels, and streams that name their replica on failure.

A stream that fails with UNAVAILABLE or RESOURCE_EXHAUSTED (a full replica), or ends without a
status, raises `ReplicaLost` (the loop fails over); any other status raises `SessionError` with
that code (the loop ends the session).
"""

from __future__ import annotations

import asyncio
from typing import Dict, Optional

import grpc

from steerspec.serving import security
from steerspec.v1 import drafter_pb2_grpc, verifier_pb2_grpc

CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20),
                   ("grpc.enable_retries", 0)]
# UNAVAILABLE: the replica is gone; RESOURCE_EXHAUSTED: it is full (sessions or --max-cache-mb) -> place elsewhere
FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


def _core_transport_failure(exc: grpc.aio.AioRpcError) -> bool:
    """True for grpc core's local "Internal error from Core" (no server status behind it)."""
    return exc.code() == grpc.StatusCode.INTERNAL and (exc.details() or "").startswith("Internal error from Core")


class SessionError(Exception):
    """Ends a session with a gRPC status code and a message a person can act on."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class ReplicaLost(Exception):
    """A replica failed under a session (UNAVAILABLE or a stream cut short), or is full
    (RESOURCE_EXHAUSTED, `full`): re-place the session. A full replica is alive and stays registered."""

    def __init__(self, kind: str, address: str, detail: str, full: bool = False):
        super().__init__(f"{kind} {address}: {detail}")
        self.kind, self.address, self.detail, self.full = kind, address, detail, full


class Channels:
    """One grpc.aio channel per replica address, shared by all sessions of a coordinator."""

    def __init__(self, options: Optional[list] = None) -> None:
        self._channels: Dict[str, grpc.aio.Channel] = {}
        self._options = options or CHANNEL_OPTIONS

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = security.aio_channel(address, self._options)
        return channel

    def verifier(self, address: str) -> verifier_pb2_grpc.VerifierServiceStub:
        return verifier_pb2_grpc.VerifierServiceStub(self.get(address))

    def drafter(self, address: str) -> drafter_pb2_grpc.DrafterServiceStub:
        return drafter_pb2_grpc.DrafterServiceStub(self.get(address))

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close(grace=None)


def _status_of(exc: grpc.aio.AioRpcError) -> str:
    return f"{exc.code().name}: {exc.details()}"


class Stream:
    """A bidirectional call with its replica address (read/write that name the replica on failure)."""

    def __init__(self, kind: str, address: str, call) -> None:
        self.kind, self.address, self.call = kind, address, call
        self.broken = False

    async def write(self, message) -> None:
        try:
            await self.call.write(message)
        except grpc.aio.AioRpcError as exc:
            raise self._lost(await self._final(exc)) from None
        except asyncio.InvalidStateError:  # the RPC already ended: say why
            raise await self._ended() from None

    async def read(self):
        try:
            message = await self.call.read()
        except grpc.aio.AioRpcError as exc:
            raise self._lost(await self._final(exc)) from None
        if message is grpc.aio.EOF:
            raise await self._ended()
        return message

    async def _ended(self) -> Exception:
        """The exception for a stream that ended under us: failover for UNAVAILABLE (or no status)."""
        self.broken = True
        code = await self.call.code()
        details = await self.call.details()
        if code in (grpc.StatusCode.OK, None) or code in FAILOVER_CODES:
            return ReplicaLost(self.kind, self.address, f"stream ended early ({code.name if code else '?'}: {details})",
                               full=code == grpc.StatusCode.RESOURCE_EXHAUSTED)
        return SessionError(code, f"{self.kind} {self.address}: {details}")

    async def _final(self, exc: grpc.aio.AioRpcError, wait_s: float = 1.0) -> grpc.aio.AioRpcError:
        """The call's own terminal status when grpc reports a write/read racing its end as INTERNAL.

        A deadline or cancellation that lands during a write can surface as "Internal error from
        Core"; the call itself then ends with the real status (e.g. DEADLINE_EXCEEDED).
        """
        if exc.code() != grpc.StatusCode.INTERNAL:
            return exc
        try:
            code = await asyncio.wait_for(self.call.code(), wait_s)
            details = await asyncio.wait_for(self.call.details(), wait_s)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return exc
        if code in (None, grpc.StatusCode.OK, grpc.StatusCode.INTERNAL):
            return exc
        return grpc.aio.AioRpcError(code, exc.initial_metadata(), exc.trailing_metadata(), details=details)

    def _lost(self, exc: grpc.aio.AioRpcError) -> Exception:
        self.broken = True
        # "Internal error from Core" that _final could not resolve is grpc core's own transport failure (a
        # replica stopped mid-write), not a status the server sent: the replica is lost, fail over (unless it
        # came at the generation's deadline: the loop's lost_to_deadline then ends the session DEADLINE_EXCEEDED)
        if exc.code() in FAILOVER_CODES or _core_transport_failure(exc):
            return ReplicaLost(self.kind, self.address, _status_of(exc),
                               full=exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED)
        return SessionError(exc.code(), f"{self.kind} {self.address}: {exc.details()}")

    async def close(self, message, wait_s: float = 2.0) -> None:
        """Say goodbye, half-close and wait (bounded) for the server to end the stream."""
        if self.broken or self.call.done():
            self.call.cancel()
            return
        try:
            await asyncio.wait_for(self._close(message), wait_s)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass
        finally:
            if not self.call.done():
                self.call.cancel()

    async def _close(self, message) -> None:
        await self.call.write(message)
        await self.call.done_writing()
        while await self.call.read() is not grpc.aio.EOF:
            pass

    def abort(self) -> None:
        self.call.cancel()


def status_from_code(value: int) -> grpc.StatusCode:
    """grpc.StatusCode from its integer value (a StreamError's code)."""
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN
