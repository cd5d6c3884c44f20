"""Sessions as one gateway holds them: a cache of folded session logs over the bus, so a turn
costs one read (the session's last sequence) when this gateway served the previous one, and a
catch-up read of what it missed when another gateway did, or after a restart.

A turn holds its session's lock from planning to recording, so two requests of one session to
one gateway are served one after the other; across gateways the conditional append refuses the
second (`SessionConflict`). Idle sessions end (`SessionEnd(reason="expired")`) after the idle
timeout; the cache keeps at most `max_cached` sessions (an evicted one is read back from the
bus when it comes again).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

import anyio

from rlfabric.bus import Bus
from rlfabric.bus.sessions import SessionConflict, SessionLog, session_key
from rlfabric.schemas import SessionEnd, SessionFold, SessionRecord, Trajectory

log = logging.getLogger("rlfabric.gateway")


@dataclass(eq=False)
class Session:
    session_id: str
    key: str
    seq: int = 0  # the last record applied to `fold`
    fold: SessionFold = field(default_factory=SessionFold)
    #: `decode(fold.prompt)`, where known (the last turn's full render)
    prompt_text: str | None = None
    #: the text of the choices the session returned (`splice.raw_text`'s cache)
    texts: dict[tuple[bytes, bytes, str], str] = field(default_factory=dict)
    touched: float = field(default_factory=time.monotonic)
    lock: anyio.Lock = field(default_factory=anyio.Lock)

    @property
    def new(self) -> bool:
        return self.fold.last is None


class SessionStore:
    def __init__(self, bus: Bus, *, idle_timeout: float = 3600.0,
                 max_cached: int = 10_000) -> None:
        self.log = SessionLog(bus)
        self.idle_timeout = idle_timeout
        self.max_cached = max_cached
        self._cache: collections.OrderedDict[str, Session] = collections.OrderedDict()

    def _entry(self, session_id: str) -> Session:
        key = session_key(session_id)
        s = self._cache.get(key)
        if s is None:
            s = self._cache[key] = Session(session_id, key)
            while len(self._cache) > self.max_cached:
                old_key, old = next(iter(self._cache.items()))
                if old.lock.locked():  # in use: keep it
                    self._cache.move_to_end(old_key)
                    break
                del self._cache[old_key]
        else:
            self._cache.move_to_end(key)
        s.touched = time.monotonic()
        return s

    def local(self, session_id: str) -> Session:
        """A session of one turn that nobody continues: nothing to read."""
        return Session(session_id, session_key(session_id))

    async def open(self, session_id: str) -> Session:
        """The session with every stored record applied (caller holds `lock` for a turn)."""
        s = self._entry(session_id)
        await self._catch_up(s)
        return s

    async def _catch_up(self, s: Session) -> None:
        seq, _ = await self.log.last(s.key)
        if seq == s.seq:
            return
        if seq < s.seq:  # the stream lost records (purged, aged out): read it all again
            s.seq, s.fold, s.prompt_text = 0, SessionFold(), None
        for rseq, record in await self.log.read(s.key, after=s.seq):
            s.fold.apply(record)
            s.seq = rseq
        s.prompt_text = None

    async def record(self, s: Session, record: SessionRecord, *,
                     prompt_text: str | None = None) -> None:
        """Append `record` after what `s` has seen, then apply it; `SessionConflict` if another
        gateway appended first."""
        seq = await self.log.append(record, expect_last=s.seq)
        s.fold.apply(record)
        s.seq = seq
        s.prompt_text = prompt_text

    async def trajectory(self, session_id: str) -> Trajectory | None:
        s = self._entry(session_id)
        async with s.lock:
            await self._catch_up(s)
            return s.fold.trajectory() if s.fold.turns else None

    async def end(self, session_id: str, reason: str) -> Session | None:
        """End a session (`finished`); None if it has no records. Ending an ended one is a
        no-op."""
        s = self._entry(session_id)
        async with s.lock:
            await self._catch_up(s)
            if not s.fold.turns:
                return None
            if not s.fold.ended:
                await self.record(s, SessionEnd(session_id=session_id, reason=reason,
                                                at=time.time()))
            return s

    async def sweep(self) -> int:
        """End the cached sessions idle past the timeout; returns how many."""
        cutoff = time.monotonic() - self.idle_timeout
        ended = 0
        for key, s in list(self._cache.items()):
            if s.touched > cutoff or s.lock.locked():
                continue
            if s.fold.turns and not s.fold.ended:
                try:
                    await self.record(s, SessionEnd(session_id=s.session_id, reason="expired",
                                                    at=time.time()))
                    ended += 1
                except SessionConflict:  # another gateway served it meanwhile: not idle
                    pass
            self._cache.pop(key, None)
        return ended

    async def run_sweeper(self, every: float) -> None:
        while True:
            await anyio.sleep(every)
            try:
                n = await self.sweep()
            except Exception as exc:  # the bus down for a moment: the next round retries
                log.warning("idle sessions not swept: %s", exc)
                continue
            if n:
                log.info("%d idle sessions expired", n)
