"""The session-stream loop shared by the verifier's Verify and the drafter's Draft streams.

    open        -> the first reply; a ProtocolError aborts the stream with its status code, and a
                   failed computation (prefill, first draft) with INTERNAL
    work        -> its reply, or an in-stream StreamError that leaves the session unchanged; a failed
                   computation aborts with INTERNAL (the cache may be partial: the session is closed)
    close / stream end / cancel / deadline -> the session's cache is freed at once; a session idle
                   for longer than its idle timeout is aborted with DEADLINE_EXCEEDED.

A servicer subclasses `SessionStreamServicer`, names its messages in a `StreamSpec` and implements
`open_session`, `handle` and `close_session`; its sessions have `session_id` and `touch()` (restart
the idle clock). Its gRPC method calls `serve_session`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import grpc

from steerspec.serving.grpc_common import IdleTimeout, read_request
from steerspec.serving.wire import ProtocolError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamSpec:
    """The names one kind of session stream uses in its messages and errors."""

    stream: str  # "Verify"
    open_message: str  # "VerifyOpen"
    request: str  # "VerifyRequest"
    work: str  # the request's oneof field that carries work: "block"
    open_failure: str  # "prefill failed"
    work_failure: str  # "verification failed"
    error_reply: Callable[[grpc.StatusCode, str], Any]  # an in-stream StreamError response


class SessionStreamServicer:
    """One session per bidirectional stream: the loop of the module docstring over three hooks."""

    stream_spec: StreamSpec
    idle_timeout_s: float = 0.0  # 0 = sessions never expire

    async def open_session(self, msg) -> Tuple[Any, Any]:
        """(session, first reply) for the open message; raise ProtocolError for a bad open. On any
        other failure nothing may be left open."""
        raise NotImplementedError

    async def handle(self, session, msg) -> Optional[Any]:
        """The reply to one work message (None: nothing to send)."""
        raise NotImplementedError

    def close_session(self, session) -> None:
        """Free the session's cache (called once the stream ends, however it ends)."""
        raise NotImplementedError

    def after_reply(self, session) -> None:
        """Called once a reply has been written (the drafter starts drafting ahead there); nothing by default."""

    async def serve_session(self, context) -> None:
        spec = self.stream_spec
        session = None
        try:
            first = await self._read(context, None)
            if first is None:
                return
            kind = first.WhichOneof("kind")
            if kind != "open":
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"the first message of a {spec.stream} stream must be {spec.open_message}, got "
                                    f"{kind or 'an empty ' + spec.request}; open the session first")
            try:
                session, reply = await self.open_session(first.open)
            except ProtocolError as exc:
                await context.abort(exc.code, exc.message)
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # e.g. out of memory: open_session kept nothing
                log.exception("%s stream: %s", spec.stream, spec.open_failure)
                await context.abort(grpc.StatusCode.INTERNAL, f"{spec.open_failure} ({type(exc).__name__}: {exc})")
            await context.write(reply)
            self.after_reply(session)
            while True:
                request = await self._read(context, session)
                if request is None:
                    return
                kind = request.WhichOneof("kind")
                if kind == "close":
                    return
                if kind == spec.work:
                    try:
                        reply = await self.handle(session, getattr(request, spec.work))
                    except (asyncio.CancelledError, grpc.aio.AbortError):
                        raise
                    except Exception as exc:  # a failed forward: the cache may be partial, end the session
                        log.exception("%s for session %s", spec.work_failure, session.session_id)
                        await context.abort(grpc.StatusCode.INTERNAL,
                                            f"{spec.work_failure} ({type(exc).__name__}: {exc}); the session was "
                                            "closed: reopen it with the committed prefix")
                elif kind == "open":
                    reply = spec.error_reply(grpc.StatusCode.FAILED_PRECONDITION,
                                             f"session {session.session_id!r} is already open on this stream; "
                                             "open a new stream for another session")
                else:
                    reply = spec.error_reply(grpc.StatusCode.INVALID_ARGUMENT,
                                             f"empty {spec.request}: set one of open, {spec.work} or close")
                session.touch()
                if reply is not None:
                    await context.write(reply)
                    self.after_reply(session)
        finally:
            if session is not None:
                self.close_session(session)

    async def _read(self, context, session):
        """The next request, or None at stream end; aborts an idle session after its timeout."""
        timeout = self.idle_timeout_s if self.idle_timeout_s > 0 else None
        try:
            return await read_request(context, timeout)
        except IdleTimeout:
            if session is not None:
                self.close_session(session)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"session idle for more than --idle-timeout-s {self.idle_timeout_s:g}s; "
                                "its cache was freed: reopen with the committed prefix to resume")
