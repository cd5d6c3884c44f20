"""Small synchronisation helpers over anyio events."""

from __future__ import annotations

import math

import anyio


class Signal:
    """A re-armable event: `fire()` wakes everyone waiting on the event taken before it."""

    def __init__(self) -> None:
        self._ev = anyio.Event()

    def event(self) -> anyio.Event:
        return self._ev

    def fire(self) -> None:
        self._ev.set()
        self._ev = anyio.Event()


async def wait_any(*events: anyio.Event, timeout: float = math.inf) -> None:
    """Return when any of `events` is set, or after `timeout` seconds."""

    async def _one(ev: anyio.Event, scope: anyio.CancelScope) -> None:
        await ev.wait()
        scope.cancel()

    with anyio.move_on_after(timeout):
        async with anyio.create_task_group() as tg:
            for ev in events:
                tg.start_soon(_one, ev, tg.cancel_scope)
