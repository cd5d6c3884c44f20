"""Spans across the bus: what the trainer, the broker hops and each worker did for one call.

    with span("generate", attributes={...}) as s:          # a child of the current span
        with producer_span(subject, message_id=...):         # `traceparent` goes in the headers
            ...
    with consumer_span(subject, headers, message_id=...):    # parent: the sender's span

Off unless `configure()` set a tracer (`--trace PATH`, or OTLP through the usual `OTEL_*`
variables) or the application installed an SDK `TracerProvider` of its own: then every
helper here is a shared no-op context (no span object, no context switch).

Names and attributes follow OpenTelemetry's messaging conventions: `send <subject>` for what
goes on the bus (kind PRODUCER), `process <subject>` for what a receiver does with it (kind
CONSUMER), with `messaging.system=nats`, `messaging.destination.name`,
`messaging.operation.type`, `messaging.message.id`, `messaging.consumer.group.name`; ours are
under `rlfabric.` (worker id, weight version, cmd id and op).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import ProxyTracerProvider, Span, SpanKind, Status, StatusCode, Tracer

SYSTEM = "messaging.system"
DESTINATION = "messaging.destination.name"
OPERATION = "messaging.operation.type"
MESSAGE_ID = "messaging.message.id"
CONSUMER_GROUP = "messaging.consumer.group.name"
BATCH_COUNT = "messaging.batch.message_count"
WORKER_ID = "rlfabric.worker.id"
#: the job a request is of ("" the pool's own; `rlfabric.schemas.jobs`)
JOB = "rlfabric.job"
WEIGHT_VERSION = "rlfabric.weight.version"
CMD_ID = "rlfabric.cmd.id"
CMD_OP = "rlfabric.cmd.op"
CMD_SEQ = "rlfabric.cmd.seq"
STEP = "rlfabric.step"

#: what every helper here returns while tracing is off (for a site that skips the helper)
NOOP: contextlib.nullcontext[Span] = contextlib.nullcontext(trace.INVALID_SPAN)
_configured: Tracer | None = None
_global: Tracer | None = None  # the application's own, when it set a TracerProvider
_global_checked = -math.inf
#: how soon a TracerProvider the application sets later is used
GLOBAL_RECHECK_S = 1.0


def set_tracer(tracer: Tracer | None) -> None:
    """The tracer rlfabric's spans go to (None: the application's global one, if any)."""
    global _configured
    _configured = tracer


def tracer() -> Tracer | None:
    """The tracer in use, or None when tracing is off."""
    global _global, _global_checked
    if _configured is not None:
        return _configured
    # NOTE: the application's provider is looked up at most once a second: the lookup reads
    # the environment, which costs more than everything else a span site costs when off
    now = time.monotonic()
    if now - _global_checked > GLOBAL_RECHECK_S:
        _global_checked = now
        provider = trace.get_tracer_provider()
        _global = (None if isinstance(provider, ProxyTracerProvider | trace.NoOpTracerProvider)
                   else provider.get_tracer("rlfabric"))
    return _global


def enabled() -> bool:
    if _configured is not None:
        return True
    if time.monotonic() - _global_checked <= GLOBAL_RECHECK_S:  # `tracer()`'s, asked per message
        return _global is not None
    return tracer() is not None


def span(name: str, *, attributes: Mapping[str, Any] | None = None,
         kind: SpanKind = SpanKind.INTERNAL, parent: otel_context.Context | None = None
         ) -> contextlib.AbstractContextManager[Span]:
    """A span, current inside the block; a child of `parent` or of the current span."""
    t = tracer()
    if t is None:
        return NOOP
    return t.start_as_current_span(name, context=parent, kind=kind, attributes=attributes)


def producer_span(subject: str, *, message_id: str = "",
                  attributes: Mapping[str, Any] | None = None,
                  ) -> contextlib.AbstractContextManager[Span]:
    """`send <subject>`: putting a message on the bus (and, for a stored one, until stored)."""
    t = tracer()
    if t is None:
        return NOOP
    return t.start_as_current_span(f"send {subject}", kind=SpanKind.PRODUCER,
                                   attributes=_messaging(subject, "send", message_id, attributes))


def start_producer(subject: str, *, attributes: Mapping[str, Any] | None = None,
                   parent: Span | None = None) -> Span:
    """`send <subject>` started now and ended by the caller (`end(s, error)`), not made
    current: for a send whose end (stored) comes in a callback. `parent`: its parent (else
    the current span)."""
    t = tracer()
    if t is None:
        return trace.INVALID_SPAN
    return t.start_span(f"send {subject}", kind=SpanKind.PRODUCER, context=_under(parent),
                        attributes=_messaging(subject, "send", "", attributes))


def start_consumer(subject: str, headers: Mapping[str, str] | None, *, message_id: str = "",
                   attributes: Mapping[str, Any] | None = None) -> Span:
    """`consumer_span` started now and ended by the caller, not made current: for one of
    several requests handled in one call."""
    t = tracer()
    if t is None:
        return trace.INVALID_SPAN
    return t.start_span(f"process {subject}", kind=SpanKind.CONSUMER,
                        context=parent_of(headers),
                        attributes=_messaging(subject, "process", message_id, attributes))


def _under(parent: Span | None) -> otel_context.Context | None:
    return None if parent is None else trace.set_span_in_context(parent)


def end(s: Span, error: BaseException | None = None) -> None:
    """End `s`, recording `error` as its status (what a `with` block's span does)."""
    if error is not None and s.is_recording():
        s.record_exception(error)
        s.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    s.end()


def consumer_span(subject: str, headers: Mapping[str, str] | None, *, message_id: str = "",
                  attributes: Mapping[str, Any] | None = None,
                  ) -> contextlib.AbstractContextManager[Span]:
    """`process <subject>`: handling a received message, a child of the span that sent it
    (its `traceparent` header)."""
    t = tracer()
    if t is None:
        return NOOP
    return t.start_as_current_span(
        f"process {subject}", kind=SpanKind.CONSUMER, context=parent_of(headers),
        attributes=_messaging(subject, "process", message_id, attributes))


def _messaging(subject: str, operation: str, message_id: str,
               extra: Mapping[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {SYSTEM: "nats", DESTINATION: subject, OPERATION: operation}
    if message_id:
        out[MESSAGE_ID] = message_id
    if extra:
        out.update(extra)
    return out


def parent_of(headers: Mapping[str, str] | None) -> otel_context.Context | None:
    """The context a message's headers carry (None: none, or tracing off)."""
    if not headers or "traceparent" not in headers:
        return None
    return propagate.extract(headers)


def carrier() -> dict[str, str] | None:
    """The current span's context as headers (`traceparent`), or None when there is none."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    out: dict[str, str] = {}
    propagate.inject(out)
    return out


def within(s: Span) -> contextlib.AbstractContextManager[Span]:
    """Make an already started span current inside the block (it is not ended here)."""
    if not s.get_span_context().is_valid:  # tracing off: no generator-based manager
        return contextlib.nullcontext(s)
    return trace.use_span(s, end_on_exit=False)


def start(name: str, *, attributes: Mapping[str, Any] | None = None,
          parent: Span | None = None) -> Span:
    """A span started now and ended by the caller (`s.end()`); not made current. For spans
    that outlive one block: an async generator's, a step's. `parent`: its parent (else the
    current span)."""
    t = tracer()
    if t is None:
        return trace.INVALID_SPAN
    return t.start_span(name, context=_under(parent), attributes=attributes)
