"""The rollout server's counts, in one owner: requests in flight, those whose samples are all
generated (their results being stored), messages taken beyond capacity (parked, prefetch),
and how many pull credits fit.

- A request whose every sample is generated leaves the engine room while its results are
  stored (`engaged` does not count it): the next request is pulled meanwhile, so it is in
  hand when the store ends.
- Credits are messages; a message brings `per_msg` requests on average (a moving average):
  as many credits as fit are asked for (one, whatever its size, when idle). Until the first
  message tells how big they come, one: an idle worker of capacity 100 that asked for 100
  credits took two 50-request messages and handed 5 back to the stream.
- Parked messages go to the engine in the order they came, once they fit (`on_room`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import anyio

from rlfabric.concurrency.sync import Signal
from rlfabric.schemas import RolloutRequest
from rlfabric.worker.delivery import Delivery

Parked = tuple[Delivery, list[RolloutRequest]]


class Credits:
    def __init__(self, capacity: int, prefetch: int) -> None:
        self.capacity = capacity
        self.prefetch = prefetch
        self.in_flight = 0
        self.storing = 0
        self.parked = 0  # requests of the parked messages (counted in `in_flight` too)
        self._parked: deque[Parked] = deque()
        self.per_msg: float | None = None  # requests per message (None: none seen yet)
        #: credit came back (a request done or generated, a message refused): pull again
        self.room = Signal()
        self.load = Signal()  # a message taken, or nothing in flight any more
        self._idle = anyio.Event()  # set while nothing is in flight
        self._idle.set()
        #: called when the engine has room again (parked messages may fit now)
        self.on_room: Callable[[], None] = lambda: None

    @property
    def engaged(self) -> int:
        """Requests in flight the engine still generates for: what an offer or a message
        counts against capacity (a request whose results are being stored is not: its next
        turn may come before the store's acknowledgement does)."""
        return self.in_flight - self.storing

    def fits(self, n: int) -> bool:
        """Whether `n` more requests go to the engine now (an idle engine takes any message)."""
        running = self.engaged - self.parked
        return running == 0 or running + n <= self.capacity

    def want(self) -> int:
        """Pull credits (messages) to keep out now."""
        if self.per_msg is None:
            return 1
        free = self.capacity + self.prefetch - self.engaged
        fit = int(free // max(1.0, self.per_msg))
        return max(fit, 1) if self.engaged == 0 else fit

    def came(self, n: int) -> None:
        """A message of `n` requests was delivered (taken or not)."""
        per = self.per_msg
        if per is None:  # the first message: now the pull loop knows what fits
            self.per_msg = n
            self.room.fire()
        else:
            self.per_msg = per + 0.2 * (n - per)

    def should_park(self, n: int) -> bool:
        return self.parked > 0 or not self.fits(n)

    def took(self, d: Delivery, reqs: list[RolloutRequest], *, park: bool) -> None:
        """A message's requests are in flight now; parked (prefetch) or on their way in."""
        self.in_flight += len(reqs)
        self._idle = anyio.Event()
        self.load.fire()  # a message at a time: the fleet sees the load it took
        if park:
            self._parked.append((d, reqs))
            self.parked += len(reqs)

    def unpark(self) -> list[Parked]:
        """Parked messages that fit now, in the order they came (out of the queue)."""
        out = []
        while self._parked and self.fits(len(self._parked[0][1])):
            d, reqs = self._parked.popleft()
            self.parked -= len(reqs)
            out.append((d, reqs))
        return out

    def take_parked(self) -> list[Parked]:
        """Every parked message, out of the queue (its requests stay in flight until each is
        `done`)."""
        out, self._parked, self.parked = list(self._parked), deque(), 0
        return out

    def generated(self, requests: int = 1) -> None:
        """`requests` in flight have every sample generated: the engine has room for as many
        more while their results are stored."""
        self.storing += requests
        self.on_room()
        self.room.fire()

    def done(self, generated: bool = False) -> None:
        """A request's capacity is free again (its results stored, or it was answered);
        `generated`: it was counted by `generated`."""
        self.in_flight -= 1
        if generated:
            self.storing -= 1
        self.on_room()
        self.room.fire()
        if self.in_flight == 0:
            self._idle.set()
            self.load.fire()  # idle: said at once too

    async def wait_idle(self) -> None:
        """Return once nothing is in flight."""
        while self.in_flight:
            idle = self._idle
            await idle.wait()
