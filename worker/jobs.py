"""Per job (`rlfabric.schemas.jobs`): whether its requests are held by its pause, and the
serving of its requests in flight, counted and cancellable.

A job's pause holds its requests only: `wait` lets those in flight finish first, `abort` ends
them now (their messages go back to the stream and are sampled again once the job resumes),
`keep` lets them run on (on the adapter version each started under; their spans say which).
Requests that arrive while the job is paused go back to the stream and come again within a
second of the resume.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, deque
from collections.abc import Awaitable, Iterator

import anyio
import anyio.lowlevel

from rlfabric.schemas import PauseMode

#: seconds between two refreshes of the last minute's tokens in the members key (a key
#: write each)
TOKENS_EVERY = 10.0


class TokenWindow:
    """Tokens served by job over the last `span` seconds, in one-second buckets."""

    def __init__(self, span: int = 60) -> None:
        self.span = span
        self._buckets: deque[tuple[int, Counter[str]]] = deque()
        self._snapshot: tuple[float, dict[str, int]] = (-TOKENS_EVERY, {})

    def snapshot(self) -> dict[str, int]:
        """`totals()`, taken again every `TOKENS_EVERY` seconds at most."""
        if time.monotonic() - self._snapshot[0] >= TOKENS_EVERY:
            self._snapshot = (time.monotonic(), self.totals())
        return self._snapshot[1]

    def add(self, job: str, tokens: int) -> None:
        now = int(time.monotonic())
        if not self._buckets or self._buckets[-1][0] != now:
            self._buckets.append((now, Counter()))
            self._trim(now)
        self._buckets[-1][1][job] += tokens

    def _trim(self, now: int) -> None:
        while self._buckets and self._buckets[0][0] <= now - self.span:
            self._buckets.popleft()

    def totals(self) -> dict[str, int]:
        self._trim(int(time.monotonic()))
        out: Counter[str] = Counter()
        for _, c in self._buckets:
            out.update(c)
        return dict(out)


class JobScopes:
    def __init__(self) -> None:
        #: tokens served in the last minute, by job
        self.tokens = TokenWindow()
        #: paused jobs and how
        self.paused: dict[str, PauseMode] = {}
        #: jobs ended by the pool's operator (`Shutdown(job=...)`): their requests are refused
        self.ended: set[str] = set()
        self._running: dict[str, dict[anyio.CancelScope, int]] = {}
        self._generated: dict[anyio.CancelScope, int] = {}  # requests with every sample out
        self._idle: dict[str, anyio.Event] = {}

    def held(self, job: str) -> bool:
        return job in self.paused

    def in_flight(self) -> dict[str, int]:
        """Requests being served, by job (the default job's under "")."""
        return {job: sum(running.values()) for job, running in self._running.items()}

    def generating(self, job: str) -> int:
        """Requests of `job` the engine still samples for (not those whose results are
        being stored)."""
        return sum(n - self._generated.get(s, 0) for s, n in self._running.get(job, {}).items())

    def generated(self, scope: anyio.CancelScope, requests: int = 1) -> None:
        """`requests` served under `scope` (from `serving`) have every sample generated."""
        self._generated[scope] = self._generated.get(scope, 0) + requests

    @contextlib.contextmanager
    def serving(self, job: str, requests: int = 1) -> Iterator[anyio.CancelScope]:
        """The engine serving `requests` of job `job`: cancelled by the job's `abort` pause
        (`cancelled_caught` then says so)."""
        scope = anyio.CancelScope()
        running = self._running.setdefault(job, {})
        running[scope] = requests
        try:
            with scope:
                yield scope
        finally:
            del running[scope]
            self._generated.pop(scope, None)
            if not running:
                del self._running[job]
                idle = self._idle.pop(job, None)
                if idle is not None:
                    idle.set()

    def pause(self, job: str, mode: PauseMode) -> Awaitable[None]:
        """Hold job `job`'s requests now (an `abort` cancels those running); what this returns
        is awaited until none of them runs (`keep`: at once)."""
        self.paused[job] = mode
        if mode == "abort":
            for scope in list(self._running.get(job, ())):
                scope.cancel()
        return self._idle_of(job) if mode != "keep" else anyio.lowlevel.checkpoint()

    async def _idle_of(self, job: str) -> None:
        while job in self._running:
            await self._idle.setdefault(job, anyio.Event()).wait()

    def end(self, job: str) -> None:
        """End job `job`: its running requests are cancelled (their messages go back, and
        are then refused as every later one of the job)."""
        self.ended.add(job)
        self.paused.pop(job, None)
        for scope in list(self._running.get(job, ())):
            scope.cancel()

    def resume(self, job: str) -> bool:
        """Serve job `job`'s requests again; whether it was paused."""
        return self.paused.pop(job, None) is not None
