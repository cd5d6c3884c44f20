"""The HTTP face of the gateway: a Starlette app with OpenAI's routes, the session routes, bearer
keys, body limits, and every error in OpenAI's shape (never a bare 500 for bad input).

    POST /v1/chat/completions                    a turn (session: header X-Session-ID)
    POST /sessions/{id}/v1/chat/completions      a turn of session {id}
    POST /v1/completions                         a prompt (text or token ids) completed
    GET  /v1/models
    GET  /health                                 liveness: 200 while the bus is reachable
    GET  /ready                                  readiness: 503 until a worker serving the
                                                 model is a member
    GET  /metrics                                Prometheus' text format (rlfabric gateway
                                                 turns it on; empty where nothing did)
    GET  /v1/sessions/{id}/trajectory            the session's segments (token ids, loss mask,
                                                 logprobs, weight versions, reasons)
    POST /v1/sessions/{id}/finish                no turn follows
"""

from __future__ import annotations

import logging
import re
import time
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
from rlfabric.schemas.jobs import SEPARATOR
from rlfabric.schemas.validation import InvalidRequest
from rlfabric.telemetry import instruments, prometheus_text, spans
from rlfabric.text import ChatFormatError

log = logging.getLogger("rlfabric.gateway")
#: a line per request (`rlfabric gateway` turns it on; a streamed response is logged when its
#: headers go out)
access = logging.getLogger("rlfabric.gateway.access")
SESSION_HEADER = "x-session-id"
_AT = re.compile(r"at `\$\.?(.*)`$")
_JSON = "application/json"


def _param(message: str) -> str | None:
    """The field a msgspec validation error names (`... - at `$.messages[0].role``)."""
    m = _AT.search(message)
    return (m.group(1) or None) if m else None


def _json(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type=_JSON)


#: statuses a client must not send again as they are: a 409 means another turn of the
#: session is in flight (or it ended); the official `openai` client retries a 409 by default,
#: and a retry that lands after that turn samples a branch nobody asked for
_NO_RETRY = {409: {"x-should-retry": "false"}}


def _error(exc: APIError) -> Response:
    return Response(exc.body(), status_code=exc.status, media_type=_JSON,
                    headers=_NO_RETRY.get(exc.status))


Handler = Callable[[Request, str], Awaitable[Response]]


def create_app(gateway: Gateway, *, api_keys: dict[str, str] | None = None,
               max_body_bytes: int = 8 << 20) -> Starlette:
    """`api_keys`: bearer key -> tenant (empty: no key needed)."""
    api = _Api(gateway, dict(api_keys or {}), max_body_bytes)
    guarded = api.guarded
    return Starlette(
        routes=[
            Route("/health", api.health, methods=["GET"]),  # open: no key, no metrics
            Route("/ready", api.ready, methods=["GET"]),  # the same
            Route("/metrics", api.metrics, methods=["GET"]),  # the same: a scraper has no key
            Route("/v1/models", guarded("models", api.models), methods=["GET"]),
            Route("/v1/chat/completions", guarded("chat", api.chat), methods=["POST"]),
            Route("/sessions/{session_id}/v1/chat/completions", guarded("chat", api.chat),
                  methods=["POST"]),
            Route("/v1/completions", guarded("completions", api.completions),
                  methods=["POST"]),
            Route("/v1/sessions/{session_id}/trajectory",
                  guarded("trajectory", api.trajectory), methods=["GET"]),
            Route("/v1/sessions/{session_id}/finish", guarded("finish", api.finish),
                  methods=["POST"]),
        ],
        exception_handlers={HTTPException: _not_found},
    )


def _decode(data: bytes, kind: type[Any]) -> Any:
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as exc:
        raise bad_request(f"invalid request: {exc}", _param(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", None,
                          ErrorCode.INVALID_JSON) from None


def _session_of(request: Request) -> str | None:
    path = request.path_params.get("session_id")
    header = request.headers.get(SESSION_HEADER)
    if path and header and path != header:
        raise bad_request(f"the path names session {path!r}, the {SESSION_HEADER} header "
                          f"{header!r}: name one", "session_id")
    sid = path or header
    if sid is not None and not 0 < len(sid) <= 256:
        raise bad_request("a session id needs 1 to 256 characters", "session_id")
    return sid


def _failure(request: Request, exc: Exception) -> Response:
    """Any error of a handler, in OpenAI's shape."""
    if isinstance(exc, APIError):
        return _error(exc)
    if isinstance(exc, (ChatFormatError, InvalidRequest)):  # the conversation's fault
        return _error(bad_request(str(exc), None, ErrorCode.INVALID_CONVERSATION))
    if isinstance(exc, TRANSIENT):  # the bus is coming back: worth a retry
        return _error(APIError(503, f"the bus did not answer ({type(exc).__name__}: {exc}); "
                               "retry", code=ErrorCode.BUS_UNAVAILABLE))
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return _error(APIError(500, f"the gateway failed: {type(exc).__name__}: {exc}",
                           code=ErrorCode.INTERNAL_ERROR))


async def _not_found(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 404
    what = "no such route" if status == 404 else "method not allowed"
    return _error(APIError(status, f"{what}: {request.method} {request.url.path}",
                           code=ErrorCode.NOT_FOUND if status == 404
                           else ErrorCode.METHOD_NOT_ALLOWED))


class _Api:
    """The routes' handlers over one `Gateway`; `guarded` adds keys, spans and metrics."""

    def __init__(self, gateway: Gateway, keys: dict[str, str], max_body_bytes: int) -> None:
        self.gateway = gateway
        self.keys = keys
        self.max_body_bytes = max_body_bytes

    def within(self, session_id: str, tenant: str) -> str:
        """A session id as the store keys it: a job's sessions apart from every other job's
        (one job's key never reaches another's session of the same id)."""
        job = self.gateway.config.job_of(tenant)
        return f"{job}{SEPARATOR}{session_id}" if job else session_id

    def tenant_of(self, request: Request) -> str:
        if not self.keys:
            return "default"
        auth = request.headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        tenant = self.keys.get(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer "
                           "<key>' with a key the gateway was started with (--api-key)",
                           code=ErrorCode.INVALID_API_KEY)
        return tenant

    async def body(self, request: Request) -> bytes:
        limit = self.max_body_bytes
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > limit:
            raise APIError(413, f"the request body has {int(size)} bytes; this gateway takes "
                           f"at most {limit} (--max-body-bytes)",
                           code=ErrorCode.REQUEST_TOO_LARGE)
        chunks, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise APIError(413, f"the request body is over {limit} bytes "
                               "(--max-body-bytes)", code=ErrorCode.REQUEST_TOO_LARGE)
            chunks.append(chunk)
        return b"".join(chunks)

    def guarded(self, name: str, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            tenant = "-"
            t0 = time.monotonic()
            try:
                tenant = self.tenant_of(request)
                if spans.enabled():
                    with spans.span(f"gateway {name}", attributes={"rlfabric.tenant": tenant,
                                                                   "http.route": name}):
                        response = await handler(request, tenant)
                else:
                    response = await handler(request, tenant)
            except Exception as exc:
                response = _failure(request, exc)
            instruments.current.gateway_requests.add(1, {
                "http.route": name, "http.response.status_code": response.status_code,
                "rlfabric.tenant": tenant})
            if access.isEnabledFor(logging.INFO):
                client = request.client.host if request.client else "-"
                access.info('%s "%s %s" %d %.0fms session=%s tenant=%s', client,
                            request.method, request.url.path, response.status_code,
                            (time.monotonic() - t0) * 1e3, _session_of(request) or "-", tenant)
            return response
        return endpoint

    async def chat(self, request: Request, tenant: str) -> Response:
        req = _decode(await self.body(request), ChatRequest)
        sid = _session_of(request)
        out = await self.gateway.chat(req, session_id=sid and self.within(sid, tenant),
                                      tenant=tenant)
        if isinstance(out, msgspec.Struct):
            return _json(out)
        return StreamingResponse(out, media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    async def completions(self, request: Request, tenant: str) -> Response:
        req = _decode(await self.body(request), CompletionRequest)
        return _json(await self.gateway.complete(req, tenant=tenant))

    async def models(self, request: Request, tenant: str) -> Response:
        return _json(self.gateway.models(tenant))

    async def health(self, request: Request) -> Response:
        h = self.gateway.health()
        return _json(h, 200 if h["status"] == "ok" else 503)

    async def metrics(self, request: Request) -> Response:
        body, kind = prometheus_text()
        return Response(body, media_type=kind)

    async def ready(self, request: Request) -> Response:
        r = self.gateway.ready()
        return _json(r, 200 if r["ready"] else 503)

    async def trajectory(self, request: Request, tenant: str) -> Response:
        sid = request.path_params["session_id"]
        return _json(await self.gateway.trajectory(sid, self.within(sid, tenant)))

    async def finish(self, request: Request, tenant: str) -> Response:
        sid = request.path_params["session_id"]
        return _json(await self.gateway.finish(sid, self.within(sid, tenant)))
