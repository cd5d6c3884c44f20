"""Sessions as one gateway holds them: a cache of folded session logs over the bus.

- A turn's record is stored before its response goes out (`record`), so a gateway killed
  after answering has lost no turn. A write that fails is logged and counted, and the session
  is read back from the bus at its next turn.
- Every gateway hears the records others append (core NATS, the writer in a header, no payload
  decoded) and marks its copy stale; a stale or unknown session is read from the bus before it
  is planned (`open`). So consecutive turns of a session on one gateway cost no read, and turns
  that alternate between gateways cost one.
- A turn is planned against this copy; a new segment is declared only against the freshest
  state (`refresh`): the caller reads the bus again and plans again if it changed.
- One turn of a session at a time, on any gateway: a turn claims its session before anything is
  sampled (`rlfabric.bus.sessions.turns`), and a second one is refused at once (409
  `session_conflict`); the conditional append (`SessionConflict`) stays as the last guard.
- Idle sessions end (`SessionEnd(reason="expired")`) after the idle timeout. The cache holds at
  most `max_cached` sessions and about `max_bytes` of their tokens: to take a new one it drops
  the least recently used sessions with no turn in progress (expired ones first, as they are
  the least recent; an evicted one is read back when it comes again). When the sessions in
  turns fill the bound, a new one is refused with 503 (`session_limit`).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskGroup, TaskStatus
from nats.aio.msg import Msg

from rlfabric.bus import Bus
from rlfabric.bus.sessions.log import WRITER_HEADER, SessionConflict, SessionLog, session_key
from rlfabric.gateway.errors import APIError
from rlfabric.schemas import ErrorCode, SessionEnd, SessionFold, SessionRecord, Trajectory
from rlfabric.telemetry import instruments

log = logging.getLogger("rlfabric.gateway")
#: `Session.claim` while the claim is being taken
PENDING = object()
#: what a held token costs the gateway, about: its id, mask and logprob as Python objects
TOKEN_BYTES = 96
MIB = 1024 * 1024


@dataclass(eq=False)
class Session:
    session_id: str
    key: str
    seq: int = 0  # the last record applied to `fold` (stored)
    fold: SessionFold = field(default_factory=SessionFold)
    #: `decode(fold.prompt)`, where known (the last turn's full render)
    prompt_text: str | None = None
    #: the text of the choices the session returned (`splice.raw_text`'s cache)
    texts: dict[tuple[bytes, bytes, str], str] = field(default_factory=dict)
    touched: float = field(default_factory=time.monotonic)
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    #: another writer appended since `seq`, or a write of ours failed: read before planning
    stale: bool = True
    #: set once this gateway's last write of it is stored (or failed)
    written: anyio.Event | None = None
    #: its turn in flight: the claim on the bus (`rlfabric.bus.sessions.turns`), PENDING while taken
    claim: object | None = None
    #: moves whenever `fold` does: a turn planned on one state records only onto it
    changes: int = 0
    #: turns of it in progress here, and when the last began (a turn whose end was never
    #: seen, a stream nobody read, stops counting after the wait timeout)
    active: int = 0
    began: float = 0.0
    #: what `fold` and `prompt_text` cost, about (see `SessionStore.resize`)
    nbytes: int = 0

    @property
    def new(self) -> bool:
        return self.fold.last is None

    def forget(self) -> None:
        self.seq, self.fold, self.prompt_text, self.stale = 0, SessionFold(), None, True
        self.changes += 1


class SessionStore:
    def __init__(self, bus: Bus, *, writer: str, idle_timeout: float = 3600.0,
                 max_cached: int = 10_000, max_bytes: int = 1 << 30,
                 wait_timeout: float = 600.0) -> None:
        self.bus = bus
        self.writer = writer
        self.log = SessionLog(bus, writer=writer)
        self.idle_timeout = idle_timeout
        self.max_cached = max_cached
        self.max_bytes = max_bytes
        self.held_bytes = 0  # `nbytes` of the cached sessions
        #: how long a turn waits for the session's previous record to be stored
        self.wait_timeout = wait_timeout
        self.write_failures = 0
        self._cache: collections.OrderedDict[str, Session] = collections.OrderedDict()
        self._tg: TaskGroup | None = None

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Hear other writers, settle writes, sweep idle sessions; started once listening."""
        prefix = len(self.bus.subjects.sessions_all) - 1  # "<prefix>.session."

        async def heard(msg: Msg) -> None:
            if (msg.headers or {}).get(WRITER_HEADER) != self.writer:
                s = self._cache.get(msg.subject[prefix:])
                if s is not None:
                    s.stale = True

        sub = await self.bus.nc.subscribe(self.bus.subjects.sessions_all, cb=heard)
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._sweep_every, min(60.0, self.idle_timeout / 4))
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._tg = None
            with anyio.CancelScope(shield=True):
                await sub.unsubscribe()

    def entry(self, session_id: str) -> Session:
        """The cached session (made and cached if new: `APIError` 503 when the bound is full
        of sessions in turns)."""
        key = session_key(session_id)
        s = self._cache.get(key)
        if s is None:
            self._make_room()
            s = self._cache[key] = Session(session_id, key)
        else:
            self._cache.move_to_end(key)
        s.touched = time.monotonic()
        return s

    def load(self) -> dict[str, int]:
        """What the bound counts: sessions held, those in turns now, their bytes (about)."""
        return {"sessions": len(self._cache),
                "sessions_in_turns": sum(1 for s in self._cache.values() if self._busy(s)),
                "session_bytes": self.held_bytes}

    def begin(self, s: Session) -> None:
        s.active += 1
        s.began = time.monotonic()

    def done(self, s: Session) -> None:
        s.active = max(0, s.active - 1)

    def _busy(self, s: Session) -> bool:
        if s.lock.locked() or s.claim is not None or (
                s.written is not None and not s.written.is_set()):
            return True
        return s.active > 0 and time.monotonic() - s.began < self.wait_timeout

    def _full(self) -> bool:
        return len(self._cache) >= self.max_cached or self.held_bytes >= self.max_bytes

    def _make_room(self) -> None:
        if not self._full():  # the common case: no copy of the cache
            return
        for key, old in list(self._cache.items()):  # least recently used first
            if not self._full():
                return
            if not self._busy(old):
                self._evict(key, old)
        if self._full():
            raise APIError(503, (
                f"the gateway holds {len(self._cache)} sessions ({self.held_bytes / MIB:.1f} "
                f"MiB of tokens), all in turns now: its bound is --max-cached-sessions "
                f"{self.max_cached} and --max-session-bytes {self.max_bytes}. Retry when a "
                "turn ends, raise the bound, or add a gateway"), code=ErrorCode.SESSION_LIMIT)

    def _evict(self, key: str, s: Session) -> None:
        del self._cache[key]
        self.held_bytes -= s.nbytes
        expired = time.monotonic() - s.touched > self.idle_timeout
        if expired and s.fold.turns and not s.fold.ended and self._tg is not None:
            self._tg.start_soon(self._expire, s)

    def resize(self, s: Session) -> None:
        """Count what `s` holds now against the bound (if it is the cached copy)."""
        n = s.fold.held_tokens() * TOKEN_BYTES + len(s.prompt_text or "")
        if self._cache.get(s.key) is s:
            self.held_bytes += n - s.nbytes
        s.nbytes = n

    def local(self, session_id: str) -> Session:
        """A session of one turn that nobody continues: nothing to read."""
        return Session(session_id, session_key(session_id), stale=False)

    async def open(self, s: Session) -> None:
        """Make `s` current for a turn (the caller holds `s.lock`): what others wrote read, if
        anything was heard of. This gateway's own last write may still be on its way: the
        next record waits for it (`record`), the plan needs only the fold."""
        if s.stale:
            await self.refresh(s)

    async def _stored(self, s: Session) -> None:
        """Wait for this gateway's last write of `s` (a bus that does not answer: 503)."""
        if s.written is None:
            return
        with anyio.move_on_after(self.wait_timeout):
            await s.written.wait()
            return
        raise APIError(503, f"session {s.session_id!r}: its last turn is not stored after "
                       f"{self.wait_timeout:g} s (the bus is not answering); retry",
                       code=ErrorCode.BUS_UNAVAILABLE)

    async def refresh(self, s: Session) -> bool:
        """Read what the bus holds after `s.seq`; True if anything was."""
        await self._stored(s)  # our own last write first: the bus is read after it
        s.stale = False
        seq, _ = await self.log.last(s.key)
        if seq == s.seq:
            return False
        if seq < s.seq:  # the stream lost records (purged, aged out): read it all again
            s.forget()
            s.stale = False
        for rseq, record in await self.log.read(s.key, after=s.seq):
            s.fold.apply(record)
            s.seq = rseq
        s.prompt_text = None
        s.changes += 1
        self.resize(s)
        return True

    async def record(self, s: Session, record: SessionRecord, *, planned_on: int,
                     prompt_text: str | None = None) -> None:
        """Apply `record` as the session's next one and store it; returns once it is stored,
        or its write failed (logged and counted; the session is read back at its next turn).
        `planned_on`: `s.changes` when the turn was planned; `SessionConflict` if the session
        moved since (another turn of it came first, or the write of the turn it extends
        failed)."""
        await self._stored(s)
        if s.changes != planned_on:
            raise SessionConflict(f"session {s.session_id!r} had another turn while this one "
                                  "was generated; send the turns of one session one at a time")
        stored = await self.log.send(record, expect_last=s.seq)
        s.fold.apply(record)
        s.changes += 1
        s.prompt_text = prompt_text
        self.resize(s)
        written = s.written = anyio.Event()
        assert self._tg is not None, "SessionStore.run is not running"
        # settled apart from the request (its client may go away), and waited for: a gateway
        # killed after its response has lost no turn
        self._tg.start_soon(self._settle, s, stored, written, record)
        await self._stored(s)

    async def _settle(self, s: Session, stored: Callable[[], Awaitable[int]],
                      written: anyio.Event, record: SessionRecord) -> None:
        try:
            s.seq = await stored()
        except Exception as exc:
            self.write_failures += 1
            instruments.current.errors.add(1, {"code": ErrorCode.SESSION_WRITE_FAILED})
            log.error("session %r: its record was not stored (%s: %s); the session is read "
                      "back from the bus at its next turn", record.session_id,
                      type(exc).__name__, exc)
            s.forget()
            self.resize(s)
        finally:
            written.set()

    async def trajectory(self, session_id: str) -> Trajectory | None:
        s = self.entry(session_id)
        async with s.lock:
            await self.refresh(s)
            return s.fold.trajectory() if s.fold.turns else None

    async def end(self, session_id: str, reason: str) -> Session | None:
        """End a session (`finished`); None if it has no records. Ending an ended one is a
        no-op."""
        s = self.entry(session_id)
        async with s.lock:
            await self.refresh(s)
            if not s.fold.turns:
                return None
            if not s.fold.ended:
                end = SessionEnd(session_id=session_id, reason=reason, at=time.time())
                s.seq = await self.log.append(end, expect_last=s.seq)
                s.fold.apply(end)
                s.changes += 1
            return s

    async def sweep(self) -> int:
        """End the cached sessions idle past the timeout; returns how many."""
        cutoff = time.monotonic() - self.idle_timeout
        ended = 0
        for key, s in list(self._cache.items()):
            if s.touched > cutoff or self._busy(s):
                continue
            if self._cache.pop(key, None) is s:
                self.held_bytes -= s.nbytes
            ended += await self._expire(s)
        return ended

    async def _expire(self, s: Session) -> int:
        """Record that idle `s` ended; 1 if this did."""
        if not s.fold.turns or s.fold.ended:
            return 0
        try:
            await self.log.append(SessionEnd(session_id=s.session_id, reason="expired",
                                             at=time.time()), expect_last=s.seq)
        except SessionConflict:  # another gateway served it meanwhile: not idle
            return 0
        except Exception as exc:  # the bus down for a moment: it stays open, said
            log.warning("session %r: its expiry was not recorded (%s)", s.session_id, exc)
            return 0
        return 1

    async def _sweep_every(self, every: float) -> None:
        while True:
            await anyio.sleep(every)
            try:
                n = await self.sweep()
            except Exception as exc:  # the bus down for a moment: the next round retries
                log.warning("idle sessions not swept: %s", exc)
                continue
            if n:
                log.info("%d idle sessions expired", n)
