"""A worker's rollout data plane: pull requests from the workers' shared durable consumer,
serve them on a fixed set of lanes, publish each result before acking its request.

- Pull requests are kept out for exactly the free capacity (`Puller`), none while held
  (paused, asleep) or draining; a request that lands as a pause does goes back (`nak`).
- `capacity` serving lanes take the messages (no task per request); one sweeper sends
  in-progress acks for requests generating longer than a third of `ack_wait`.
- Every result is persisted (PubAck) before its request is acked, so a worker that dies
  mid-request loses nothing: the request is redelivered to another. A broker restart is
  ridden through: results are published again until stored (their `Nats-Msg-Id` makes a
  repeat a duplicate), pull requests are renewed on reconnect, and a message beyond the free
  capacity (pull requests the server kept across a reconnect) goes straight back.
- Bad requests are answered with a typed `RolloutError` and never reach the engine.
"""

from __future__ import annotations

import logging
import time

import anyio
import msgspec
import nats.errors
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream
from nats.aio.msg import Msg

from rlfabric.bus import Bus, Registration
from rlfabric.bus.errors import TRANSIENT
from rlfabric.bus.pull import Puller
from rlfabric.bus.ratelimit import RateLimited
from rlfabric.bus.sync import Signal, wait_any
from rlfabric.engines.protocol import Engine, EngineDied, RequestRejected
from rlfabric.schemas import (
    CLIENT_ID_HEADER,
    REQUEST_ID_HEADER,
    ErrorEvent,
    RolloutError,
    RolloutRequest,
    SchemaError,
    codec_for,
    encode,
)

log = logging.getLogger("rlfabric.worker.rollouts")
#: failures that are not the request's: it goes back to the stream for another try
_HAND_BACK: tuple[type[Exception], ...] = (EngineDied, *TRANSIENT)


class RolloutServer:
    def __init__(self, bus: Bus, engine: Engine, worker_id: str, reg: Registration, *,
                 capacity: int) -> None:
        self.bus = bus
        self.engine = engine
        self.worker_id = worker_id
        self.reg = reg
        self.capacity = capacity
        self.ack_wait = bus.limits.rollout_ack_wait
        self.in_flight = 0
        self.served = 0
        self.held = False
        self.draining = False
        self._serving = anyio.Event()  # set while not held
        self._serving.set()
        self._idle = anyio.Event()  # set while nothing is in flight
        self._idle.set()
        self._slot = Signal()  # a lane finished a request
        self._poke = Signal()  # hold, serve again, drain, a new version: the loop re-checks
        self._load = Signal()  # in-flight count crossed 0 <-> 1 or reached capacity
        self._working: dict[int, tuple[Msg, float]] = {}
        self._result_subjects: dict[str, str] = {}
        self._codec = codec_for(RolloutRequest)
        self._flood = RateLimited(log)

    # ---- what the runtime's commands change ----
    def hold(self) -> None:
        """Take no more requests (pause, sleep): the loop stops pulling."""
        self.held = True
        self._serving = anyio.Event()
        self._poke.fire()

    def serve_again(self) -> None:
        self.held = False
        self._serving.set()

    def version_moved(self) -> None:
        """Requests waiting for a newer version may be servable now (they come back from the
        stream within their back-off, at most a second)."""
        self._poke.fire()

    async def wait_idle(self) -> None:
        """Return once nothing is in flight."""
        while self.in_flight:
            idle = self._idle
            await idle.wait()

    async def drain(self, grace: float) -> None:
        """Stop fetching and wait (at most `grace` seconds) for in-flight requests."""
        self.draining = True
        self._poke.fire()
        with anyio.move_on_after(grace):
            await self.wait_idle()

    # ---- the loop ----
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        s = self.bus.subjects
        info = await self.bus.js.consumer_info(s.rollout_stream, s.rollout_consumer)
        self.ack_wait = info.config.ack_wait or self.ack_wait  # as the job's creator set it
        send, recv = anyio.create_memory_object_stream[Msg](self.capacity)

        async def on_message(msg: Msg) -> None:
            if self.held or self.draining:
                await msg.nak(delay=0.5)  # landed as a pause did: back to the stream
                return
            if self.in_flight >= self.capacity:  # more than asked for: back, for anyone
                await msg.nak()
                return
            self.in_flight += 1
            self._idle = anyio.Event()
            if self.in_flight == 1 or self.in_flight == self.capacity:
                self._load.fire()
            send.send_nowait(msg)

        async with anyio.create_task_group() as tg:
            for _ in range(self.capacity):
                tg.start_soon(self._lane, recv.clone())
            recv.close()
            tg.start_soon(self._keep_alive)
            tg.start_soon(self._report_load)
            puller = Puller(self.bus, s.rollout_stream, s.rollout_consumer, on_message)
            await tg.start(puller.run)
            task_status.started()
            with send:  # closed once draining: lanes finish what they hold, then end
                await self._pull(puller)

    async def _pull(self, puller: Puller) -> None:
        """Keep pull requests out for exactly our free capacity, until draining."""
        while not self.draining:
            if self.held:
                serving = self._serving
                await serving.wait()
                continue
            slot, kicked, poke = self._slot.event(), puller.kicked(), self._poke.event()
            try:
                await puller.want(self.capacity - self.in_flight)
            except nats.errors.Error as exc:  # a reconnect: try again shortly
                log.warning("%s: pull request failed (%s); retrying", self.worker_id, exc)
                await anyio.sleep(0.5)
                continue
            await wait_any(slot, kicked, poke)

    async def _report_load(self) -> None:
        """Tell the fleet at once that we took work (heartbeats carry it later anyway)."""
        news = self._load.event()
        while True:
            await news.wait()
            news = self._load.event()  # taken before the write: a change during it counts
            try:
                await self.reg.flush()
            except Exception as exc:
                log.debug("in-flight count not published: %s", exc)

    async def _keep_alive(self) -> None:
        """In-progress acks for every request generating longer than a third of ack_wait."""
        while True:
            await anyio.sleep(self.ack_wait / 3)
            cutoff = time.monotonic() - self.ack_wait / 3
            for msg, t0 in list(self._working.values()):
                if t0 < cutoff:
                    try:
                        await msg.in_progress()
                    except nats.errors.Error as exc:  # a reconnect: the next round sends it
                        log.debug("in-progress ack not sent: %s", exc)

    async def _lane(self, recv: MemoryObjectReceiveStream[Msg]) -> None:
        async with recv:
            async for msg in recv:
                self._working[id(msg)] = (msg, time.monotonic())
                try:
                    await self._serve_one(msg)
                except anyio.get_cancelled_exc_class():
                    # stopped (an engine died, a drain ran out of grace): hand it back now
                    # rather than at ack_wait
                    with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                        await msg.nak()
                    raise
                except _HAND_BACK as exc:
                    # not the request's fault (the engine died, the bus hiccuped): it goes
                    # back to the stream for another try
                    log.debug("request on %s handed back: %r", msg.subject, exc)
                    with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                        await msg.nak(delay=0.25)
                except Exception as exc:  # never let one request take the worker down
                    log.exception("request on %s failed", msg.subject)
                    await self._reply_error(msg, None, "engine_error",
                                            f"{type(exc).__name__}: {exc}", retryable=True)
                    await msg.ack()
                finally:
                    del self._working[id(msg)]
                    self.in_flight -= 1
                    self._slot.fire()
                    if self.in_flight == 0:
                        self._idle.set()
                        self._load.fire()  # idle: said at once too

    # ---- one request ----
    async def _serve_one(self, msg: Msg) -> None:
        try:
            req = self._codec.decode(msg.data, msg.headers, subject=msg.subject)
        except SchemaError as exc:
            await self._reply_error(msg, None, "malformed", str(exc))
            await msg.term()
            return
        subject = self._result_subjects.get(req.client_id)
        if subject is None:
            try:
                subject = self.bus.subjects.rollout_result(req.client_id)
            except ValueError:
                await self._reply_error(msg, req, "bad_request", "request has no usable "
                                        f"client_id ({req.client_id!r})")
                await msg.term()
                return
            self._result_subjects[req.client_id] = subject
        if req.deadline and time.time() > req.deadline:  # nobody waits for it: out of the queue
            await self._reply_error(msg, req, "deadline_exceeded",
                                    f"request {req.request_id} expired before a worker took it")
            await msg.ack()
            return
        if req.min_weight_version > self.engine.version:
            await self._not_yet(msg, req)
            return
        try:
            self.engine.check(req)
        except RequestRejected as exc:
            await self._reply_error(msg, req, exc.code, str(exc))
            await msg.ack()
            return
        attempt = msg.metadata.num_delivered or 1
        # past its deadline + a margin nobody waits for a result: stop retrying the publish
        until = req.deadline + 10.0 if req.deadline else None
        async for res in self.engine.generate(req, worker_id=self.worker_id):
            res = msgspec.structs.replace(res, attempt=attempt, submission_id=req.submission_id)
            await self.bus.persist(  # persisted (PubAck) before the request is acked
                subject, encode(res),
                self.bus.headers({"Nats-Msg-Id": _result_id(req, res.sample_index)}),
                until=until)
        await msg.ack()
        self.served += 1

    async def _not_yet(self, msg: Msg, req: RolloutRequest) -> None:
        """A request for weights newer than ours. If the fleet's desired version is that new
        (an update is on its way, or this worker is behind), it goes back to the stream for a
        while, backing off, so the requests behind it are served meanwhile. If no update to
        it was ever sent, a request without a deadline fails now (nothing would ever serve
        it); one with a deadline waits for it until then."""
        desired = await self.bus.desired_state()
        want = req.min_weight_version
        if desired.weight_version < want and not req.deadline:
            await self._reply_error(
                msg, req, "version_unavailable",
                f"request {req.request_id} needs weight version >= {want}, but the fleet's "
                f"desired version is {desired.weight_version} and no update to {want} was sent:"
                " push it first, lower min_weight_version, or give the request a deadline to "
                "wait for it", retryable=True)
            await msg.ack()
            return
        tries = msg.metadata.num_delivered or 1
        await msg.nak(delay=min(1.0, 0.25 * 2 ** min(tries - 1, 2)))

    async def _reply_error(self, msg: Msg, req: RolloutRequest | None, code: str, message: str,
                           *, retryable: bool = False) -> None:
        hdrs = msg.headers or {}
        client_id = req.client_id if req else hdrs.get(CLIENT_ID_HEADER, "")
        request_id = req.request_id if req else hdrs.get(REQUEST_ID_HEADER, "")
        # one log line per kind and interval with a count, not one per request; every one
        # an event
        self._flood.warning(f"%s answered a request with {code}: %s", self.worker_id, message)
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


def _result_id(req: RolloutRequest | None, sample: int | str, request_id: str = "") -> str:
    """The results stream's dedupe key: one per submission and sample (a reused request id
    is a new submission, never a duplicate of the old one's result)."""
    sub = (req.submission_id or f"{req.client_id}/{req.request_id}") if req else request_id
    return f"{sub}/{sample}"
