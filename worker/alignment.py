"""Whether a worker serves the fleet's desired policy, and getting back onto it.

A worker takes new requests only while it holds the desired state's base policy. A command
keeps it there; what can take it off without a word is the bus: a connection that dropped, a
server cut off from the rest of its cluster (pull requests and stream reads go unanswered, the
membership key is not written). Any of those is a doubt: the worker takes nothing new
(`WorkerStatus.behind`; in-flight requests finish), then reads and applies every command
stored meanwhile, reads the desired state, loads it if it holds another policy, and serves
again once it holds it. A desired policy it cannot load (pushed over a collective, or a
payload that is gone with its trainer) keeps it out, said in its membership (`behind`), until
a push brings it. A trainer that takes a failed push back rolls the desired state back too, so
a worker that applied the failed version is off it and goes back the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import TaskStatus

from rlfabric.bus import Bus, CommandReceiver
from rlfabric.bus.errors import READ_FAILED
from rlfabric.concurrency.sync import Signal
from rlfabric.schemas import DesiredState
from rlfabric.worker.policies import desired_policy
from rlfabric.worker.state import WorkerStatus
from rlfabric.worker.weights import WeightSync

log = logging.getLogger("rlfabric.worker")
#: seconds between checks while the worker cannot get back onto the desired policy (at most)
RETRY_MAX_S = 5.0


class Alignment:
    def __init__(self, bus: Bus, receiver: CommandReceiver, weights: WeightSync,
                 status: WorkerStatus, publish: Callable[[], Awaitable[None]],
                 worker_id: str) -> None:
        self.bus = bus
        self.receiver = receiver
        self.weights = weights
        self.status = status
        self.publish = publish
        self.worker_id = worker_id
        self.realigned = 0  # checks that found the worker off the desired state, or unsure
        self._doubts = Signal()
        self._again = False

    def doubt(self, why: str) -> None:
        """Something may have moved without this worker: no new requests until it has
        checked. Callable from any callback (it only sets flags)."""
        self._again = True
        if not self.status.behind:
            log.info("%s: %s; takes no new requests until it holds the desired state",
                     self.worker_id, why)
            self.status.change(behind=why)
        self._doubts.fire()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            doubted = self._doubts.event()
            if not self._again:
                await doubted.wait()
            self._again = False
            await self._realign()

    async def _realign(self) -> None:
        self.realigned += 1
        delay = 0.25
        published = ""
        while True:
            self._again = False  # this check covers every doubt raised before it
            why = await self._check()
            if not why:
                break
            if why != published:
                log.info("%s: %s", self.worker_id, why)
                self.status.change(behind=why)
                await self.publish()
                published = why
            with anyio.move_on_after(delay):
                await self._doubts.event().wait()  # a new doubt (a reconnect): check again now
            delay = min(2 * delay, RETRY_MAX_S)
        if self._again:  # doubted again while checking: the loop in `run` checks once more
            return
        self.status.change(behind="")
        await self.publish()
        log.info("%s: on the desired policy %s; taking requests", self.worker_id,
                 self.weights.policies.base or "(checkpoint)")

    async def _check(self) -> str:
        """"" once the worker holds the desired state's base policy; else why not."""
        if not await self.receiver.sync():
            return "the control stream cannot be read (cut off from the bus?)"
        try:
            desired = await self.bus.state.after(self.receiver.applied_seq)
        except READ_FAILED as exc:
            return f"the desired state cannot be read ({str(exc) or type(exc).__name__})"
        if not self.weights.in_line(desired):
            await self.weights.load_current(desired)
        return self.off(desired)

    def off(self, desired: DesiredState) -> str:
        """"" if the worker holds `desired`'s base policy; else why it takes no requests."""
        if self.weights.in_line(desired):
            return ""
        return (f"it serves {self.weights.policies.base or '(no weights)'} but the fleet's "
                f"desired policy is {desired_policy(desired)}, which it cannot load"
                + (f" ({self.weights.unloadable})" if self.weights.unloadable else "")
                + ": it waits for the next push")
