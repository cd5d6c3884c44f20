"""Counts kept under a fault (the chaos and partition tests): one `generate` call's results,
and every control call's outcome."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import nats

from rlfabric.bus import MembershipChanged, QuorumNotReached
from rlfabric.errors import RLFabricError
from rlfabric.schemas import FanoutReport, RolloutError, RolloutRequest
from rlfabric.trainer import FabricClient


class Tally:
    """Consume `fabric.generate(reqs)` (run `consume` in a task group) and keep how often each
    request id came back, the errors, and when each result arrived; `serving` is set at the
    first result."""

    def __init__(self, fabric: FabricClient, reqs: list[RolloutRequest], timeout: float) -> None:
        self.fabric = fabric
        self.reqs = reqs
        self.timeout = timeout
        self.got: Counter[str] = Counter()
        self.errors: list[RolloutError] = []
        self.arrivals: list[float] = []
        self.served_by: list[tuple[float, str]] = []  # (arrival, worker id) of each result
        #: the weight version of every span of every result
        self.versions: list[int] = []
        self.serving = anyio.Event()
        self._dropped_before = fabric.duplicates_dropped

    async def consume(self) -> None:
        await self._consume(self.reqs)

    async def consume_paced(self, size: int, every: float) -> None:
        """`consume`, the requests sent `size` at a time, one batch every `every` seconds
        (each its own `generate` call), so that they keep coming through a fault."""
        async with anyio.create_task_group() as tg:
            for k in range(0, len(self.reqs), size):
                tg.start_soon(self._consume, self.reqs[k:k + size])
                await anyio.sleep(every)

    async def _consume(self, reqs: list[RolloutRequest]) -> None:
        async for res in self.fabric.generate(reqs, timeout=self.timeout):
            self.arrivals.append(time.monotonic())
            self.served_by.append((self.arrivals[-1], getattr(res, "worker_id", "")))
            self.serving.set()
            self.got[res.request_id] += 1
            if isinstance(res, RolloutError):
                self.errors.append(res)
            else:
                self.versions += [sp.version for sp in res.version_spans]

    def assert_each_once(self) -> None:
        """No error, and every request's result exactly once."""
        assert not self.errors, self.errors[:3]
        assert len(self.got) == len(self.reqs) and set(self.got.values()) == {1}

    def first_after(self, t: float) -> float:
        """Seconds from `t` (a `time.monotonic()`) to the first result after it (nan: none)."""
        return min((a for a in self.arrivals if a >= t), default=float("nan")) - t

    def longest_gap(self) -> float:
        """The longest time between two results in a row (seconds)."""
        times = sorted(self.arrivals)
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    @property
    def results(self) -> int:
        return sum(self.got.values())

    @property
    def dropped(self) -> int:
        """Duplicates the client dropped since the tally began."""
        return self.fabric.duplicates_dropped - self._dropped_before


@dataclass
class Outcome:
    """One control call: what it was, when, and what came back (a report, or an error with
    the workers it names)."""

    op: str
    at: float
    ok: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    error: str = ""


@dataclass
class Commands:
    """Every control call a test makes, in order."""

    t0: float = field(default_factory=time.monotonic)
    log: list[Outcome] = field(default_factory=list)

    async def once(self, op: str, call: Callable[[], Awaitable[FanoutReport]]) -> Outcome:
        """`call()` once; its outcome logged and returned (an error is an outcome too)."""
        out = Outcome(op, round(time.monotonic() - self.t0, 2))
        try:
            rep = await call()
            out.ok, out.missing = tuple(sorted(rep.ok)), tuple(sorted(rep.missing))
        except QuorumNotReached as exc:
            out.ok, out.missing = tuple(sorted(exc.report.ok)), tuple(sorted(exc.report.missing))
            out.error = f"QuorumNotReached: {exc}"
        except MembershipChanged as exc:
            out.error = f"MembershipChanged: {exc}"
        except (RLFabricError, nats.errors.Error, TimeoutError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        self.log.append(out)
        return out

    async def until_ok(self, op: str, call: Callable[[], Awaitable[FanoutReport]],
                       timeout: float = 90) -> Outcome:
        """`call()` (a new command each time) until every worker acks it ok."""
        with anyio.fail_after(timeout):
            while True:
                out = await self.once(op, call)
                if not out.error:
                    return out
                await anyio.sleep(0.5)

    def table(self) -> str:
        return "\n".join(f"  {o.at:7.2f}s {o.op:<16} ok={','.join(o.ok) or '-'} "
                         f"missing={','.join(o.missing) or '-'}"
                         + (f" {o.error[:150]}" if o.error else "") for o in self.log)
