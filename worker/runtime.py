"""The worker runtime: one engine on the bus.

Start order (each step is live before the next):
0. the engine;
1. the control receiver (so any command sent to a snapshot containing us reaches us);
2. the desired state, no older than the last command stored before the receiver started
   (`Bus.desired_state_after`): a worker never serves before it holds the fleet's weight
   version (loading it needs a pull transport; see `WeightSync`), and joins a paused fleet
   paused. A job no trainer pushed weights to serves its checkpoint as version 0: the first
   worker's checkpoint (`CheckpointClaim`, by checksum); a worker whose checkpoint differs
   stays at version -1, says so (`checkpoint_mismatch`) and waits for a push;
3. membership (ping responder + heartbeated key);
4. the rollout data plane (`RolloutServer`).

A command the worker did not apply (it came past its deadline: the worker was cut off; or the
weights of an update could not be fetched) is followed by the desired state, read again and
taken as at join (`_missed`): the fleet may have gone on without this worker.

`drain()` (SIGTERM, or a `Shutdown` command) stops fetching, lets in-flight requests finish
(a `Shutdown` with `move` hands them back to go on elsewhere), then `run()` returns: the key is
deleted, the control consumer removed, the engine stopped.
"""

from __future__ import annotations

import functools
import logging
import math
import time

import anyio
import msgspec
from anyio.abc import TaskStatus

from rlfabric.bus import (
    AckFields,
    Bus,
    CommandContext,
    CommandFailed,
    CommandReceiver,
    Registration,
    new_worker_info,
)
from rlfabric.bus.control.receiver import POLL_MAX
from rlfabric.bus.errors import READ_FAILED
from rlfabric.bus.subjects import check_token
from rlfabric.concurrency.sync import beside
from rlfabric.engines.errors import EngineDied, EngineError
from rlfabric.engines.protocol import Engine
from rlfabric.schemas import (
    Ack,
    CheckpointClaim,
    Command,
    Describe,
    DesiredState,
    ErrorCode,
    ErrorEvent,
    InitTransport,
    Pause,
    ResetPrefixCache,
    Resume,
    Shutdown,
    Sleep,
    StateEvent,
    UnloadAdapter,
    UpdateWeights,
    Wake,
    WorkerInfo,
    adapter_key,
)
from rlfabric.telemetry import instruments, spans
from rlfabric.worker.admission import MAX_REQUEST_TOKENS
from rlfabric.worker.alignment import Alignment
from rlfabric.worker.groups import init_transport
from rlfabric.worker.job_control import JobControl
from rlfabric.worker.jobs import JobScopes
from rlfabric.worker.rollouts import RolloutServer
from rlfabric.worker.state import WorkerStatus, record_state
from rlfabric.worker.weights import WeightSync

log = logging.getLogger("rlfabric.worker")
STATE_WRITE_S = 1.0  # how long a command waits for the worker's state to be written
#: how long a worker that missed a command keeps trying to read the desired state
MISSED_STATE_WAIT_S = 60.0


#: requests a worker holds in flight at most, unless told (`rlfabric worker --capacity`)
CAPACITY = 32


def check_knobs(*, capacity: int, prefetch: int, poll_max: float) -> None:
    """Raise ValueError unless a worker's knobs are in range (before anything starts)."""
    if capacity < 1 or prefetch < 0 or not poll_max >= 1:
        raise ValueError(f"a worker needs capacity >= 1, prefetch >= 0 and poll_max >= 1 "
                         f"(got {capacity}, {prefetch}, {poll_max})")


class Worker:
    def __init__(self, bus: Bus, engine: Engine, worker_id: str, *, capacity: int = CAPACITY,
                 prefetch: int = 0, poll_max: float = POLL_MAX, drain_grace: float = 120.0,
                 max_request_tokens: int = MAX_REQUEST_TOKENS) -> None:
        check_knobs(capacity=capacity, prefetch=prefetch, poll_max=poll_max)
        self.bus = bus
        self.engine = engine
        self.worker_id = check_token(worker_id, "worker id")
        self.drain_grace = drain_grace
        self.weights = WeightSync(bus, engine, self.worker_id)
        self.receiver = CommandReceiver(bus, self.worker_id, self._handle_command,
                                        poll_max=poll_max, on_not_applied=self._missed,
                                        state=lambda: (engine.version, self._checksum()),
                                        on_unread=self._doubt)
        self.reg = Registration(bus, new_worker_info(self.worker_id, engine=engine.name,
                                                     model=engine.model, capacity=capacity))
        self.reg.refresh = self._refresh_info
        self.reg.on_unwritten = self._doubt
        #: the worker's one state: membership, the engine calls and the rollout server read it
        self.status = WorkerStatus()
        #: takes no requests while off (or unsure of) the desired policy
        self.alignment = Alignment(bus, self.receiver, self.weights, self.status, self._publish,
                                   self.worker_id)
        #: each job's pause and requests in flight (`rlfabric.schemas.jobs`)
        self.jobs = JobScopes()
        self.rollouts = RolloutServer(bus, engine, self.worker_id, self.reg, capacity=capacity,
                                      max_request_tokens=max_request_tokens,
                                      prefetch=prefetch, status=self.status,
                                      policies=self.weights.policies, on_silent=self._doubt,
                                      jobs=self.jobs, weights=self.weights)
        self.job_control = JobControl(self.jobs, self.weights, self.reg, self.rollouts,
                                      self._publish, self.worker_id)
        self._checksum_cache: tuple[int, str] | None = None
        self._drain = anyio.Event()
        self._move_out = False

    def _checksum(self) -> str:
        v = self.engine.version
        if self._checksum_cache is None or self._checksum_cache[0] != v:
            self._checksum_cache = (v, self.engine.weights_checksum())
        return self._checksum_cache[1]

    def _doubt(self, why: str) -> None:
        if self.status.started:  # before, the join reads the desired state anyway
            self.alignment.doubt(why)

    def _version_metric(self) -> None:
        instruments.current.weight_version.set(self.engine.version,
                                               {spans.WORKER_ID: self.worker_id})

    # ---- lifecycle ----
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await self.reg.refuse_if_taken()  # before anything binds this id's control consumer
        async with beside(cancel_at_exit=True) as tg:  # an engine's death raised as itself
            await tg.start(self._run_engine)
            await tg.start(self.receiver.run)
            await tg.start(self.weights.peers.run)
            # no older than the last command the receiver will not apply
            desired = await self.bus.state.after(self.receiver.start_end)
            await self.weights.load_current(desired)  # never serve a stale version
            if desired.locator is None and self.engine.version < 0:
                await self._serve_checkpoint(desired)
            if desired.paused:  # join a paused fleet paused
                self.status.change(paused=True)
                await self.engine.pause("keep")
            for job, state in (await self.bus.state.jobs()).items():
                await self.job_control.take(job, state)
            if why := self.alignment.off(desired):  # its weights cannot be loaded now
                self.status.change(behind=why)
            self.reg.update(weight_version=self.engine.version,
                            adapters=self.engine.adapter_versions(),
                            policy=self.weights.policies.base, behind=self.status.behind)
            self._version_metric()
            await tg.start(self.alignment.run)
            await tg.start(self.reg.run)
            await tg.start(self.rollouts.run)
            lost = functools.partial(self._doubt, "its connection to the bus dropped")
            self.bus.link.on_disconnect.append(lost)
            try:
                await self._publish(started=True)
                if self.status.behind:
                    self.alignment.doubt(self.status.behind)  # checked again, and again
                task_status.started()
                await self._drain.wait()
                await self._publish(draining=True)
                await self.rollouts.drain(self.drain_grace, move=self._move_out)
            finally:
                self.bus.link.on_disconnect.remove(lost)
            tg.cancel_scope.cancel()
        with anyio.CancelScope(shield=True):
            await self.receiver.close()

    async def _serve_checkpoint(self, desired: DesiredState) -> None:
        """No trainer pushed weights: serve the checkpoint as version 0 if it is the job's."""
        checksum = self._checksum()
        self.reg.update(checkpoint=checksum)
        if desired.weight_version > 0:  # a version was pushed over a collective: wait for it
            return
        held = await self.bus.state.claim_checkpoint(CheckpointClaim(
            model=self.engine.model, checksum=checksum, worker_id=self.worker_id,
            at=time.time()))
        if held.checksum == checksum:
            await self.engine.serve_checkpoint_as(0)
            self.weights.policies.set_checkpoint(checksum)
            return
        why = (f"{self.worker_id} started from another checkpoint ({self.engine.model}, "
               f"checksum {checksum[:12]}) than the job's version 0 ({held.model}, checksum "
               f"{held.checksum[:12]}, first loaded by {held.worker_id}): it does not serve it "
               "as version 0 and waits for a weight push. Start it from the same checkpoint, "
               "or clear the claim with `rlfabric ctl reset-state`")
        log.error("%s", why)
        await self.bus.emit(ErrorEvent(source=self.worker_id, code=ErrorCode.CHECKPOINT_MISMATCH,
                                       message=why, at=time.time()))

    async def _run_engine(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                          ) -> None:
        try:
            await self.engine.run(task_status=task_status)
        except Exception as exc:  # the engine is gone: say so, then leave (run() raises it)
            log.error("%s: engine %s stopped: %s", self.worker_id, self.engine.name, exc)
            code = exc.code if isinstance(exc, EngineDied) else ErrorCode.ENGINE_DIED
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await self.bus.emit(ErrorEvent(source=self.worker_id, code=code,
                                               message=str(exc), at=time.time()))
                await self.bus.nc.flush()
            raise

    def drain(self, move: bool = False) -> None:
        """Stop taking requests, finish in-flight ones (`move`: hand them back to go on
        elsewhere; `drain_grace` seconds at most), leave: `run()` returns then."""
        self._move_out = self._move_out or move
        self._drain.set()

    async def _publish(self, *, started: bool | None = None, paused: bool | None = None,
                       asleep: bool | None = None, draining: bool | None = None,
                       updating: bool | None = None) -> None:
        """Change the worker's status (`WorkerStatus.change`) and publish the state that
        results: the members key and a `StateEvent`."""
        state = self.status.change(started=started, paused=paused, asleep=asleep,
                                   draining=draining, updating=updating)
        record_state(self.worker_id, state)
        self.reg.update(state=state, behind=self.status.behind,
                        policy=self.weights.policies.base)
        # a command never waits long on this (a server still recovering its JetStream after a
        # restart can leave a KV write unanswered for seconds): the next heartbeat carries it
        with anyio.move_on_after(STATE_WRITE_S) as scope:
            try:
                await self.reg.flush()
                await self.bus.emit(StateEvent(source=self.worker_id, state=state,
                                               weight_version=self.engine.version,
                                               at=time.time()))
            except Exception as exc:
                log.debug("state %s not published yet: %s", state, exc)
        if scope.cancelled_caught:
            log.debug("state %s not written within %ss; the next heartbeat carries it", state,
                      STATE_WRITE_S)

    def _refresh_info(self, info: WorkerInfo) -> WorkerInfo:
        now = dict(in_flight=self.rollouts.load, policy=self.weights.policies.base,
                   jobs=self.jobs.in_flight(), job_tokens=self.jobs.tokens.snapshot(),
                   weight_version=self.engine.version, kept=self.weights.peers.keeps())
        same = all(getattr(info, k) == v for k, v in now.items())
        return info if same else msgspec.structs.replace(info, **now)

    # ---- commands: one method per op ----
    async def _handle_command(self, cmd: Command, ctx: CommandContext) -> AckFields | None:
        try:
            return await self._dispatch(cmd, ctx)
        except EngineDied:
            raise
        except EngineError as exc:  # the engine said what failed: the ack carries its code
            raise CommandFailed(exc.code, str(exc)) from exc

    async def _dispatch(self, cmd: Command, ctx: CommandContext) -> AckFields | None:
        match cmd:
            case Pause():  # a job's: that job's requests only
                return await (self.job_control.pause(cmd) if cmd.job else self._pause(cmd))
            case Resume():
                return await self._resume(cmd.job)
            case UpdateWeights():
                return await self._update_weights(cmd, ctx)
            case InitTransport():
                return await init_transport(self.weights, cmd, ctx)
            case Sleep():
                return await self._sleep(cmd)
            case Wake():
                return await self._wake(cmd)
            case ResetPrefixCache():
                await self.engine.reset_prefix_cache()
                return None
            case UnloadAdapter():
                held = await self.weights.unload(adapter_key(cmd.job, cmd.name))
                self.reg.update(adapters=self.engine.adapter_versions())
                await self._publish()
                return AckFields(detail={"unloaded": str(held).lower()})
            case Describe():
                return self._describe()
            case Shutdown() if cmd.job:  # that job ends, the worker serves on
                return await self.job_control.end(cmd.job)
            case Shutdown() if cmd.worker and cmd.worker != self.worker_id:
                return AckFields(detail={"leaves": "false"})
            case Shutdown():
                # once acked (leaving first would read as "left" to the sender)
                ctx.after_done(lambda: self.drain(move=cmd.move))
                return None
        raise CommandFailed(ErrorCode.UNSUPPORTED, f"{type(cmd).__name__} is not supported by this "
                            f"worker ({self.engine.name} engine)")

    async def _pause(self, cmd: Pause) -> AckFields | None:
        # draining is bounded by the command's deadline: past it the sender has given up
        limit = cmd.deadline - time.time() if cmd.deadline else math.inf
        await self._publish(paused=True)
        with anyio.move_on_after(max(0.0, limit)) as scope:
            if not self.status.asleep:  # asleep, the engine generates nothing already
                await self.engine.pause(cmd.mode)
            if cmd.mode != "keep":
                await self.rollouts.wait_idle()
        if scope.cancelled_caught:
            raise CommandFailed(ErrorCode.DRAIN_TIMEOUT, f"{self.worker_id} still had "
                                f"{self.rollouts.in_flight} requests in flight at the pause's "
                                "deadline; it is paused and will finish them")
        return None

    async def _resume(self, job: str = "") -> AckFields | None:
        if job:
            return await self.job_control.resume(job)
        if not self.status.asleep:  # asleep, it stays so until woken (`_wake` resumes it)
            await self.engine.resume()
        await self._publish(paused=False)
        return None

    async def _sleep(self, cmd: Sleep) -> AckFields | None:
        await self.engine.sleep(cmd.level)  # an engine that cannot sleep refuses: still serving
        await self._publish(asleep=True)
        return None

    async def _wake(self, cmd: Wake) -> AckFields | None:
        if not self.status.asleep:  # nothing to wake (and a paused engine stays paused)
            return None
        await self.engine.wake(cmd.tags)
        if self.status.paused:  # woken, not resumed: the engine generates nothing yet
            await self.engine.pause("keep")
        await self._publish(asleep=False)
        return None

    async def _missed(self, cmd: Command, ack: Ack) -> None:
        """`cmd` was not applied here: it came past its deadline (this worker was cut off or
        reconnecting), or its weights could not be fetched. The fleet may have gone on
        without this worker, so take the desired state that followed (its weights, paused or
        not), as a joiner does. Commands stored after it are applied after this, in order."""
        late = ack.error_code == ErrorCode.DEADLINE_EXCEEDED
        unfetched = isinstance(cmd, UpdateWeights) and ack.error_code == ErrorCode.FETCH_FAILED
        if not (unfetched or (late and isinstance(cmd, Pause | Resume | UpdateWeights))):
            return
        assert isinstance(cmd, Pause | Resume | UpdateWeights)
        if cmd.job:  # the job's state, not the pool's
            return await self.job_control.missed(cmd.job, MISSED_STATE_WAIT_S)
        desired = await _state_after(self.bus, cmd.seq, self.worker_id)
        if desired is None:
            log.error("%s: missed %s %s and could not read the desired state within %ss; the "
                      "next command brings it back in line", self.worker_id,
                      type(cmd).__name__, cmd.cmd_id, MISSED_STATE_WAIT_S)
            return
        log.warning("%s: %s %s not applied (%s); taking the desired state (v%d, %s)",
                    self.worker_id, type(cmd).__name__, cmd.cmd_id, ack.error_code,
                    desired.weight_version,
                    "paused" if desired.paused else "running")
        await self.weights.load_current(desired)
        self._checksum_cache = None
        if not self.weights.in_line(desired):
            self._doubt(f"it missed {type(cmd).__name__} {cmd.cmd_id} and could not load the "
                        "desired state then")
        if desired.paused and not self.status.paused:
            await self._publish(paused=True)
            if not self.status.asleep:
                await self.engine.pause("keep")
        elif not desired.paused and self.status.paused:
            await self._resume()
        else:
            await self._publish()

    def _describe(self) -> AckFields:
        d = self.engine.describe()
        d.update(in_flight=str(self.rollouts.in_flight), parked=str(self.rollouts.parked),
                 served=str(self.rollouts.served),
                 state=self.status.state, paused=str(self.status.paused),
                 asleep=str(self.status.asleep), applied_seq=str(self.receiver.applied_seq))
        d.update(self.weights.residency.describe())
        return AckFields(detail=d)

    async def _update_weights(self, cmd: UpdateWeights, ctx: CommandContext) -> AckFields:
        await self._publish(updating=True)
        try:
            return await self.weights.update(cmd, ctx)
        finally:
            self._checksum_cache = None
            self.reg.update(adapters=self.engine.adapter_versions())
            self.rollouts.version_moved()
            self._version_metric()
            await self._publish(updating=False)


async def _state_after(bus: Bus, seq: int, worker_id: str) -> DesiredState | None:
    """The desired state no older than command `seq`, read for up to `MISSED_STATE_WAIT_S`
    (None if it could not be)."""
    with anyio.move_on_after(MISSED_STATE_WAIT_S):
        while True:
            try:
                return await bus.state.after(seq)
            except READ_FAILED as exc:  # a node just back answers once it has caught up
                log.debug("%s: desired state not read yet: %s", worker_id, exc)
                await anyio.sleep(0.5)
    return None
