"""Workers gone quiet mid-work. A worker whose token deltas to this client stop while it holds
unfinished samples of ours is pinged then (`MembershipWatcher.suspect`), not once it is unheard
for `member_ttl`: a SIGKILLed worker's connection closes with it, so "no responders" names it
gone in one round trip, and its samples go on elsewhere from their tokens (`Awaited.lost`). A
worker that answers (paused, in a long prefill) stays; one cut off by a partition is left to
membership's own timeouts.

Quiet means silent for `QUIET_GAPS` of its usual gaps between deltas (a streamed sample's
deltas come every step, other samples' every `PROGRESS_TOKENS`), at least `MIN_QUIET_S`."""

from __future__ import annotations

import time

import anyio

from rlfabric.bus.control.membership import MembershipWatcher
from rlfabric.bus.rollouts.awaited import Awaited

#: a worker is quiet after this many of its usual gaps between deltas to this client
QUIET_GAPS = 8
#: seconds of silence below which no worker counts as quiet
MIN_QUIET_S = 0.1


class QuietWorkers:
    """Run with `tg.start_soon(q.run)`; it hears of deltas through `awaited.on_worker`."""

    def __init__(self, awaited: Awaited, watcher: MembershipWatcher) -> None:
        self.watcher = watcher
        self._awaited = awaited
        self._last: dict[str, float] = {}  # worker -> when its last delta came
        self._gap: dict[str, float] = {}  # worker -> its usual gap between deltas (moving mean)
        self._asked: dict[str, int] = {}  # times pinged since its last delta (each waits longer)
        self._heard = anyio.Event()
        awaited.on_worker = self.heard

    def heard(self, worker: str) -> None:
        now = time.monotonic()
        last = self._last.get(worker)
        if self._asked.pop(worker, 0):
            pass  # the gap since includes the spell it was asked about: not usual
        elif last is not None:
            gap = now - last
            self._gap[worker] = 0.8 * self._gap.get(worker, gap) + 0.2 * gap
        self._last[worker] = now
        self._heard.set()

    def quiet_after(self, worker: str) -> float:
        """Silence that makes `worker` quiet; doubled each time it answered (paused, say)."""
        usual = max(MIN_QUIET_S, QUIET_GAPS * self._gap.get(worker, 0.0))
        ttl = float(self.watcher.bus.buckets.member_ttl)
        return min(usual * (1 << min(self._asked.get(worker, 0), 16)), ttl)

    def quiet(self) -> list[str]:
        """The workers quiet now that hold unfinished samples of ours (each named once a quiet
        spell); those that hold none are forgotten until their next delta."""
        now = time.monotonic()
        quiet = [w for w, t in self._last.items() if now - t >= self.quiet_after(w)]
        if not quiet:
            return []
        holding = self._awaited.holders()
        for w in quiet:
            if w in holding:
                self._last[w] = now
                self._asked[w] = self._asked.get(w, 0) + 1
            else:
                del self._last[w]
                self._gap.pop(w, None)
                self._asked.pop(w, None)
        return [w for w in quiet if w in holding]

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            while True:
                if not self._last:
                    self._heard = anyio.Event()
                    await self._heard.wait()
                await anyio.sleep(MIN_QUIET_S / 4)
                for worker in self.quiet():
                    tg.start_soon(self.watcher.suspect, worker)
