"""TLS, mutual TLS and bearer tokens for every SteerSpec server and channel.

    security.configure_from_args(args, host=args.host)   # CLI: --tls-cert/--tls-key/--tls-client-ca/...
    running = await start_server(...)                     # picks up the process-wide ServerSecurity
    channel = security.aio_channel("verifier:50061", options)   # TLS + token when configured

One process-wide `ServerSecurity` (what this process accepts) and `ClientSecurity` (what it
presents when it dials a coordinator, verifier or drafter). Both also load from environment
variables (``STEERSPEC_TLS_CERT`` ... below), so Ray actors and KubeRay pods get them from
mounted secrets without new flags. Plaintext is the default on loopback only: binding another
address without TLS needs ``--insecure`` (``STEERSPEC_INSECURE=1``) and logs a warning.

Tokens: a file with one token per line (``#`` comments allowed), or ``STEERSPEC_AUTH_TOKENS``
(comma separated). A call without a valid ``authorization: Bearer <token>`` gets UNAUTHENTICATED.
The caller's identity (`identity_of`) is a hash of its token or the CN of its client certificate.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import ipaddress
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from steerspec.errors import UsageError

log = logging.getLogger(__name__)

ENV = {
    "cert": "STEERSPEC_TLS_CERT", "key": "STEERSPEC_TLS_KEY", "client_ca": "STEERSPEC_TLS_CLIENT_CA",
    "ca": "STEERSPEC_TLS_CA", "auth_tokens_file": "STEERSPEC_AUTH_TOKENS_FILE", "auth_tokens": "STEERSPEC_AUTH_TOKENS",
    "token_file": "STEERSPEC_TOKEN_FILE", "token": "STEERSPEC_TOKEN", "insecure": "STEERSPEC_INSECURE",
    "server_name": "STEERSPEC_TLS_SERVER_NAME",
}
AUTH_HEADER = "authorization"
UNAUTHENTICATED_EXEMPT = ("/grpc.health.v1.Health/",)  # orchestrator probes carry no token
LOOPBACK_NAMES = ("localhost", "ip6-localhost")


# -- configuration -------------------------------------------------------------------------------
def _read(path: Optional[str], what: str) -> Optional[bytes]:
    if not path:
        return None
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def read_tokens(text: str) -> FrozenSet[str]:
    """Tokens of a token file or a comma-separated list: one per line/item, blanks and # comments skipped."""
    tokens = set()
    for line in text.replace(",", "\n").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            tokens.add(line)
    return frozenset(tokens)


def token_identity(token: str) -> str:
    """A stable, non-secret name for a bearer token (its SHA-256 prefix)."""
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ServerSecurity:
    """What a server accepts: TLS key pair, optional client CA (mTLS), bearer tokens."""

    cert: Optional[bytes] = None
    key: Optional[bytes] = None
    client_ca: Optional[bytes] = None
    tokens: FrozenSet[str] = field(default_factory=frozenset)
    insecure: bool = False  # non-loopback plaintext was asked for explicitly

    @property
    def tls(self) -> bool:
        return self.cert is not None

    def credentials(self) -> Optional[grpc.ServerCredentials]:
        if not self.tls:
            return None
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)

    def check_bind(self, host: str) -> None:
        """UsageError for plaintext on a non-loopback address without --insecure (a warning with it)."""
        if self.tls or is_loopback(host):
            return
        if not self.insecure:
            raise UsageError(f"refusing to serve plaintext on {host}, which is not loopback: pass --tls-cert and "
                             "--tls-key (and --auth-tokens), or --insecure to accept unauthenticated plaintext")
        log.warning("serving plaintext on non-loopback %s (--insecure): anyone who reaches it can use it", host)

    def interceptors(self) -> List[grpc.aio.ServerInterceptor]:
        return [GuardInterceptor(self.tokens)]


@dataclass(frozen=True)
class ClientSecurity:
    """What a channel presents: TLS (CA to verify the server), client key pair (mTLS), bearer token."""

    ca: Optional[bytes] = None
    cert: Optional[bytes] = None
    key: Optional[bytes] = None
    token: Optional[str] = None
    tls: bool = False
    server_name: Optional[str] = None  # ssl target name override (a certificate for another name)

    def credentials(self) -> Optional[grpc.ChannelCredentials]:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def metadata(self) -> Tuple[Tuple[str, str], ...]:
        return ((AUTH_HEADER, f"Bearer {self.token}"),) if self.token else ()

    def options(self) -> List[Tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name and self.tls else []


def server_security(cert: Optional[str] = None, key: Optional[str] = None, client_ca: Optional[str] = None,
                    auth_tokens_file: Optional[str] = None, auth_tokens: Optional[str] = None,
                    insecure: bool = False) -> ServerSecurity:
    """A ServerSecurity from file paths (UsageError for a missing file or half a key pair)."""
    if bool(cert) != bool(key):
        raise UsageError("--tls-cert and --tls-key go together (the server certificate and its private key)")
    if client_ca and not cert:
        raise UsageError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    tokens = set(read_tokens(auth_tokens or ""))
    if auth_tokens_file:
        tokens |= read_tokens(_read(auth_tokens_file, "the --auth-tokens file").decode())
        if not tokens:
            raise UsageError(f"the --auth-tokens file {auth_tokens_file} holds no token")
    return ServerSecurity(cert=_read(cert, "--tls-cert"), key=_read(key, "--tls-key"),
                          client_ca=_read(client_ca, "--tls-client-ca"), tokens=frozenset(tokens),
                          insecure=bool(insecure))


def client_security(ca: Optional[str] = None, cert: Optional[str] = None, key: Optional[str] = None,
                    token_file: Optional[str] = None, token: Optional[str] = None, tls: bool = False,
                    server_name: Optional[str] = None) -> ClientSecurity:
    """A ClientSecurity from file paths; TLS is on when a CA or client key pair is given (or `tls`)."""
    if bool(cert) != bool(key):
        raise UsageError("a client certificate and its key go together (--tls-cert and --tls-key)")
    if token_file:
        tokens = read_tokens(_read(token_file, "the --token-file").decode())
        if len(tokens) != 1:
            raise UsageError(f"the --token-file {token_file} must hold exactly one token, found {len(tokens)}")
        token = next(iter(tokens))
    return ClientSecurity(ca=_read(ca, "--tls-ca"), cert=_read(cert, "the client --tls-cert"),
                          key=_read(key, "the client --tls-key"), token=(token or "").strip() or None,
                          tls=bool(tls or ca or cert), server_name=server_name or None)


def _env(name: str) -> Optional[str]:
    return os.environ.get(ENV[name]) or None


def server_from_env() -> ServerSecurity:
    return server_security(_env("cert"), _env("key"), _env("client_ca"), _env("auth_tokens_file"),
                           _env("auth_tokens"), insecure=(_env("insecure") or "0") not in ("0", "false", "no"))


def client_from_env() -> ClientSecurity:
    """TLS when STEERSPEC_TLS_CA is set; the server's key pair doubles as the client certificate (mTLS)."""
    ca = _env("ca")
    cert, key = (_env("cert"), _env("key")) if ca else (None, None)
    return client_security(ca, cert, key, _env("token_file"), _env("token"), server_name=_env("server_name"))


def actor_env() -> Dict[str, str]:
    """This process's STEERSPEC_* security variables, for the Ray actors it starts (their servers and
    channels configure themselves from the environment; the files must exist on their nodes)."""
    return {var: os.environ[var] for var in ENV.values() if os.environ.get(var)}


def export_to_env(args: argparse.Namespace) -> None:
    """Put the security flags a launcher was given into its environment as STEERSPEC_* variables, so
    `actor_env()` hands them to the actors it starts (flags win over variables already set)."""
    flags = {"tls_cert": "cert", "tls_key": "key", "tls_client_ca": "client_ca", "tls_ca": "ca",
             "auth_tokens": "auth_tokens_file", "token_file": "token_file", "tls_server_name": "server_name"}
    for flag, name in flags.items():
        value = getattr(args, flag, None)
        if value:
            os.environ[ENV[name]] = str(Path(value).resolve()) if name != "server_name" else str(value)
    if getattr(args, "insecure", False):
        os.environ[ENV["insecure"]] = "1"


_SERVER: Optional[ServerSecurity] = None
_CLIENT: Optional[ClientSecurity] = None


def configure(server: Optional[ServerSecurity] = None, client: Optional[ClientSecurity] = None) -> None:
    """Set this process's server and/or client security (None leaves that side as it is)."""
    global _SERVER, _CLIENT
    if server is not None:
        _SERVER = server
    if client is not None:
        _CLIENT = client


def reset() -> None:
    """Back to the environment's settings (tests)."""
    global _SERVER, _CLIENT
    _SERVER = _CLIENT = None


def current_server() -> ServerSecurity:
    global _SERVER
    if _SERVER is None:
        _SERVER = server_from_env()
    return _SERVER


def current_client() -> ClientSecurity:
    global _CLIENT
    if _CLIENT is None:
        _CLIENT = client_from_env()
    return _CLIENT


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# -- CLI -----------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser, serving: bool = True) -> None:
    """--tls-* / token / --insecure flags (servers: `serving`; clients such as `steerspec run`: not)."""
    group = parser.add_argument_group("security (TLS and tokens; also from STEERSPEC_TLS_* env vars)")
    group.add_argument("--tls-ca", default=None, metavar="PEM",
                       help="CA that signed the servers this process dials (turns TLS on for its channels)")
    group.add_argument("--tls-cert", default=None, metavar="PEM",
                       help="certificate: this server's (with --tls-key), and the client certificate for mTLS")
    group.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    group.add_argument("--tls-server-name", default=None,
                       help="name to expect in the servers' certificates (default: the dialled host)")
    group.add_argument("--token-file", default=None, metavar="FILE",
                       help="bearer token this process sends (default: $STEERSPEC_TOKEN)")
    if serving:
        group.add_argument("--tls-client-ca", default=None, metavar="PEM",
                           help="require client certificates signed by this CA (mutual TLS)")
        group.add_argument("--auth-tokens", default=None, metavar="FILE",
                           help="accept only calls with one of these bearer tokens (one per line; "
                                "default: $STEERSPEC_AUTH_TOKENS, comma separated)")
        group.add_argument("--insecure", action="store_true",
                           help="allow plaintext without authentication on a non-loopback --host")


def configure_from_args(args: argparse.Namespace, host: Optional[str] = None) -> None:
    """Configure this process from the flags of `add_arguments` (falling back to the environment);
    with `host`, refuse a plaintext non-loopback bind now (UsageError) rather than after models load."""
    get = lambda name: getattr(args, name, None) or None  # noqa: E731
    client = client_security(get("tls_ca") or _env("ca"),
                             (get("tls_cert") or _env("cert")) if (get("tls_ca") or _env("ca")) else None,
                             (get("tls_key") or _env("key")) if (get("tls_ca") or _env("ca")) else None,
                             get("token_file") or _env("token_file"), _env("token"),
                             server_name=get("tls_server_name") or _env("server_name"))
    configure(client=client)
    if not hasattr(args, "auth_tokens"):
        return
    server = server_security(get("tls_cert") or _env("cert"), get("tls_key") or _env("key"),
                             get("tls_client_ca") or _env("client_ca"), get("auth_tokens") or _env("auth_tokens_file"),
                             _env("auth_tokens"), insecure=bool(get("insecure")) or server_from_env_insecure())
    configure(server=server)
    if host is not None:
        server.check_bind(host)


def server_from_env_insecure() -> bool:
    return (_env("insecure") or "0").lower() not in ("0", "false", "no")


# -- channels ------------------------------------------------------------------------------------
class _Details(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


def _with_metadata(details, extra):
    metadata = list(details.metadata or ()) + list(extra)
    if isinstance(details, grpc.aio.ClientCallDetails):
        return details._replace(metadata=metadata)
    return _Details(details.method, details.timeout, metadata, details.credentials, details.wait_for_ready,
                    getattr(details, "compression", None))


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the bearer token to every call of a sync channel."""

    def __init__(self, metadata):
        self._metadata = metadata

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_with_metadata(details, self._metadata), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(_with_metadata(details, self._metadata), request_iterator)

    intercept_stream_stream = intercept_stream_unary


class _AioTokenUU(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, metadata):
        self._metadata = metadata

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_metadata(details, self._metadata), request)


class _AioTokenUS(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, metadata):
        self._metadata = metadata

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_metadata(details, self._metadata), request)


class _AioTokenSS(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, metadata):
        self._metadata = metadata

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with_metadata(details, self._metadata), request_iterator)


def aio_channel(target: str, options: Sequence = (), client: Optional[ClientSecurity] = None) -> grpc.aio.Channel:
    """A grpc.aio channel to `target`: TLS and the bearer token when `client` (default: this process's) has them."""
    client = client or current_client()
    opts = list(options) + client.options()
    meta = client.metadata()
    interceptors = [_AioTokenUU(meta), _AioTokenUS(meta), _AioTokenSS(meta)] if meta else None
    creds = client.credentials()
    if creds is not None:
        return grpc.aio.secure_channel(target, creds, options=opts, interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=opts, interceptors=interceptors)


def sync_channel(target: str, options: Sequence = (), client: Optional[ClientSecurity] = None) -> grpc.Channel:
    """The sync counterpart of `aio_channel`."""
    client = client or current_client()
    opts = list(options) + client.options()
    creds = client.credentials()
    channel = (grpc.secure_channel(target, creds, options=opts) if creds is not None
               else grpc.insecure_channel(target, options=opts))
    meta = client.metadata()
    return grpc.intercept_channel(channel, _SyncToken(meta)) if meta else channel


# -- server side: tokens, identity, malformed requests -------------------------------------------
def bearer_token(metadata) -> Optional[str]:
    for key, value in metadata or ():
        if key == AUTH_HEADER and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):].strip()
    return None


def identity_of(context) -> str:
    """Who made this call: its token's identity, else its client certificate's CN, else "" (anonymous)."""
    token = bearer_token(context.invocation_metadata())
    if token:
        return token_identity(token)
    try:
        auth = context.auth_context() or {}
    except Exception:  # noqa: BLE001 - a context without auth data
        auth = {}
    names = auth.get("x509_common_name") or auth.get("x509_subject_alternative_name") or []
    if names:
        name = names[0]
        return "cert:" + (name.decode() if isinstance(name, bytes) else str(name))
    return ""


class _Malformed:
    """A request whose bytes did not parse; the handler answers INVALID_ARGUMENT."""

    def __init__(self, error: str):
        self.error = error


def _lenient(deserializer: Optional[Callable]) -> Optional[Callable]:
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except DecodeError as exc:
            return _Malformed(str(exc) or "DecodeError")
    return parse


def _malformed_message(method: str, bad: _Malformed) -> str:
    return f"{method}: the request is not a valid protobuf message ({bad.error}); send the message the proto defines"


def _abort_handler(handler, code: grpc.StatusCode, message: str):
    """A handler of the same kind as `handler` that ends the call with (code, message)."""
    async def abort(_request, context):
        await context.abort(code, message)

    kind = (grpc.unary_unary_rpc_method_handler if not handler.request_streaming and not handler.response_streaming
            else grpc.unary_stream_rpc_method_handler if not handler.request_streaming
            else grpc.stream_unary_rpc_method_handler if not handler.response_streaming
            else grpc.stream_stream_rpc_method_handler)
    return kind(abort, request_deserializer=None, response_serializer=handler.response_serializer)


def _guard_unary_request(handler, method: str):
    """Wrap a unary-request handler so a malformed request gets INVALID_ARGUMENT (not UNKNOWN)."""
    behavior = handler.unary_unary or handler.unary_stream
    if handler.response_streaming:
        async def guarded(request, context):
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _malformed_message(method, request))
            result = behavior(request, context)
            if hasattr(result, "__aiter__"):
                async for item in result:
                    yield item
            else:
                await result
        return grpc.unary_stream_rpc_method_handler(guarded, request_deserializer=_lenient(handler.request_deserializer),
                                                    response_serializer=handler.response_serializer)

    async def guarded_unary(request, context):
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _malformed_message(method, request))
        return await behavior(request, context)
    return grpc.unary_unary_rpc_method_handler(guarded_unary, request_deserializer=_lenient(handler.request_deserializer),
                                               response_serializer=handler.response_serializer)


class _GuardedContext:
    """A servicer context whose `read()` ends the call with INVALID_ARGUMENT on a malformed request."""

    def __init__(self, context, method: str) -> None:
        self._context, self._method = context, method

    def __getattr__(self, name):
        return getattr(self._context, name)

    async def read(self):
        request = await self._context.read()
        if isinstance(request, _Malformed):
            await self._context.abort(grpc.StatusCode.INVALID_ARGUMENT, _malformed_message(self._method, request))
        return request


async def _checked_requests(requests, context, method: str):
    async for request in requests:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _malformed_message(method, request))
        yield request


def _guard_streaming_request(handler, method: str):
    """Wrap a request-streaming handler so a malformed message gets INVALID_ARGUMENT (not UNKNOWN),
    whether the servicer iterates its requests or reads them with `context.read()`."""
    behavior = handler.stream_stream or handler.stream_unary
    deserializer = _lenient(handler.request_deserializer)
    if handler.response_streaming:
        async def guarded(request_iterator, context):
            result = behavior(_checked_requests(request_iterator, context, method), _GuardedContext(context, method))
            if hasattr(result, "__aiter__"):
                async for item in result:
                    yield item
            else:
                await result
        return grpc.stream_stream_rpc_method_handler(guarded, request_deserializer=deserializer,
                                                     response_serializer=handler.response_serializer)

    async def guarded_unary(request_iterator, context):
        return await behavior(_checked_requests(request_iterator, context, method), _GuardedContext(context, method))
    return grpc.stream_unary_rpc_method_handler(guarded_unary, request_deserializer=deserializer,
                                                response_serializer=handler.response_serializer)


class GuardInterceptor(grpc.aio.ServerInterceptor):
    """Checks bearer tokens (UNAUTHENTICATED) and turns unparsable requests (unary or streamed) into INVALID_ARGUMENT."""

    def __init__(self, tokens: FrozenSet[str] = frozenset()):
        self._tokens = tuple(t.encode() for t in tokens)

    def _authorized(self, metadata) -> Optional[str]:
        """None when the call may proceed, else why not."""
        if not self._tokens:
            return None
        token = bearer_token(metadata)
        if token is None:
            return ("this server requires a bearer token: send metadata 'authorization: Bearer <token>' "
                    "(SDK: Client(..., token=...); CLI: --token-file or $STEERSPEC_TOKEN)")
        given = token.encode()
        if not any(hmac.compare_digest(given, t) for t in self._tokens):
            return "the bearer token is not one this server accepts (check --auth-tokens on the server)"
        return None

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if not method.startswith(UNAUTHENTICATED_EXEMPT):
            refusal = self._authorized(handler_call_details.invocation_metadata)
            if refusal is not None:
                return _abort_handler(handler, grpc.StatusCode.UNAUTHENTICATED, refusal)
        if not handler.request_streaming and (handler.unary_unary or handler.unary_stream):
            return _guard_unary_request(handler, method)
        if handler.request_streaming and (handler.stream_stream or handler.stream_unary):
            return _guard_streaming_request(handler, method)
        return handler


def server_port(server: grpc.aio.Server, address: str, security: Optional[ServerSecurity] = None) -> int:
    """Bind `address` with TLS when configured, else plaintext; the bound port (0 when it failed)."""
    security = security or current_server()
    creds = security.credentials()
    if creds is not None:
        return server.add_secure_port(address, creds)
    return server.add_insecure_port(address)
