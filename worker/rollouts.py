"""A worker's rollout data plane: pull requests from the workers' shared durable consumer,
serve them (a message at a time, or one request at a time on a fixed set of lanes), publish
each result before acking its request.

- Pull requests are kept out for exactly the engine's free room (`Puller`; a request whose
  samples are all generated leaves it while its results are stored) plus `prefetch`, none
  while held (paused, asleep) or draining; a request that lands as a pause does goes back
  (`nak`).
- Prefetch: up to `prefetch` requests beyond capacity are taken and held (in flight, kept
  alive, not yet in the engine), so the next batch is in hand when room frees, not one pull
  later. Held ones go to the engine in the order they came; at a pause or a drain they go
  back to the stream at once; a worker killed holding them has them redelivered after
  `ack_wait`, as any request it held.
- A message holds one request or several (`RolloutRequests`, header `rlf-count`); credits
  are messages, sized by the average number of requests a message brought (one credit until
  the first message came).
- An engine that serves many requests in one call (`ServesMany`: the null and torch engines)
  gets a message's requests together, one task per message; otherwise (vLLM, or tracing on)
  `capacity` serving lanes take the requests one by one (no task per request). Either way a
  request's capacity comes back once its results are stored. One sweeper sends in-progress
  acks for messages generating longer than a third of `ack_wait`.
- Every result is persisted (PubAck) before its message is acked, so a worker that dies
  mid-request loses nothing: the message is redelivered to another (and the client drops
  results it already has). Results that finish together go out as one `RolloutReplies` per
  client (`Outbox`; a decode batch's from the serving task at once): one PubAck for a burst,
  not one per result. A message with a request that must be served again (handed back,
  waiting for a weight version) is naked once all its requests are answered. A broker
  restart is ridden through: results are published again until stored (their `Nats-Msg-Id`
  makes a repeat a duplicate), pull requests are renewed on reconnect, and a message beyond
  the free capacity (pull requests the server kept across a reconnect) goes straight back.
- A request can also be offered to this worker directly (session affinity, core NATS
  `<prefix>.worker.<id>.offer`): taken when there is room and the offer is still valid, it is
  served like a pulled one; handed back, it goes to the shared queue, stored.
- Bad requests are answered with a typed `RolloutError` and never reach the engine.
- A request with `stream` set has its tokens sent as `TokenDelta`s on core NATS
  (`<prefix>.stream.<client_id>`) while it is sampled, in order, by one sender task: what is
  queued for one client when it runs goes as one `TokenDeltas` (a decode step of every
  streamed request, not one message each). A delta lost to a reconnect is not sent again (the
  stored result holds every token).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import anyio
import msgspec
import nats.errors
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from nats.aio.msg import Msg

from rlfabric.bus import Bus, Registration
from rlfabric.bus.affinity import BUSY, OFFER_UNTIL_HEADER, TAKEN
from rlfabric.bus.errors import TRANSIENT, PayloadTooLarge
from rlfabric.bus.outbox import Outbox
from rlfabric.bus.pull import Puller
from rlfabric.concurrency.ratelimit import RateLimited
from rlfabric.concurrency.sync import Signal
from rlfabric.engines.errors import EngineDied, RequestRejected
from rlfabric.engines.protocol import Engine, ServesMany, TokenSink
from rlfabric.schemas import (
    CLIENT_ID_HEADER,
    COUNT_HEADER,
    REQUEST_ID_HEADER,
    TRACEPARENTS_HEADER,
    ErrorCode,
    ErrorEvent,
    MalformedMessage,
    RolloutError,
    RolloutReplies,
    RolloutRequest,
    RolloutRequests,
    RolloutResult,
    SchemaError,
    TokenDelta,
    TokenDeltas,
    codec_for,
    encode,
    headers,
)
from rlfabric.telemetry import instruments, spans

log = logging.getLogger("rlfabric.worker.rollouts")
#: failures that are not the request's: it goes back to the stream for another try
_HAND_BACK: tuple[type[Exception], ...] = (EngineDied, *TRANSIENT)
#: the in-flight count reaches the membership bucket once it held this long (shorter than a
#: batch, longer than the hand-over between two), or this long after a change when it keeps
#: changing; and at most this often
LOAD_SETTLE_S = 0.02
LOAD_REPORT_S = 0.1


@dataclass(eq=False)
class _Delivery:
    """One delivered message and its requests still being served."""

    msg: Msg
    left: int  # requests the lanes still serve (a message served at once counts in `_Many`)
    t0: float
    back: float | None = None  # set: nak with this delay once all are done (serve again)


class _Offered:
    """A request offered to this worker (session affinity) as the serving path sees a message
    it pulled: acking it is nothing, and handed back it goes to the shared queue, stored (its
    `Nats-Msg-Id` makes it one with a copy the client queues)."""

    def __init__(self, bus: Bus, msg: Msg) -> None:
        self.bus = bus
        self.data = msg.data
        self.headers = {k: v for k, v in (msg.headers or {}).items() if k != OFFER_UNTIL_HEADER}
        self.subject = bus.subjects.rollout_request
        self.metadata = _FIRST_DELIVERY

    async def ack(self) -> None:
        pass

    async def in_progress(self) -> None:
        pass

    async def term(self) -> None:
        pass

    async def nak(self, delay: float | None = None) -> None:
        del delay  # the queue's workers take it when they can
        await self.bus.persist(self.subject, self.data, self.headers)


_FIRST_DELIVERY = SimpleNamespace(num_delivered=1)

#: what a lane takes: a delivery, one of its requests, and that request's trace context
_Work = tuple[_Delivery, RolloutRequest, dict[str, str] | None]


@dataclass(eq=False)
class _Many:
    """A message's requests in one `generate_many` call: per request id, its samples not yet
    stored (or never to come), its samples generated, and the first error that stopped one."""

    left: dict[str, int]
    posted: dict[str, int]
    #: a request's every sample stored (or never to come); True: all were generated
    request_done: Callable[[bool], None]
    generated: set[str] = field(default_factory=set)  # every sample generated
    errors: dict[str, BaseException] = field(default_factory=dict)
    settled: anyio.Event = field(default_factory=anyio.Event)

    def settle(self, rid: str, samples: int = 1) -> None:
        if rid not in self.left:  # an engine that yields a sample twice: nothing left
            return
        self.left[rid] -= samples
        if self.left[rid] == 0:
            del self.left[rid]
            self.request_done(rid in self.generated)
            if not self.left:
                self.settled.set()

    def stored(self, rids: Iterable[str], error: BaseException | None) -> None:
        """The outbox's answer for a result of each of `rids`: stored, or `error` stopped it."""
        for rid in rids:
            if error is not None:
                self.errors.setdefault(rid, error)
            self.settle(rid)


class RolloutServer:
    def __init__(self, bus: Bus, engine: Engine, worker_id: str, reg: Registration, *,
                 capacity: int, prefetch: int = 0) -> None:
        self.bus = bus
        self.engine = engine
        self.worker_id = worker_id
        self.reg = reg
        self.capacity = capacity
        self.prefetch = prefetch
        #: messages taken beyond capacity (prefetch), waiting for the engine's room; and
        #: their requests (counted in `in_flight` too)
        self._parked: deque[tuple[_Delivery, list[RolloutRequest]]] = deque()
        self.parked = 0
        self._send: MemoryObjectSendStream[_Work] | None = None  # the lanes' queue, running
        self.ack_wait = bus.limits.rollout_ack_wait
        self.in_flight = 0
        #: the in-flight count as the fleet is told it (`_report_load`): the live count once
        #: it held for `LOAD_SETTLE_S`
        self.load = 0
        #: requests in flight whose every sample is generated (their results being stored):
        #: the engine has room for another while they are
        self.storing = 0
        self.served = 0
        self.held = False
        self.draining = False
        self._serving = anyio.Event()  # set while not held
        self._serving.set()
        self._idle = anyio.Event()  # set while nothing is in flight
        self._idle.set()
        # a lane finished a request; hold, serve again, drain, a new version; pull credits
        # came back: the pull loop re-checks
        self._wake = Signal()
        self._load = Signal()  # a message taken, or nothing in flight any more
        self._working: dict[int, _Delivery] = {}
        self._result_subjects: dict[str, str] = {}
        self._codec = codec_for(RolloutRequest)
        self._batch_codec = codec_for(RolloutRequests)
        #: requests per delivered message, a moving average (None: no message seen yet)
        self._per_msg: float | None = None
        #: results go out through it, coalesced per client (`outbox.messages`, `.items`)
        self.outbox = Outbox(bus, combine=lambda replies: RolloutReplies(replies=replies))
        self._flood = RateLimited(log)
        self._many: ServesMany | None = engine if isinstance(engine, ServesMany) else None
        self._tg: TaskGroup | None = None
        self._deltas: deque[tuple[str, TokenDelta]] = deque()  # (subject, delta)
        self._delta_ready = Signal()
        self._delta_headers = headers()

    # ---- what the runtime's commands change ----
    def hold(self) -> None:
        """Take no more requests (pause, sleep): the loop stops pulling, prefetched requests
        go back to the stream."""
        if not self.held:  # held twice (pause, pause): the loop waits on the first event
            self.held = True
            self._serving = anyio.Event()
        self._give_back_parked()
        self._wake.fire()

    def serve_again(self) -> None:
        self.held = False
        self._serving.set()

    def version_moved(self) -> None:
        """Requests waiting for a newer version may be servable now (they come back from the
        stream within their back-off, at most a second)."""
        self._wake.fire()

    async def wait_idle(self) -> None:
        """Return once nothing is in flight."""
        while self.in_flight:
            idle = self._idle
            await idle.wait()

    async def drain(self, grace: float) -> None:
        """Stop fetching and wait (at most `grace` seconds) for in-flight requests."""
        self.draining = True
        self._give_back_parked()
        self._wake.fire()
        with anyio.move_on_after(grace):
            await self.wait_idle()

    # ---- the loop ----
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        s = self.bus.subjects
        info = await self.bus.js.consumer_info(s.rollout_stream, s.rollout_consumer)
        self.ack_wait = info.config.ack_wait or self.ack_wait  # as the job's creator set it
        # a message may hold several requests: the lanes' queue takes whatever came
        send, recv = anyio.create_memory_object_stream[_Work](math.inf)
        self._send = send
        async with anyio.create_task_group() as tg:
            self._tg = tg
            await tg.start(self.outbox.run)
            # a lane holds its request while its results are stored, and the engine has room
            # for another meanwhile (`engaged`): twice the lanes, never more than capacity
            # generating
            for _ in range(2 * self.capacity):
                tg.start_soon(self._lane, recv.clone())
            recv.close()
            tg.start_soon(self._keep_alive)
            tg.start_soon(self._report_load)
            tg.start_soon(self._send_deltas)
            puller = Puller(self.bus, s.rollout_stream, s.rollout_consumer, self._on_message,
                            kick=self._wake)
            await tg.start(puller.run)
            try:
                async with self._offers(self._on_message):
                    task_status.started()
                    with send:  # closed once draining: lanes finish what they hold, then end
                        await self._pull(puller)
            finally:  # stopped: prefetched requests go back now, not at ack_wait
                with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                    await self._nak_parked()

    async def _on_message(self, msg: Msg) -> None:
        """A pulled (or offered) message: its requests to the engine, held (prefetch), or back."""
        if self.held or self.draining:
            await msg.nak(delay=0.5)  # landed as a pause did: back to the stream
            return
        try:
            reqs = self._decode(msg)
        except SchemaError as exc:
            await self._reply_error(msg, None, ErrorCode.MALFORMED, str(exc))
            await msg.term()
            self._wake.fire()  # its credit is spent and no lane will say so: pull again
            return
        per = self._per_msg
        if per is None:  # the first message: now the pull loop knows what fits
            self._per_msg = len(reqs)
            self._wake.fire()
        else:
            self._per_msg = per + 0.2 * (len(reqs) - per)
        park = self.parked > 0 or not self._fits(len(reqs))
        if park and self.parked + len(reqs) > self.prefetch:
            await msg.nak()  # more than we have room for: back, for anyone
            return
        d = _Delivery(msg, len(reqs), time.monotonic())
        self._working[id(d)] = d
        self.in_flight += len(reqs)
        self._idle = anyio.Event()
        self._load.fire()  # a message at a time: the fleet sees the load it took
        if park:
            self._parked.append((d, reqs))
            self.parked += len(reqs)
        else:
            self._dispatch(d, reqs)

    @contextlib.asynccontextmanager
    async def _offers(self, take: Callable[[Msg], Awaitable[None]]) -> AsyncIterator[None]:
        """Requests offered to this worker (session affinity), while the block runs."""
        async def on_offer(msg: Msg) -> None:
            await self._on_offer(msg, take)

        sub = await self.bus.nc.subscribe(self.bus.subjects.offer(self.worker_id), cb=on_offer)
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _on_offer(self, msg: Msg, take: Callable[[Msg], Awaitable[None]]) -> None:
        """Take an offered request if there is room now (and the offer is still valid), else
        say so: the client queues it."""
        try:
            until = float((msg.headers or {}).get(OFFER_UNTIL_HEADER) or 0)
        except ValueError:
            until = 0.0
        if (self.held or self.draining or self.engaged >= self.capacity
                or time.time() > until):
            with contextlib.suppress(Exception):
                await msg.respond(BUSY)
            return
        try:
            await msg.respond(TAKEN)
        except Exception:  # the client is gone: it queued the request, or nobody waits
            return
        # NOTE: duck-typed as a pulled message: the serving path acks, naks, reads headers
        await take(cast(Msg, _Offered(self.bus, msg)))

    def _fits(self, n: int) -> bool:
        """Whether `n` more requests go to the engine now (an idle engine takes any message)."""
        running = self.engaged - self.parked
        return running == 0 or running + n <= self.capacity

    def _dispatch(self, d: _Delivery, reqs: list[RolloutRequest]) -> None:
        """Hand a taken message's requests to the engine: in one call (`ServesMany`), or to
        the lanes one by one."""
        if (self._many is not None and self._tg is not None and not spans.enabled()
                and len({r.request_id for r in reqs}) == len(reqs)):
            self._tg.start_soon(self._serve_many, d, reqs)
            return
        traced = _traces(d.msg.headers, len(reqs)) if spans.enabled() else None
        assert self._send is not None
        for i, req in enumerate(reqs):
            self._send.send_nowait((d, req, traced[i] if traced else None))

    def _unpark(self) -> None:
        """Prefetched messages to the engine, in the order they came, while they fit."""
        while (self._parked and not self.held and not self.draining
               and self._fits(len(self._parked[0][1]))):
            d, reqs = self._parked.popleft()
            self.parked -= len(reqs)
            self._dispatch(d, reqs)

    def _give_back_parked(self) -> None:
        if self._parked and self._tg is not None:
            self._tg.start_soon(self._nak_parked)

    async def _nak_parked(self) -> None:
        """Every prefetched message back to the stream, for anyone (held, draining, stopped)."""
        parked, self._parked, self.parked = self._parked, deque(), 0
        for d, reqs in parked:
            del self._working[id(d)]
            with contextlib.suppress(nats.errors.Error):  # else redelivered after ack_wait
                await d.msg.nak(delay=0.5 if self.held else None)
            for _ in reqs:
                self._request_done()

    def _decode(self, msg: Msg) -> list[RolloutRequest]:
        if COUNT_HEADER in (msg.headers or {}):
            batch: RolloutRequests = self._batch_codec.decode(msg.data, msg.headers,
                                                              subject=msg.subject)
            if not batch.requests:
                raise MalformedMessage(f"an empty request batch on {msg.subject!r}")
            return batch.requests
        return [self._codec.decode(msg.data, msg.headers, subject=msg.subject)]

    async def _pull(self, puller: Puller) -> None:
        """Keep pull requests out for exactly our free capacity, until draining."""
        while not self.draining:
            if self.held:
                serving = self._serving
                await serving.wait()
                continue
            wake = self._wake.event()
            try:
                # a request whose samples are all generated leaves the engine room while its
                # results are stored: the next request is pulled meanwhile, so it is in hand
                # when the store ends
                free = self.capacity + self.prefetch - self.engaged
                # credits are messages; a message brings `_per_msg` requests on average: ask
                # for as many as fit (one, whatever its size, when idle). Until the first
                # message tells how big they come, one: an idle worker of capacity 100 that
                # asked for 100 credits took two 50-request messages and handed 5 back to the
                # stream (none with one credit first)
                if self._per_msg is None:
                    want = 1
                else:
                    fit = int(free // max(1.0, self._per_msg))
                    want = max(fit, 1) if self.engaged == 0 else fit
                await puller.want(want)
            except nats.errors.Error as exc:  # a reconnect: try again shortly
                log.warning("%s: pull request failed (%s); retrying", self.worker_id, exc)
                await anyio.sleep(0.5)
                continue
            await wake.wait()

    async def _report_load(self) -> None:
        """Tell the fleet soon that we took work or went idle (heartbeats carry it later
        anyway): once the in-flight count held for `LOAD_SETTLE_S`, or `LOAD_REPORT_S` after
        a change if it keeps changing, and at most every `LOAD_REPORT_S`. What the members
        key already holds is not written again: a worker busy batch after batch (idle only
        while one batch's results go out and the next requests come in) writes nothing."""
        news = self._load.event()
        while True:
            await news.wait()
            until = time.monotonic() + LOAD_REPORT_S
            # changed again within LOAD_SETTLE_S (a dip undone by the next message): not
            # settled yet
            while self.in_flight != self.load and (left := until - time.monotonic()) > 0 \
                    and await self._load.wait(min(LOAD_SETTLE_S, left)):
                pass
            news = self._load.event()  # taken before the write: a change during it counts
            self.load = self.in_flight
            instruments.current.queue_depth.set(self.load, {spans.WORKER_ID: self.worker_id})
            if not self.reg.changed():  # the key holds it (heartbeats retry a failed write)
                continue
            try:
                await self.reg.flush()
            except Exception as exc:
                log.debug("in-flight count not published: %s", exc)
            await anyio.sleep(LOAD_REPORT_S)

    def _streamer(self, reqs: dict[str, RolloutRequest]) -> TokenSink | None:
        """What the engine hands the deltas of `reqs` (by request id) to; None when none of
        them is streamed."""
        if not any(r.stream for r in reqs.values()):
            return None
        subjects = self.bus.subjects

        def on_tokens(delta: TokenDelta) -> None:
            req = reqs.get(delta.request_id)
            if req is None or not req.stream:
                return
            delta = msgspec.structs.replace(delta, submission_id=req.submission_id)
            self._deltas.append((subjects.token_stream(req.client_id), delta))
            self._delta_ready.fire()
        return on_tokens

    async def _send_deltas(self) -> None:
        """Publish the queued token deltas, in order, one message per client (core NATS:
        buffered, no round trip)."""
        while True:
            ready = self._delta_ready.event()
            by_subject: dict[str, list[TokenDelta]] = {}
            while self._deltas:
                subject, delta = self._deltas.popleft()
                by_subject.setdefault(subject, []).append(delta)
            for subject, deltas in by_subject.items():
                try:
                    await self.bus.nc.publish(subject, encode(TokenDeltas(deltas=deltas)),
                                              headers=self._delta_headers)
                except nats.errors.Error as exc:  # the result still carries every token
                    log.debug("token deltas to %s not sent: %s", subject, exc)
            await ready.wait()

    async def _keep_alive(self) -> None:
        """In-progress acks for every message generating longer than a third of ack_wait."""
        while True:
            await anyio.sleep(self.ack_wait / 3)
            cutoff = time.monotonic() - self.ack_wait / 3
            for d in list(self._working.values()):
                if d.t0 < cutoff:
                    try:
                        await d.msg.in_progress()
                    except nats.errors.Error as exc:  # a reconnect: the next round sends it
                        log.debug("in-progress ack not sent: %s", exc)

    async def _lane(self, recv: MemoryObjectReceiveStream[_Work]) -> None:
        async with recv:
            async for d, req, traced in recv:
                try:
                    if spans.enabled():
                        with spans.consumer_span(d.msg.subject, traced,
                                                 message_id=req.request_id,
                                                 attributes=self._span_attributes(req)):
                            await self._serve_one(d, req)
                    else:
                        await self._serve_one(d, req)
                except anyio.get_cancelled_exc_class():
                    # stopped (an engine died, a drain ran out of grace): hand it back now
                    # rather than at ack_wait
                    with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                        await d.msg.nak()
                    raise
                except Exception as exc:  # never let one request take the worker down
                    await self._request_failed(d, req, exc)
                finally:
                    self._request_done()
                d.left -= 1
                if d.left == 0:
                    await self._finish(d)

    async def _request_failed(self, d: _Delivery, req: RolloutRequest, exc: Exception) -> None:
        """`req` raised `exc`. Not the request's fault (the engine died, the bus hiccuped): its
        message goes back to the stream for another try. Otherwise it is answered with an
        `engine_error`."""
        if isinstance(exc, _HAND_BACK):
            log.debug("request %s handed back: %r", req.request_id, exc)
            d.back = max(d.back or 0.0, 0.25)
            return
        code, retryable = _code_of(exc)
        if code == ErrorCode.ENGINE_ERROR:
            log.error("request %s failed", req.request_id, exc_info=exc)
        await self._reply_error(d.msg, req, code, f"{type(exc).__name__}: {exc}",
                                retryable=retryable)

    @property
    def engaged(self) -> int:
        """Requests in flight the engine still generates for: what an offer or a message
        counts against capacity (a request whose results are being stored is not: its next
        turn may come before the store's acknowledgement does)."""
        return self.in_flight - self.storing

    def _generated(self, requests: int = 1) -> None:
        """`requests` have every sample generated: the engine has room for as many more."""
        self.storing += requests
        self._unpark()
        self._wake.fire()

    def _request_done(self, generated: bool = False) -> None:
        """A request's capacity is free again (its results stored, or it was answered);
        `generated`: it was counted in `storing`."""
        self.in_flight -= 1
        if generated:
            self.storing -= 1
        self._unpark()
        self._wake.fire()
        if self.in_flight == 0:
            self._idle.set()
            self._load.fire()  # idle: said at once too

    async def _serve_many(self, d: _Delivery, reqs: list[RolloutRequest]) -> None:
        """A message's requests through one `generate_many` call; each burst of results is
        stored as it comes (no wait), and the message is acked (or naked, see `_finish`) once
        all are."""
        todo: dict[str, tuple[RolloutRequest, str]] = {}
        try:
            for req in reqs:
                try:
                    subject = await self._admit(d, req)
                except Exception as exc:  # never let one request take the worker down
                    await self._request_failed(d, req, exc)
                    subject = None
                if subject is None:
                    self._request_done()
                else:
                    todo[req.request_id] = (req, subject)
            if todo:
                await self._generate_many(d, todo)
        except anyio.get_cancelled_exc_class():
            # stopped (an engine died, a drain ran out of grace): hand it back now
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                await d.msg.nak()
            raise
        await self._finish(d)

    async def _generate_many(self, d: _Delivery,
                             todo: dict[str, tuple[RolloutRequest, str]]) -> None:
        many = _Many(left={rid: req.sampling.n for rid, (req, _) in todo.items()},
                     posted=dict.fromkeys(todo, 0), request_done=self._request_done)
        failed = await self._post_many(d, todo, many)
        # samples that will not come (generation ended early) settle now
        for rid, (req, _) in todo.items():
            if many.posted[rid] < req.sampling.n:
                if failed is not None:
                    many.errors.setdefault(rid, failed)
                many.settle(rid, req.sampling.n - many.posted[rid])
        if many.left:
            await many.settled.wait()
        self.served += sum(1 for rid, (req, _) in todo.items()
                           if many.posted[rid] == req.sampling.n and rid not in many.errors)
        for rid, err in many.errors.items():
            if isinstance(err, _HAND_BACK):
                d.back = max(d.back or 0.0, 0.25)
            else:
                code, retryable = _code_of(err)
                await self._reply_error(d.msg, todo[rid][0], code,
                                        f"{type(err).__name__}: {err}", retryable=retryable)

    async def _post_many(self, d: _Delivery, todo: dict[str, tuple[RolloutRequest, str]],
                         many: _Many) -> Exception | None:
        """Generate the message's requests in one call, posting each result as it comes; the
        error that stopped generation, if it was the requests' (else handed back)."""
        assert self._many is not None
        attempt = d.msg.metadata.num_delivered or 1
        tokens = instruments.current.tokens
        who = {spans.WORKER_ID: self.worker_id}
        try:
            results = self._many.generate_many(
                [req for req, _ in todo.values()], worker_id=self.worker_id,
                on_tokens=self._streamer({rid: req for rid, (req, _) in todo.items()}))
            async with contextlib.aclosing(results):
                async for burst in results:
                    by_subject: dict[str, list[tuple[RolloutResult, RolloutRequest]]] = {}
                    n_tokens, generated = 0, []
                    for res in burst:
                        req, subject = todo[res.request_id]
                        res = msgspec.structs.replace(res, attempt=attempt,
                                                      submission_id=req.submission_id)
                        n_tokens += len(res.completion_token_ids)
                        many.posted[req.request_id] += 1
                        if many.posted[req.request_id] == req.sampling.n:
                            generated.append(req.request_id)
                        by_subject.setdefault(subject, []).append((res, req))
                    tokens.add(n_tokens, who)  # a burst at a time, as the engine gave them
                    if generated:  # marked and counted together (`_request_done` pairs them)
                        many.generated.update(generated)
                        self._generated(len(generated))
                    for subject, done in by_subject.items():
                        await self._store_burst(subject, done, many)
        except _HAND_BACK as exc:  # not the requests' fault: the message goes back
            log.debug("%d requests handed back: %r", len(todo), exc)
            d.back = max(d.back or 0.0, 0.25)
        except Exception as exc:  # never let one message take the worker down
            log.exception("requests %s failed", ", ".join(todo))
            return exc
        return None

    async def _store_burst(self, subject: str, done: list[tuple[RolloutResult, RolloutRequest]],
                           many: _Many) -> None:
        """Results that finished together, for one client: sent now as one message (each
        sample settled in `many` once stored); a sample too large for a message is answered
        alone, the rest sent without it."""
        items = [(res, _result_id(req, res.sample_index)) for res, req in done]
        deadlines = [req.deadline for _, req in done]
        # past its deadline + a margin nobody waits for a result: stop retrying
        until = None if not all(deadlines) else max(deadlines) + 10.0
        rids = [res.request_id for res, _ in done]
        try:
            await self.outbox.post_now(subject, items, until=until,
                                       on_done=functools.partial(many.stored, rids))
        except PayloadTooLarge:  # one by one: only the oversized samples are answered
            for (res, req), item in zip(done, items, strict=True):
                one = (res.request_id,)
                try:
                    self.outbox.post(subject, [item], until=req.deadline + 10.0
                                     if req.deadline else None,
                                     on_done=functools.partial(many.stored, one))
                except PayloadTooLarge as exc:
                    many.stored(one, exc)

    async def _finish(self, d: _Delivery) -> None:
        """Every request of the message answered: ack it; or, if one must be served again
        (handed back, waiting for a version), nak it: the client drops what it already has."""
        del self._working[id(d)]
        try:
            if d.back is None:
                await d.msg.ack()
            else:
                await d.msg.nak(delay=d.back)
        except nats.errors.Error as exc:  # redelivered after ack_wait; duplicates dropped
            log.debug("message not acked (%s): redelivered", exc)

    # ---- one request ----
    def _span_attributes(self, req: RolloutRequest) -> dict[str, Any]:
        return {spans.CONSUMER_GROUP: self.bus.subjects.rollout_consumer,
                spans.WORKER_ID: self.worker_id, spans.WEIGHT_VERSION: self.engine.version,
                "rlfabric.request.id": req.request_id, "rlfabric.client.id": req.client_id,
                "rlfabric.samples": req.sampling.n}

    async def _admit(self, d: _Delivery, req: RolloutRequest) -> str | None:
        """The subject `req`'s results go to, if it is to be served now; None once it was
        answered with an error or is to come back later (`d.back`)."""
        msg = d.msg
        subject = self._result_subjects.get(req.client_id)
        if subject is None:
            try:
                subject = self.bus.subjects.rollout_result(req.client_id)
            except ValueError:
                await self._reply_error(msg, req, ErrorCode.BAD_REQUEST, "request has no usable "
                                        f"client_id ({req.client_id!r})")
                return None
            self._result_subjects[req.client_id] = subject
        if req.deadline and time.time() > req.deadline:  # nobody waits for it: out of the queue
            await self._reply_error(msg, req, ErrorCode.DEADLINE_EXCEEDED,
                                    f"request {req.request_id} expired before a worker took it")
            return None
        if not await self._version_ready(d, req):
            return None
        try:
            self.engine.check(req)
        except RequestRejected as exc:
            await self._reply_error(msg, req, exc.code, str(exc))
            return None
        return subject

    async def _serve_one(self, d: _Delivery, req: RolloutRequest) -> None:
        msg = d.msg
        subject = await self._admit(d, req)
        if subject is None:
            return
        attempt = msg.metadata.num_delivered or 1
        # past its deadline + a margin nobody waits for a result: stop retrying the publish
        until = req.deadline + 10.0 if req.deadline else None
        tokens = instruments.current.tokens
        left = req.sampling.n
        try:
            with spans.span(f"{self.engine.name} generate", attributes={
                    spans.WORKER_ID: self.worker_id, "rlfabric.engine": self.engine.name}) as gen:
                async for res in self.engine.generate(
                        req, worker_id=self.worker_id,
                        on_tokens=self._streamer({req.request_id: req}) if req.stream else None):
                    left -= 1
                    if left == 0:
                        self._generated()
                    res = msgspec.structs.replace(res, attempt=attempt,
                                                  submission_id=req.submission_id)
                    n = len(res.completion_token_ids)
                    tokens.add(n, {spans.WORKER_ID: self.worker_id})
                    if gen.is_recording():
                        gen.add_event("sample", {"index": res.sample_index, "tokens": n,
                                                 "finish_reason": res.finish_reason})
                    # persisted (PubAck), coalesced with what finished meanwhile, before the
                    # request's message is acked
                    with spans.producer_span(subject,
                                             message_id=_result_id(req, res.sample_index)):
                        await self.outbox.send(
                            subject, [(res, _result_id(req, res.sample_index))], until=until)
        finally:
            if left <= 0:
                self.storing -= 1
        self.served += 1

    async def _version_ready(self, d: _Delivery, req: RolloutRequest) -> bool:
        """Whether this worker holds a version `req` may be served under (its adapter's, if
        it names one); if not, it was answered or goes back (`_not_yet`)."""
        if not req.adapter:
            if req.min_weight_version <= self.engine.version:
                return True
            desired = await self.bus.state.read()
            await self._not_yet(d, req, desired.weight_version, "weight version")
            return False
        held = self.engine.adapter_versions().get(req.adapter, ())
        if held and max(req.min_weight_version, req.adapter_version) <= max(held):
            return True  # an evicted version asked for: the engine's check says so
        upd = (await self.bus.state.read()).adapters.get(req.adapter)
        if upd is None:
            await self._reply_error(d.msg, req, ErrorCode.ADAPTER_UNKNOWN,
                                    f"request {req.request_id} names adapter {req.adapter!r}, "
                                    "which no update loaded on this fleet (or one unloaded): "
                                    "push it with FabricClient.update_weights(adapter=...)")
            return False
        await self._not_yet(d, req, upd.version, f"adapter {req.adapter!r} version")
        return False

    async def _not_yet(self, d: _Delivery, req: RolloutRequest, desired: int, what: str
                       ) -> None:
        """A request for a version newer than ours. If the fleet's desired version is that
        new (an update is on its way, or this worker is behind), it goes back to the stream
        for a while, backing off, so the requests behind it are served meanwhile. If no
        update to it was ever sent, a request without a deadline fails now (nothing would
        ever serve it); one with a deadline waits for it until then."""
        want = max(req.min_weight_version, req.adapter_version)
        if desired < want and not req.deadline:
            await self._reply_error(
                d.msg, req, ErrorCode.VERSION_UNAVAILABLE,
                f"request {req.request_id} needs {what} >= {want}, but the fleet's desired "
                f"version is {desired} and no update to {want} was sent: push it first, lower "
                "min_weight_version, or give the request a deadline to wait for it",
                retryable=True)
            return
        tries = d.msg.metadata.num_delivered or 1
        d.back = max(d.back or 0.0, min(1.0, 0.25 * 2 ** min(tries - 1, 2)))

    async def _reply_error(self, msg: Msg, req: RolloutRequest | None, code: str, message: str,
                           *, retryable: bool = False) -> None:
        hdrs = msg.headers or {}
        client_id = req.client_id if req else hdrs.get(CLIENT_ID_HEADER, "")
        request_id = req.request_id if req else hdrs.get(REQUEST_ID_HEADER, "")
        # one log line per kind and interval with a count, not one per request; every one
        # an event
        self._flood.warning(f"%s answered a request with {code}: %s", self.worker_id, message)
        instruments.current.errors.add(1, {"code": code, spans.WORKER_ID: self.worker_id})
        await self.bus.emit(ErrorEvent(source=self.worker_id, code=code, message=message,
                                       subject=msg.subject, at=time.time()))
        if not client_id or not request_id:
            return
        err = RolloutError(request_id=request_id, worker_id=self.worker_id, code=code,
                           message=message, group_id=req.group_id if req else "",
                           retryable=retryable,
                           submission_id=req.submission_id if req else "")
        try:
            await self.bus.persist(self.bus.subjects.rollout_result(client_id), encode(err),
                                   self.bus.headers({
                                       "Nats-Msg-Id": _result_id(req, "error", request_id)}),
                                   until=time.time() + 30.0)
        except Exception as exc:
            log.warning("could not answer %s with %s: %s", request_id, code, exc)


def _code_of(exc: BaseException) -> tuple[str, bool]:
    """The `RolloutError` code a request's failure is answered with, and whether resending
    it can help."""
    if isinstance(exc, PayloadTooLarge):
        return ErrorCode.PAYLOAD_TOO_LARGE, False
    if isinstance(exc, RequestRejected):
        return exc.code, False
    return ErrorCode.ENGINE_ERROR, True


def _traces(headers: dict[str, str] | None, n: int) -> list[dict[str, str] | None]:
    """Each request's trace context: the message's `traceparent`, or one per request when it
    combined several traced calls (`rlf-traceparents`; see `Outbox`)."""
    hdrs = headers or {}
    listed = hdrs.get(TRACEPARENTS_HEADER)
    if listed is not None:
        tps = listed.split(",")
        if len(tps) == n:
            return [None if tp == "-" else {"traceparent": tp} for tp in tps]
    return [hdrs] * n


def _result_id(req: RolloutRequest | None, sample: int | str, request_id: str = "") -> str:
    """The results stream's dedupe key: one per submission and sample (a reused request id
    is a new submission, never a duplicate of the old one's result)."""
    sub = (req.submission_id or f"{req.client_id}/{req.request_id}") if req else request_id
    return f"{sub}/{sample}"
