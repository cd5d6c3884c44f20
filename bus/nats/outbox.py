"""`Outbox`: JetStream publishes coalesced per subject, PubAcks pipelined.

    outbox = Outbox(bus, combine=lambda msgs: RolloutReplies(replies=msgs), headers=...)
    await tg.start(outbox.run)
    await outbox.send(subject, [(msg, msg_id)], until=deadline)   # returns once stored
    outbox.post(subject, [(msg, msg_id)], on_done=callback)       # returns at once
    await outbox.post_now(subject, burst, on_done=callback)       # sent by the caller, now

Whatever is queued while earlier messages are on their way goes out as one message (up to
`max_items`, a number or a function of how many items are queued and the first of them, asked
at each message, and `max_bytes`): a burst of n small messages costs a few PubAcks, not n,
and nothing waits for a window to close. Several combined messages are in flight at once.
A single item goes as itself, so a receiver decodes either the message type or its
combination.

Every combined message carries a `Nats-Msg-Id` derived from all its items' ids (`batch_id`),
so a retry after a lost PubAck (a reconnect, a broker restart: `Bus.persist`) is dropped by the
stream as a duplicate, and a message that differs in any item is not: a batch that starts with
a repeated item (a result served again after a redelivery) still stores the new ones.

When tracing is on, each `send` call's span context goes with its items: a message whose
items share one carries it as `traceparent`; one that combines items of several traced calls
also lists each item's (`rlf-traceparents`, in item order, `-` for none), so a receiver
parents every item's span on the call that sent it.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
from anyio.abc import TaskGroup, TaskStatus
from nats.js.api import PubAck

from rlfabric.bus.errors import (
    PUBLISH_FAILED,
    PayloadTooLarge,
    StorageFull,
    retryable,
    storage_refused,
)
from rlfabric.bus.session import Bus
from rlfabric.concurrency.sync import Signal
from rlfabric.schemas import TRACEPARENTS_HEADER, encode
from rlfabric.telemetry import spans


@dataclass(eq=False, slots=True)
class Ticket:
    """The items of one `post` (or `send`) call until they are all stored: `on_done` is
    called once, with None or the error that stopped one."""

    left: int
    until: float | None
    on_done: Callable[[BaseException | None], None] | None
    error: BaseException | None = None
    finished: bool = False


@dataclass(eq=False, slots=True)
class _Item:
    subject: str
    msg: Any
    msg_id: str
    data: bytes
    ticket: Ticket
    trace: dict[str, str] | None


#: bytes of a message left for its headers (schema, message id, trace context)
HEADROOM = 4096


class Outbox:
    def __init__(self, bus: Bus, *, combine: Callable[[list[Any]], Any],
                 headers: Callable[[list[Any]], dict[str, str]] | None = None,
                 max_items: int | Callable[[int, Any], int] = 64, max_bytes: int | None = None,
                 group: Callable[[Any], object] | None = None) -> None:
        self.bus = bus
        #: items combine only with items of the same group (and subject)
        self.group = group
        self.combine = combine
        self.extra_headers = headers
        self.max_items = max_items
        self.max_bytes = max_bytes or max(64 * 1024, bus.nc.max_payload // 2)
        #: messages stored, and the items they held
        self.messages = 0
        self.items = 0
        self._queue: deque[_Item] = deque()
        self._queued = Signal()
        self._tg: TaskGroup | None = None

    async def send(self, subject: str, items: list[tuple[Any, str]], *,
                   until: float | None = None) -> None:
        """Queue `(message, msg_id)` pairs for `subject`; return once all are stored, or
        raise the error that stopped one (retried until `until`, a `time.time()`; None: until
        stored). Cancelled before they went out, they are not sent."""
        if not items:
            return
        stored = anyio.Event()
        ticket = self.post(subject, items, until=until, on_done=lambda _: stored.set())
        await self.settle(ticket, stored)

    async def settle(self, ticket: Ticket, stored: anyio.Event) -> None:
        """Wait for `stored` (set by `ticket`'s `on_done`), then raise the error that stopped
        one of its items. Cancelled meanwhile: what did not go out yet is not sent."""
        try:
            await stored.wait()
        except BaseException:
            self.withdraw(ticket)
            raise
        if ticket.error is not None:
            raise ticket.error

    def post(self, subject: str, items: list[tuple[Any, str]], *, until: float | None = None,
             on_done: Callable[[BaseException | None], None] | None = None) -> Ticket:
        """`send` without the wait: queue the items and return; `on_done(error)` is called
        (from the outbox's task) once all are stored (`error` None) or one failed for good.
        For hot paths that have something else to await anyway: no event, no task switch."""
        if self._tg is None:
            raise RuntimeError("Outbox.post before Outbox.run started")
        limit = self.bus.nc.max_payload - HEADROOM
        ticket = Ticket(left=len(items), until=until, on_done=on_done)
        trace = spans.carrier() if spans.enabled() else None
        queued = []
        for msg, msg_id in items:
            data = encode(msg)
            if len(data) > limit:  # nothing of the call is queued
                raise PayloadTooLarge(
                    f"{_name(msg, msg_id)} is {len(data):,} bytes, over the "
                    f"{limit:,} the NATS server takes in one message (its max_payload less "
                    f"headers): send a shorter prompt, ask for fewer tokens or logprobs, or "
                    "raise max_payload on the server", size=len(data), limit=limit)
            queued.append(_Item(subject, msg, msg_id, data, ticket, trace))
        self._queue.extend(queued)
        self._queued.fire()
        return ticket

    async def post_now(self, subject: str, items: list[tuple[Any, str]], *,
                       until: float | None = None,
                       on_done: Callable[[BaseException | None], None] | None = None) -> Ticket:
        """`post` for a burst the caller holds whole (a decode batch's results): sent from the
        caller's task, now, as one message encoded once, not at the outbox task's next turn
        item by item. While something is queued, or past `max_items` or `max_bytes`, it is
        `post` (what is queued goes first)."""
        if not items or self._queue or self._tg is None:
            return self.post(subject, items, until=until, on_done=on_done)
        limit = self.max_items(len(items), items[0][0]) if callable(self.max_items) \
            else self.max_items
        if len(items) > limit:
            return self.post(subject, items, until=until, on_done=on_done)
        body = items[0][0] if len(items) == 1 else self.combine([msg for msg, _ in items])
        data = encode(body)
        if len(data) > self.max_bytes:
            return self.post(subject, items, until=until, on_done=on_done)
        ticket = Ticket(left=len(items), until=until, on_done=on_done)
        trace = spans.carrier() if spans.enabled() else None
        # what `_store` settles; the message's body is `data`
        batch = [_Item(subject, msg, msg_id, b"", ticket, trace) for msg, msg_id in items]
        msg_id = items[0][1] if len(items) == 1 else batch_id([i for _, i in items])
        hdrs = self._headers(batch, msg_id)
        sent = await self._send_now(subject, data, hdrs)
        if self._tg is not None:
            self._tg.start_soon(self._store, batch, subject, data, hdrs, sent)
        # nats-py writes from its flusher task, at the caller's next wait: yielded to now, not
        # after whatever the caller does before it waits
        await anyio.lowlevel.checkpoint()
        return ticket

    def withdraw(self, ticket: Ticket) -> None:
        """Drop the items of `ticket` not yet taken into a message (their sender gave up);
        its `on_done` is then never called."""
        if any(i.ticket is ticket for i in self._queue):
            self._queue = deque(i for i in self._queue if i.ticket is not ticket)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            try:
                while True:
                    queued = self._queued.event()
                    if not self._queue:
                        await queued.wait()
                        continue
                    batch = self._take()
                    subject, data, hdrs = self._message(batch)
                    # sent from here, its PubAck awaited in a task: the message leaves now,
                    # not once that task is scheduled behind whatever else is ready
                    sent = await self._send_now(subject, data, hdrs)
                    tg.start_soon(self._store, batch, subject, data, hdrs, sent)
                    await anyio.lowlevel.checkpoint()  # let senders queue more meanwhile
            finally:
                self._tg = None

    def _take(self) -> list[_Item]:
        """The oldest item and what follows it for the same subject, up to the limits."""
        queued = len(self._queue)
        first = self._queue.popleft()
        batch, size, rest = [first], len(first.data), deque[_Item]()
        limit = (self.max_items(queued, first.msg) if callable(self.max_items)
                 else self.max_items)
        group = self.group
        key = group(first.msg) if group is not None else None
        while self._queue and len(batch) < limit:
            item = self._queue.popleft()
            if item.subject != first.subject or size + len(item.data) > self.max_bytes or \
                    (group is not None and group(item.msg) != key):
                rest.append(item)
                continue
            batch.append(item)
            size += len(item.data)
        rest.extend(self._queue)
        self._queue = rest
        return batch

    def _message(self, batch: list[_Item]) -> tuple[str, bytes, dict[str, str]]:
        """The subject, body and headers of the message holding `batch`."""
        if len(batch) == 1:
            data, msg_id = batch[0].data, batch[0].msg_id
        else:
            # the items as `post` encoded them, not encoded again (msgspec writes a Raw as is)
            data = encode(self.combine([msgspec.Raw(i.data) for i in batch]))
            msg_id = batch_id([i.msg_id for i in batch])
        return batch[0].subject, data, self._headers(batch, msg_id)

    def _headers(self, batch: list[_Item], msg_id: str) -> dict[str, str]:
        extra = self.extra_headers([i.msg for i in batch]) if self.extra_headers else {}
        hdrs = self.bus.headers({**extra, "Nats-Msg-Id": msg_id})
        _trace_headers(hdrs, batch)
        return hdrs

    async def _send_now(self, subject: str, data: bytes, hdrs: dict[str, str]
                        ) -> asyncio.Future[PubAck] | None:
        """The message sent, its PubAck to come on the future; None if it could not go now
        (no connection): `_store` stores it, and says why if it cannot."""
        if not self.bus.nc.is_connected:
            return None
        try:
            return await self.bus.send_stored(subject, data, hdrs)
        except Exception:
            return None

    async def _store(self, batch: list[_Item], subject: str, data: bytes,
                     hdrs: dict[str, str], sent: asyncio.Future[PubAck] | None) -> None:
        error: BaseException | None = None
        try:
            try:
                # a PubAck not back in 2 s (a server still recovering after a restart may
                # drop the publish): sent again, a stored one is dropped as a duplicate
                if sent is not None:
                    await self.bus.pub_ack(sent, timeout=2.0)
                else:
                    await self.bus.publish_stored(subject, data, hdrs, timeout=2.0)
            except PUBLISH_FAILED as exc:
                if not retryable(exc):
                    raise
                # a reconnect, a broker restart, a partition: until stored
                untils = [i.ticket.until for i in batch]
                until = None if None in untils else max(u for u in untils if u is not None)
                await self.bus.persist(subject, data, hdrs, until=until)
        except Exception as exc:
            error = exc
            if storage_refused(exc):
                error = StorageFull(
                    f"JetStream has no room for {_name(batch[0].msg, batch[0].msg_id)} on "
                    f"{subject} ({getattr(exc, 'description', exc)}): its stream is at its cap "
                    "(Limits.*_max_bytes; queued requests: rollout_max_bytes) or the server's "
                    "store is full. Wait for the queue to drain, or raise the cap")
        self.messages += 1
        self.items += len(batch)
        for item in batch:
            t = item.ticket
            t.left -= 1
            if error is not None and t.error is None:
                t.error = error
            if (t.left == 0 or t.error is not None) and not t.finished:
                t.finished = True
                if t.on_done is not None:
                    t.on_done(t.error)


def _name(msg: Any, msg_id: str) -> str:
    """What a user calls `msg`: its type and request id (and sample), else its message id."""
    rid = getattr(msg, "request_id", None)
    if rid is None:
        return f"{type(msg).__name__} {msg_id}"
    sample = getattr(msg, "sample_index", None)
    return f"{type(msg).__name__} of request {rid}" + (f" (sample {sample})" if sample else "")


def batch_id(ids: list[str]) -> str:
    """The `Nats-Msg-Id` of a message combining items with these ids: the first, the count,
    and a digest of all (equal only for the same items in the same order)."""
    digest = hashlib.blake2b("\n".join(ids).encode(), digest_size=12).hexdigest()
    return f"{ids[0]}+{len(ids)}.{digest}"


def _trace_headers(hdrs: dict[str, str], batch: list[_Item]) -> None:
    """The items' trace contexts (see the module doc); nothing when none was traced."""
    traces = [i.trace for i in batch]
    if not any(traces):
        return
    first = next(t for t in traces if t)
    hdrs.update(first)
    if any(t != first for t in traces):
        hdrs[TRACEPARENTS_HEADER] = ",".join((t or {}).get("traceparent", "-") for t in traces)
