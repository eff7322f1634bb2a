"""uvicorn serving the OpenAI-compatible app in the coordinator's own event loop, with its TLS settings.

    http = await start_http(coordinator, host="127.0.0.1", port=8000)   # port 0: any free port
    print(http.url)            # http(s)://127.0.0.1:PORT
    await http.stop()

TLS comes from the process's ServerSecurity (--tls-cert/--tls-key, --tls-client-ca for mutual TLS), bearer
tokens from its --auth-tokens, so both APIs accept the same callers. uvicorn's signal handling is left
out: the coordinator's own (`serve_until_signal`) stops both servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import tempfile
from dataclasses import dataclass
from typing import Optional

import uvicorn

from coordinator.http_api.http_app import create_app
from steerspec.errors import UsageError
from steerspec.serving import security

log = logging.getLogger(__name__)


def ssl_context(server: security.ServerSecurity) -> Optional[ssl.SSLContext]:
    """The server's TLS context (None for plaintext): its key pair, and its client CA when mTLS is on."""
    if not server.tls:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    with tempfile.TemporaryDirectory(prefix="steerspec-tls-") as folder:  # ssl loads key pairs from files only
        cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
        for path, data in ((cert, server.cert), (key, server.key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
        context.load_cert_chain(cert, key)
    if server.client_ca is not None:
        context.load_verify_locations(cadata=server.client_ca.decode())
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (here, so a taken port is a UsageError, not uvicorn's sys.exit)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except (OSError, OverflowError) as exc:
        raise UsageError(f"cannot serve the HTTP API on {host}:{port} ({getattr(exc, 'strerror', None) or exc}); "
                         "choose another --http-port (0 = any free port)") from None
    sock.setblocking(False)
    return sock


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handlers (the coordinator process owns SIGINT/SIGTERM)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


@dataclass
class RunningHTTP:
    server: uvicorn.Server
    task: asyncio.Task
    host: str
    port: int
    tls: bool

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    async def stop(self, grace: float = 1.0) -> None:
        """Stop accepting, give open requests `grace` seconds, then end them."""
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), grace)
        except asyncio.TimeoutError:
            self.server.force_exit = True
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self.task, 5.0)


async def start_http(coordinator, host: str = "127.0.0.1", port: int = 0,
                     server_security: Optional[security.ServerSecurity] = None) -> RunningHTTP:
    """Serve `coordinator`'s OpenAI-compatible API on host:port; returns once it accepts connections."""
    server_security = server_security or security.current_server()
    server_security.check_bind(host)
    context = ssl_context(server_security)
    config = uvicorn.Config(create_app(coordinator, server_security.tokens), host=host, port=port,
                            log_level="warning", lifespan="off", access_log=False, timeout_graceful_shutdown=1,
                            ssl_context_factory=(lambda _config, _default: context) if context is not None else None)
    sock = bind(host, port)
    server = _QuietServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            sock.close()
            error = task.exception() if not task.cancelled() else None
            raise UsageError(f"the HTTP API on {host}:{port} did not start ({error or 'uvicorn exited'})")
        await asyncio.sleep(0.01)
    bound = sock.getsockname()[1]
    return RunningHTTP(server=server, task=task, host=host, port=int(bound), tls=context is not None)
