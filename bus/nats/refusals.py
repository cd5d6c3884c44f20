"""Permission refusals: a publish the server refuses this client comes back as an asynchronous
error, not as the publish's own failure; `Refusals.guard` turns it into `PermissionDenied` at
once instead of a timeout."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from rlfabric.bus.errors import TRANSIENT, PermissionDenied
from rlfabric.bus.nats.connect import Link
from rlfabric.concurrency import beside

T = TypeVar("T")


class Refusals:
    def __init__(self, link: Link) -> None:
        self.link = link
        self._cleared: set[str] = set()  # subjects a publish to went through

    def cleared(self, key: str) -> bool:
        """A call to `key` went through on this connection (its permission holds)."""
        return key in self._cleared

    async def guard(self, subject: str, call: Callable[[], Awaitable[T]], *,
                    cleared_as: str | None = None) -> T:
        """`await call()`, unless the server refuses this client `subject` meanwhile: then
        `PermissionDenied` at once. Once a call to `subject` went through, later calls run
        bare (permissions hold for the connection's life) and a refusal is looked for only
        when one fails. `cleared_as` names what went through instead of `subject` (a wildcard
        the role's permission names, for subjects that are each used once, such as one per
        session)."""
        since = time.monotonic()
        key = cleared_as or subject
        if key in self._cleared:
            try:
                return await call()
            except TRANSIENT:
                if (why := self.link.refusal(subject, since)) is not None:
                    raise denied(subject, why) from None
                raise

        async def watch() -> None:
            while True:
                refusals = self.link.refusals.event()
                why = self.link.refusal(subject, since)
                if why is not None:
                    raise denied(subject, why)
                await refusals.wait()

        async with beside(cancel_at_exit=True) as tg:
            tg.start_soon(watch)
            out = await call()
        if len(self._cleared) < 1024:
            self._cleared.add(key)
        return out


def denied(subject: str, why: str) -> PermissionDenied:
    return PermissionDenied(f"the NATS server refused this client publishing to {subject!r} "
                            f"({why}): its role may not; use the key of a role that may "
                            "(rlfabric nats --auth)", subject=subject)
