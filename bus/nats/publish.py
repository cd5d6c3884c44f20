"""Publishing on the bus: core-NATS messages, and JetStream publishes that are pipelined,
stored for sure (through a reconnect or a broker restart) and refused at once when the
client's role may not."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.api import PubAck
from opentelemetry import propagate, trace

from rlfabric.bus.errors import PUBLISH_FAILED, TRANSIENT, retryable
from rlfabric.bus.nats.connect import Link
from rlfabric.bus.nats.puback import PubAcks
from rlfabric.bus.nats.refusals import Refusals
from rlfabric.bus.subjects import Subjects, check_token
from rlfabric.concurrency import RateLimited, wait_any
from rlfabric.schemas import Event, encode
from rlfabric.schemas import headers as schema_headers
from rlfabric.telemetry import spans

#: seconds a pipelined JetStream publish waits for its PubAck before it counts as lost
PUB_ACK_TIMEOUT = 5.0
log = logging.getLogger("rlfabric.bus")
_retrying = RateLimited(log)


class Publisher:
    def __init__(self, nc: NATS, subjects: Subjects, link: Link) -> None:
        self.nc = nc
        self.subjects = subjects
        #: the connection's ups and downs (`link.reconnected` fires after each reconnect)
        self.link = link
        self.refusals = Refusals(link)
        self._pubacks = PubAcks(nc)

    def headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """`rlf-schema`, the current trace context (`traceparent`, when a span is active), and
        `extra`."""
        out = schema_headers(extra)
        # no tracer, no span: the context lookup is skipped (it costs more than the rest)
        if spans.enabled() and trace.get_current_span().get_span_context().is_valid:
            propagate.inject(out)
        return out

    async def publish(self, subject: str, msg: Any, *, extra: Mapping[str, str] | None = None,
                      ) -> None:
        """Core-NATS publish of an rlfabric message (buffered; no round trip)."""
        await self.nc.publish(subject, encode(msg), headers=self.headers(extra))

    async def emit(self, event: Event, *, once: str = "") -> None:
        """Send a fleet event (core NATS; the events stream keeps it). `once`: its
        `Nats-Msg-Id`, so that the stream keeps one copy of an event several processes send."""
        kind = event.__struct_config__.tag
        assert isinstance(kind, str)
        await self.publish(self.subjects.events(kind, check_token(event.source, "source")),
                           event, extra={"Nats-Msg-Id": once} if once else None)

    async def persist(self, subject: str, data: bytes, headers: dict[str, str], *,
                      until: float | None = None, attempt_timeout: float = 5.0,
                      on_retry: Callable[[Exception], None] | None = None,
                      cleared_as: str | None = None) -> PubAck:
        """A JetStream publish that rides through a reconnect or a broker restart: a
        transient failure (no connection, no PubAck in `attempt_timeout`, JetStream not up
        yet) is retried, at once after a reconnect, else backing off up to 1 s, until
        `until` (a `time.time()`; None: until it is stored). Give the message a
        `Nats-Msg-Id` header: a retry of one that was stored but whose PubAck was lost is
        then dropped by the stream as a duplicate (`PubAck.duplicate`). `on_retry` is called
        with each transient error before its retry. `cleared_as`: the permission `subject`
        falls under, if subjects under it are many (see `Refusals.guard`)."""
        delay = 0.05
        last: Exception = nats.errors.ConnectionReconnectingError()
        while True:
            reconnected = self.link.reconnected.event()
            if self.nc.is_closed:
                raise nats.errors.ConnectionClosedError
            if self.nc.is_connected:
                try:
                    # a pipelined publish awaited at once, not nats-py's `js.publish` (a
                    # request and `asyncio.wait_for`): less CPU a publish, and a reconnect
                    # fails it at once (`Link.pending_acks`) where a request waits out its
                    # timeout
                    return await self.refusals.guard(subject, lambda: self.publish_stored(
                        subject, data, headers, timeout=attempt_timeout), cleared_as=cleared_as)
                except PUBLISH_FAILED as exc:
                    if not retryable(exc):  # e.g. no room: it will not store on a retry either
                        raise
                    last = exc
                    if on_retry is not None:
                        on_retry(exc)
                    _retrying.warning("publish to %s did not reach JetStream (%s: %s); "
                                      "retrying until it does", subject, type(exc).__name__,
                                      exc)
            if until is not None and time.time() >= until:
                raise last
            await wait_any(reconnected, timeout=delay)
            delay = min(2 * delay, 1.0)

    async def publish_stored(self, subject: str, data: bytes | memoryview,
                             headers: dict[str, str] | None = None, *,
                             timeout: float = PUB_ACK_TIMEOUT) -> PubAck:
        """A JetStream publish that others may be in flight beside (pipelined); returns its
        PubAck. A reconnect before the PubAck came (it may be lost with the old connection)
        or none within `timeout` raises a `TRANSIENT` error: retry with the same
        `Nats-Msg-Id` (`persist`) and a stored one is dropped as a duplicate. A stream that
        refuses the message raises its `APIError` at once."""
        return await self.pub_ack(await self.send_stored(subject, data, headers), timeout)

    async def send_stored(self, subject: str, data: bytes | memoryview,
                          headers: dict[str, str] | None) -> asyncio.Future[PubAck]:
        """Send a JetStream publish; its PubAck comes on the returned future (`PubAcks`;
        failed by a reconnect: see `Link.pending_acks`). Await it with `pub_ack`, or cancel
        it and discard it from `Link.pending_acks`."""
        fut = await self._pubacks.send(subject, data, headers)
        self.link.pending_acks.add(fut)
        return fut

    async def pub_ack(self, fut: asyncio.Future[PubAck], timeout: float) -> PubAck:
        if fut.done():  # come already (a write sent before what the caller awaited first)
            self.link.pending_acks.discard(fut)
            return fut.result()
        # no PubAck in `timeout`: a loop timer fails `fut` (its pending slot is freed; a late
        # PubAck is dropped), not a cancel scope (one more per publish)
        timer = asyncio.get_running_loop().call_later(timeout, _time_out, fut)
        try:
            return await fut
        finally:
            timer.cancel()
            self.link.pending_acks.discard(fut)

    async def stored_later(self, subject: str, data: bytes, headers: dict[str, str], *,
                           cleared_as: str | None = None) -> Callable[[], Awaitable[PubAck]]:
        """A JetStream publish sent now, stored for sure later: the returned call awaits its
        PubAck and, if none comes (a reconnect, a timeout), stores it as `persist` does (give
        it a `Nats-Msg-Id`). A refusal by the stream raises from the call. For a write whose
        caller has other work to do meanwhile."""
        fut = None
        if self.nc.is_connected and self.refusals.cleared(cleared_as or subject):
            with contextlib.suppress(*TRANSIENT):
                fut = await self.send_stored(subject, data, headers)

        async def stored() -> PubAck:
            if fut is not None:
                try:
                    return await self.pub_ack(fut, PUB_ACK_TIMEOUT)
                except PUBLISH_FAILED as exc:
                    if not retryable(exc):
                        raise
                    # sent again below; a stored copy is dropped as a duplicate
            return await self.persist(subject, data, headers, cleared_as=cleared_as)
        return stored


def _time_out(fut: asyncio.Future[PubAck]) -> None:
    if not fut.done():
        fut.set_exception(nats.errors.TimeoutError())
