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
that served its last turn first (`rlfabric.bus.rollouts.affinity`); those it does not take go to the
queue like the rest.

Token deltas of requests submitted with `stream` set come on core NATS
(`<prefix>.stream.<client_id>`); a `generate(..., deltas=True)` call yields them among its
results while its request is awaited. One may be lost, so a caller that sees a gap takes the
tokens from the result.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import operator
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Literal, cast, overload

import anyio
import anyio.lowlevel
import msgspec
import nats.errors
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from nats.js.api import DeliverPolicy
from opentelemetry.trace import INVALID_SPAN

from rlfabric.bus.control.membership import MembershipWatcher
from rlfabric.bus.nats.outbox import Outbox, Ticket
from rlfabric.bus.rollouts.affinity import Affinity, affinity_key
from rlfabric.bus.rollouts.awaited import NO_MEMBERS, Awaited, Inbox, Item, NoMembers, Sink
from rlfabric.bus.rollouts.quiet import QuietWorkers
from rlfabric.bus.session import Bus
from rlfabric.concurrency.sync import Signal
from rlfabric.schemas import (
    CLIENT_ID_HEADER,
    COUNT_HEADER,
    REQUEST_ID_HEADER,
    ErrorCode,
    RolloutCancel,
    RolloutReply,
    RolloutRequest,
    RolloutRequests,
    RolloutResult,
    TokenDelta,
    codec_for,
    encode,
    headers,
)
from rlfabric.schemas.validation import check_request
from rlfabric.telemetry import spans

log = logging.getLogger("rlfabric.bus")
#: seconds a `generate` call waits with no worker in the job before it fails its requests
NO_WORKER_WAIT = 3.0


_ADAPTER = operator.attrgetter("adapter")


@dataclass(slots=True)
class _Rebind:
    """A session's binding, moved to the worker whose result came when it is another."""

    affinity: Affinity
    key: str
    bound: str

    async def to(self, reply: Item) -> None:
        if not isinstance(reply, RolloutResult) or reply.worker_id == self.bound:
            return
        self.bound = reply.worker_id
        await self.affinity.bind(self.key, reply.worker_id)


class Vacancy:
    """Whether the job has no member: every waiting `generate` call is told when the last
    one leaves (`NO_MEMBERS` in its inbox), and fails its requests once none has been a
    member for `wait` seconds (a call made while there is none counts from then)."""

    def __init__(self, watcher: MembershipWatcher, wait: float) -> None:
        self.watcher = watcher
        self.wait = wait
        self.inboxes: set[Inbox] = set()

    def join(self, inbox: Inbox) -> float | None:
        """Tell `inbox` from now on; since when the job has had no member (None: it has)."""
        self.inboxes.add(inbox)
        return None if self.watcher.members else time.monotonic()

    def left(self, empty: float) -> tuple[float | None, float | None]:
        """(since when empty, seconds left before failing), or (None, None): a member came."""
        if self.watcher.members:
            return None, None
        return empty, empty + self.wait - time.monotonic()

    def why(self) -> str:
        return (f"no worker serves job {self.watcher.bus.subjects.prefix!r}: none has been a "
                f"member for {self.wait:g} s (the last one left or died, or none started); "
                "start workers (`rlfabric worker`), then submit again")

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        joins_leaves = Signal()
        with self.watcher.firing_on_join_or_leave(joins_leaves):
            task_status.started()
            while True:
                changed = joins_leaves.event()
                if not self.watcher.members:
                    for inbox in self.inboxes:
                        inbox.send_nowait(NO_MEMBERS)
                await changed.wait()


class RolloutPlane:
    def __init__(self, bus: Bus, client_id: str, *,
                 max_batch: int | Callable[[int, RolloutRequest], int] = 64,
                 affinity: Affinity | None = None, watcher: MembershipWatcher | None = None,
                 no_worker_wait: float = NO_WORKER_WAIT, job: str = "") -> None:
        self.bus = bus
        self.client_id = client_id
        #: the job whose subjects its requests, results and deltas travel on ("": the pool's)
        self.job = job
        #: routes the requests of a session (`generate(..., session=)`), and puts back in the
        #: queue what a worker that left held; None: all go to the shared queue
        self.affinity = affinity
        #: a `generate` call fails once the job has had no member for `no_worker_wait` s
        watcher = watcher or (affinity.watcher if affinity is not None else None)
        self.vacancy = Vacancy(watcher, no_worker_wait) if watcher is not None else None
        #: each submitted request until answered (results deduplicated there)
        self.awaited = Awaited(affinity.answered if affinity is not None else None,
                               affinity.held_by if affinity is not None else None,
                               move=self._move)
        #: request messages go out through it (`outbox.messages`, `.items`: how they packed)
        # one adapter a message: a worker holding few adapters admits a message's requests
        # under one (`rlfabric.worker.residency`)
        self.outbox = Outbox(bus, combine=lambda reqs: RolloutRequests(requests=reqs),
                             headers=self._request_headers, max_items=max_batch,
                             group=_ADAPTER)
        # NOTE: submission ids never repeat, across calls, clients and restarts: a random
        # session part and a counter (the streams' dedupe windows key on them)
        self._session = uuid.uuid4().hex[:16]
        self._counter = itertools.count()
        self._request_subject = bus.subjects.rollout_request_of(job)
        #: what `generate` calls gave up on, sent while `listen` runs
        self._cancels = _Cancels()

    async def listen(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Receive this client's results and send its requests; started once the results
        subscription is live."""
        # NOTE: an ordered consumer re-creates itself from the last result it saw once two
        # idle heartbeats are missed: after a broker restart, within a second
        s = self.bus.subjects
        deltas = await self.bus.nc.subscribe(s.token_stream(self.client_id, self.job),
                                             cb=self.awaited.on_delta)
        sub = await self.bus.js.subscribe(
            s.rollout_result(self.client_id, self.job), cb=self.awaited.on_result,
            ordered_consumer=True, deliver_policy=DeliverPolicy.NEW, idle_heartbeat=0.5)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.outbox.run)
                self._cancels.stream, cancels = \
                    anyio.create_memory_object_stream[list[str]](math.inf)
                tg.start_soon(_send_cancels, self.bus, self.bus.subjects.rollout_cancel(self.job),
                              self.client_id, cancels)
                if self.affinity is not None:
                    await tg.start(self.affinity.run, self._requeue,
                                   functools.partial(self._requeue, pulled=True))
                if self.vacancy is not None:
                    await tg.start(self.vacancy.run)
                    tg.start_soon(QuietWorkers(self.awaited, self.vacancy.watcher).run)
                task_status.started()
        finally:
            self._cancels.close()
            with anyio.CancelScope(shield=True):
                await sub.unsubscribe()
                await deltas.unsubscribe()

    @property
    def outstanding(self) -> int:
        """Requests submitted and still awaiting a result (queued here or at a worker)."""
        return len(self.awaited)

    @property
    def duplicates_dropped(self) -> int:
        return self.awaited.duplicates_dropped

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

    def _post(self, requests: Iterable[RolloutRequest], sink: Sink, timeout: float | None,
              on_stored: Callable[[BaseException | None], None], deltas: Inbox | None,
              ) -> tuple[list[RolloutRequest], Ticket | None]:
        """Check every request (a bad one refuses the whole call: nothing is sent), register
        where its results go, and queue the lot for the request stream; `on_stored(error)`
        once stored or failed for good. The ticket is None when there was nothing to send."""
        prepared = self._register(requests, sink, timeout, deltas)
        try:
            return prepared, self._send(prepared, on_stored)
        except BaseException:  # e.g. PayloadTooLarge: nothing was queued, nothing is awaited
            self.awaited.forget(prepared)
            raise

    def _register(self, requests: Iterable[RolloutRequest], sink: Sink,
                  timeout: float | None, deltas: Inbox | None) -> list[RolloutRequest]:
        prepared = [self._prepare(req, timeout) for req in requests]
        self.awaited.register(prepared, sink, deltas)
        return prepared

    def _send(self, prepared: list[RolloutRequest],
              on_stored: Callable[[BaseException | None], None], *,
              again: str = "") -> Ticket | None:
        """Queue `prepared` for the request stream. `again`: a copy of requests already
        stored, sent under message ids of its own (the stream would drop it as a duplicate
        of the first within its dedupe window)."""
        if not prepared:
            return None
        deadlines = [r.deadline for r in prepared]
        until = max(deadlines) if all(deadlines) else None
        subject = self._request_subject
        items = [(r, r.submission_id + again) for r in prepared]
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

    async def _route(self, session: str, requests: Iterable[RolloutRequest], inbox: Inbox,
                     timeout: float | None, deltas: Inbox | None,
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
        except BaseException:  # e.g. the caller hung up: an offer in flight may be taken
            self._cancels.send([r.submission_id for r in prepared])
            self.awaited.forget(prepared)
            raise

    def _move(self, req: RolloutRequest) -> RolloutRequest:
        """A handed-over sample sent on (`Awaited`), a submission of its own; as sent."""
        cont = msgspec.structs.replace(req, submission_id=f"{self._session}.{next(self._counter)}")
        self._send([cont], lambda error: None)  # not stored: its deadline answers it
        return cont

    def _requeue(self, request_ids: list[str], pulled: bool = False) -> None:
        """Requests a worker took (offered, or `pulled` from the queue) and left with: sent on
        from their tokens so far (`Awaited.lost`; the originals cancelled, so a copy the stream
        hands out again is skipped), the rest queued again now, not after the stream's ack wait
        (a copy the worker handed back itself is dropped as a duplicate)."""
        again, moved = self.awaited.lost(request_ids)
        self._cancels.send(moved)
        reqs = [r for rid in again if (r := self.awaited.request(rid)) is not None]
        if reqs:
            log.info("%d requests held by a worker that left: queued again", len(reqs))
            self._send(reqs, lambda error: None,  # not stored: its deadline answers it
                       again=f".again{next(self._counter)}" if pulled else "")

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
        return self._generate(reqs, timeout, deltas, session)

    async def _generate(self, reqs: list[RolloutRequest], timeout: float | None, deltas: bool,
                        session: str | None) -> AsyncIterator[RolloutReply | TokenDelta]:
        total = sum(r.sampling.n for r in reqs)
        inbox = Inbox()
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
        vacancy = self.vacancy
        empty = vacancy.join(inbox) if vacancy is not None else None
        try:
            while yielded < total:
                wait = self.awaited.next_deadline(ids) if timed else None
                if empty is not None and vacancy is not None:
                    empty, left = vacancy.left(empty)
                    if left is not None and left <= 0:
                        for err in self.awaited.fail(ids, ErrorCode.NO_WORKERS, vacancy.why()):
                            yielded += 1
                            yield err
                        continue
                    if left is not None:
                        wait = left if wait is None else min(wait, left)
                if wait is None:  # no deadline, no cancel scope (one each costs)
                    reply: Item | None = await inbox.get()
                else:
                    reply = None
                    with anyio.move_on_after(wait):
                        reply = await inbox.get()
                if reply is None:
                    for err in self.awaited.expire(ids):
                        yielded += 1
                        yield err
                    continue
                if isinstance(reply, NoMembers):
                    empty = empty or time.monotonic()
                    continue
                if type(reply) is not TokenDelta:  # a delta is no sample's answer
                    yielded += 1
                    if rebind is not None:  # before the caller's next turn can read it
                        await rebind.to(reply)
                yield reply
        finally:
            if vacancy is not None:
                vacancy.inboxes.discard(inbox)
            self._given_up(sent, ticket)
            if span.is_recording():
                span.set_attribute("rlfabric.results", yielded)
            span.end()

    def _given_up(self, sent: Iterable[RolloutRequest], ticket: Ticket | None) -> None:
        """A `generate` call ended: what it sent is awaited no more, what it queued and did
        not send yet is not sent, and the workers stop sampling what they hold of it."""
        if ticket is not None and not ticket.finished:
            self.outbox.withdraw(ticket)
        self._cancels.send(self.awaited.unanswered(sent))
        self.awaited.forget(sent)

    async def _start(self, reqs: list[RolloutRequest], inbox: Inbox, timeout: float | None,
                     deltas: bool, session: str | None,
                     ) -> tuple[list[RolloutRequest], Ticket | None, _Rebind | None]:
        """Submit: not awaited (no result comes before its request is stored, and a request
        that cannot be stored raises out of `inbox.get`), but a session's turn is offered to
        its worker first."""
        # a job's client sends a session's turns to the shared queue: an offer goes to one
        # worker's own subject, which no job's permissions hold it to
        if session and self.affinity is not None and not self.job:
            sent, ticket, bound = await self._route(session, reqs, inbox, timeout,
                                                    inbox if deltas else None)
            return sent, ticket, _Rebind(self.affinity, affinity_key(session), bound)
        sent, ticket = self._post(reqs, inbox, timeout, inbox.stored, inbox if deltas else None)
        return sent, ticket, None

    def generate_groups(self, requests: Iterable[RolloutRequest], *,
                        timeout: float | None = None) -> AsyncIterator[list[RolloutReply]]:
        reqs = list(requests)
        return in_groups(reqs, self.generate(reqs, timeout=timeout))


class _Cancels:
    """The submissions a client gave up on, for `_send_cancels` while the plane listens."""

    def __init__(self) -> None:
        self.stream: MemoryObjectSendStream[list[str]] | None = None

    def send(self, submission_ids: list[str]) -> None:
        if submission_ids and self.stream is not None:
            with contextlib.suppress(anyio.WouldBlock, anyio.BrokenResourceError):
                self.stream.send_nowait(submission_ids)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None


async def _send_cancels(bus: Bus, subject: str, client_id: str,
                        recv: MemoryObjectReceiveStream[list[str]]) -> None:
    """Tell the workers which requests this client gave up on (`RolloutCancel`)."""
    codec = codec_for(RolloutCancel)
    async with recv:
        async for ids in recv:
            msg = RolloutCancel(client_id=client_id, submission_ids=ids)
            try:
                await bus.nc.publish(subject, codec.encode(msg), headers=headers())
            except nats.errors.Error as exc:  # workers then sample them to their end
                log.debug("cancel of %d requests not sent: %r", len(ids), exc)


async def in_groups(requests: list[RolloutRequest], replies: AsyncIterator[RolloutReply]
                    ) -> AsyncIterator[list[RolloutReply]]:
    """`replies` (of `requests`) a request's n samples together, in sample order; `replies`
    is closed with this (a caller that stops early gives its requests up at once)."""
    n_of = {r.request_id: r.sampling.n for r in requests}
    groups: dict[str, list[RolloutReply]] = {}
    async with contextlib.aclosing(cast(AsyncGenerator[RolloutReply, None], replies)):
        async for reply in replies:
            g = groups.setdefault(reply.request_id, [])
            g.append(reply)
            if len(g) == n_of[reply.request_id]:
                del groups[reply.request_id]
                yield sorted(g, key=lambda r: r.sample_index or 0)
