"""The desired state (`<prefix>_state`): what this client last asked of the fleet. The pool's
trainer is the one writer of the pool's; a job's client of its job's (its adapters and pause,
`rlfabric.schemas.jobs`). Workers read them when they join.

Every write goes through `DesiredStateWriter`, which also owns taking a write back when the
call it stood for failed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec

from rlfabric.bus import Bus
from rlfabric.schemas import DesiredState


class DesiredStateWriter:
    def __init__(self, bus: Bus, state: DesiredState | None = None, *, job: str = "") -> None:
        self.bus = bus
        self.state = state or DesiredState()
        self.job = job

    async def load(self) -> DesiredState:
        """Start from what the bucket holds (a restarted trainer resumes its fleet's state)."""
        self.state = await self.bus.state.read(self.job)
        return self.state

    async def write(self, **changes: Any) -> DesiredState:
        self.state = msgspec.structs.replace(self.state, updated_at=time.time(), **changes)
        await self.bus.state.put(self.state, job=self.job)
        return self.state

    @contextlib.asynccontextmanager
    async def during(self, *, rollback: bool, **changes: Any) -> AsyncIterator[DesiredState]:
        """Write `changes` while the body runs (a worker joining meanwhile starts from the new
        state; only a connection's first write is a round trip before the body). If the body
        raises and `rollback`, the state from before is written back: the fleet never looks
        updated by a failed call."""
        before = self.state
        self.state = msgspec.structs.replace(before, updated_at=time.time(), **changes)
        try:
            async with self.bus.state.written(self.state, job=self.job):
                yield self.state
        except Exception:
            if rollback:
                self.state = before
                with anyio.CancelScope(shield=True):
                    await self.bus.state.put(before, job=self.job)
            raise
