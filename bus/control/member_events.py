"""Joins and leaves told to the events stream. Every client's membership watcher sees them,
and each sends a `MemberEvent` for every change it sees; the stream keeps one copy of each
(`Nats-Msg-Id`: the change, the worker and when it started), within its duplicate window."""

from __future__ import annotations

import contextlib
import time
from typing import Literal

import anyio
from anyio.abc import TaskStatus

from rlfabric.bus.control.membership import MembershipWatcher
from rlfabric.bus.session import Bus
from rlfabric.concurrency.sync import Signal
from rlfabric.schemas import MemberEvent, WorkerInfo


class MemberEvents:
    def __init__(self, bus: Bus, watcher: MembershipWatcher, source: str) -> None:
        self.bus = bus
        self.watcher = watcher
        self.source = source
        self._known: dict[str, WorkerInfo] = {}

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Started once the watcher has read the member set: the members that joined within
        the stream's duplicate window are told too (another client may have missed them), the
        rest are known."""
        changed = Signal()
        with self.watcher.firing_on_join_or_leave(changed):
            recent = time.time() - self.bus.limits.duplicate_window
            self._known = {w: i for w, i in self.watcher.members.items()
                           if i.started_at < recent}
            task_status.started()
            while True:
                event = changed.event()
                await self._tell()
                await event.wait()

    async def _tell(self) -> None:
        now = dict(self.watcher.members)
        for w, info in self._known.items():
            if now.get(w) is None or now[w].started_at != info.started_at:
                await self._emit("left", info)
        for w, info in now.items():
            if self._known.get(w) is None or self._known[w].started_at != info.started_at:
                await self._emit("joined", info)
        self._known = now

    async def _emit(self, change: Literal["joined", "left"], info: WorkerInfo) -> None:
        event = MemberEvent(source=self.source, worker_id=info.worker_id, change=change,
                            engine=info.engine, at=time.time())
        with contextlib.suppress(Exception):  # a lost event is no reason to stop watching
            await self.bus.emit(event, once=f"{change}.{info.worker_id}.{info.started_at!r}")
