"""Server bootstrap shared by the verifier, drafter and coordinator: grpc.aio + health + reflection.

    server = await start_server([(add_VerifierServiceServicer_to_server, servicer)],
                                ["steerspec.v1.VerifierService"], host="127.0.0.1", port=0)
    print(server.port)            # the bound port (port 0 picks a free one)
    await server.stop(grace=5.0)  # on_drain, NOT_SERVING, finish in-flight calls for `grace` s, on_stop

`grpc.aio.server` is looked up at call time so that `steerspec.observability.tracing.instrument_grpc()` (when
called first) adds its server interceptor.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, List, Optional, Sequence, Tuple

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from steerspec.errors import UsageError
from steerspec.observability import service_metrics
from steerspec.serving import security as sec

if TYPE_CHECKING:
    from steerspec.serving.security import ServerSecurity

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
Registration = Tuple[Callable[[object, grpc.aio.Server], None], object]


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> List[Tuple[str, int]]:
    """Options for servers and channels: message size limits both ways, keepalive off by default."""
    return [
        ("grpc.max_receive_message_length", int(max_message_bytes)),
        ("grpc.max_send_message_length", int(max_message_bytes)),
    ]


@dataclass
class RunningServer:
    """A started grpc.aio server, its bound port and its health servicer."""

    server: grpc.aio.Server
    host: str
    port: int
    health: health_aio.HealthServicer
    service_names: Sequence[str]
    on_drain: List[Callable[[], object]] = field(default_factory=list)  # first thing `stop` does
    on_stop: List[Callable[[], object]] = field(default_factory=list)  # after the server has stopped

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace: Optional[float] = 5.0) -> None:
        """Graceful shutdown: run on_drain (leave the registry), report NOT_SERVING, refuse new calls,
        let in-flight ones finish, then run on_stop."""
        await _run_callbacks(self.on_drain)
        await self.set_serving(False)
        await self.server.stop(grace)
        await _run_callbacks(self.on_stop)

    async def wait(self) -> None:
        await self.server.wait_for_termination()


async def _run_callbacks(callbacks: Iterable[Callable[[], object]]) -> None:
    """Call each callback in order, awaiting those that return a coroutine."""
    for callback in callbacks:
        result = callback()
        if asyncio.iscoroutine(result):
            await result


async def start_server(
    registrations: Iterable[Registration],
    service_names: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 0,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Optional[Sequence[grpc.aio.ServerInterceptor]] = None,
    security: Optional["ServerSecurity"] = None,
) -> RunningServer:
    """Start a grpc.aio server with `registrations` plus health and reflection; return it bound.

    `security` (default: this process's, `steerspec.serving.security`) adds TLS and token checks; the port
    is exclusive (no SO_REUSEPORT), so a taken port is a UsageError rather than a silent share."""
    security = security or sec.current_server()
    security.check_bind(host)
    options = channel_options(max_message_bytes) + [("grpc.so_reuseport", 0)]

    chain = [*service_metrics.interceptors(), *security.interceptors(), *(interceptors or [])]
    server = grpc.aio.server(interceptors=chain, options=options)
    for add, servicer in registrations:
        add(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = list(service_names)
    reflection.enable_server_reflection([*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                         reflection.SERVICE_NAME], server)
    try:
        bound = sec.server_port(server, f"{host}:{port}", security)
    except RuntimeError:  # grpc's "Failed to bind": the port is taken or the host is not this machine's
        bound = 0
    if bound == 0:
        raise UsageError(f"cannot bind {host}:{port}: the port is in use or the address is not on this machine; "
                         "choose another --port (0 = any free port) or --host")
    await server.start()
    running = RunningServer(server=server, host=host, port=bound, health=health, service_names=names)
    await running.set_serving(True)
    return running


def check_port(port: int, flag: str = "--port") -> None:
    """UsageError unless `port` is in [0, 65535]: grpc would silently bind another port."""
    if not 0 <= port <= 65535:
        raise UsageError(f"{flag} must be in [0, 65535] (0 = any free port), got {port}")


async def serve_until_signal(running: RunningServer, grace: float = 5.0) -> None:
    """Block until SIGINT/SIGTERM, then stop gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-main thread
            pass
    waiter = asyncio.ensure_future(running.wait())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        await running.stop(grace)
    for task in (waiter, stopper):
        task.cancel()


class IdleTimeout(Exception):
    """No request arrived on a session stream within its idle timeout."""


async def read_request(context, timeout_s: Optional[float]):
    """The next request of a bidirectional stream, or None at its end; IdleTimeout after `timeout_s`.

    `asyncio.timeout` (3.11+) arms a timer on the running task instead of wrapping each read in a
    new task as `wait_for` does: one hop of a session costs fewer event-loop turns."""
    try:
        if timeout_s is None:
            request = await context.read()
        elif hasattr(asyncio, "timeout"):
            async with asyncio.timeout(timeout_s):
                request = await context.read()
        else:  # Python 3.10
            request = await asyncio.wait_for(context.read(), timeout_s)
    except asyncio.TimeoutError:
        raise IdleTimeout(f"no request for {timeout_s:g}s") from None
    return None if request is grpc.aio.EOF else request
