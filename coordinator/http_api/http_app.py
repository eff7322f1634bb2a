"""The OpenAI-compatible routes over one `Coordinator`: POST /v1/completions, POST /v1/chat/completions,
GET /v1/models, GET /health.

Status codes: 400 bad or unsupported parameter (OpenAI's error body names it), 401 missing or wrong bearer
token (the coordinator's --auth-tokens), 404 unknown model, 409 session conflict, 429 the caller's session
quota, 503 no verifier (or the store failed), 504 the request's `timeout` passed. A stream that fails after
its first chunk ends with an error event, then `data: [DONE]`.
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from typing import Any, Dict, FrozenSet, Optional

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.responses import StreamingResponse

from coordinator.http_api.openai_request import APIError, OpenAIRequest, chat_prompt, parse
from coordinator.http_api.openai_response import Responder, Timing
from coordinator.http_api.session_feed import SessionFeed
from coordinator.loop import MAX_NEW_TOKENS
from coordinator.streams import SessionError
from steerspec.serving import security

STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
          grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
          grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.ALREADY_EXISTS: 409,
          grpc.StatusCode.ABORTED: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
          grpc.StatusCode.DEADLINE_EXCEEDED: 504}
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context's room


def http_error(exc: SessionError) -> APIError:
    """A coordinator SessionError as its HTTP status and OpenAI error body."""
    return APIError(STATUS.get(exc.code, 500), exc.message, code=exc.code.name.lower())


def sse(payload: Dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class FeedStream(StreamingResponse):
    """A server-sent-event stream that closes its SessionFeed however it ends (done, failed, or the client
    went away), so an abandoned generation ends on every service."""

    def __init__(self, content, feed: SessionFeed) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.feed = feed

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.feed.close()


class OpenAIApp:
    """The routes' state: the coordinator, the accepted bearer tokens."""

    def __init__(self, coordinator, tokens: FrozenSet[str] = frozenset()) -> None:
        self.coordinator = coordinator
        self.tokens = tuple(t.encode() for t in tokens)

    def identity(self, request: Request) -> str:
        """The caller's identity (its token's, as on gRPC); APIError 401 when tokens are required and it has none."""
        header = request.headers.get("authorization", "")
        token = header[len("Bearer "):].strip() if header.startswith("Bearer ") else ""
        if self.tokens:
            if not token:
                raise APIError(401, "this server requires a bearer token: send 'Authorization: Bearer <token>' "
                                    "(openai client: api_key=...)", code="missing_token")
            if not any(hmac.compare_digest(token.encode(), t) for t in self.tokens):
                raise APIError(401, "the bearer token is not one this server accepts (check --auth-tokens on the "
                                    "coordinator)", code="invalid_api_key")
        return security.token_identity(token) if token else ""

    async def model_name(self) -> str:
        try:
            await self.coordinator.ensure_model()
        except SessionError as exc:
            raise http_error(exc) from None
        return self.coordinator.model_name

    async def models(self, request: Request) -> Dict[str, Any]:
        self.identity(request)
        name = await self.model_name()
        identity = self.coordinator.config.model
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": 0, "owned_by": "steerspec", "root": name,
            "max_model_len": self.coordinator.config.max_length,
            "steerspec": identity.to_dict() if identity is not None else {}}]}

    async def health(self) -> JSONResponse:
        live = await self.coordinator.config.placer.live("verifier")
        if not live:
            return JSONResponse({"status": "unavailable", "verifiers": 0}, status_code=503)
        return JSONResponse({"status": "ok", "verifiers": len(live)})

    async def _session(self, parsed: OpenAIRequest, identity: str):
        """(SessionRequest, SessionFeed) of a checked request: its generation is running."""
        coordinator = self.coordinator
        name = await self.model_name()
        if parsed.model != name:
            raise APIError(404, f"the model '{parsed.model}' does not exist here: this server serves '{name}' "
                                "(GET /v1/models)", param="model", code="model_not_found")
        prompt = parsed.prompt if parsed.kind == "completion" else chat_prompt(coordinator.tokenizer,
                                                                               parsed.messages, name)
        request = parsed.generate_request(prompt, parsed.max_tokens or COMPLETION_MAX_TOKENS)
        try:
            prompt_ids = await coordinator.admission.prompt_ids(request)
            if parsed.max_tokens is None and parsed.kind == "chat":  # the rest of the context, as vLLM does
                used = len(prompt_ids if prompt_ids is not None else request.prompt_ids)
                room = (coordinator.config.max_length or used + MAX_NEW_TOKENS) - used
                request.max_new_tokens = max(1, min(room, MAX_NEW_TOKENS))
            session = coordinator.session_request(request, prompt_ids)
        except SessionError as exc:
            raise http_error(exc) from None
        deadline = None if parsed.timeout is None else time.monotonic() + parsed.timeout
        operation = "chat" if parsed.kind == "chat" else "text_completion"
        feed = SessionFeed(coordinator.serve_session(session, identity, deadline, operation=operation), deadline)
        return session, feed

    async def complete(self, kind: str, request: Request):
        identity = self.identity(request)
        try:
            body = await request.json()
        except ValueError:
            raise APIError(400, "the request body is not valid JSON") from None
        parsed = parse(kind, body)
        timing = Timing()
        session, feed = await self._session(parsed, identity)
        try:
            first = await feed.next()
        except SessionError as exc:
            await feed.close()
            raise http_error(exc) from None
        responder = Responder(kind, parsed.model, f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-"
                                                  f"{session.session_id or uuid.uuid4().hex}")
        spec_tokens = session.block_limit if session.mode == "speculative" else 0
        if parsed.stream:
            return FeedStream(self._events(first, feed, responder, timing, parsed.include_usage, spec_tokens), feed)
        try:
            item = first
            while item is not None and not item.HasField("summary"):
                timing.tokens_arrived(len(item.chunk.token_ids))
                item = await feed.next()
        except SessionError as exc:
            raise http_error(exc) from None
        finally:
            await feed.close()
        if item is None:
            raise APIError(500, "the generation ended without a summary")
        return JSONResponse(responder.body(item.summary, timing, spec_tokens))

    async def _events(self, item, feed: SessionFeed, responder: Responder, timing: Timing, include_usage: bool,
                      spec_tokens: int):
        """The stream's server-sent events, from the first response on."""
        first = True
        try:
            while item is not None:
                if item.HasField("summary"):
                    if first and responder.kind == "chat":
                        yield sse(responder.chunk("", first=True))
                    yield sse(responder.final_chunk(item.summary))
                    if include_usage:
                        yield sse(responder.usage_chunk(item.summary, timing, spec_tokens))
                else:
                    timing.tokens_arrived(len(item.chunk.token_ids))
                    if item.chunk.text or (first and responder.kind == "chat"):
                        yield sse(responder.chunk(item.chunk.text, first=first))
                        first = False
                item = await feed.next()
        except SessionError as exc:
            yield sse(http_error(exc).body())
        yield "data: [DONE]\n\n"


def create_app(coordinator, tokens: Optional[FrozenSet[str]] = None) -> FastAPI:
    """The FastAPI app of `coordinator`; `tokens`: accepted bearer tokens (default: the process's --auth-tokens)."""
    state = OpenAIApp(coordinator, security.current_server().tokens if tokens is None else tokens)
    app = FastAPI(title="SteerSpec OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await state.complete("completion", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await state.complete("chat", request)

    @app.get("/v1/models")
    async def models(request: Request):
        return await state.models(request)

    @app.get("/health")
    async def health():
        return await state.health()

    app.state.openai = state
    return app
