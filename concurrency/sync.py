"""Small synchronisation helpers over anyio: a re-armable event, a wait on several events, and
a task group that raises its first real error as itself."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator

import anyio
from anyio.abc import TaskGroup


class Signal:
    """A re-armable event: `fire()` wakes everyone waiting on the event taken before it, and
    every `wait()` in progress."""

    def __init__(self) -> None:
        self._ev: anyio.Event | None = None  # made when first asked for: a fire nobody
        # waits on costs nothing (hot paths fire per message)
        self._timed: set[asyncio.Future[bool]] = set()

    def event(self) -> anyio.Event:
        if self._ev is None:
            self._ev = anyio.Event()
        return self._ev

    def fire(self) -> None:
        if self._ev is not None:
            self._ev.set()
            self._ev = None
        for fut in self._timed:
            if not fut.done():
                fut.set_result(True)

    async def wait(self, timeout: float) -> bool:
        """Until the next `fire()` (True) or for `timeout` seconds (False). A loop timer and a
        future, not a cancel scope: periodic loops (beats, polls) of many workers in one
        process wait this way, and a scope that runs out costs several times as much."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        timer = loop.call_later(timeout, _resolve, fut)
        self._timed.add(fut)
        try:
            return await fut
        finally:
            timer.cancel()
            self._timed.discard(fut)


def _resolve(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(False)


async def wait_any(*events: anyio.Event, timeout: float = math.inf) -> None:
    """Return when any of `events` is set, or after `timeout` seconds."""
    if len(events) == 1:  # no task group for the common case
        with anyio.move_on_after(timeout):
            await events[0].wait()
        return

    async def _one(ev: anyio.Event, scope: anyio.CancelScope) -> None:
        await ev.wait()
        scope.cancel()

    with anyio.move_on_after(timeout):
        async with anyio.create_task_group() as tg:
            for ev in events:
                tg.start_soon(_one, ev, tg.cancel_scope)


@contextlib.asynccontextmanager
async def beside(*, cancel_at_exit: bool = False) -> AsyncIterator[TaskGroup]:
    """A task group for work that runs beside the body of the `async with`.

    The first real error, of the body or of a task, is raised as itself, not inside an
    `ExceptionGroup`, so callers catch `QuorumNotReached` and friends by type; the others are
    cancelled. `cancel_at_exit=True`: tasks still running when the body ends are cancelled
    (helpers such as a prober); otherwise the body's end waits for them (work that must finish,
    such as a state write).
    """
    body_error: Exception | None = None
    try:
        async with anyio.create_task_group() as tg:
            try:
                yield tg
            except Exception as exc:  # raised below, outside the group
                body_error = exc
                tg.cancel_scope.cancel()
            if cancel_at_exit:
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # the body's error came first: the tasks' errors are what its cancellation caused
        raise (body_error or _first_real(group)) from None
    if body_error is not None:
        raise body_error


def _first_real(group: BaseExceptionGroup) -> BaseException:
    """The first leaf of `group` that is not a cancellation (the group itself if all are)."""
    cancelled = anyio.get_cancelled_exc_class()
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            leaf = _first_real(exc)
            if leaf is not exc:
                return leaf
        elif not isinstance(exc, cancelled):
            return exc
    return group
