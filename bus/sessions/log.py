"""Agent sessions on the bus: the append-only log of what gateways served, per session, in the
stream `<PREFIX>_SESSIONS` (one subject per session), and the trajectories folded from it.

    log = SessionLog(bus)
    seq, record = await log.last(key)             # one direct get
    records = await log.read(key, after=seq)      # batched direct gets, in stored order
    seq = await log.append(record, expect_last=seq)   # refused if another turn came first
    stored = await log.send(record, expect_last=seq)  # sent now; `await stored()` later

Appends are conditional on the session's last sequence (`Nats-Expected-Last-Subject-Sequence`),
so two gateways serving one session never interleave turns unseen: the second raises
`SessionConflict`. An append sent again after its PubAck was lost (a broker restart) returns
the copy its first try stored. A trainer reads trajectories straight off the bus
(`read_trajectory`), no gateway needed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable

import anyio
import nats.errors
from nats.aio.msg import Msg
from nats.js.errors import APIError

from rlfabric.bus.errors import JS_WRONG_LAST_SEQUENCE, BusError
from rlfabric.bus.session import Bus
from rlfabric.bus.subjects import is_token
from rlfabric.schemas import (
    SessionFold,
    SessionRecord,
    SessionTurn,
    Trajectory,
    codec_for,
    encode,
)

#: records one batched read asks for
READ_BATCH = 256
_STATUS = "Status"
#: on a session record: who appended it (a gateway's id), so others know their copy is stale
WRITER_HEADER = "rlf-writer"


class SessionConflict(BusError):
    """Raised by `SessionLog.append` when the session has a record the caller did not see
    (another gateway served a turn of it meanwhile): read it and plan again."""


def session_key(session_id: str) -> str:
    """The subject token of a session: the id itself when it is one, else a digest of it
    (ids are the agent's: they may hold dots, slashes, anything)."""
    if is_token(session_id) and not session_id.startswith("h-"):
        return session_id
    return "h-" + hashlib.blake2b(session_id.encode(), digest_size=16).hexdigest()


class SessionLog:
    def __init__(self, bus: Bus, *, writer: str = "") -> None:
        self.bus = bus
        self.writer = writer
        self._codec = codec_for(SessionRecord)
        self._stream = bus.subjects.sessions_stream
        self._api = f"$JS.API.DIRECT.GET.{self._stream}"

    def _decode(self, data: bytes, headers: dict[str, str] | None,
                subject: str) -> SessionRecord:
        record: SessionRecord = self._codec.decode(data, headers, subject=subject)
        return record

    async def last(self, key: str) -> tuple[int, SessionRecord | None]:
        """The session's last stored sequence and record; (0, None) if it has none."""
        subject = self.bus.subjects.session(key)
        msg = await self._get_one(f"{self._api}.{subject}", b"", f"session {key}")
        if msg is None:
            return 0, None
        hdrs = msg.headers or {}
        return int(hdrs["Nats-Sequence"]), self._decode(msg.data, hdrs, subject)

    async def _get_one(self, api: str, req: bytes, what: str) -> Msg | None:
        """One direct get of `what`; None if the stream has no such record."""
        msg = await self.bus.nc.request(api, req, timeout=5.0)
        hdrs = msg.headers or {}
        if _STATUS not in hdrs:
            return msg
        if hdrs[_STATUS] == "404":
            return None
        raise BusError(f"reading {what} failed: status {hdrs[_STATUS]} "
                       f"({hdrs.get('Description', '')})")

    async def read(self, key: str, *, after: int = 0
                   ) -> list[tuple[int, SessionRecord]]:
        """The session's records stored after sequence `after`, in order, with their
        sequences."""
        subject = self.bus.subjects.session(key)
        out: list[tuple[int, SessionRecord]] = []
        inbox = self.bus.nc.new_inbox()
        sub = await self.bus.nc.subscribe(inbox)
        try:
            start = after + 1
            while True:
                req = json.dumps({"seq": start, "next_by_subj": subject, "batch": READ_BATCH})
                await self.bus.nc.publish(self._api, req.encode(), reply=inbox)
                pending = 0
                while True:
                    try:
                        msg = await sub.next_msg(timeout=5.0)
                    except nats.errors.TimeoutError:
                        raise BusError(f"reading session {key}: the server stopped answering "
                                       f"after {len(out)} records") from None
                    hdrs = msg.headers or {}
                    status = hdrs.get(_STATUS)
                    if status == "404":  # nothing after `start`
                        return out
                    if status is not None:  # 204: end of this batch
                        pending = int(hdrs.get("Nats-Num-Pending", "0") or 0)
                        break
                    seq = int(hdrs["Nats-Sequence"])
                    out.append((seq, self._decode(msg.data, hdrs, subject)))
                    start = seq + 1
                if pending <= 0:
                    return out
        finally:
            with anyio.CancelScope(shield=True):
                await sub.unsubscribe()

    async def append(self, record: SessionRecord, *, expect_last: int) -> int:
        """Store `record` as the session's next one, if its last sequence is still
        `expect_last` (0: none yet), or find it stored there already (this append, sent again
        by this writer); returns its sequence. `SessionConflict` otherwise."""
        stored = await self.send(record, expect_last=expect_last)
        return await stored()

    async def send(self, record: SessionRecord, *, expect_last: int
                   ) -> Callable[[], Awaitable[int]]:
        """`append`, sent now: the returned call waits until it is stored and returns its
        sequence (or raises `SessionConflict`)."""
        key = session_key(record.session_id)
        subject = self.bus.subjects.session(key)
        n = record.turn if isinstance(record, SessionTurn) else "end"
        msg_id = f"{self._stream}/{key}/{expect_last}/{n}/{self.writer}"
        hdrs = self.bus.headers({"Nats-Expected-Last-Subject-Sequence": str(expect_last),
                                 "Nats-Msg-Id": msg_id, WRITER_HEADER: self.writer})
        data = encode(record)
        stored = await self.bus.stored_later(subject, data, hdrs,
                                             cleared_as=self.bus.subjects.sessions_all)

        async def seq() -> int:
            try:
                ack = await stored()
            except APIError as exc:
                if exc.err_code not in JS_WRONG_LAST_SEQUENCE:
                    raise
                # a send again after a lost PubAck meets its own first copy: the stream checks
                # the expected sequence before its duplicate window
                if (mine := await self._stored_as(subject, expect_last, msg_id, data)) is not None:
                    return mine
                raise SessionConflict(
                    f"session {record.session_id!r} has a turn this gateway did not see "
                    f"(stored after sequence {expect_last}); send the turns of one session "
                    "one at a time") from None
            return int(ack.seq)
        return seq

    async def _stored_as(self, subject: str, after: int, msg_id: str, data: bytes) -> int | None:
        """The sequence of the first record on `subject` after `after` if it is `msg_id` with
        `data` (this very append, stored by an earlier try); None if another or none."""
        req = json.dumps({"seq": after + 1, "next_by_subj": subject}).encode()
        msg = await self._get_one(self._api, req, f"the record after {after} on {subject}")
        if msg is None or msg.data != data:
            return None
        hdrs = msg.headers or {}
        return int(hdrs["Nats-Sequence"]) if hdrs.get("Nats-Msg-Id") == msg_id else None


async def read_trajectory(bus: Bus, session_id: str) -> Trajectory | None:
    """A session's trajectory as stored on the bus now; None if it has no records."""
    records = await SessionLog(bus).read(session_key(session_id))
    if not records:
        return None
    f = SessionFold()
    for _, r in records:
        f.apply(r)
    return f.trajectory()
