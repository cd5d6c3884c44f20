"""A worker's acks of commands: made, sent, and remembered so a command stored twice, or a
sender's probe for one already applied, is answered as the first time (`CommandReceiver`)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import nats.errors

from rlfabric.bus.errors import CommandFailed
from rlfabric.bus.session import Bus
from rlfabric.schemas import Ack, Command, ErrorCode, codec_for, op_of
from rlfabric.telemetry import instruments, spans

log = logging.getLogger("rlfabric.bus.control.receiver")
#: () -> (the weight version a worker serves now, its checksum)
StateFn = Callable[[], tuple[int, str]]


@dataclass(kw_only=True, slots=True)
class AckFields:
    """What a handler reports besides ok/error: the version it serves now and its checksum,
    and op-specific details."""

    weight_version: int | None = None
    weights_checksum: str | None = None
    detail: dict[str, str] = field(default_factory=dict)


class Acks:
    # slots: a process can hold many receivers (simulated fleets), each acks every command
    __slots__ = ("_encode", "_prefix", "_remember", "_seq_ids", "bus", "sent", "state",
                 "worker_id")

    def __init__(self, bus: Bus, worker_id: str, state: StateFn, *, remember: int) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.state = state
        #: cmd_id -> its encoded acks: one (most commands) as is, two (two-phase) in a tuple
        #: (not a tuple of one: the garbage collector tracks tuples, and one kept per command
        #: makes it run often on a busy worker); `cmd_id in acks.sent`: handled already
        self.sent: OrderedDict[str, bytes | tuple[bytes, ...]] = OrderedDict()
        self._seq_ids: OrderedDict[int, str] = OrderedDict()  # seq -> cmd_id, for re-sends
        self._remember = remember
        self._encode = codec_for(Ack).encode_raw
        self._prefix = bus.subjects.ack_prefix

    def make(self, cmd: Command, t0: float, phase: Literal["ready", "done"],
             status: Literal["ok", "error"], fields: dict[str, Any] | AckFields | None, *,
             code: str = "", message: str = "") -> Ack:
        version, checksum = self.state()
        if fields is None and status == "ok" and phase == "done":  # most commands: defaults
            return Ack(cmd_id=cmd.cmd_id, worker_id=self.worker_id, weight_version=version,
                       weights_checksum=checksum, elapsed_s=time.monotonic() - t0)
        if fields is None:
            return Ack(cmd_id=cmd.cmd_id, worker_id=self.worker_id, phase=phase,
                       status=status, error_code=code, error_message=message,
                       weight_version=version, weights_checksum=checksum,
                       elapsed_s=time.monotonic() - t0)
        detail: dict[str, str] = {}
        if isinstance(fields, AckFields):
            version = version if fields.weight_version is None else fields.weight_version
            checksum = checksum if fields.weights_checksum is None else fields.weights_checksum
            detail = fields.detail
        elif fields:
            version = fields.get("weight_version", version)
            checksum = fields.get("weights_checksum", checksum)
            detail = fields.get("detail", {})
        return Ack(cmd_id=cmd.cmd_id, worker_id=self.worker_id, phase=phase,
                   status=status, error_code=code, error_message=message,
                   weight_version=version, weights_checksum=checksum,
                   elapsed_s=time.monotonic() - t0, detail=detail)

    def failed(self, cmd: Command, t0: float, exc: Exception | None) -> Ack:
        """The error `done` Ack of a command past its deadline (`exc` None) or whose handler
        raised `exc`, counted."""
        code: str
        if exc is None:
            code, message = ErrorCode.DEADLINE_EXCEEDED, (
                f"{op_of(cmd)} arrived {time.time() - cmd.deadline:.3f}s after its deadline; "
                "not applied")
        elif isinstance(exc, CommandFailed):
            code, message = exc.code, str(exc)
        else:
            log.error("handler of %s %s failed on %s", op_of(cmd), cmd.cmd_id, self.worker_id,
                      exc_info=exc)
            code, message = ErrorCode.HANDLER_ERROR, f"{type(exc).__name__}: {exc}"
        instruments.current.errors.add(1, {"code": code, spans.WORKER_ID: self.worker_id})
        return self.make(cmd, t0, "done", "error", None, code=code, message=message)

    def send(self, cmd: Command, ack: Ack, *, traced: bool) -> Awaitable[None]:
        """Remember `ack` and publish it; await what this returns (it raises what nats-py's
        publish raises: the caller says `not_sent`). `cmd` is one the receiver took: its
        cmd_id passed `is_token` there. `traced`: as `spans.enabled()`, asked once."""
        cmd_id = cmd.cmd_id
        seq_ids = self._seq_ids  # a probe for its seq re-sends what was sent (`resend_seq`)
        seq_ids[cmd.seq] = cmd_id
        if len(seq_ids) > self._remember:  # one in, one out
            seq_ids.popitem(last=False)
        data = self._remembered(cmd_id, ack)
        subject = self._prefix + cmd_id
        if not traced:  # every worker, every command: nats-py's publish, no frame of ours
            return self.bus.nc.publish(subject, data)
        return self._send_traced(subject, data, ack)

    async def _send_traced(self, subject: str, data: bytes, ack: Ack) -> None:
        with spans.producer_span(subject, message_id=ack.cmd_id,
                                 attributes={spans.WORKER_ID: self.worker_id,
                                             "rlfabric.ack.phase": ack.phase,
                                             "rlfabric.ack.status": ack.status}):
            await self.bus.nc.publish(subject, data, headers=self.bus.headers())

    def _remembered(self, cmd_id: str, ack: Ack) -> bytes:
        """`ack` encoded, and remembered so to be sent again as is when asked (`resend`): not
        kept as an `Ack`, which costs more a command."""
        data = self._encode(ack)
        sent = self.sent.get(cmd_id)
        if sent is None:  # the first ack of a command: it is remembered from now on
            self.sent[cmd_id] = data
            if len(self.sent) > self._remember:
                self.sent.popitem(last=False)
        else:
            self.sent[cmd_id] = (sent, data) if isinstance(sent, bytes) else (*sent, data)
        return data

    async def publish(self, subject: str, data: bytes, cmd_id: str,
                      headers: dict[str, str] | None = None) -> None:
        """The ack of a command this worker decoded goes without headers unless tracing is on
        (see `rlfabric.schemas.codec`); a rejection carries them."""
        try:
            await self.bus.nc.publish(subject, data, headers=headers)
        except nats.errors.Error as exc:
            self.not_sent(cmd_id, exc)

    def not_sent(self, cmd_id: str, exc: Exception) -> None:
        # the sender's probe asks again (see `CommandReceiver._on_ping`)
        log.warning("%s: ack of %s not sent (%s); sent again when asked", self.worker_id,
                    cmd_id, exc)

    async def resend(self, cmd_id: str, seq: int | None = None) -> None:
        """The acks of `cmd_id` again (stored twice: as `seq`, now answered too)."""
        if seq is not None:
            self._seq_ids[seq] = cmd_id
            if len(self._seq_ids) > self._remember:  # one in, one out
                self._seq_ids.popitem(last=False)
        subject = self.bus.subjects.ack(cmd_id)
        headers = self.bus.headers() if spans.enabled() else None
        sent = self.sent.get(cmd_id, ())
        for data in (sent,) if isinstance(sent, bytes) else sent:
            await self.publish(subject, data, cmd_id, headers)

    async def resend_seq(self, seq: int) -> None:
        """The acks of the command applied as `seq`, again, if it is remembered."""
        if (cmd_id := self._seq_ids.get(seq)) is not None:
            await self.resend(cmd_id)

    async def reject(self, cmd_id: str, code: str, message: str) -> None:
        """An error Ack for a message that is not a command this worker can apply."""
        ack = Ack(cmd_id=cmd_id, worker_id=self.worker_id, status="error", error_code=code,
                  error_message=message)
        await self.publish(self.bus.subjects.ack(cmd_id), self._encode(ack), cmd_id,
                           self.bus.headers())
