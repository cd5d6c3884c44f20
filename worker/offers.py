"""Requests offered to this worker directly (session affinity, core NATS
`<prefix>.worker.<id>.offer`): taken when there is room and the offer is still valid, served
like a pulled one; handed back, it goes to the shared queue, stored."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import cast

import anyio
from nats.aio.msg import Msg

from rlfabric.bus import Bus
from rlfabric.bus.rollouts.affinity import BUSY, OFFER_UNTIL_HEADER, TAKEN

_FIRST_DELIVERY = SimpleNamespace(num_delivered=1)


class Offered:
    """A request offered to this worker as the serving path sees a message it pulled: acking
    it is nothing, and handed back it goes to the shared queue, stored (its `Nats-Msg-Id`
    makes it one with a copy the client queues)."""

    def __init__(self, bus: Bus, msg: Msg) -> None:
        self.bus = bus
        self.data = msg.data
        self.headers = {k: v for k, v in (msg.headers or {}).items() if k != OFFER_UNTIL_HEADER}
        self.subject = bus.subjects.rollout_request
        self.metadata = _FIRST_DELIVERY

    async def ack(self) -> None:
        pass

    async def in_progress(self) -> None:
        pass

    async def term(self) -> None:
        pass

    async def nak(self, delay: float | None = None) -> None:
        del delay  # the queue's workers take it when they can
        await self.bus.persist(self.subject, self.data, self.headers)


@contextlib.asynccontextmanager
async def offers(bus: Bus, worker_id: str, take: Callable[[Msg], Awaitable[None]],
                 has_room: Callable[[], bool]) -> AsyncIterator[None]:
    """While the block runs, offered requests are answered `TAKEN` and handed to `take` when
    `has_room()` and the offer is still valid, else `BUSY` (the client queues them)."""
    async def on_offer(msg: Msg) -> None:
        try:
            until = float((msg.headers or {}).get(OFFER_UNTIL_HEADER) or 0)
        except ValueError:
            until = 0.0
        if not has_room() or time.time() > until:
            with contextlib.suppress(Exception):
                await msg.respond(BUSY)
            return
        try:
            await msg.respond(TAKEN)
        except Exception:  # the client is gone: it queued the request, or nobody waits
            return
        # NOTE: duck-typed as a pulled message: the serving path acks, naks, reads headers
        await take(cast(Msg, Offered(bus, msg)))

    sub = await bus.nc.subscribe(bus.subjects.offer(worker_id), cb=on_offer)
    try:
        yield
    finally:
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await sub.unsubscribe()
