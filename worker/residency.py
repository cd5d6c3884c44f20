"""Which adapters an engine holds, within its `--max-adapters`: a new one evicts the least
recently used that no admitted request holds; an evicted adapter is loaded again from the
desired state when a request names it (`WeightSync.reload`), its digest verified as at any
load. A request for a known adapter therefore never fails for capacity: it waits for the
reload, and for a held one to free if every one is held. A push finds no room only while every
adapter held serves a request: it fails at once (`adapter_limit`) rather than hold the worker's
commands (a resume among them) behind requests that may be frozen by a `keep` pause.

Requests pin the adapter they were admitted under until their message is done, so a reload
for another request cannot evict it between admission and generation.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable

import anyio


class Residency:
    def __init__(self, limit: int) -> None:
        #: adapter names the engine holds at most (0: not managed here)
        self.limit = limit
        self._recent: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._pins: Counter[str] = Counter()
        self._freed = anyio.Event()
        self.evicted = 0
        self.reloaded = 0
        #: seconds each reload took to fetch, verify and load (not its wait for the loading
        #: lock), newest last (for `describe` and the bench)
        self.reload_s: list[float] = []

    def touch(self, key: str) -> None:
        self._recent[key] = None
        self._recent.move_to_end(key)

    def pin(self, key: str) -> None:
        self._pins[key] += 1
        self.touch(key)

    def unpin(self, key: str) -> None:
        self._pins[key] -= 1
        if self._pins[key] <= 0:
            del self._pins[key]
            self._freed.set()
            self._freed = anyio.Event()

    def freed(self) -> anyio.Event:
        """Set when a request next lets go of its adapter."""
        return self._freed

    async def make_room(self, key: str, held: Callable[[], dict[str, tuple[int, ...]]],
                        unload: Callable[[str], Awaitable[bool]]) -> bool:
        """Before `key` is loaded: while the engine holds `limit` other adapters, unload the
        least recently used one no request holds. False (nothing unloaded past that) if every
        one serves a request now."""
        if self.limit < 1:
            return True
        while key not in (names := held()) and len(names) >= self.limit:
            victim = next((k for k in [*self._recent, *names] if k in names
                           and not self._pins[k]), None)
            if victim is None:
                return False
            await unload(victim)
            self._recent.pop(victim, None)
            self.evicted += 1
        self.touch(key)
        return True

    def forget(self, key: str) -> None:
        self._recent.pop(key, None)

    def describe(self) -> dict[str, str]:
        """What `describe` reports of it (nothing where the engine's limit is not managed)."""
        if not self.limit:
            return {}
        return {"adapters_evicted": str(self.evicted), "adapters_reloaded": str(self.reloaded),
                "reload_ms": ",".join(f"{1e3 * t:.1f}" for t in self.reload_s[-200:])}
