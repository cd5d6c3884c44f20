"""The receiving side of broadcasts: a worker's ordered, idempotent command loop.

Each worker owns one durable pull consumer on the control stream, created fresh (deliver
policy "new") when it starts: what it missed while away is in the desired state it reads at
join, not in stale commands. `max_ack_pending=1` makes the server deliver commands one at a
time in stream order, so they are applied in `seq` order.

Per delivered message:
- not an rlfabric command (garbage, another schema, an unknown major version): an
  `ErrorEvent` on `<prefix>.events.error.<worker>` and, if the sender's `rlf-cmd-id` header is
  there, an error `Ack` (code `malformed`); the message is terminated, the loop goes on;
- a `cmd_id` already handled: the Acks it produced are sent again; the handler does not run;
- past its deadline: an error Ack (code `deadline_exceeded`); the handler does not run;
- otherwise the handler runs (in-progress acks keep the message while it does), its Ack is
  published, then the message is acked.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import nats.errors
from anyio.abc import TaskStatus
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from rlfabric.bus.errors import BusError, CommandFailed
from rlfabric.bus.pull import Puller
from rlfabric.bus.ratelimit import RateLimited
from rlfabric.bus.session import Bus
from rlfabric.bus.subjects import check_token
from rlfabric.bus.sync import Signal, wait_any
from rlfabric.schemas import (
    CMD_ID_HEADER,
    Ack,
    Command,
    ErrorEvent,
    SchemaError,
    UnknownSchemaVersion,
    codec_for,
    op_of,
)

log = logging.getLogger("rlfabric.bus.receiver")


@dataclass(kw_only=True, slots=True)
class AckFields:
    """What a handler reports besides ok/error: the version it serves now and its checksum,
    and op-specific details."""

    weight_version: int | None = None
    weights_checksum: str | None = None
    detail: dict[str, str] = field(default_factory=dict)


class CommandContext:
    """Given to a handler with its command: `await ctx.ready()` sends the `ready` Ack of a
    two-phase command."""

    def __init__(self, receiver: CommandReceiver, cmd: Command) -> None:
        self._r = receiver
        self.cmd = cmd
        self.t0 = time.monotonic()

    async def ready(self, **fields: Any) -> None:
        await self._r._send_ack(self.cmd.cmd_id, self._r._make_ack(self, "ready", "ok", fields))


Handler = Callable[[Command, CommandContext], Awaitable[AckFields | None]]
StateFn = Callable[[], tuple[int, str]]


class CommandReceiver:
    """Run with `await tg.start(receiver.run)`: started means the consumer exists and the
    subscription is bound, so any command published afterwards reaches this worker."""

    def __init__(self, bus: Bus, worker_id: str, handler: Handler, *,
                 state: StateFn = lambda: (-1, ""), ack_wait: float = 30.0,
                 remember: int = 4096) -> None:
        self.bus = bus
        self.worker_id = check_token(worker_id, "worker id")
        self.handler = handler
        self.state = state
        self.ack_wait = ack_wait
        self._sent: OrderedDict[str, list[Ack]] = OrderedDict()
        self._remember = remember
        self._codec = codec_for(Command)
        self.applied_seq = 0
        self.handled = 0
        self.rejected = 0
        self._flood = RateLimited(log)

    # ---- acks ----
    def _make_ack(self, ctx: CommandContext, phase: Literal["ready", "done"],
                  status: Literal["ok", "error"],
                  fields: dict[str, Any] | AckFields | None, *, code: str = "",
                  message: str = "") -> Ack:
        version, checksum = self.state()
        detail: dict[str, str] = {}
        if isinstance(fields, AckFields):
            version = version if fields.weight_version is None else fields.weight_version
            checksum = checksum if fields.weights_checksum is None else fields.weights_checksum
            detail = fields.detail
        elif fields:
            version = fields.get("weight_version", version)
            checksum = fields.get("weights_checksum", checksum)
            detail = fields.get("detail", {})
        return Ack(cmd_id=ctx.cmd.cmd_id, worker_id=self.worker_id, phase=phase,
                   status=status, error_code=code, error_message=message,
                   weight_version=version, weights_checksum=checksum,
                   elapsed_s=time.monotonic() - ctx.t0, detail=detail)

    async def _send_ack(self, cmd_id: str, ack: Ack) -> None:
        self._sent.setdefault(cmd_id, []).append(ack)
        self._sent.move_to_end(cmd_id)
        while len(self._sent) > self._remember:
            self._sent.popitem(last=False)
        await self.bus.publish(self.bus.subjects.ack(cmd_id), ack)

    # ---- the loop ----
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        s = self.bus.subjects
        durable = s.control_consumer(self.worker_id)
        try:
            await self.bus.js.delete_consumer(s.control_stream, durable)
        except NotFoundError:
            pass
        await self.bus.js.add_consumer(s.control_stream, ConsumerConfig(
            durable_name=durable, deliver_policy=DeliverPolicy.NEW, ack_policy=AckPolicy.EXPLICIT,
            max_ack_pending=1, ack_wait=self.ack_wait, inactive_threshold=3600.0,
            filter_subject=s.control_all,
        ))
        # one command at a time (max_ack_pending=1), through a `Puller`: its pull request is
        # renewed the moment a reconnect or a broker restart drops it
        send, recv = anyio.create_memory_object_stream[Msg](16)
        delivered = Signal()

        async def on_message(msg: Msg) -> None:
            delivered.fire()
            try:
                send.send_nowait(msg)
            except anyio.WouldBlock:  # cannot happen with one pending; if it does: later
                await msg.nak(delay=0.5)

        puller = Puller(self.bus, s.control_stream, durable, on_message)
        async with anyio.create_task_group() as tg, send, recv:
            await tg.start(puller.run)
            tg.start_soon(self._keep_pulling, puller, delivered)
            task_status.started()
            async for msg in recv:
                try:
                    await self._handle(msg)
                except nats.errors.Error as exc:
                    # the connection went mid-way (an ack not sent): the command comes back
                    # and is answered from `_sent` if it was handled
                    log.warning("%s: command on %s not finished (%s); it is redelivered",
                                self.worker_id, msg.subject, exc)
                    with contextlib.suppress(nats.errors.Error):
                        await msg.nak()

    async def _keep_pulling(self, puller: Puller, delivered: Signal) -> None:
        while True:
            kicked, got = puller.kicked(), delivered.event()
            try:
                await puller.want(1)
            except nats.errors.Error as exc:  # the connection went in between: kicked later
                log.debug("%s: pull for commands not sent: %s", self.worker_id, exc)
            await wait_any(kicked, got)

    async def close(self) -> None:
        """Delete this worker's control consumer (on a clean exit)."""
        s = self.bus.subjects
        try:
            await self.bus.js.delete_consumer(s.control_stream, s.control_consumer(self.worker_id))
        except Exception as exc:
            log.debug("control consumer of %s not deleted: %s", self.worker_id, exc)

    async def _handle(self, msg: Msg) -> None:
        try:
            cmd = self._codec.decode(msg.data, msg.headers, subject=msg.subject)
        except SchemaError as exc:
            await self._reject(msg, exc)
            return
        if cmd.cmd_id in self._sent:  # delivered again: answer as the first time
            for ack in self._sent[cmd.cmd_id]:
                await self.bus.publish(self.bus.subjects.ack(cmd.cmd_id), ack)
            await msg.ack()
            return
        ctx = CommandContext(self, cmd)
        if cmd.deadline and time.time() > cmd.deadline:
            ack = self._make_ack(ctx, "done", "error", None, code="deadline_exceeded",
                                 message=f"{op_of(cmd)} arrived {time.time() - cmd.deadline:.3f}s "
                                 "after its deadline; not applied")
        else:
            ack = await self._run_handler(msg, cmd, ctx)
        await self._send_ack(cmd.cmd_id, ack)
        self.applied_seq = max(self.applied_seq, cmd.seq)
        self.handled += 1
        await msg.ack()

    async def _run_handler(self, msg: Msg, cmd: Command, ctx: CommandContext) -> Ack:
        async def keep_alive() -> None:
            while True:
                await anyio.sleep(self.ack_wait / 3)
                with contextlib.suppress(nats.errors.Error):  # a reconnect: next round
                    await msg.in_progress()

        async with anyio.create_task_group() as tg:
            tg.start_soon(keep_alive)
            try:
                fields = await self.handler(cmd, ctx)
            except CommandFailed as exc:
                ack = self._make_ack(ctx, "done", "error", None, code=exc.code, message=str(exc))
            except Exception as exc:
                log.exception("handler of %s %s failed on %s", op_of(cmd), cmd.cmd_id,
                              self.worker_id)
                ack = self._make_ack(ctx, "done", "error", None, code="handler_error",
                                     message=f"{type(exc).__name__}: {exc}")
            else:
                ack = self._make_ack(ctx, "done", "ok", fields)
            tg.cancel_scope.cancel()
        return ack

    async def _reject(self, msg: Msg, exc: SchemaError) -> None:
        self.rejected += 1
        cmd_id = (msg.headers or {}).get(CMD_ID_HEADER, "")
        code = "unknown_schema_version" if isinstance(exc, UnknownSchemaVersion) else "malformed"
        # one log line per interval with a count, not one per message; every one an event
        self._flood.warning("%s rejected a command on %s: %s", self.worker_id, msg.subject, exc)
        await self.bus.emit(ErrorEvent(source=self.worker_id, code=code, message=str(exc),
                                       subject=msg.subject, cmd_id=cmd_id, at=time.time()))
        if cmd_id:
            try:
                check_token(cmd_id, "command id")
            except BusError:
                cmd_id = ""
        if cmd_id:
            ack = Ack(cmd_id=cmd_id, worker_id=self.worker_id, status="error", error_code=code,
                      error_message=str(exc))
            await self.bus.publish(self.bus.subjects.ack(cmd_id), ack)
        await msg.term()

