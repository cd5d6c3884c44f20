"""The receiving side of broadcasts: a worker's ordered, idempotent command loop.

The control stream is the durable, ordered log of commands; a command's sequence there is
its place in the order. The sender persists a command, then publishes a copy of it on core
NATS (`<prefix>.live.<op>.<schema major>.<seq>`, no headers unless tracing is on): that copy
reaches every worker in one hop, so the common case costs no JetStream round trip on the
worker. A copy of another schema major, or one that does not decode, is never acted on: the
stream is read instead, where the stored command's headers say what it is.

Each worker keeps `next_seq`, the stream sequence it applies next (at start: the stream's end,
so it begins from the desired state it read at join, not from stale commands).
- a live copy with `seq == next_seq` is applied at once: in the live subscription's callback
  when nothing else is queued or being applied (no hop to the loop: less CPU per command),
  else by the loop, in order;
- `seq > next_seq` is a gap (a live copy lost or overtaken: a slow consumer, a reconnect, two
  senders): the missing commands are read from the stream in order (`catch-up`), then this one;
- `seq < next_seq` was applied already: ignored;
- a catch-up also runs after every reconnect, every `poll` seconds in which no live copy was
  applied (a command stored by something other than a `Broadcaster`, or whose live copy never
  came, and no copy after it showed the jump; the wait doubles while polls find nothing, up to
  `poll_max`, so an idle fleet costs the server next to nothing), and when the sender pings
  this worker with the sequence it waits for (`Fanout`'s probe). A ping for a command already
  applied re-sends its acks (they may have been lost).

Per command, in stream order:
- not an rlfabric command (garbage, another schema, an unknown major version): an
  `ErrorEvent` on `<prefix>.events.error.<worker>` and, if the sender's `rlf-cmd-id` header is
  there, an error `Ack` (code `malformed`); the loop goes on;
- a `cmd_id` already handled (stored twice): the Acks it produced are sent again; the handler
  does not run;
- past its deadline: an error Ack (code `deadline_exceeded`); the handler does not run;
- otherwise the handler runs and its Ack is published.
A command not applied (past its deadline, or its handler failed) is then passed to
`on_not_applied(cmd, ack)`: the fleet may have gone on without this worker, which may have to
catch up before the next command.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec
import nats.errors
import nats.js.errors
from anyio.abc import TaskStatus
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import NotFoundError
from opentelemetry.trace import StatusCode

from rlfabric.bus.control.acks import AckFields, Acks, StateFn
from rlfabric.bus.errors import READ_FAILED, TRANSIENT, CommandFailed
from rlfabric.bus.session import Bus
from rlfabric.bus.subjects import Subjects, check_token, is_token
from rlfabric.concurrency.ratelimit import RateLimited
from rlfabric.concurrency.sync import Signal
from rlfabric.schemas import (
    CMD_ID_HEADER,
    DECODE_ERRORS,
    JOB_COMMANDS,
    SCHEMA_MAJOR,
    Ack,
    Adapter,
    Command,
    ErrorCode,
    ErrorEvent,
    MalformedMessage,
    SchemaError,
    UnknownSchemaVersion,
    UpdateWeights,
    codec_for,
    op_of,
)
from rlfabric.telemetry import spans

log = logging.getLogger("rlfabric.bus.control.receiver")
#: seconds an idle worker's control-stream polls back off to, unless told
#: (`rlfabric worker --poll-max`)
POLL_MAX = 8.0
#: how a live copy's subject ends before its seq: `.<schema major>`
_MAJOR_TAIL = f".{SCHEMA_MAJOR}"


class CommandContext:
    """Given to a handler with its command: `await ctx.ready()` sends the `ready` Ack of a
    two-phase command; `ctx.after_done(fn)` runs `fn` once the `done` Ack is sent (what must
    not start before the sender has heard back, e.g. leaving on `Shutdown`)."""

    __slots__ = ("_after_done", "_r", "cmd", "t0")

    def __init__(self, receiver: CommandReceiver, cmd: Command) -> None:
        self._r = receiver
        self.cmd = cmd
        self.t0 = time.monotonic()
        self._after_done: list[Callable[[], None]] | None = None

    async def ready(self, **fields: Any) -> None:
        acks = self._r.acks
        try:
            await acks.send(self.cmd, acks.make(self.cmd, self.t0, "ready", "ok", fields),
                            traced=spans.enabled())
        except nats.errors.Error as exc:
            acks.not_sent(self.cmd.cmd_id, exc)

    def after_done(self, fn: Callable[[], None]) -> None:
        if self._after_done is None:
            self._after_done = []
        self._after_done.append(fn)


Handler = Callable[[Command, CommandContext], Awaitable[AckFields | None]]
#: queued for the loop: (seq, `live(op)`, live copy), or (0, "", None) for a catch-up
_Item = tuple[int, str, Msg | None]


class CommandReceiver:
    """Run with `await tg.start(receiver.run)`: started means the live subscription is bound
    and `next_seq` read, so any command persisted afterwards reaches this worker."""

    # slots: a process can hold many receivers (simulated fleets), each read every command
    __slots__ = ("_buffer", "_busy", "_codec", "_decode_raw", "_flood", "_queue", "_queued",
                 "_sync_queued", "_sync_waiters", "acks", "applied_live", "applied_seq", "bus",
                 "caught_up", "handled", "handler", "live_sub", "next_seq", "on_not_applied",
                 "on_unread", "poll", "poll_max", "rejected", "start_end", "stream_reads",
                 "worker_id")

    def __init__(self, bus: Bus, worker_id: str, handler: Handler, *,
                 state: StateFn = lambda: (-1, ""), poll: float = 1.0,
                 poll_max: float = POLL_MAX, remember: int = 4096, buffer: int = 4096,
                 on_not_applied: Callable[[Command, Ack], Awaitable[None]] | None = None,
                 on_unread: Callable[[str], None] | None = None) -> None:
        self.bus = bus
        self.on_not_applied = on_not_applied
        #: told why, when the control stream could not be read (commands may be missed)
        self.on_unread = on_unread
        self.worker_id = check_token(worker_id, "worker id")
        self.handler = handler
        self.acks = Acks(bus, self.worker_id, state, remember=remember)
        self.poll = poll
        self.poll_max = max(poll, poll_max)
        self._buffer = buffer
        self._codec = codec_for(Command)
        self._decode_raw = self._codec.decode_raw
        #: the control-stream sequence applied next
        self.next_seq = 0
        #: the control stream's last sequence when `run` started (commands up to it are not
        #: applied: a joiner starts from the desired state instead)
        self.start_end = 0
        #: the sequence of the last command applied (0: none yet)
        self.applied_seq = 0
        self.handled = self.rejected = 0
        #: commands applied from their live copy / read from the stream to fill a gap
        self.applied_live = self.caught_up = 0
        #: reads of the control stream (each catch-up ends with one that finds nothing new)
        self.stream_reads = 0
        self._flood = RateLimited(log)
        #: the core subscription to live copies (while running)
        self.live_sub: Subscription | None = None
        self._sync_queued = False
        self._sync_waiters: list[tuple[anyio.Event, list[bool]]] = []  # (done, [read])
        # what the subscription callbacks queued for the loop (a deque and a signal: an
        # anyio memory stream cost as much per item as applying the command)
        self._queue: deque[_Item] | None = None
        self._queued = Signal()
        # a command is being applied (by the loop or the live callback): one at a time, in
        # stream order; `_queued` fires when the callback is done with one
        self._busy = False

    # ---- the loop ----
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        s = self.bus.subjects
        # the live callback applies a copy that is next in order when nothing is queued or
        # being applied; everything else is queued for one loop, in this task group
        self._queue = queue = deque[_Item]()
        self.live_sub = live = await self.bus.nc.subscribe(s.live_all, cb=self._on_live)
        pings = await self.bus.nc.subscribe(s.ping(self.worker_id), cb=self._on_ping)
        try:
            await self.bus.nc.flush(timeout=10)  # both subscriptions are live on the server
            self.start_end = await self._stream_end()
            self.next_seq = self.start_end + 1
            async with anyio.create_task_group() as tg:
                tg.start_soon(_keep_in_sync, self)
                task_status.started()
                while True:
                    if not queue or self._busy:
                        await self._queued.event().wait()
                        continue
                    seq, subject, msg = queue.popleft()
                    self._busy = True
                    try:
                        if msg is None:
                            self._sync_queued = False
                            waiters, self._sync_waiters = self._sync_waiters, []
                            read = await self._catch_up()
                            for done, out in waiters:
                                out.append(read)
                                done.set()
                        elif seq > self.next_seq:
                            await self._catch_up()  # reads up to the stream's end, this too
                        elif seq == self.next_seq:
                            await (self._apply_traced if spans.enabled() else self._apply)(
                                seq, subject, msg.data, msg.headers, "live")
                        # seq < next_seq: applied already (read from the stream first)
                    finally:
                        self._busy = False
        finally:
            self._queue = None
            with anyio.CancelScope(shield=True):
                for sub in (live, pings):
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()  # cancels a handler its callback runs
                # that handler unwinds before the worker goes on (at most a few seconds)
                with anyio.move_on_after(5):
                    while self._busy:
                        await self._queued.event().wait()

    async def close(self) -> None:
        """Nothing to remove on the server (kept for callers that close what they run)."""

    def _enqueue(self, item: _Item) -> bool:
        queue = self._queue
        if queue is None or len(queue) >= self._buffer:
            return False
        queue.append(item)
        self._queued.fire()
        return True

    def _sync(self) -> None:
        """Ask the loop for a catch-up from the stream (one queued at a time)."""
        if not self._sync_queued:
            self._sync_queued = self._enqueue((0, "", None))

    async def sync(self, timeout: float = 30.0) -> bool:
        """Apply every command stored up to now, in order; False if the stream could not be
        read to its end (within `timeout` seconds)."""
        done, out = anyio.Event(), list[bool]()
        self._sync_waiters.append((done, out))
        self._sync()
        with anyio.move_on_after(timeout):
            await done.wait()
        return bool(out and out[0])

    async def _on_live(self, msg: Msg) -> None:
        # `Subjects.live_parts`, inline for the common case: every worker parses every copy
        subject = msg.subject
        head, _, tail = subject.rpartition(".")
        if head.endswith(_MAJOR_TAIL) and tail.isdecimal():
            subject, seq = head[:-len(_MAJOR_TAIL)], int(tail)
        elif (parts := Subjects.live_parts(subject)) is not None and parts[1] == SCHEMA_MAJOR:
            subject, _, seq = parts
        else:
            self._flood.warning("%s: a live command on %s is not a live copy of schema %d.x; "
                                "reading the stream instead", self.worker_id, msg.subject,
                                SCHEMA_MAJOR)
            self._sync()
            return
        queue = self._queue  # None: stopped
        if seq == self.next_seq and not self._busy and queue is not None and not queue:
            # in order, nothing before it waiting: applied here, in nats-py's task for this
            # subscription (its next live copy waits meanwhile; pings have their own)
            self._busy = True
            try:
                await (self._apply_traced if spans.enabled() else self._apply)(
                    seq, subject, msg.data, msg.headers, "live")
            finally:
                self._busy = False
                if self._queue is None or self._queue:  # stopping, or queued meanwhile
                    self._queued.fire()
            return
        if seq >= self.next_seq and not self._enqueue((seq, subject, msg)):
            self._sync()  # we are slow (the queue is full): the stream has it

    async def _on_ping(self, msg: Msg) -> None:
        """A sender's probe carries the sequence it waits for (`Fanout`); a plain liveness
        ping carries nothing. Answering pings is `Registration`'s part."""
        if not msg.data:
            return
        try:
            seq = int(msg.data)
        except ValueError:
            return
        if seq >= self.next_seq:
            self._sync()  # its live copy never came, or is queued behind a long handler
        else:
            await self.acks.resend_seq(seq)  # applied: the acks may have been lost

    async def _stream_end(self) -> int:
        delay = 0.05
        while True:
            try:
                return (await self.bus.js.stream_info(self.bus.subjects.control_stream)
                        ).state.last_seq
            except TRANSIENT as exc:  # a broker coming back
                log.debug("%s: control stream not readable yet: %s", self.worker_id, exc)
                await anyio.sleep(delay)
                delay = min(2 * delay, 1.0)

    async def _catch_up(self) -> bool:
        """Apply every command stored from `next_seq` on, in order; False if the stream could
        not be read to its end."""
        s = self.bus.subjects
        while True:
            self.stream_reads += 1
            try:
                raw = await self.bus.js.get_msg(s.control_stream, seq=self.next_seq,
                                                subject=s.control_all, next=True)
            except NotFoundError:
                return True  # up to date
            except READ_FAILED as exc:
                # the next poll, reconnect or probe tries again; nothing applied out of order
                log.warning("%s: reading commands from seq %d failed (%s); retried shortly",
                            self.worker_id, self.next_seq, exc)
                if self.on_unread is not None:
                    self.on_unread("the control stream could not be read "
                                   f"({str(exc) or type(exc).__name__})")
                return False
            if raw.seq is None or raw.seq < self.next_seq:
                return True
            self.caught_up += 1
            # nats-py parses a stored message's headers with `email`: a value that is not
            # ASCII comes back as an `email.header.Header`, not a str
            headers = {str(k): str(v) for k, v in raw.headers.items()} if raw.headers else None
            await (self._apply_traced if spans.enabled() else self._apply)(
                raw.seq, raw.subject or "", raw.data or b"", headers, "stream")

    def _decoded(self, subject: str, data: bytes, headers: dict[str, str] | None,
                 path: str) -> Command:
        if path == "live":  # its major was read from its subject: no header to check
            cmd: Command = self._decode_raw(data)
        else:
            cmd = self._codec.decode(data, headers, subject=subject)
        if not is_token(cmd.cmd_id):  # its acks could not be sent: not a command
            raise MalformedMessage(
                f"command cmd_id {cmd.cmd_id[:80]!r} on {subject!r} cannot name its ack "
                "subject: 1-64 characters from A-Z a-z 0-9 _ -", subject=subject,
                type_name="Command")
        return cmd

    async def _apply(self, seq: int, subject: str, data: bytes,
                     headers: dict[str, str] | None, path: str, *, traced: bool = False
                     ) -> tuple[Command, Ack] | None:
        """Apply the command stored as `seq` (its `done` Ack sent); the command and that Ack,
        or None when nothing was applied (not a command, or one handled already)."""
        try:
            cmd = self._decoded(subject, data, headers, path)
        except (SchemaError, *DECODE_ERRORS) as exc:
            if path == "live":  # the stored command's headers say what it is
                await self._catch_up()
                return None
            self.next_seq = seq + 1
            await self._reject(subject, headers, exc)
            return None
        self.next_seq = seq + 1
        cmd_id = cmd.cmd_id
        if path == "live":
            self.applied_live += 1
        msgspec.structs.force_setattr(cmd, "seq", seq)  # decoded here: no one else holds it
        acks = self.acks
        if cmd_id in acks.sent:  # stored twice: answer as the first time
            await acks.resend(cmd_id, seq)
            return None
        ctx = CommandContext(self, cmd)
        if cmd.deadline and time.time() > cmd.deadline:
            ack = acks.failed(cmd, ctx.t0, None)
        elif ".job." in subject and (why := out_of_scope(subject, cmd)):
            ack = acks.failed(cmd, ctx.t0, CommandFailed(ErrorCode.POOL_ONLY, why))
        else:
            try:
                fields = await self.handler(cmd, ctx)
            except Exception as exc:
                ack = acks.failed(cmd, ctx.t0, exc)
            else:
                ack = acks.make(cmd, ctx.t0, "done", "ok", fields)
        self.applied_seq = seq
        self.handled += 1
        try:
            await acks.send(cmd, ack, traced=traced)
        except nats.errors.Error as exc:
            acks.not_sent(cmd_id, exc)
        if ack.status != "ok" and self.on_not_applied is not None:
            await self.on_not_applied(cmd, ack)
        if ctx._after_done:
            for fn in ctx._after_done:
                fn()
        return cmd, ack

    async def _apply_traced(self, seq: int, subject: str, data: bytes,
                            headers: dict[str, str] | None, path: str) -> None:
        """`_apply` inside the command's `process` span (a child of the sender's)."""
        with spans.consumer_span(subject, headers, attributes={
                spans.WORKER_ID: self.worker_id, spans.CMD_SEQ: seq,
                "rlfabric.cmd.path": path}) as span:  # how it came
            applied = await self._apply(seq, subject, data, headers, path, traced=True)
            if applied is not None and span.is_recording():
                cmd, ack = applied
                span.set_attributes({spans.MESSAGE_ID: cmd.cmd_id, spans.CMD_ID: cmd.cmd_id,
                                     spans.CMD_OP: op_of(cmd),
                                     spans.WEIGHT_VERSION: ack.weight_version,
                                     "rlfabric.ack.status": ack.status})
                if ack.status != "ok":
                    span.set_status(StatusCode.ERROR, f"{ack.error_code}: {ack.error_message}")

    async def _reject(self, subject: str, headers: dict[str, str] | None,
                      exc: Exception) -> None:
        self.rejected += 1
        cmd_id = (headers or {}).get(CMD_ID_HEADER, "")
        code = (ErrorCode.UNKNOWN_SCHEMA_VERSION if isinstance(exc, UnknownSchemaVersion)
                else ErrorCode.MALFORMED)
        # one log line per interval with a count, not one per message; every one an event
        self._flood.warning("%s rejected a command on %s: %s", self.worker_id, subject, exc)
        with contextlib.suppress(nats.errors.Error):
            await self.bus.emit(ErrorEvent(source=self.worker_id, code=code, message=str(exc),
                                           subject=subject, cmd_id=cmd_id, at=time.time()))
        if cmd_id and is_token(cmd_id):
            await self.acks.reject(cmd_id, code, str(exc))


async def _keep_in_sync(r: CommandReceiver) -> None:
    """A catch-up after every reconnect, and every `poll` seconds in which no live copy was
    applied. While copies come in order a poll would find nothing a copy does not show:
    a command stored without one is a jump in the next copy's seq. Once they stop, the
    next quiet poll reads it (within two polls). A poll costs a stream read, of the worker's
    CPU and the server's: skipping them while commands flow takes them off the calls, and
    the wait doubling while nothing comes takes them off an idle fleet. The poll's clock is
    a loop timer, not a task's timed wait: a process can hold many receivers (simulated
    fleets), and a timed wait costs several times as much CPU each time it runs out."""
    loop = asyncio.get_running_loop()
    live, seq, wait = r.applied_live, r.next_seq, r.poll
    timer: asyncio.TimerHandle

    def arm() -> asyncio.TimerHandle:
        return loop.call_later(wait * random.uniform(0.5, 1.5), tick)

    def tick() -> None:
        nonlocal live, seq, wait, timer
        before, live = live, r.applied_live
        if live == before:  # else: in step with the live copies
            r._sync()
        moved, seq = r.next_seq != seq, r.next_seq
        wait = r.poll if moved else min(2 * wait, r.poll_max)
        timer = arm()

    timer = arm()
    try:
        while True:
            await r.bus.link.reconnected.event().wait()
            timer.cancel()
            r._sync()
            live, seq, wait = r.applied_live, r.next_seq, r.poll
            timer = arm()
    finally:
        timer.cancel()


def out_of_scope(subject: str, cmd: Command) -> str:
    """Why a command that came on a job's subjects (`Subjects.control(op, job)`) is not
    applied ("" if it is): a job's credentials reach its own subjects only, so what comes on
    them may act on that job's requests and adapters only."""
    job = Subjects.job_of_command(subject)
    if job is None:
        return ""
    op = op_of(cmd)
    if not isinstance(cmd, JOB_COMMANDS) or (
            isinstance(cmd, UpdateWeights) and not isinstance(cmd.target, Adapter)):
        return (f"{op} came on job {job}'s subject {subject}; a job may pause and resume its "
                "own requests and push or unload its own adapters, nothing of the pool's")
    if cmd.job != job:
        return (f"{op} names job {cmd.job or '(the pool)'!r} but came on job {job}'s subject "
                f"{subject}; a job acts on its own requests and adapters only")
    return ""
