"""Session affinity: the turns of a session go to the worker that holds its prefix in cache.

- The binding (session key -> the worker whose result ended its last turn) lives in the
  `<prefix>_affinity` KV bucket, read at every turn: every gateway replica and every
  `FabricClient` of the job routes a session the same way. It expires after
  `Limits.affinity_ttl` without a turn.
- A turn goes to its bound worker while that worker is a member ready to serve; a session with
  no binding (or whose worker left) goes to the least-loaded member (its reported load plus
  what this client sent it since). The worker itself says whether it has room.
- The request is offered to that worker on core NATS (`<prefix>.worker.<id>.offer`); it
  answers whether it took it. Refused (full, paused, draining), not answered within
  `offer_wait`, nobody there (a dead worker answers at once), or the bus in a reconnect: the
  request goes to the shared queue, persisted, for any worker. An offer carries the time it
  stops being valid, so a worker that reads it late does not serve it beside the queue's
  copy.
- A request a worker took lives with that worker: if the worker leaves membership before its
  result came, the client puts the request in the shared queue (`lost`); a worker that hands
  an offered request back puts it there itself. Either way its submission id makes the copies
  one request: the stream drops the second, the client keeps the first result.
- A request a worker took from the shared queue is told to its client (`pulled`): if that
  worker leaves before answering, the client queues it again at once (`lost_pulled`), not
  after the stream's ack wait; the first result of either copy is kept.
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
import time
from collections import Counter
from collections.abc import Callable

import anyio
import nats.errors
import nats.js.errors
from anyio.abc import TaskStatus

from rlfabric.bus.control.membership import MembershipWatcher
from rlfabric.bus.session import Bus
from rlfabric.concurrency import RateLimited, Signal
from rlfabric.schemas import WorkerInfo

#: seconds a worker has to answer an offer before the request goes to the shared queue
OFFER_WAIT = 1.0
#: the header of an offer: the unix time after which the worker must not take it
OFFER_UNTIL_HEADER = "rlf-offer-until"
TAKEN, BUSY = b"taken", b"busy"
log = logging.getLogger("rlfabric.bus")
_unbound = RateLimited(log)
_KEY = re.compile(r"[-_=A-Za-z0-9]{1,128}")


def affinity_key(session_id: str) -> str:
    """The session's key in the bucket: its id where KV takes it as one, else a digest."""
    if _KEY.fullmatch(session_id) and not session_id.startswith("h-"):
        return session_id
    return "h-" + hashlib.blake2b(session_id.encode(), digest_size=16).hexdigest()


class Affinity:
    def __init__(self, bus: Bus, watcher: MembershipWatcher, *,
                 offer_wait: float = OFFER_WAIT) -> None:
        self.bus = bus
        self.watcher = watcher
        self.offer_wait = offer_wait
        self.kv = bus.buckets.affinity
        #: request id -> the worker that took it, until its result comes
        self.taken: dict[str, str] = {}
        #: request id -> the worker that pulled it from the shared queue, until answered
        self.pulled: dict[str, str] = {}
        self._offered: Counter[str] = Counter()  # requests per worker sent, not answered
        #: turns routed: to their bound worker (bound), to another (moved: the bound one
        #: left; new: no binding), to the shared queue (queued: refused or unanswered)
        self.counts: Counter[str] = Counter()

    async def bound(self, session_key: str) -> str | None:
        """The worker the session is bound to (None: none, or the bucket cannot be read now:
        the turn then goes to the least-loaded worker)."""
        if self.kv is None:
            return None
        try:
            entry = await self.kv.get(session_key)
        except nats.js.errors.KeyNotFoundError:
            return None
        except Exception as exc:
            _unbound.warning("session %s: binding not read (%s: %s)", session_key,
                             type(exc).__name__, exc)
            return None
        return entry.value.decode() if entry.value else None

    async def bind(self, session_key: str, worker_id: str) -> None:
        """Bind the session to `worker_id`. Not stored (the bus busy): its next turn goes to
        the least-loaded worker, said once a while."""
        if self.kv is None:
            return
        try:
            await self.kv.put(session_key, worker_id.encode())
        except Exception as exc:
            _unbound.warning("session %s not bound to %s (%s: %s)", session_key, worker_id,
                             type(exc).__name__, exc)

    def choose(self, bound: str | None, n: int = 1) -> str | None:
        """The bound worker while it is a member (it says itself whether it has room: an
        offer it refuses goes to the shared queue), else the least-loaded member. `n`
        requests are counted against the worker chosen at once (`offer` gives back those it
        did not take), so sessions that start together spread."""
        members = {m.worker_id: m for m in self.watcher.snapshot().members
                   if m.state == "ready"}
        if bound in members:
            self.counts["bound"] += 1
            wid: str | None = bound
        elif not members:
            return None
        else:
            self.counts["moved" if bound else "new"] += 1
            wid = max(members.values(), key=lambda m: (self._room(m) / max(1, m.capacity),
                                                       random.random())).worker_id
        assert wid is not None
        self._offered[wid] += n
        return wid

    def _room(self, m: WorkerInfo) -> int:
        return m.capacity - m.in_flight - self._offered[m.worker_id]

    async def offer(self, worker_id: str, request_id: str, data: bytes,
                    headers: dict[str, str]) -> bool:
        """Whether `worker_id` (as `choose` gave it) took the request; False: it goes to the
        shared queue."""
        until = time.time() + self.offer_wait
        taken = False
        try:
            reply = await self.bus.nc.request(
                self.bus.subjects.offer(worker_id), data,
                headers={**headers, OFFER_UNTIL_HEADER: f"{until:.6f}"},
                timeout=self.offer_wait)
            taken = reply.data == TAKEN
            if not taken:
                self.counts["refused"] += 1
        except nats.errors.Error:  # timeout, nobody there, a reconnect: the queue takes it
            self.counts["unanswered"] += 1
        finally:
            if taken:
                self.taken[request_id] = worker_id
            else:
                self.release(worker_id)
        if not taken:
            self.counts["queued"] += 1
        return taken

    def release(self, worker_id: str) -> None:
        """Give back a count `choose` took for a request `worker_id` did not take."""
        self._offered[worker_id] -= 1
        if self._offered[worker_id] <= 0:
            del self._offered[worker_id]

    def answered(self, request_id: str) -> None:
        wid = self.taken.pop(request_id, None)
        if wid is not None:
            self.release(wid)
        self.pulled.pop(request_id, None)

    def held_by(self, request_id: str, worker_id: str) -> None:
        """`worker_id` took `request_id` from the shared queue."""
        if request_id not in self.taken:
            self.pulled[request_id] = worker_id

    async def run(self, lost: Callable[[list[str]], None],
                  lost_pulled: Callable[[list[str]], None] | None = None, *,
                  task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Hand `lost` the offered requests whose worker left before answering, and
        `lost_pulled` those it pulled from the queue, as it leaves."""
        joins_leaves = Signal()
        with self.watcher.firing_on_join_or_leave(joins_leaves):
            task_status.started()
            while True:
                changed = joins_leaves.event()
                self._rescue(lost, lost_pulled)
                await changed.wait()

    def _rescue(self, lost: Callable[[list[str]], None],
                lost_pulled: Callable[[list[str]], None] | None) -> None:
        alive = self.watcher.members
        gone = [rid for rid, wid in self.taken.items() if wid not in alive]
        pulled = [rid for rid, wid in self.pulled.items() if wid not in alive]
        for rid in gone:
            self.answered(rid)
        for rid in pulled:
            self.pulled.pop(rid, None)
        if gone:
            self.counts["rescued"] += len(gone)
            lost(gone)
        if pulled and lost_pulled is not None:
            self.counts["rescued"] += len(pulled)
            lost_pulled(pulled)
