"""Credit-based pulling from a durable JetStream consumer.

nats-py's `fetch(batch, timeout)` lingers until the batch is full or the timeout ends, which
turns a trickle of requests into waits. `Puller` keeps pull requests outstanding for exactly
the credits it is given (a worker's free capacity) and hands each message over the moment it
lands. Every pull request expires after `expires` seconds; the server's 408 (or our own clock,
should the status be lost in a reconnect) returns its unused credits.

Reconnects: no pull request is sent while the connection is down (nats-py would buffer it and
send them all at once on reconnect: the server would then deliver several times the credits
given). After a reconnect every outstanding pull request counts as gone (a restarted server
lost them) and the credits are requested again at once, not at the old requests' expiry.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
from nats.aio.msg import Msg

from rlfabric.bus.session import Bus
from rlfabric.concurrency.sync import Signal, wait_any

log = logging.getLogger("rlfabric.bus.nats.pull")
#: pull requests in a row that expire unanswered before the owner is told (`on_silent`)
SILENT_PULLS = 2


@dataclass
class _Pull:
    credits: int
    deadline: float


class Puller:
    """Run with `await tg.start(puller.run)`; then `await puller.want(n)` keeps up to `n`
    messages requested. Each message goes to `on_message` (which must return quickly: start a
    task for the work); `outstanding` is what is requested and not yet delivered. `kick`, the
    owner's own signal (one event for its loop to wait on), fires when credits come back (a
    pull request expired or ended, the connection is back)."""

    def __init__(self, bus: Bus, stream: str, consumer: str,
                 on_message: Callable[[Msg], Awaitable[None]], *, kick: Signal,
                 expires: float = 2.0, on_silent: Callable[[str], None] | None = None) -> None:
        self.bus = bus
        #: told when pull requests in a row went unanswered (no message, no status): the
        #: server this client talks to may be cut off from the stream's leader
        self.on_silent = on_silent
        self._silent = 0
        self._next = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._on_message = on_message
        self.expires = expires
        self._pulls: deque[_Pull] = deque()
        self._inbox = bus.nc.new_inbox()
        self._kick = kick

    @property
    def outstanding(self) -> int:
        self._expire()
        return sum(p.credits for p in self._pulls)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pulls and self._pulls[0].deadline + 1.0 < now:
            self._pulls.popleft()  # its 408 never came (a reconnect): its credits are back
            self._silent += 1
            if self._silent == SILENT_PULLS and self.on_silent is not None:
                self.on_silent(f"{SILENT_PULLS} pull requests in a row got no answer")

    async def want(self, n: int) -> None:
        """Request more messages so that `n` are outstanding (never fewer than now). While the
        connection is down nothing is sent; `kick` fires once it is back."""
        more = n - self.outstanding
        if more <= 0 or not self.bus.nc.is_connected:
            return
        req = {"batch": more, "expires": int(self.expires * 1e9)}
        self._pulls.append(_Pull(more, time.monotonic() + self.expires))
        await self.bus.nc.publish(self._next, json.dumps(req).encode(), reply=self._inbox)

    async def _on_raw(self, msg: Msg) -> None:
        self._silent = 0
        status = (msg.headers or {}).get("Status")
        if status is None:
            if self._pulls:
                self._pulls[0].credits -= 1
                if self._pulls[0].credits <= 0:
                    self._pulls.popleft()
            await self._on_message(msg)
            return
        if status == "100":  # idle heartbeat
            return
        # 404 no messages, 408 request expired, 409 (leader change, too many waiting ...): the
        # oldest pull request is over; whatever it did not deliver is ours again
        if self._pulls:
            self._pulls.popleft()
        if status not in ("404", "408"):
            log.debug("pull request ended with %s %s", status,
                      (msg.headers or {}).get("Description", ""))
        self._kick.fire()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        sub = await self.bus.nc.subscribe(self._inbox, cb=self._on_raw)
        link = self.bus.link
        try:
            task_status.started()
            while True:  # our clock, in case a server status was lost; and reconnects
                reconnected = link.reconnected.event()
                await wait_any(reconnected, timeout=self.expires)
                if reconnected.is_set():
                    # pull requests died with the old connection (or the server): ask again
                    # now. Should the server have kept some, what they bring beyond the
                    # credits is handed back by the owner (see `RolloutServer`)
                    self._pulls.clear()
                    self._kick.fire()
                    continue
                before = len(self._pulls)
                self._expire()
                if len(self._pulls) != before:
                    self._kick.fire()
        finally:
            with anyio.CancelScope(shield=True):
                await sub.unsubscribe()
