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
- Parked messages go to the engine once they fit (`on_room`): each job's in the order they
  came, the jobs' in weighted fair order of their tokens (`FairQueue`).
- With several jobs, each keeps up to `depth(job)` messages parked or asked for beyond what
  the engine has room for, so that the fair order has each job's next message to choose.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import anyio

from rlfabric.concurrency.sync import Signal
from rlfabric.schemas import RolloutRequest
from rlfabric.worker.delivery import Delivery
from rlfabric.worker.fair import FairQueue, cost

Parked = tuple[Delivery, list[RolloutRequest]]
#: messages each job of weight 1 keeps parked or asked for while several jobs have work
#: (a job of weight w: w times as many, up to MAX_DEPTH)
DEPTH = 2
MAX_DEPTH = 16
#: seconds since a job's last message during which it counts as having work
ACTIVE_S = 2.0
#: seconds since a job's last message during which a worker keeps one request's room for it
#: (a job back from a trainer's step, or a light job between requests, starts at once)
KEEP_S = 30.0
#: seconds other jobs' messages may go first while the next in fair order does not fit
BLOCKED_S = 0.5


class Credits:
    def __init__(self, capacity: int, prefetch: int) -> None:
        self.capacity = capacity
        self.prefetch = prefetch
        self.in_flight = 0
        self.storing = 0
        self.parked = 0  # requests of the parked messages (counted in `in_flight` too)
        self._parked: FairQueue[Parked] = FairQueue()
        self.per_msg: float | None = None  # requests per message (None: none seen yet)
        self._seen: dict[str, float] = {}  # when a message of each job last came
        self._backlog: dict[str, bool] = {}  # whether more of each job's waited then
        self._blocked = 0.0  # since when the next parked message has not fit (0: it fits)
        #: several jobs are pulled for (`JobPulls`): the engine takes the next message in fair
        #: order as soon as one request's room is free
        self.several = False
        #: requests of a job the engine samples for now (`JobScopes.generating`)
        self.running_of: Callable[[str], int] = lambda job: 0
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

    def fits(self, n: int, job: str = "") -> bool:
        """Whether `n` more requests of `job` go to the engine now (an idle engine takes any
        message). With several jobs, whether some of them do (`room`)."""
        if self.several:
            return self.room_for(job) > 0
        running = self.engaged - self.parked
        return running == 0 or running + n <= self.capacity

    def room_for(self, job: str) -> int:
        """Requests of `job` the engine takes now, with several jobs: its free room, less one
        request's for each other job with work in the last `KEEP_S` and none here (its next
        request starts at once, not when a batch of others ends)."""
        running = self.engaged - self.parked
        now = time.monotonic()
        kept = sum(1 for j, t in self._seen.items() if j != job and now - t < KEEP_S
                   and not self.running_of(j) and not self._parked.count(j))
        return self.capacity - running - min(kept, self.capacity // 4) if running else \
            self.capacity

    def want(self, *, storing: bool = False) -> int:
        """Pull credits (messages) to keep out now; `storing`: requests whose results are
        being stored count too, beyond one capacity's worth (several jobs: what the worker
        takes in is what it serves, so the jobs' queues stay in the server, where each job's
        part of the credits decides whose go next)."""
        if self.per_msg is None:
            return 1
        free = self.capacity + self.prefetch - self.engaged
        if storing:
            free = min(free, 2 * self.capacity + self.prefetch - self.in_flight)
        fit = int(free // max(1.0, self.per_msg))
        return max(fit, 1) if self.engaged == 0 else fit

    def came(self, n: int, job: str = "", pending: int = 0) -> None:
        """A message of `n` requests of `job` was delivered (taken or not), with `pending`
        more of the job's waiting in the server."""
        self._seen[job] = time.monotonic()
        self._backlog[job] = pending > 0
        per = self.per_msg
        if per is None:  # the first message: now the pull loop knows what fits
            self.per_msg = n
            self.room.fire()
        else:
            self.per_msg = per + 0.2 * (n - per)

    @property
    def weights(self) -> dict[str, float]:
        """Each job's weight (`JobShare.weight`; 1 for a job not named)."""
        return self._parked.weights

    def depth(self, job: str) -> int:
        """Messages `job` may keep parked or asked for beyond the engine's room."""
        w = self._parked.weights
        least = min((x for x in w.values() if x > 0), default=1.0)
        return min(MAX_DEPTH, max(1, math.ceil(DEPTH * w.get(job, 1.0) / min(least, 1.0))))

    def want_for(self, job: str, jobs: int) -> int:
        """Pull credits (messages) to keep out for `job`, one of `jobs` pulled from: a job
        with no message lately one (to see whether it has work); one with, at least its
        depth, and if more of its requests wait in the server, its weight's part of the
        engine's free room among the jobs whose requests wait."""
        if jobs == 1:
            return self.want()
        now = time.monotonic()
        if now - self._seen.get(job, -ACTIVE_S) >= ACTIVE_S:
            return 1
        depth = self.depth(job) - self._parked.count(job)
        if not self._backlog.get(job):
            return depth
        waiting = {j: self.weights.get(j, 1.0) for j, more in self._backlog.items()
                   if more and now - self._seen.get(j, -ACTIVE_S) < ACTIVE_S}
        part = math.ceil(self.want(storing=True) * waiting[job] /
                         max(sum(waiting.values()), 1e-9))
        return max(part, depth)

    def may_park(self, job: str, n: int, jobs: int) -> bool:
        """Whether a message of `n` requests of `job` (one of `jobs` pulled from) that does
        not go to the engine now may wait here."""
        return self.parked + n <= self.prefetch or \
            (jobs > 1 and (self._parked.count(job) < self.depth(job) or self.fits(n, job)))

    def should_park(self, n: int, job: str = "") -> bool:
        """Whether a message waits in the fair order (with several jobs, each does: it may
        go in parts) rather than straight to the engine."""
        return self.several or self.parked > 0 or not self.fits(n, job)

    def took(self, d: Delivery, reqs: list[RolloutRequest], *, park: bool) -> None:
        """A message's requests are in flight now; parked (prefetch) or on their way in."""
        self.in_flight += len(reqs)
        self._idle = anyio.Event()
        self.load.fire()  # a message at a time: the fleet sees the load it took
        job = reqs[0].job if reqs else ""
        if park:
            self._parked.push(job, (d, reqs), cost(reqs))
            self.parked += len(reqs)
        else:
            self._parked.charge(job, cost(reqs))

    def unpark(self) -> list[Parked]:
        """Parked messages that fit now, in fair order (out of the queue). While the next
        one does not fit, others that do go first, for `BLOCKED_S` at most: then nothing
        more goes in until it fits (the engine empties for it, if it must)."""
        out = []
        while (head := self._parked.head()) is not None:
            job = head[0]
            if not self.fits(len(head[1][1]), job):
                now = time.monotonic()
                self._blocked = self._blocked or now
                other = self._parked.head(lambda p: self.fits(len(p[1]), p[1][0].job)) \
                    if now - self._blocked < BLOCKED_S else None
                if other is None:
                    break
                job = other[0]
            else:
                self._blocked = 0.0
            if self.several:
                out.append(self._part(job))
                continue
            d, reqs = self._parked.pop(job)
            self.parked -= len(reqs)
            out.append((d, reqs))
        return out

    def _part(self, job: str) -> Parked:
        """As many of `job`'s next message's requests as there is room for; the rest wait at
        the head of its queue. A message split once goes in parts to the end."""
        (d, reqs), tokens = self._parked.take(job)
        whole = d.whole or d
        k = min(len(reqs), self.room_for(job))
        now, rest = reqs[:k], reqs[k:]
        self._parked.charge(job, cost(now))
        self.parked -= k
        if rest:
            self._parked.push_front(job, (whole, rest), tokens - cost(now))
        elif not whole.parts:  # whole, as it came
            return d, reqs
        return whole.part(k, len(rest)), now

    def take_parked(self) -> list[Parked]:
        """Every parked message, out of the queue (its requests stay in flight until each is
        `done`)."""
        out, self.parked = self._parked.take_all(), 0
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
