"""The HTTP face of the gateway: a Starlette app with OpenAI's routes, the session routes, bearer
keys, body limits, and every error in OpenAI's shape (never a bare 500 for bad input).

    POST /v1/chat/completions                    a turn (session: header X-Session-ID)
    POST /sessions/{id}/v1/chat/completions      a turn of session {id}
    POST /v1/completions                         a prompt (text or token ids) completed
    GET  /v1/models, GET /health
    GET  /v1/sessions/{id}/trajectory            the session's segments (token ids, loss mask,
                                                 logprobs, weight versions, reasons)
    POST /v1/sessions/{id}/finish                no turn follows
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from rlfabric.bus.errors import TRANSIENT
from rlfabric.gateway.api import ChatRequest, CompletionRequest
from rlfabric.gateway.errors import APIError, bad_request
from rlfabric.gateway.service import Gateway
from rlfabric.schemas import ErrorCode
from rlfabric.schemas.validation import InvalidRequest
from rlfabric.telemetry import instruments, spans
from rlfabric.text import ChatFormatError

log = logging.getLogger("rlfabric.gateway")
SESSION_HEADER = "x-session-id"
_AT = re.compile(r"at `\$\.?(.*)`$")
_JSON = "application/json"


def _param(message: str) -> str | None:
    """The field a msgspec validation error names (`... - at `$.messages[0].role``)."""
    m = _AT.search(message)
    return (m.group(1) or None) if m else None


def _json(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type=_JSON)


def _error(exc: APIError) -> Response:
    return Response(exc.body(), status_code=exc.status, media_type=_JSON)


def create_app(gateway: Gateway, *, api_keys: dict[str, str] | None = None,
               max_body_bytes: int = 8 << 20) -> Starlette:
    """`api_keys`: bearer key -> tenant (empty: no key needed)."""
    keys = dict(api_keys or {})

    def tenant_of(request: Request) -> str:
        if not keys:
            return "default"
        auth = request.headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        tenant = keys.get(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer "
                           "<key>' with a key the gateway was started with (--api-key)",
                           code=ErrorCode.INVALID_API_KEY)
        return tenant

    async def body(request: Request) -> bytes:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            raise APIError(413, f"the request body has {int(size)} bytes; this gateway takes "
                           f"at most {max_body_bytes} (--max-body-bytes)",
                           code=ErrorCode.REQUEST_TOO_LARGE)
        chunks, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > max_body_bytes:
                raise APIError(413, f"the request body is over {max_body_bytes} bytes "
                               "(--max-body-bytes)", code=ErrorCode.REQUEST_TOO_LARGE)
            chunks.append(chunk)
        return b"".join(chunks)

    def decode(data: bytes, kind: type[Any]) -> Any:
        try:
            return msgspec.json.decode(data, type=kind)
        except msgspec.ValidationError as exc:
            raise bad_request(f"invalid request: {exc}", _param(str(exc))) from None
        except msgspec.DecodeError as exc:
            raise bad_request(f"the body is not valid JSON: {exc}", None,
                              ErrorCode.INVALID_JSON) from None

    def route(name: str, handler: Callable[[Request, str], Awaitable[Response]]
              ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            tenant = "-"
            try:
                tenant = tenant_of(request)
                if spans.enabled():
                    with spans.span(f"gateway {name}", attributes={"rlfabric.tenant": tenant,
                                                                   "http.route": name}):
                        response = await handler(request, tenant)
                else:
                    response = await handler(request, tenant)
            except APIError as exc:
                response = _error(exc)
            except (ChatFormatError, InvalidRequest) as exc:  # the conversation's fault
                response = _error(bad_request(str(exc), None, ErrorCode.INVALID_CONVERSATION))
            except TRANSIENT as exc:  # the bus is coming back: worth a retry
                response = _error(APIError(503, f"the bus did not answer ({type(exc).__name__}:"
                                           f" {exc}); retry", code=ErrorCode.BUS_UNAVAILABLE))
            except Exception as exc:
                log.exception("%s %s failed", request.method, request.url.path)
                response = _error(APIError(500, f"the gateway failed: {type(exc).__name__}: "
                                           f"{exc}", code=ErrorCode.INTERNAL_ERROR))
            instruments.current.gateway_requests.add(1, {
                "http.route": name, "http.response.status_code": response.status_code,
                "rlfabric.tenant": tenant})
            return response
        return endpoint

    def session_of(request: Request) -> str | None:
        path = request.path_params.get("session_id")
        header = request.headers.get(SESSION_HEADER)
        if path and header and path != header:
            raise bad_request(f"the path names session {path!r}, the {SESSION_HEADER} header "
                              f"{header!r}: name one", "session_id")
        sid = path or header
        if sid is not None and not 0 < len(sid) <= 256:
            raise bad_request("a session id needs 1 to 256 characters", "session_id")
        return sid

    async def chat(request: Request, tenant: str) -> Response:
        req = decode(await body(request), ChatRequest)
        out = await gateway.chat(req, session_id=session_of(request), tenant=tenant)
        if isinstance(out, msgspec.Struct):
            return _json(out)
        return StreamingResponse(out, media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    async def completions(request: Request, tenant: str) -> Response:
        req = decode(await body(request), CompletionRequest)
        return _json(await gateway.complete(req, tenant=tenant))

    async def models(request: Request, tenant: str) -> Response:
        return _json(gateway.models())

    async def health(request: Request, tenant: str) -> Response:
        h = gateway.health()
        return _json(h, 200 if h["status"] == "ok" else 503)

    async def trajectory(request: Request, tenant: str) -> Response:
        return _json(await gateway.trajectory(request.path_params["session_id"]))

    async def finish(request: Request, tenant: str) -> Response:
        return _json(await gateway.finish(request.path_params["session_id"]))

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        what = "no such route" if status == 404 else "method not allowed"
        return _error(APIError(status, f"{what}: {request.method} {request.url.path}",
                               code=ErrorCode.NOT_FOUND if status == 404
                               else ErrorCode.METHOD_NOT_ALLOWED))

    open_routes = {"health"}

    def make(name: str, handler: Callable[[Request, str], Awaitable[Response]]
             ) -> Callable[[Request], Awaitable[Response]]:
        if name in open_routes:
            async def endpoint(request: Request) -> Response:
                return await handler(request, "-")
            return endpoint
        return route(name, handler)

    return Starlette(
        routes=[
            Route("/health", make("health", health), methods=["GET"]),
            Route("/v1/models", make("models", models), methods=["GET"]),
            Route("/v1/chat/completions", make("chat", chat), methods=["POST"]),
            Route("/sessions/{session_id}/v1/chat/completions", make("chat", chat),
                  methods=["POST"]),
            Route("/v1/completions", make("completions", completions), methods=["POST"]),
            Route("/v1/sessions/{session_id}/trajectory", make("trajectory", trajectory),
                  methods=["GET"]),
            Route("/v1/sessions/{session_id}/finish", make("finish", finish),
                  methods=["POST"]),
        ],
        exception_handlers={HTTPException: not_found},
    )
