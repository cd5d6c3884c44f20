"""A worker's one state, owned by the `Worker`: what its commands set, what membership
publishes, what the rollout server reads to know whether to take requests.

A worker is paused (`Pause` ... `Resume`), asleep (`Sleep` ... `Wake`), draining (leaving:
never undone), updating (a weight or adapter load in progress) and behind (not on the fleet's
desired policy, or unsure of it: `Alignment`) independently of each other: a `Resume` of a
sleeping worker leaves it asleep, a `Wake` of a paused one leaves it paused, and a load on
either republishes what it was. `state` is the one name membership shows: the first of
draining, updating, sleeping, paused that holds, else ready; `behind` says why a worker that
is up takes no requests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import get_args

from rlfabric.schemas.fleet import WorkerState
from rlfabric.telemetry import instruments, spans


def record_state(worker_id: str, state: WorkerState) -> None:
    """The state gauge (`rlfabric.worker.state`): 1 for `state`, 0 for every other."""
    gauge = instruments.current.worker_state
    for s in get_args(WorkerState):
        gauge.set(int(s == state), {spans.WORKER_ID: worker_id, "state": s})


class WorkerStatus:
    def __init__(self) -> None:
        self.started = False
        self.paused = False
        self.asleep = False
        self.draining = False
        self.updating = False
        #: why the worker is off the desired policy ("": it is on it)
        self.behind = ""
        self._watchers: list[Callable[[bool], None]] = []

    @property
    def state(self) -> WorkerState:
        if not self.started:
            return "starting"
        if self.draining:
            return "draining"
        if self.updating:
            return "updating"
        if self.asleep:
            return "sleeping"
        if self.paused:
            return "paused"
        return "ready"

    @property
    def held(self) -> bool:
        """Taking no requests: paused, asleep, draining or behind (an update holds nothing:
        requests keep being served between the load's two decode steps)."""
        return self.paused or self.asleep or self.draining or bool(self.behind)

    def watch(self, on_change: Callable[[bool], None]) -> None:
        """Call `on_change(held)` at every change."""
        self._watchers.append(on_change)

    def change(self, *, started: bool | None = None, paused: bool | None = None,
               asleep: bool | None = None, draining: bool | None = None,
               updating: bool | None = None, behind: str | None = None) -> WorkerState:
        """Set the flags given; the state that results."""
        if started is not None:
            self.started = started
        if paused is not None:
            self.paused = paused
        if asleep is not None:
            self.asleep = asleep
        if draining is not None:
            self.draining = self.draining or draining  # leaving is never undone
        if updating is not None:
            self.updating = updating
        if behind is not None:
            self.behind = behind
        held = self.held
        for fn in self._watchers:
            fn(held)
        return self.state
