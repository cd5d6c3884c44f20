"""Broadcast with quorum: publish one command to every worker, count their acks.

    fanout = Broadcaster(bus, watcher)
    report = await fanout.broadcast(Pause(cmd_id=new_cmd_id(), mode="wait"), QuorumPolicy())

The command is persisted in the control stream (its PubAck returns its `seq`), then its live
copy goes to every worker on core NATS; acks arrive on `<prefix>.ack.<cmd_id>`. While it
waits, members that have not acked are pinged every `probe_interval` with the command's `seq`
(a worker that missed the live copy reads it from the stream; one that applied it sends its
acks again): "no responders" means the process is gone, which ends the wait at once under
`fail` (`MembershipChanged`) or drops that member from the required set under `shrink`.
Two-phase commands wait twice on one `Fanout`: `await fo.wait("ready")`, then
`await fo.wait("done")`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.trace import INVALID_SPAN, Span

from rlfabric.bus.control.membership import RECONNECT_SETTLE, MembershipWatcher, fingerprint
from rlfabric.bus.errors import (
    TRANSIENT,
    BusError,
    MembershipChanged,
    QuorumNotReached,
)
from rlfabric.bus.session import Bus
from rlfabric.concurrency.sync import Signal, beside
from rlfabric.schemas import (
    CMD_ID_HEADER,
    DECODE_ERRORS,
    JOB_COMMANDS,
    STATE_MARK_HEADER,
    Ack,
    Command,
    CommandEvent,
    FanoutReport,
    MembershipSnapshot,
    SchemaError,
    UpdateWeights,
    codec_for,
    encode,
    op_of,
)
from rlfabric.telemetry import instruments, spans


def new_cmd_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True, kw_only=True, slots=True)
class QuorumPolicy:
    """When a broadcast counts as done.

    `required`: "all" members of the snapshot, a count (int >= 0), or a fraction (float in
    (0, 1]). `timeout`: seconds to wait for it. `on_membership_change`: "fail" raises
    `MembershipChanged` when a worker joins, leaves or is found dead while waiting; "shrink"
    drops the departed from the required set and goes on. `probe_interval` / `ping_timeout`:
    how often and how patiently members that have not acked are pinged.
    """

    required: Literal["all"] | int | float = "all"
    timeout: float = 30.0
    on_membership_change: Literal["fail", "shrink"] = "fail"
    probe_interval: float = 0.2
    ping_timeout: float = 0.5

    def __post_init__(self) -> None:
        r = self.required
        if isinstance(r, bool) or not (
            r == "all" or (isinstance(r, int) and r >= 0)
            or (isinstance(r, float) and 0.0 < r <= 1.0)
        ):
            raise ValueError(
                f"QuorumPolicy.required={r!r}: use 'all', a count (int >= 0) or a fraction "
                "(float in (0, 1])"
            )
        if self.timeout <= 0:
            raise ValueError(f"QuorumPolicy.timeout={self.timeout!r}: must be > 0 seconds")
        if self.on_membership_change not in ("fail", "shrink"):
            raise ValueError(
                f"QuorumPolicy.on_membership_change={self.on_membership_change!r}: "
                "use 'fail' or 'shrink'"
            )

    def needed(self, n_members: int) -> int:
        r = self.required
        if r == "all":
            return n_members
        if isinstance(r, float):
            return math.ceil(r * n_members)
        return int(r)


class Fanout:
    """The acks of one published command, by phase and worker."""

    def __init__(self, broadcaster: Broadcaster, cmd: Command, before: MembershipSnapshot):
        self.b = broadcaster
        self.cmd = cmd
        self.before = before
        #: the members it was sent to (every ack, count and report checks against them)
        self.before_ids = frozenset(before.worker_ids)
        self.acks: dict[str, dict[str, Ack]] = {"ready": {}, "done": {}}
        #: acks of any phase that are not ok (while none came, counts are set operations)
        self.errors = 0
        self.dead: set[str] = set()
        self.t0 = time.monotonic()
        self._news = Signal()
        self._wake_at = 0
        self._codec = codec_for(Ack)
        self._decode_raw = self._codec.decode_raw
        self.span: Span = INVALID_SPAN  # the broadcast's `send` span, while open
        self._recording = False  # whether `span` records (asked once, not per ack)

    def _on_ack(self, msg: Msg) -> None:
        try:
            if msg.headers is None:  # an ack of a command its worker decoded: of our major
                ack = self._decode_raw(msg.data)
            else:
                ack = self._codec.decode(msg.data, msg.headers, subject=msg.subject)
        except (SchemaError, *DECODE_ERRORS):
            return  # not an ack of ours; the sender's log would only be noise here
        got = self.acks[ack.phase]  # "ready" or "done": the decoder checked
        if ack.worker_id in got:
            return
        got[ack.worker_id] = ack
        if ack.status != "ok":
            self.errors += 1
        if self._recording:
            elapsed = time.monotonic() - self.t0
            self.span.add_event("ack", {spans.WORKER_ID: ack.worker_id, "phase": ack.phase,
                                        "status": ack.status, "elapsed_s": elapsed})
        # the waiter re-counts only when the count could meet its quorum, or on an error
        if ack.status != "ok" or len(got) >= self._wake_at:
            self._news.fire()

    def _got(self, phase: str) -> dict[str, Ack]:
        """Acks of `phase`. For `ready`, a worker that acked `done` with an error (it failed
        before it could post, e.g. an engine that refuses the transport) counts as answered
        with that error: it will never be ready."""
        got = dict(self.acks.get(phase, {}))
        if phase == "ready":
            for w, a in self.acks.get("done", {}).items():
                if a.status != "ok":
                    got.setdefault(w, a)
        return got

    async def failed(self, phase: Literal["ready", "done"]) -> None:
        """Return once any worker has answered `phase` with an error."""
        while True:
            news = self._news.event()
            if any(a.status != "ok" for a in self._got(phase).values()):
                return
            await news.wait()

    async def heard(self, workers: set[str], phase: Literal["ready", "done"] = "done", *,
                    timeout: float) -> FanoutReport:
        """The report once each of `workers` answered `phase` or is no longer a member, or
        after `timeout` seconds (no quorum: those who matter are named by the caller)."""
        with self.b.watcher.firing_on_join_or_leave(self._news), anyio.move_on_after(timeout):
            while True:
                news = self._news.event()
                got, members = self._got(phase), self.b.watcher.members
                if all(w in got or w not in members for w in workers):
                    break
                await news.wait()
        return self.report(phase)

    def report(self, phase: str) -> FanoutReport:
        """Acks of `phase` so far; `missing` is every member of the snapshot the command was
        sent to that has not answered (found dead or not)."""
        got = self._got(phase)
        if self.errors:
            ok = sorted(w for w, a in got.items() if a.status == "ok")
            failed = sorted(w for w, a in got.items() if a.status != "ok")
        else:
            ok, failed = sorted(got), []
        missing = self.before_ids.difference(got)
        return FanoutReport(
            cmd_id=self.cmd.cmd_id, op=op_of(self.cmd), ok=tuple(ok), failed=tuple(failed),
            missing=tuple(sorted(missing)), dead=tuple(sorted(self.dead & missing)), acks=got,
            epoch=self.before.epoch, elapsed_s=time.monotonic() - self.t0, phase=phase,
        )

    def _current(self, watcher: MembershipWatcher) -> MembershipSnapshot:
        snap = watcher.snapshot()
        alive = tuple(m for m in snap.members if m.worker_id not in self.dead)
        ids = [m.worker_id for m in alive]
        return MembershipSnapshot(epoch=snap.epoch, fingerprint=fingerprint(ids), members=alive)

    async def _probe(self, phase: str, required: set[str], policy: QuorumPolicy) -> None:
        """Ping each member that has not acked every `probe_interval`, without waiting for the
        last ping to it: a ping in flight when its worker dies is never answered (it times out
        after `ping_timeout`), the next one, `probe_interval` later, finds the worker gone."""
        link = self.b.bus.link
        in_flight: dict[str, int] = {}
        # a worker that answers slowly holds this many pings at most (the default: 3)
        most = max(1, math.ceil(policy.ping_timeout / policy.probe_interval) + 1)

        async def one(wid: str) -> None:
            in_flight[wid] = in_flight.get(wid, 0) + 1
            try:
                # the seq tells a worker that missed the live copy to read it from the stream
                answer = await self.b.bus.fleet.ping(wid, timeout=policy.ping_timeout,
                                               payload=str(self.cmd.seq).encode())
            finally:
                in_flight[wid] -= 1
            # "no responders" right after a reconnect may be a worker still reconnecting
            if answer == "dead" and link.settled(RECONNECT_SETTLE) and wid not in self.dead:
                self.dead.add(wid)
                await self.b.watcher.mark_dead(wid)
                self._news.fire()

        async with anyio.create_task_group() as tg:
            while True:
                pending = required - set(self.acks.get(phase, {})) - self.dead
                for wid in pending:
                    if in_flight.get(wid, 0) < most:
                        tg.start_soon(one, wid)
                await anyio.sleep(policy.probe_interval)

    async def wait(self, phase: Literal["ready", "done"] = "done",
                   policy: QuorumPolicy | None = None) -> FanoutReport:
        """Wait until `policy` is met for acks of `phase`; return the report or raise
        `QuorumNotReached` / `MembershipChanged`."""
        policy = policy or QuorumPolicy()
        required = set(self.before_ids)
        op = op_of(self.cmd)
        deadline = self.t0 + policy.timeout
        with self.b.watcher.firing_on_join_or_leave(self._news):
            # members that have not acked are probed from `probe_interval` on; the common
            # case is over by then and runs no task group (entering and cancelling one costs)
            probe_at = time.monotonic() + policy.probe_interval
            rep = await self._wait(phase, policy, required, op, deadline, until=probe_at)
            if rep is not None:
                return rep
            async with beside(cancel_at_exit=True) as tg:
                tg.start_soon(self._probe, phase, required, policy)
                rep = await self._wait(phase, policy, required, op, deadline, until=None)
                assert rep is not None  # without `until` it returns or raises
                return rep

    async def _wait(self, phase: str, policy: QuorumPolicy, required: set[str], op: str,
                    deadline: float, *, until: float | None) -> FanoutReport | None:
        """The report once the quorum is met, None at `until` (a `time.monotonic()`) if it is
        not met by then; raises when it cannot be. `required` shrinks in place (the prober
        reads it)."""
        while True:
            news = self._news.event()
            if self.dead or self.b.watcher.epoch != self.before.epoch:
                now = self._current(self.b.watcher)
                # a member that answered this phase and then left (a `Shutdown`) is no change
                kept = set(now.worker_ids) | (required & set(self._got(phase)))
                if kept != self.before_ids:
                    if policy.on_membership_change == "fail":
                        rep = self.report(phase)
                        exc = MembershipChanged("", before=self.before, after=now, report=rep)
                        exc.args = (
                            f"{op} {self.cmd.cmd_id}: membership changed while waiting for "
                            f"{phase} acks (left: {list(exc.left)}, joined: {list(exc.joined)}, "
                            f"found dead by ping: {sorted(self.dead)}); retry, or use "
                            "on_membership_change='shrink' to go on without them",
                        )
                        raise exc
                    required &= kept
            ok, failed = self._count(phase, required)
            needed = self.policy_needed(policy, len(required))
            if not self.before.members and policy.required != 0:
                rep = self.report(phase)
                raise QuorumNotReached(self._why(op, phase, rep, needed, "cannot be met"), rep)
            if ok >= needed:
                return self.report(phase)
            lost = ok + (len(required) - ok - failed) < needed
            if lost:
                # lost already; still hear out the rest (up to the timeout) so the report says
                # what happened on every worker, not just on the first that failed
                unheard = required - self._got(phase).keys() - self.dead
                if not unheard or time.monotonic() >= deadline:
                    rep = self.report(phase)
                    raise QuorumNotReached(self._why(op, phase, rep, needed, "cannot be met"),
                                           rep)
            # wake at the ack that could complete the quorum; once lost, at every ack
            self._wake_at = 0 if lost else needed
            now_t = time.monotonic()
            remaining = deadline - now_t
            if remaining <= 0:
                rep = self.report(phase)
                raise QuorumNotReached(
                    self._why(op, phase, rep, needed, f"timed out after {policy.timeout}s"), rep
                )
            if until is not None and now_t >= until:
                return None
            wait = remaining if until is None else min(remaining, until - now_t)
            # a timer that fires the signal, not a cancel scope (cheaper per wait)
            alarm = asyncio.get_running_loop().call_later(wait, self._news.fire)
            try:
                await news.wait()
            finally:
                alarm.cancel()

    def _count(self, phase: str, required: set[str]) -> tuple[int, int]:
        """How many of `required` answered `phase` ok, and how many with an error."""
        if not self.errors:  # every ack ok: a count in C, not a loop over the fleet
            return len(required.intersection(self.acks[phase])), 0
        got = self._got(phase)
        ok = sum(1 for w in required if w in got and got[w].status == "ok")
        return ok, sum(1 for w in required if w in got) - ok

    @staticmethod
    def policy_needed(policy: QuorumPolicy, n: int) -> int:
        needed = policy.needed(n)
        if policy.on_membership_change == "shrink":
            needed = min(needed, n) if n else needed
        return needed

    def _why(self, op: str, phase: str, rep: FanoutReport, needed: int, what: str) -> str:
        parts = [f"{op} {rep.cmd_id}: quorum of {needed} {phase} acks {what}: "
                 f"{len(rep.ok)} ok"]
        if rep.failed:
            errs = ", ".join(
                f"{w} ({rep.acks[w].error_code}: {rep.acks[w].error_message})" for w in rep.failed
            )
            parts.append(f"failed: {errs}")
        if rep.missing:
            parts.append(f"missing: {', '.join(rep.missing)}")
        if rep.dead:
            parts.append(f"gone (no ping responder): {', '.join(rep.dead)}")
        if not self.before.members:
            parts.append("no workers were members when it was sent (start some with "
                         "`rlfabric worker`)")
        return "; ".join(parts)


class Broadcaster:
    """Publishes commands and opens their `Fanout`s. A command is persisted in the control
    stream (its PubAck gives its `seq`), then sent on core NATS to every worker with that
    `seq` (the live copy, see `CommandReceiver`). Acks come in on one standing subscription
    (`<prefix>.ack.*`) and are routed to the open `Fanout` by cmd_id."""

    def __init__(self, bus: Bus, watcher: MembershipWatcher, source: str = "") -> None:
        self.bus = bus
        self.watcher = watcher
        #: who sends the commands, in the events that tell their outcomes
        self.source = source or f"c{uuid.uuid4().hex[:12]}"
        self._open: dict[str, Fanout] = {}
        self._acks: Subscription | None = None
        self._subscribing = anyio.Lock()

    async def _route(self, msg: Msg) -> None:
        fo = self._open.get(msg.subject.rpartition(".")[2])
        if fo is not None:
            fo._on_ack(msg)

    async def _listen(self) -> None:
        if self._acks is None:
            async with self._subscribing:
                if self._acks is None:  # one standing subscription; SUB precedes our PUB
                    self._acks = await self.bus.nc.subscribe(self.bus.subjects.ack_all,
                                                             cb=self._route)

    async def _publish(self, cmd: Command) -> Command:
        """Persist `cmd`, then send its live copy; return it with `seq` = its sequence in the
        control stream."""
        s = self.bus.subjects
        op = op_of(cmd)
        # a job's own command travels on its job's subjects
        job = cmd.job if isinstance(cmd, JOB_COMMANDS) else ""
        retried: list[Exception] = []  # transient failures: a duplicate after one is ours
        data = encode(cmd)
        hdrs = self.bus.headers({CMD_ID_HEADER: cmd.cmd_id, "Nats-Msg-Id": cmd.cmd_id})
        if self.bus.state.mark is not None:  # a joiner waits for that state (see `Bus`)
            hdrs[STATE_MARK_HEADER] = self.bus.state.mark
        try:
            ack = await self.bus.persist(s.control(op, job), data, hdrs,
                                         until=cmd.deadline or None, on_retry=retried.append)
        except TRANSIENT as exc:
            raise BusError(
                f"{op} {cmd.cmd_id} not sent: the control stream did not store it before its "
                f"deadline ({type(exc).__name__}: {exc}; this client is connected to "
                f"{_server(self.bus.nc)}). A server cut off from its cluster, or "
                "a stream electing a new leader, stores nothing for seconds: retry the call"
            ) from exc
        if ack.duplicate and not retried:
            raise BusError(
                f"{op} {cmd.cmd_id}: this cmd_id was already published (control stream seq "
                f"{ack.seq}); its acks went to whoever sent it then. Send the command again "
                "with a new cmd_id (`new_cmd_id()`)"
            )
        # a duplicate after a retry: stored by an attempt whose PubAck was lost; that seq is ours
        # the live copy: its seq and schema major in the subject, headers only for a trace
        await self.bus.nc.publish(s.live_copy(op, ack.seq, job), data,
                                  headers=self.bus.headers() if spans.enabled() else None)
        return msgspec.structs.replace(cmd, seq=ack.seq)

    @contextlib.asynccontextmanager
    async def open(self, cmd: Command) -> AsyncIterator[Fanout]:
        """Publish the command and yield its `Fanout`; its acks are counted from before the
        publish."""
        await self._listen()
        before = self.watcher.snapshot()
        cmd = msgspec.structs.replace(cmd, epoch=before.epoch)
        fo = Fanout(self, cmd, before)
        if cmd.cmd_id in self._open:
            raise BusError(f"{op_of(cmd)} {cmd.cmd_id}: a command with this cmd_id is already "
                           "waiting for acks; use a new cmd_id (`new_cmd_id()`)")
        self._open[cmd.cmd_id] = fo
        op = op_of(cmd)
        try:
            # one span from the publish to the last ack awaited; workers' `process` spans
            # hang from it, each ack is an event on it
            with spans.producer_span(self.bus.subjects.control(op), message_id=cmd.cmd_id,
                                     attributes={spans.CMD_ID: cmd.cmd_id, spans.CMD_OP: op,
                                                 "rlfabric.members": len(before.members)}
                                     ) as span:
                fo.span, fo._recording = span, span.is_recording()
                fo.cmd = await self._publish(cmd)
                span.set_attribute(spans.CMD_SEQ, fo.cmd.seq)
                yield fo
        finally:
            self._open.pop(cmd.cmd_id, None)
            if fo.cmd.seq:  # published: its outcome goes to the events stream
                ev = outcome(fo, self.source)
                instruments.current.command_duration.record(ev.seconds, {
                    spans.CMD_OP: op,
                    "outcome": "ok" if not (ev.failed or ev.missing) else
                               "failed" if ev.failed else "missing"})
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await self.bus.emit(ev)

    async def broadcast(self, cmd: Command, policy: QuorumPolicy | None = None,
                        phase: Literal["ready", "done"] = "done") -> FanoutReport:
        async with self.open(cmd) as fo:
            return await fo.wait(phase, policy)


def outcome(fo: Fanout, source: str) -> CommandEvent:
    """The `CommandEvent` of `fo` as it stands (its done acks, or ready acks of a two-phase
    command that never got to done)."""
    rep = fo.report("done")
    if not rep.acks and fo._got("ready"):
        rep = fo.report("ready")
    return CommandEvent(source=source, cmd_id=rep.cmd_id, op=rep.op,
                        version=fo.cmd.version if isinstance(fo.cmd, UpdateWeights) else -1,
                        ok=rep.ok, failed={w: rep.acks[w].error_code for w in rep.failed},
                        missing=rep.missing, seconds=rep.elapsed_s, at=time.time())


def _server(nc: Any) -> str:
    """The server `nc` is connected to, for an error message."""
    url = getattr(nc, "connected_url", None)
    return url.geturl() if url is not None else "no server"
