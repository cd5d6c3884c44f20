"""What the chaos tests share: a tally of one `generate` call's results under a fault."""

from __future__ import annotations

import time
from collections import Counter

import anyio
import pytest

from rlfabric.schemas import RolloutError, RolloutRequest
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
        self.serving = anyio.Event()
        self._dropped_before = fabric.duplicates_dropped

    async def consume(self) -> None:
        async for res in self.fabric.generate(self.reqs, timeout=self.timeout):
            self.arrivals.append(time.monotonic())
            self.serving.set()
            self.got[res.request_id] += 1
            if isinstance(res, RolloutError):
                self.errors.append(res)

    def assert_each_once(self) -> None:
        """No error, and every request's result exactly once."""
        assert not self.errors, self.errors[:3]
        assert len(self.got) == len(self.reqs) and set(self.got.values()) == {1}

    def first_after(self, t: float) -> float:
        """Seconds from `t` (a `time.monotonic()`) to the first result after it (nan: none)."""
        return min((a for a in self.arrivals if a >= t), default=float("nan")) - t

    @property
    def results(self) -> int:
        return sum(self.got.values())

    @property
    def dropped(self) -> int:
        """Duplicates the client dropped since the tally began."""
        return self.fabric.duplicates_dropped - self._dropped_before


@pytest.fixture
def tally() -> type[Tally]:
    return Tally
