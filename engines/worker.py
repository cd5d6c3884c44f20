"""The worker runtime: one engine on the bus.

Start order (each step is live before the next):
1. the control receiver (so any command sent to a snapshot containing us reaches us);
2. the desired state: a worker never serves before it holds the fleet's weight version
   (loading it needs a pull transport; see `WeightSync`);
3. membership (ping responder + heartbeated key);
4. the rollout loop: pull from the shared durable consumer, only up to free capacity and
   nothing while paused; publish each result (PubAck) before acking its request; in-progress
   acks while generating; bad requests answered with a typed `RolloutError`.

`drain()` (SIGTERM) stops fetching, lets in-flight requests finish, then leaves.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec
import nats.errors
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream
from nats.aio.msg import Msg

from rlfabric.bus import (
    AckFields,
    Bus,
    CommandContext,
    CommandFailed,
    CommandReceiver,
    Registration,
    new_worker_info,
)
from rlfabric.bus.pull import Puller
from rlfabric.bus.subjects import check_token
from rlfabric.bus.sync import Signal, wait_any
from rlfabric.engines.protocol import Engine, RequestRejected
from rlfabric.engines.weights import WeightSync
from rlfabric.schemas import (
    CLIENT_ID_HEADER,
    REQUEST_ID_HEADER,
    Command,
    Describe,
    ErrorEvent,
    InitTransport,
    Pause,
    ResetPrefixCache,
    Resume,
    RolloutError,
    RolloutRequest,
    SchemaError,
    Shutdown,
    Sleep,
    StateEvent,
    UpdateWeights,
    Wake,
    WorkerInfo,
    codec_for,
    encode,
)

log = logging.getLogger("rlfabric.worker")


#: handlers for commands the runtime does not handle itself, by command type
ExtraHandler = Callable[[Any, CommandContext], Awaitable[AckFields | None]]


class Worker:
    def __init__(self, bus: Bus, engine: Engine, worker_id: str, *, capacity: int = 32,
                 extra_handlers: dict[type, ExtraHandler] | None = None) -> None:
        self.bus = bus
        self.engine = engine
        self.worker_id = check_token(worker_id, "worker id")
        self.capacity = capacity
        self.in_flight = 0
        self.served = 0
        self.paused = False
        self._serving = anyio.Event()
        self._serving.set()
        self._slot = Signal()  # a lane finished a request
        self._idle = anyio.Event()
        self._idle.set()
        self._draining = False
        self._behind = 0.0  # until then, fetch nothing: requests need a newer version
        self._poke = Signal()  # pause, resume, drain: the rollout loop re-checks
        self._stop = anyio.Event()
        self.weights = WeightSync(bus, engine, self.worker_id)
        self._extra = extra_handlers or {}
        self._req_codec = codec_for(RolloutRequest)
        self.receiver = CommandReceiver(bus, self.worker_id, self._handle_command,
                                        state=lambda: (engine.version, self._checksum()))
        self.reg = Registration(bus, new_worker_info(self.worker_id, engine=engine.name,
                                                     model=engine.model, capacity=capacity))
        self.reg.refresh = self._refresh_info
        self._checksum_cache: tuple[int, str] | None = None
        self.ack_wait = bus.limits.rollout_ack_wait
        self._working: dict[int, tuple[Msg, float]] = {}
        self._result_subjects: dict[str, str] = {}

    def _checksum(self) -> str:
        v = self.engine.version
        if self._checksum_cache is None or self._checksum_cache[0] != v:
            self._checksum_cache = (v, self.engine.weights_checksum())
        return self._checksum_cache[1]

    def invalidate_checksum(self) -> None:
        self._checksum_cache = None

    # ---- lifecycle ----
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(self.receiver.run)
            await self.weights.load_current()  # never serve a stale version
            desired = await self.bus.desired_state()
            if desired.paused:  # join a paused fleet paused
                self._hold()
                await self.engine.pause("keep")
            self.reg.update(weight_version=self.engine.version)
            await tg.start(self.reg.run)
            info = await self.bus.js.consumer_info(self.bus.subjects.rollout_stream,
                                                   self.bus.subjects.rollout_consumer)
            self.ack_wait = info.config.ack_wait or self.ack_wait
            await tg.start(self._rollout_loop, tg)
            await self._set_state("paused" if self.paused else "ready")
            task_status.started()
            await self._stop.wait()
            tg.cancel_scope.cancel()
        with anyio.CancelScope(shield=True):
            await self.receiver.close()

    async def drain(self, grace: float = 120.0) -> None:
        """Stop fetching, finish in-flight requests (at most `grace` seconds), then stop."""
        self._draining = True
        self._poke.fire()
        await self._set_state("draining")
        with anyio.move_on_after(grace):
            while self.in_flight:
                idle = self._idle
                await idle.wait()
        self._stop.set()

    async def _set_state(self, state: str) -> None:
        self.reg.update(state=state)
        try:
            await self.reg.flush()
            await self.bus.emit(StateEvent(source=self.worker_id, state=state,
                                           weight_version=self.engine.version, at=time.time()))
        except Exception as exc:  # the next heartbeat carries it
            log.debug("state %s not published yet: %s", state, exc)

    # ---- rollouts ----
    async def _rollout_loop(self, tg: anyio.abc.TaskGroup, *,
                            task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Keep pull requests out for exactly our free capacity; `capacity` serving lanes take
        the messages (no task per request), one sweeper keeps long ones alive."""
        s = self.bus.subjects
        send, recv = anyio.create_memory_object_stream[Msg](self.capacity)

        async def on_message(msg: Msg) -> None:
            if self.paused or self._draining:
                await msg.nak(delay=0.5)  # landed as a pause did: back to the stream
                return
            self.in_flight += 1
            self._idle = anyio.Event()
            if self.in_flight == 1 or self.in_flight == self.capacity:
                tg.start_soon(self._publish_load)
            send.send_nowait(msg)

        for _ in range(self.capacity):
            tg.start_soon(self._lane, recv.clone())
        recv.close()
        tg.start_soon(self._keep_alive)
        puller = Puller(self.bus, s.rollout_stream, s.rollout_consumer, on_message)
        await tg.start(puller.run)
        task_status.started()
        with send:
            while not self._draining:
                if self.paused:
                    serving = self._serving
                    await serving.wait()
                    continue
                if self._behind > time.monotonic():
                    await anyio.sleep(self._behind - time.monotonic())
                    continue
                slot, kicked, poke = self._slot.event(), puller.kicked(), self._poke.event()
                try:
                    await puller.want(self.capacity - self.in_flight)
                except nats.errors.Error as exc:  # a reconnect: try again shortly
                    log.warning("%s: pull request failed (%s); retrying", self.worker_id, exc)
                    await anyio.sleep(0.5)
                    continue
                await wait_any(slot, kicked, poke)

    async def _publish_load(self) -> None:
        """Tell the fleet at once that we took work (heartbeats carry it later anyway)."""
        try:
            await self.reg.flush()
        except Exception as exc:
            log.debug("in-flight count not published: %s", exc)

    def _refresh_info(self, info: WorkerInfo) -> WorkerInfo:
        if info.in_flight == self.in_flight and info.weight_version == self.engine.version:
            return info
        return msgspec.structs.replace(info, in_flight=self.in_flight,
                                       weight_version=self.engine.version)

    async def _lane(self, recv: MemoryObjectReceiveStream[Msg]) -> None:
        async with recv:
            async for msg in recv:
                self._working[id(msg)] = (msg, time.monotonic())
                try:
                    await self._serve_one(msg)
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

    async def _keep_alive(self) -> None:
        """In-progress acks for every request generating longer than a third of ack_wait."""
        while True:
            await anyio.sleep(self.ack_wait / 3)
            cutoff = time.monotonic() - self.ack_wait / 3
            for msg, t0 in list(self._working.values()):
                if t0 < cutoff:
                    await msg.in_progress()

    async def _reply_error(self, msg: Msg, req: RolloutRequest | None, code: str, message: str,
                           *, retryable: bool = False) -> None:
        hdrs = msg.headers or {}
        client_id = req.client_id if req else hdrs.get(CLIENT_ID_HEADER, "")
        request_id = req.request_id if req else hdrs.get(REQUEST_ID_HEADER, "")
        await self.bus.emit(ErrorEvent(source=self.worker_id, code=code, message=message,
                                       subject=msg.subject, at=time.time()))
        if not client_id or not request_id:
            return
        err = RolloutError(request_id=request_id, worker_id=self.worker_id, code=code,
                           message=message, group_id=req.group_id if req else "",
                           retryable=retryable)
        try:
            await self.bus.js.publish(self.bus.subjects.rollout_result(client_id), encode(err),
                                      headers=self.bus.headers({"Nats-Msg-Id":
                                                                f"{request_id}/error"}))
        except Exception as exc:
            log.warning("could not answer %s with %s: %s", request_id, code, exc)

    async def _serve_one(self, msg: Msg) -> None:
        try:
            req = self._req_codec.decode(msg.data, msg.headers, subject=msg.subject)
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
        if req.min_weight_version > self.engine.version:
            # not servable with our weights yet: back to the stream, and fetch more slowly
            # until our version moves, so the request waits rather than bounces
            await msg.nak(delay=0.5)
            self._behind = time.monotonic() + 0.5
            return
        if req.deadline and time.time() > req.deadline:
            await self._reply_error(msg, req, "deadline_exceeded",
                                    f"request {req.request_id} expired before a worker took it")
            await msg.ack()
            return
        try:
            self.engine.check(req)
        except RequestRejected as exc:
            await self._reply_error(msg, req, exc.code, str(exc))
            await msg.ack()
            return
        attempt = msg.metadata.num_delivered if msg.metadata else 1
        async for res in self.engine.generate(req, worker_id=self.worker_id):
            if attempt > 1:
                res = msgspec.structs.replace(res, attempt=attempt)
            await self.bus.js.publish(  # persisted (PubAck) before the request is acked
                subject, encode(res),
                headers=self.bus.headers({"Nats-Msg-Id": f"{req.request_id}/{res.sample_index}"}))
        await msg.ack()
        self.served += 1

    # ---- commands ----
    def _hold(self) -> None:
        """Take no more requests (pause, sleep): the rollout loop stops pulling."""
        self.paused = True
        self._serving = anyio.Event()
        self._poke.fire()

    def _serve_again(self) -> None:
        self.paused = False
        self._serving.set()

    async def _handle_command(self, cmd: Command, ctx: CommandContext) -> AckFields | None:
        if isinstance(cmd, Pause):
            self._hold()
            await self._set_state("paused")
            # draining is bounded by the command's deadline: past it the sender has given up
            limit = cmd.deadline - time.time() if cmd.deadline else math.inf
            with anyio.move_on_after(max(0.0, limit)) as scope:
                await self.engine.pause(cmd.mode)
                if cmd.mode != "keep":
                    while self.in_flight:
                        idle = self._idle
                        await idle.wait()
            if scope.cancelled_caught:
                raise CommandFailed("drain_timeout", f"{self.worker_id} still had "
                                    f"{self.in_flight} requests in flight at the pause's "
                                    "deadline; it is paused and will finish them")
            return None
        if isinstance(cmd, Resume):
            await self.engine.resume()
            self._serve_again()
            await self._set_state("ready")
            return None
        if isinstance(cmd, Describe):
            d = self.engine.describe()
            d.update(in_flight=str(self.in_flight), served=str(self.served),
                     paused=str(self.paused), applied_seq=str(self.receiver.applied_seq))
            return AckFields(detail=d)
        if isinstance(cmd, ResetPrefixCache):
            await self.engine.reset_prefix_cache()
            return None
        if isinstance(cmd, Sleep):
            self._hold()
            await self.engine.sleep(cmd.level)
            await self._set_state("sleeping")
            return None
        if isinstance(cmd, Wake):
            await self.engine.wake(cmd.tags)
            self._serve_again()
            await self._set_state("ready")
            return None
        if isinstance(cmd, UpdateWeights):
            before = "paused" if self.paused else "ready"
            await self._set_state("updating")
            try:
                return await self.weights.update(cmd, ctx)
            finally:
                self.invalidate_checksum()
                self._behind = 0.0  # requests waiting for this version may be servable now
                self._poke.fire()
                await self._set_state(before)
        if isinstance(cmd, InitTransport):
            return await self.weights.init_transport(cmd, ctx)
        if isinstance(cmd, Shutdown):
            self.bus.tg.start_soon(self.drain)
            return None
        handler = self._extra.get(type(cmd))
        if handler is None:
            raise CommandFailed("unsupported", f"{type(cmd).__name__} is not supported by "
                                f"this worker ({self.engine.name} engine)")
        return await handler(cmd, ctx)
