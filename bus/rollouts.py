"""The client side of the data plane (a trainer's `FabricClient`, a gateway): requests into the
workers' queue, each sample's result back exactly once, samples still missing at their deadline
as typed errors, and the token deltas of streamed requests as they are sampled.

Requests submitted together (one call's batch, or concurrent calls: whatever is queued while
the previous message is being stored) are persisted as one `RolloutRequests` message of up to
`max_batch` requests; several such messages are in flight at once (PubAcks pipelined).
`submit` returns once every one of its requests is stored; `generate` does not wait for that
on its own (no result can come before it): a store that fails for good raises out of it, and
requests it gave up on before they went out are not sent.

Results arrive on `<prefix>.rollout.result.<client_id>` through an ordered consumer on the
results stream, singly or coalesced (`RolloutReplies`); a redelivered request can produce a
result twice, so results are deduplicated by (request_id, sample_index) here, at the one
place that knows what is still awaited.

The requests of an agent session's turn (`generate(..., session=)`) are offered to the worker
that served its last turn first (`rlfabric.bus.affinity`); those it does not take go to the
queue like the rest.

Token deltas of requests submitted with `stream` set come on core NATS
(`<prefix>.stream.<client_id>`); a `generate(..., deltas=True)` call yields them among its
results while its request is awaited. One may be lost, so a caller that sees a gap takes the
tokens from the result.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol, cast, overload

import anyio
import anyio.lowlevel
import msgspec
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy
from opentelemetry.trace import INVALID_SPAN

from rlfabric.bus.affinity import Affinity, affinity_key
from rlfabric.bus.outbox import Outbox, Ticket
from rlfabric.bus.session import Bus
from rlfabric.schemas import (
    CLIENT_ID_HEADER,
    COUNT_HEADER,
    REQUEST_ID_HEADER,
    ErrorCode,
    RolloutError,
    RolloutReplies,
    RolloutReply,
    RolloutRequest,
    RolloutRequests,
    RolloutResult,
    SchemaError,
    TokenDelta,
    TokenDeltas,
    codec_for,
    encode,
)
from rlfabric.schemas.validation import InvalidRequest, check_request
from rlfabric.telemetry import instruments, spans

#: metric attributes of a result handed over, and of the trainer's queue depth
_OK = {"outcome": "ok"}
_TRAINER = {"rlfabric.role": "trainer"}


def _in_flight(ids: list[str]) -> str:
    return (f"request_id {', '.join(map(repr, ids[:5]))} is already in flight from this "
            "client: ids must be unique among the requests awaiting results")


class _Sink(Protocol):
    def send_nowait(self, item: RolloutReply, /) -> None: ...


#: what a `generate` call's inbox holds: results, errors, and token deltas when asked for
_Item = RolloutReply | TokenDelta


class _Inbox:
    """Where one `generate` call's results land. Unlike a memory object stream, whose every
    `receive` yields to the event loop first, `get` returns what is there at once and waits
    (on a loop future made then: an `anyio.Event` wraps an `asyncio.Event` that makes one)
    only when nothing is: one task switch a result at most."""

    __slots__ = ("_error", "_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[_Item] = deque()
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def send_nowait(self, item: _Item, /) -> None:
        self._items.append(item)
        self._wake()

    def stored(self, error: BaseException | None) -> None:
        """The call's requests are stored; or they could not be (`error`): `get` raises it."""
        if error is not None:
            self._error = error
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # cancelled with its waiting task: nobody to wake
                waiter.set_result(None)

    async def get(self) -> _Item:
        while not self._items:
            if self._error is not None:
                raise self._error
            self._waiter = waiter = asyncio.get_running_loop().create_future()
            await waiter
        return self._items.popleft()


@dataclass(eq=False, slots=True)
class _Waiting:
    """One submitted request: which samples arrived, and where its results go."""

    request: RolloutRequest
    sink: _Sink
    got: set[int] = field(default_factory=set)  # complete at `request.sampling.n`
    #: where this request's token deltas go (None: dropped)
    deltas: _Inbox | None = None


@dataclass(slots=True)
class _Rebind:
    """A session's binding, moved to the worker whose result came when it is another."""

    affinity: Affinity
    key: str
    bound: str

    async def to(self, reply: _Item) -> None:
        if not isinstance(reply, RolloutResult) or reply.worker_id == self.bound:
            return
        self.bound = reply.worker_id
        await self.affinity.bind(self.key, reply.worker_id)


class _OneReply:
    """`generate` of one untimed, untraced, unrouted request of one sample (an agent lane's
    turn): its one answer. An iterator, not an async generator (none of the event loop's
    bookkeeping of one per call); like one, it sends the request at the first `__anext__`."""

    __slots__ = ("_plane", "_req")

    def __init__(self, plane: RolloutPlane, req: RolloutRequest) -> None:
        self._plane = plane
        self._req: RolloutRequest | None = req  # None: answered (or given up)

    def __aiter__(self) -> _OneReply:
        return self

    async def __anext__(self) -> RolloutReply:
        req, self._req = self._req, None
        if req is None:
            raise StopAsyncIteration
        plane, inbox = self._plane, _Inbox()
        sent, ticket = plane._post_one(req, inbox)
        try:
            return cast(RolloutReply, await inbox.get())  # no deltas were asked for
        finally:
            plane._given_up((sent,), ticket)

    async def aclose(self) -> None:
        self._req = None


class RolloutPlane:
    def __init__(self, bus: Bus, client_id: str, *,
                 max_batch: int | Callable[[int, RolloutRequest], int] = 64,
                 affinity: Affinity | None = None) -> None:
        self.bus = bus
        self.client_id = client_id
        #: routes the requests of a session (`generate(..., session=)`); None: all go to the
        #: shared queue
        self.affinity = affinity
        self.duplicates_dropped = 0
        self._waiting: dict[str, _Waiting] = {}
        self._codec = codec_for(RolloutReply | RolloutReplies)
        self._delta_codec = codec_for(TokenDeltas)
        #: request messages go out through it (`outbox.messages`, `.items`: how they packed)
        self.outbox = Outbox(bus, combine=lambda reqs: RolloutRequests(requests=reqs),
                             headers=self._request_headers, max_items=max_batch)
        # NOTE: submission ids never repeat, across calls, clients and restarts: a random
        # session part and a counter (the streams' dedupe windows key on them)
        self._session = uuid.uuid4().hex[:16]
        self._counter = itertools.count()
        self._request_subject = bus.subjects.rollout_request

    async def listen(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Receive this client's results and send its requests; started once the results
        subscription is live."""
        # NOTE: an ordered consumer re-creates itself from the last result it saw once two
        # idle heartbeats are missed: after a broker restart, within a second
        deltas = await self.bus.nc.subscribe(self.bus.subjects.token_stream(self.client_id),
                                             cb=self._on_delta)
        sub = await self.bus.js.subscribe(
            self.bus.subjects.rollout_result(self.client_id), cb=self._on_result,
            ordered_consumer=True, deliver_policy=DeliverPolicy.NEW, idle_heartbeat=0.5)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.outbox.run)
                if self.affinity is not None:
                    await tg.start(self.affinity.run, self._requeue)
                task_status.started()
        finally:
            with anyio.CancelScope(shield=True):
                await sub.unsubscribe()
                await deltas.unsubscribe()

    async def _on_result(self, msg: Msg) -> None:
        try:
            reply = self._codec.decode(msg.data, msg.headers, subject=msg.subject)
        except SchemaError:
            return
        waiting = len(self._waiting)
        if isinstance(reply, RolloutReplies):
            ok = 0
            for one in reply.replies:
                ok += self._take(one)
        else:
            ok = self._take(reply)
        # counted a message at a time, not a result at a time
        if ok:
            instruments.current.results.add(ok, _OK)
        if len(self._waiting) != waiting:
            instruments.current.queue_depth.set(len(self._waiting), _TRAINER)

    async def _on_delta(self, msg: Msg) -> None:
        try:
            batch = self._delta_codec.decode(msg.data, msg.headers, subject=msg.subject)
        except SchemaError:
            return
        waiting = self._waiting
        for delta in batch.deltas:
            w = waiting.get(delta.request_id)
            if w is not None and w.deltas is not None and \
                    delta.submission_id == w.request.submission_id and \
                    delta.sample_index not in w.got:
                w.deltas.send_nowait(delta)

    @property
    def outstanding(self) -> int:
        """Requests submitted and still awaiting a result (queued here or at a worker)."""
        return len(self._waiting)

    def _take(self, reply: RolloutReply) -> int:
        """Hand `reply` to its caller; 1 if it was a result (0: an error, or dropped)."""
        w = self._waiting.get(reply.request_id)
        if w is None or reply.submission_id != w.request.submission_id:
            # a late duplicate of a finished request, or an earlier submission of a reused id
            self.duplicates_dropped += 1
            return 0
        got = w.got
        ok = 0
        if isinstance(reply, RolloutResult):  # one sample's answer: the common case
            if reply.sample_index in got:
                self.duplicates_dropped += 1
                return 0
            got.add(reply.sample_index)
            w.sink.send_nowait(reply)
            ok = 1
        elif not self._take_errors(w, reply):
            self.duplicates_dropped += 1
            return 0
        if len(got) >= w.request.sampling.n:
            del self._waiting[reply.request_id]
            if self.affinity is not None:
                self.affinity.answered(reply.request_id)
        return ok

    def _take_errors(self, w: _Waiting, reply: RolloutError) -> bool:
        """Hand over an error (one per sample still missing if it is for the whole request);
        False if every sample it answers was answered already."""
        if reply.sample_index is None:
            replies = [msgspec.structs.replace(reply, sample_index=i)
                       for i in range(w.request.sampling.n) if i not in w.got]
        else:
            replies = [reply] if reply.sample_index not in w.got else []
        results = instruments.current.results
        for r in replies:
            w.got.add(r.sample_index or 0)
            w.sink.send_nowait(r)
            results.add(1, {"outcome": r.code})
        return bool(replies)

    def _prepare(self, req: RolloutRequest, timeout: float | None) -> RolloutRequest:
        check_request(req)
        submission = f"{self._session}.{next(self._counter)}"
        if timeout is not None and not req.deadline:
            return msgspec.structs.replace(req, client_id=self.client_id, submission_id=submission,
                                           deadline=time.time() + timeout)
        return msgspec.structs.replace(req, client_id=self.client_id, submission_id=submission)

    async def submit(self, requests: Iterable[RolloutRequest],
                     sink: MemoryObjectSendStream[RolloutReply], *,
                     timeout: float | None = None) -> list[RolloutRequest]:
        stored = anyio.Event()
        prepared, ticket = self._post(requests, sink, timeout, lambda _: stored.set(), None)
        if ticket is not None:  # persisted (and retried through a reconnect) before this returns
            await self.outbox.settle(ticket, stored)
        return prepared

    def _post(self, requests: Iterable[RolloutRequest], sink: _Sink, timeout: float | None,
              on_stored: Callable[[BaseException | None], None], deltas: _Inbox | None,
              ) -> tuple[list[RolloutRequest], Ticket | None]:
        """Check every request (a bad one refuses the whole call: nothing is sent), register
        where its results go, and queue the lot for the request stream; `on_stored(error)`
        once stored or failed for good. The ticket is None when there was nothing to send."""
        prepared = self._register(requests, sink, timeout, deltas)
        try:
            return prepared, self._send(prepared, on_stored)
        except BaseException:  # e.g. PayloadTooLarge: nothing was queued, nothing is awaited
            self._forget(prepared)
            raise

    def _post_one(self, req: RolloutRequest, inbox: _Inbox) -> tuple[RolloutRequest, Ticket]:
        """`_post` of one untimed, untraced request: its steps for one, without those for
        many (each lane of an agent harness sends its turns this way)."""
        sent = self._prepare(req, None)
        rid = sent.request_id
        if rid in self._waiting:
            raise InvalidRequest(_in_flight([rid]))
        self._waiting[rid] = _Waiting(sent, inbox)
        try:
            ticket = self.outbox.post(self._request_subject, [(sent, sent.submission_id)],
                                      on_done=inbox.stored)
        except BaseException:  # e.g. PayloadTooLarge: nothing was queued
            del self._waiting[rid]
            raise
        return sent, ticket

    def _forget(self, prepared: Iterable[RolloutRequest]) -> None:
        for r in prepared:
            self._waiting.pop(r.request_id, None)
            if self.affinity is not None:
                self.affinity.answered(r.request_id)  # taken ones: their results are not awaited

    def _register(self, requests: Iterable[RolloutRequest], sink: _Sink,
                  timeout: float | None, deltas: _Inbox | None) -> list[RolloutRequest]:
        prepared = [self._prepare(req, timeout) for req in requests]
        waiting = self._waiting
        if len(prepared) == 1:  # one call, one request: the agent lanes' case
            clash = prepared[0].request_id in waiting
        else:
            ids = [r.request_id for r in prepared]
            clash = len(set(ids)) != len(ids) or any(rid in waiting for rid in ids)
        if clash:
            ids = [r.request_id for r in prepared]
            raise InvalidRequest(_in_flight(
                sorted({rid for rid in ids if ids.count(rid) > 1 or rid in waiting})))
        for req in prepared:
            waiting[req.request_id] = _Waiting(req, sink, deltas=deltas)
        instruments.current.queue_depth.set(len(waiting), _TRAINER)
        return prepared

    def _send(self, prepared: list[RolloutRequest],
              on_stored: Callable[[BaseException | None], None]) -> Ticket | None:
        if not prepared:
            return None
        deadlines = [r.deadline for r in prepared]
        until = max(deadlines) if all(deadlines) else None
        subject = self._request_subject
        items = [(r, r.submission_id) for r in prepared]
        if not spans.enabled():  # the common case: no span, no wrapper of `on_stored`
            return self.outbox.post(subject, items, until=until, on_done=on_stored)
        # the span a worker's `process` span hangs from: ends once the requests are stored
        sent = spans.start_producer(subject, attributes={spans.BATCH_COUNT: len(prepared)})

        def stored(error: BaseException | None) -> None:
            spans.end(sent, error)
            on_stored(error)

        with spans.within(sent):
            try:
                return self.outbox.post(subject, items, until=until, on_done=stored)
            except BaseException as exc:  # e.g. PayloadTooLarge: never sent, never stored
                spans.end(sent, exc)
                raise

    async def _route(self, session: str, requests: Iterable[RolloutRequest], inbox: _Inbox,
                     timeout: float | None, deltas: _Inbox | None,
                     ) -> tuple[list[RolloutRequest], Ticket | None, str]:
        """`_post` for the requests of a session: each offered to the session's worker
        first (`Affinity`), the ones it did not take queued."""
        assert self.affinity is not None
        aff, key = self.affinity, affinity_key(session)
        prepared = self._register(requests, inbox, timeout, deltas)
        try:
            bound = await aff.bound(key)
            wid = aff.choose(bound, len(prepared))
            rest = []
            for i, r in enumerate(prepared):
                hdrs = self.bus.headers({**self._request_headers([r]),
                                         "Nats-Msg-Id": r.submission_id})
                try:
                    taken = wid is not None and await aff.offer(wid, r.request_id, encode(r),
                                                                hdrs)
                except BaseException:
                    if wid is not None:
                        for _ in prepared[i + 1:]:  # not offered: their counts go back
                            aff.release(wid)
                    raise
                if not taken:
                    rest.append(r)
            return prepared, self._send(rest, inbox.stored), bound or ""
        except BaseException:
            self._forget(prepared)
            raise

    def _requeue(self, request_ids: list[str]) -> None:
        """Requests a worker took and left with: into the shared queue (a copy it handed
        back itself is dropped there as a duplicate)."""
        reqs = [w.request for rid in request_ids if (w := self._waiting.get(rid)) is not None]
        if reqs:
            self._send(reqs, lambda error: None)  # not stored: its deadline answers it

    def _request_headers(self, reqs: list[RolloutRequest]) -> dict[str, str]:
        if len(reqs) == 1:
            return {CLIENT_ID_HEADER: self.client_id, REQUEST_ID_HEADER: reqs[0].request_id}
        return {CLIENT_ID_HEADER: self.client_id, COUNT_HEADER: str(len(reqs))}

    @overload
    def generate(self, requests: Iterable[RolloutRequest], *, timeout: float | None = None,
                 deltas: Literal[False] = False, session: str | None = None,
                 ) -> AsyncIterator[RolloutReply]: ...

    @overload
    def generate(self, requests: Iterable[RolloutRequest], *, timeout: float | None = None,
                 deltas: Literal[True], session: str | None = None,
                 ) -> AsyncIterator[RolloutReply | TokenDelta]: ...

    def generate(self, requests: Iterable[RolloutRequest], *, timeout: float | None = None,
                 deltas: bool = False, session: str | None = None,
                 ) -> AsyncIterator[RolloutReply | TokenDelta]:
        """Submit `requests`, yield each sample's result (or error) once, as it comes; with
        `deltas`, also the `TokenDelta`s of those submitted with `stream` set, as they come.
        `session`: the requests are a turn of this session, routed to the worker that served
        its last turn (`Affinity`; without one, to the shared queue like the rest)."""
        reqs = list(requests)
        if (len(reqs) == 1 and timeout is None and not deltas and not session
                and not reqs[0].deadline and reqs[0].sampling.n == 1 and not spans.enabled()):
            return _OneReply(self, reqs[0])
        return self._generate(reqs, timeout, deltas, session)

    async def _generate(self, reqs: list[RolloutRequest], timeout: float | None, deltas: bool,
                        session: str | None) -> AsyncIterator[RolloutReply | TokenDelta]:
        total = sum(r.sampling.n for r in reqs)
        inbox = _Inbox()
        # NOTE: started, not current: an async generator's body runs in its consumer's
        # context between yields
        span = (spans.start("generate", attributes={"rlfabric.requests": len(reqs),
                                                    "rlfabric.samples": total})
                if spans.enabled() else INVALID_SPAN)
        try:
            with spans.within(span):
                sent, ticket, rebind = await self._start(reqs, inbox, timeout, deltas, session)
        except BaseException:  # e.g. InvalidRequest: nothing was sent
            span.end()
            raise
        ids = [r.request_id for r in sent]
        timed = any(r.deadline for r in sent)  # else no wait has a deadline to end it
        yielded = 0
        try:
            while yielded < total:
                wait = self._next_deadline(ids) if timed else None
                if wait is None:  # no deadline, no cancel scope (one each costs)
                    reply: _Item | None = await inbox.get()
                else:
                    reply = None
                    with anyio.move_on_after(wait):
                        reply = await inbox.get()
                if reply is None:
                    for err in self._expire(ids):
                        yielded += 1
                        yield err
                    continue
                if type(reply) is not TokenDelta:  # a delta is no sample's answer
                    yielded += 1
                    if rebind is not None:  # before the caller's next turn can read it
                        await rebind.to(reply)
                yield reply
        finally:
            self._given_up(sent, ticket)
            if span.is_recording():
                span.set_attribute("rlfabric.results", yielded)
            span.end()

    def _given_up(self, sent: Iterable[RolloutRequest], ticket: Ticket | None) -> None:
        """A `generate` call ended: what it sent is awaited no more, what it queued and did
        not send yet is not sent."""
        if ticket is not None and not ticket.finished:
            self.outbox.withdraw(ticket)
        self._forget(sent)

    async def _start(self, reqs: list[RolloutRequest], inbox: _Inbox, timeout: float | None,
                     deltas: bool, session: str | None,
                     ) -> tuple[list[RolloutRequest], Ticket | None, _Rebind | None]:
        """Submit: not awaited (no result comes before its request is stored, and a request
        that cannot be stored raises out of `inbox.get`), but a session's turn is offered to
        its worker first."""
        if session and self.affinity is not None:
            sent, ticket, bound = await self._route(session, reqs, inbox, timeout,
                                                    inbox if deltas else None)
            return sent, ticket, _Rebind(self.affinity, affinity_key(session), bound)
        sent, ticket = self._post(reqs, inbox, timeout, inbox.stored, inbox if deltas else None)
        return sent, ticket, None

    async def generate_groups(self, requests: Iterable[RolloutRequest], *,
                              timeout: float | None = None
                              ) -> AsyncIterator[list[RolloutReply]]:
        reqs = list(requests)
        n_of = {r.request_id: r.sampling.n for r in reqs}
        groups: dict[str, list[RolloutReply]] = {}
        async for reply in self.generate(reqs, timeout=timeout):
            g = groups.setdefault(reply.request_id, [])
            g.append(reply)
            if len(g) == n_of[reply.request_id]:
                del groups[reply.request_id]
                yield sorted(g, key=lambda r: r.sample_index or 0)

    def _next_deadline(self, ids: list[str]) -> float | None:
        deadlines = [w.request.deadline for rid in ids
                     if (w := self._waiting.get(rid)) and w.request.deadline]
        return max(0.0, min(deadlines) - time.time()) if deadlines else None

    def _expire(self, ids: list[str]) -> list[RolloutError]:
        out = []
        now = time.time()
        for rid in ids:
            w = self._waiting.get(rid)
            if w is None or not w.request.deadline or w.request.deadline > now:
                continue
            for i in range(w.request.sampling.n):
                if i not in w.got:
                    out.append(RolloutError(
                        request_id=rid, worker_id="", code=ErrorCode.DEADLINE_EXCEEDED,
                        sample_index=i,
                        group_id=w.request.group_id, retryable=True,
                        submission_id=w.request.submission_id,
                        message=f"no result for sample {i} of {rid} by its deadline"))
            self._waiting.pop(rid, None)
        return out
