"""The SDK's errors (exported from `steerspec`): one class per gRPC status a caller can act on.

    from steerspec import Client, FailedPrecondition, SteerSpecError, Unavailable

    try:
        text = client.generate_text("def f():", max_new_tokens=32, timeout=30)
    except FailedPrecondition as exc:     # e.g. steering asked of a drafter without vectors
        print("fix the request:", exc.message)
    except Unavailable:                   # the retries (`Client(retries=...)`) ran out
        ...
    except SteerSpecError as exc:         # any other failed call
        print(exc.code().name, exc.details())

Every `Client` call (sync and asyncio, streaming or not) raises these in place of grpc's own call
errors, with the original as `__cause__`. `SteerSpecError` subclasses `grpc.aio.AioRpcError` (so
`grpc.RpcError` too), so `except grpc.RpcError` / `except grpc.aio.AioRpcError` keep working and the
grpc accessors are methods as in grpc: `exc.code()` (a `grpc.StatusCode`), `exc.details()` (the
server's message), `trailing_metadata()`, `debug_error_string()`. The same values are attributes
`exc.status_code` and `exc.message`; `str(exc)` is "CODE: message".

Status -> class: INVALID_ARGUMENT `InvalidArgument` (also a ValueError: arguments the client itself
rejects before any call stay plain ValueErrors), OUT_OF_RANGE `OutOfRange`, FAILED_PRECONDITION
`FailedPrecondition`, UNAUTHENTICATED `Unauthenticated`, PERMISSION_DENIED `PermissionDenied`,
RESOURCE_EXHAUSTED `ResourceExhausted` (quota or admission), UNAVAILABLE `Unavailable` (raised once the
retries are exhausted), ABORTED `Aborted` (the session stayed live in another call past the retries),
DEADLINE_EXCEEDED `DeadlineExceeded`, CANCELLED `Cancelled`, INTERNAL / UNKNOWN / DATA_LOSS
`InternalError`; any other status (NOT_FOUND, UNIMPLEMENTED, ...) a plain `SteerSpecError`.
Raised by the client itself: `ResumeMismatch` (DATA_LOSS; a resumed session replayed other tokens)
and `MissingSummary` (INTERNAL; the stream ended without its summary); both are RuntimeErrors too, as
they were before.
"""

from __future__ import annotations

from typing import Dict, Optional, Type

import grpc
import grpc.aio

__all__ = ["SteerSpecError", "InvalidArgument", "OutOfRange", "FailedPrecondition", "Unauthenticated",
           "PermissionDenied", "ResourceExhausted", "Unavailable", "Aborted", "DeadlineExceeded", "Cancelled",
           "InternalError", "ResumeMismatch", "MissingSummary", "from_rpc_error"]


class SteerSpecError(grpc.aio.AioRpcError):
    """A failed SteerSpec call: `code()` / `status_code` (grpc.StatusCode), `details()` / `message`."""

    default_code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str = "", code: Optional[grpc.StatusCode] = None, initial_metadata=None,
                 trailing_metadata=None, debug_error_string: Optional[str] = None) -> None:
        code = self.default_code if code is None else code
        super().__init__(code, initial_metadata, trailing_metadata, message, debug_error_string)
        self.args = (message,)

    @property
    def status_code(self) -> grpc.StatusCode:
        return self._code

    @property
    def message(self) -> str:
        return self._details or ""

    def __str__(self) -> str:
        return f"{self._code.name}: {self.message}" if isinstance(self._code, grpc.StatusCode) else self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, {self._code})"

    def __reduce__(self):
        return (type(self), (self.message, self._code, self._initial_metadata, self._trailing_metadata,
                             self._debug_error_string))


class InvalidArgument(SteerSpecError, ValueError):
    """INVALID_ARGUMENT: the server rejected the request's parameters (also a ValueError)."""

    default_code = grpc.StatusCode.INVALID_ARGUMENT


class OutOfRange(SteerSpecError):
    """OUT_OF_RANGE: a value past a server limit (e.g. prompt plus max_new_tokens past the context)."""

    default_code = grpc.StatusCode.OUT_OF_RANGE


class FailedPrecondition(SteerSpecError):
    """FAILED_PRECONDITION: the deployment cannot serve this request as configured."""

    default_code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(SteerSpecError):
    """UNAUTHENTICATED: no or a wrong token / client certificate."""

    default_code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(SteerSpecError):
    """PERMISSION_DENIED: the caller's identity may not do this."""

    default_code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(SteerSpecError):
    """RESOURCE_EXHAUSTED: a quota or the coordinator's admission limit; try later."""

    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(SteerSpecError):
    """UNAVAILABLE after the client's retries ran out (or the next backoff would pass the deadline)."""

    default_code = grpc.StatusCode.UNAVAILABLE


class Aborted(SteerSpecError):
    """ABORTED after the client's retries ran out: the session is still live in another call."""

    default_code = grpc.StatusCode.ABORTED


class DeadlineExceeded(SteerSpecError):
    """DEADLINE_EXCEEDED: the call's `timeout=` passed."""

    default_code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(SteerSpecError):
    """CANCELLED: the call was cancelled (by the client or the server)."""

    default_code = grpc.StatusCode.CANCELLED


class InternalError(SteerSpecError):
    """INTERNAL / UNKNOWN / DATA_LOSS: the server failed; not the request's fault."""

    default_code = grpc.StatusCode.INTERNAL


class ResumeMismatch(SteerSpecError, RuntimeError):
    """A resumed session replayed tokens that differ from those already received (DATA_LOSS)."""

    default_code = grpc.StatusCode.DATA_LOSS


class MissingSummary(InternalError, RuntimeError):
    """The coordinator ended the stream (status OK) without its final summary (INTERNAL)."""

    default_code = grpc.StatusCode.INTERNAL


_BY_CODE: Dict[grpc.StatusCode, Type[SteerSpecError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: OutOfRange,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNKNOWN: InternalError,
    grpc.StatusCode.DATA_LOSS: InternalError,
}


def _value(exc: BaseException, accessor: str):
    method = getattr(exc, accessor, None)
    if not callable(method):
        return None
    try:
        return method()
    except Exception:  # noqa: BLE001 - a call object without that accessor's value
        return None


def from_rpc_error(exc: BaseException) -> SteerSpecError:
    """The SteerSpecError for a grpc call error (sync `grpc.RpcError` or `grpc.aio.AioRpcError`):
    the subclass for its status code, its details as the message, the original as `__cause__`.
    A SteerSpecError comes back as is."""
    if isinstance(exc, SteerSpecError):
        return exc
    code = _value(exc, "code")
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    details = _value(exc, "details")
    message = "" if details is None else str(details)
    cls = _BY_CODE.get(code, SteerSpecError)
    mapped = cls(message, code, _value(exc, "initial_metadata"), _value(exc, "trailing_metadata"),
                 _value(exc, "debug_error_string"))
    mapped.__cause__ = exc
    return mapped
