"""A worker's rollout data plane: pull requests from the workers' shared durable consumer (or
take those offered to it), serve them, publish each result before acking its request.

The parts, each owning its own state:
- `Credits` (credits.py): requests in flight, those being stored, parked ones, what to pull;
- `Admission` (admission.py): decoding, deadlines, version gating, error replies;
- `Serving` (serving.py): the engine calls (lanes, or a message at once), storing results,
  acking messages;
- `offers` (offers.py): requests offered to this worker directly (session affinity);
- `DeltaSender` (streaming.py): token deltas (every step of a streamed request, now and then
  of another);
- `KeepAlive`, `LoadReport` (liveness.py): in-progress acks, the in-flight count published.

This module runs them: pull requests are kept out for exactly the engine's free room plus
`prefetch`, none while the worker is held (paused, asleep: `WorkerStatus`) or draining; a
request that lands as a pause does goes back (`nak`). Prefetch: up to `prefetch` requests
beyond capacity are taken and parked (in flight, kept alive, not yet in the engine), so the
next batch is in hand when room frees, not one pull later; at a pause or a drain they go back
to the stream at once; a worker killed holding them has them redelivered after `ack_wait`, as
any request it held. A message holds one request or several (`RolloutRequests`, header
`rlf-count`). A broker restart is ridden through: results are published again until stored
(their `Nats-Msg-Id` makes a repeat a duplicate), pull requests are renewed on reconnect, and a
message beyond the free capacity (pull requests the server kept across a reconnect) goes
straight back.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import anyio
import nats.errors
from anyio.abc import TaskGroup, TaskStatus
from nats.aio.msg import Msg

from rlfabric.bus import Bus, Registration
from rlfabric.engines.protocol import Engine
from rlfabric.schemas import ErrorCode, SchemaError
from rlfabric.worker.admission import MAX_REQUEST_TOKENS, Admission
from rlfabric.worker.credits import Credits
from rlfabric.worker.delivery import Delivery
from rlfabric.worker.job_pulls import JobPulls
from rlfabric.worker.jobs import JobScopes
from rlfabric.worker.liveness import KeepAlive, LoadReport
from rlfabric.worker.offers import Offered, offers
from rlfabric.worker.policies import Policies
from rlfabric.worker.residency import Residency
from rlfabric.worker.serving import Serving
from rlfabric.worker.state import WorkerStatus
from rlfabric.worker.streaming import DeltaSender
from rlfabric.worker.weights import WeightSync

log = logging.getLogger("rlfabric.worker.rollouts")


class RolloutServer:
    def __init__(self, bus: Bus, engine: Engine, worker_id: str, reg: Registration, *,
                 capacity: int, prefetch: int = 0, status: WorkerStatus | None = None,
                 max_request_tokens: int = MAX_REQUEST_TOKENS,
                 policies: Policies | None = None,
                 on_silent: Callable[[str], None] | None = None,
                 jobs: JobScopes | None = None, weights: WeightSync | None = None) -> None:
        self.bus = bus
        #: each job's pause and its requests in flight
        self.jobs = jobs or JobScopes()
        self._on_silent = on_silent
        self.worker_id = worker_id
        self.status = status or WorkerStatus()
        self.credits = Credits(capacity, prefetch)
        self.credits.on_room = self._unpark
        self.credits.running_of = self.jobs.generating
        self.policies = policies or Policies()
        self.admission = Admission(bus, engine, worker_id, self.policies,
                                   max_request_tokens=max_request_tokens, jobs=self.jobs,
                                   weights=weights)
        self.alive = KeepAlive(bus.limits.rollout_ack_wait)
        self.report = LoadReport(self.credits, reg, worker_id)
        self.deltas = DeltaSender(bus, worker_id, self.policies)
        self.serving = Serving(bus, engine, worker_id, credits=self.credits,
                               admission=self.admission, deltas=self.deltas, alive=self.alive,
                               policies=self.policies, jobs=self.jobs,
                               residency=weights.residency if weights else Residency(0))
        self._tg: TaskGroup | None = None
        #: the jobs pulled for, their consumers and shares (once running)
        self.pulls: JobPulls | None = None
        self.status.watch(self._held)

    # ---- read by the runtime and the launchers ----
    @property
    def in_flight(self) -> int:
        return self.credits.in_flight

    @property
    def parked(self) -> int:
        return self.credits.parked

    @property
    def prefetch(self) -> int:
        return self.credits.prefetch

    @property
    def served(self) -> int:
        return self.serving.served

    @property
    def load(self) -> int:
        """The in-flight count as the fleet is told it."""
        return self.report.load

    def version_moved(self) -> None:
        """Requests waiting for a newer version may be servable now (they come back from the
        stream within their back-off, at most a second)."""
        self.credits.room.fire()

    async def wait_idle(self) -> None:
        await self.credits.wait_idle()

    async def drain(self, grace: float, *, move: bool = False) -> None:
        """Wait (at most `grace` seconds) for in-flight requests; the worker's status says it
        is draining (nothing more is pulled, parked requests went back). `move`: the samples
        in flight end now and go back to their clients with what they sampled
        (`RolloutResult.moved`), who continue them elsewhere."""
        if move:
            self.serving.moving = True
            await self.serving.engine.pause("abort")
        with anyio.move_on_after(grace):
            await self.credits.wait_idle()

    def _held(self, held: bool) -> None:
        """The worker's status changed: held, parked messages go back to the stream; the
        pull loop looks again either way."""
        if held and self._tg is not None and self.credits.parked:
            self._tg.start_soon(self._nak_parked)
        self.credits.room.fire()

    # ---- the loop ----
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        s = self.bus.subjects
        info = await self.bus.js.consumer_info(s.rollout_stream, s.rollout_consumer)
        self.alive.ack_wait = info.config.ack_wait or self.alive.ack_wait  # as the job set it
        async with anyio.create_task_group() as tg:
            self._tg = tg
            send = await self.serving.start(tg)
            tg.start_soon(self.alive.run)
            tg.start_soon(self.report.run)
            tg.start_soon(self.deltas.run)
            self.pulls = JobPulls(self.bus, self.credits, self._on_message,
                                  kick=self.credits.room, ack_wait=self.alive.ack_wait,
                                  on_silent=self._on_silent)
            await tg.start(self.pulls.run)
            cancels = [await self.bus.nc.subscribe(subject, cb=self.serving.cancels.on_cancel)
                       for subject in s.rollout_cancels_all]
            try:
                async with offers(self.bus, self.worker_id, self._on_message, self._has_room):
                    task_status.started()
                    with send:  # closed once draining: lanes finish what they hold, then end
                        await self._pull(self.pulls)
            finally:  # stopped: prefetched requests go back now, not at ack_wait
                with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                    await self._nak_parked()
                    for sub in cancels:
                        with contextlib.suppress(nats.errors.Error):
                            await sub.unsubscribe()

    def _has_room(self) -> bool:
        return not self.status.held and self.credits.engaged < self.credits.capacity

    async def _on_message(self, msg: Msg) -> None:
        """A pulled (or offered) message: its requests to the engine, parked, or back."""
        if self.status.held:
            await msg.nak(delay=0.5)  # landed as a pause did: back to the stream
            return
        c = self.credits
        try:
            reqs = self.admission.decode(msg)
        except SchemaError as exc:
            await self.admission.reply_error(msg, None, ErrorCode.MALFORMED, str(exc))
            await msg.term()
            c.room.fire()  # its credit is spent and no request will say so: pull again
            return
        job = reqs[0].job if reqs else ""  # a message is one client's: one job's
        c.came(len(reqs), job, getattr(msg.metadata, "num_pending", 0) or 0)
        park = c.should_park(len(reqs), job)
        jobs = len(self.pulls.pullers) if self.pulls is not None else 1
        if park and not c.may_park(job, len(reqs), jobs):
            await msg.nak()  # more than we have room for: back, for anyone
            return
        d = Delivery(msg, len(reqs), time.monotonic())
        self.alive.add(d)
        c.took(d, reqs, park=park)
        if not isinstance(msg, Offered):  # an offered one's client knows who took it
            self.deltas.took(reqs, self.admission.scope_of(msg))
        if not park:
            self.serving.dispatch(d, reqs)
        elif c.several:  # it waits in the fair order only while others go first
            self._unpark()

    def _unpark(self) -> None:
        """Parked messages to the engine, in fair order, while they fit (`Credits.unpark`)."""
        if self.credits.parked and not self.status.held:
            for d, reqs in self.credits.unpark():
                self.serving.dispatch(d, reqs)

    async def _nak_parked(self) -> None:
        """Every parked message back to the stream, for anyone (held, draining, stopped)."""
        for d, reqs in self.credits.take_parked():
            self.alive.remove(d)
            with contextlib.suppress(nats.errors.Error):  # else redelivered after ack_wait
                await d.msg.nak(delay=0.5 if self.status.held else None)
            for _ in reqs:
                self.credits.done()

    async def _pull(self, pulls: JobPulls) -> None:
        """Keep pull requests out for exactly our free capacity (and, with several jobs, each
        job's depth: `Credits.want_for`), until draining."""
        while not self.status.draining:
            if self.status.held:  # until the status changes (`_held`)
                await self.credits.room.event().wait()
                continue
            room = self.credits.room.event()
            pullers = list(pulls.pullers.items())
            try:
                for job, puller in pullers:
                    await puller.want(self.credits.want_for(job, len(pullers)))
            except nats.errors.Error as exc:  # a reconnect: try again shortly
                log.warning("%s: pull request failed (%s); retrying", self.worker_id, exc)
                await anyio.sleep(0.5)
                continue
            await room.wait()
