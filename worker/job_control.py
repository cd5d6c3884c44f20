"""A worker's side of its jobs' commands (`rlfabric.schemas.jobs`): a job's pause and resume,
which hold its requests only (`JobScopes`), and a job's desired state taken at join or after
one of its commands was missed (its adapters, paused or not)."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable

import anyio

from rlfabric.bus import AckFields, CommandFailed, Registration
from rlfabric.schemas import DesiredState, ErrorCode, Pause, job_of_key
from rlfabric.schemas.jobs import ENDED
from rlfabric.worker.jobs import JobScopes
from rlfabric.worker.rollouts import RolloutServer
from rlfabric.worker.weights import WeightSync


class JobControl:
    def __init__(self, scopes: JobScopes, weights: WeightSync, reg: Registration,
                 rollouts: RolloutServer, publish: Callable[[], Awaitable[None]],
                 worker_id: str) -> None:
        self.scopes = scopes
        self.weights = weights
        self.reg = reg
        self.rollouts = rollouts
        self.publish = publish
        self.worker_id = worker_id

    def _written(self) -> None:
        self.reg.update(paused_jobs=tuple(sorted(self.scopes.paused)),
                        adapters=self.weights.engine.adapter_versions())

    async def pause(self, cmd: Pause) -> AckFields:
        """Hold job `cmd.job`'s requests only; the pool serves on. Past the command's
        deadline its requests still running are left to finish."""
        limit = cmd.deadline - time.time() if cmd.deadline else math.inf
        with anyio.move_on_after(max(0.0, limit)) as scope:
            waiting = self.scopes.pause(cmd.job, cmd.mode)
            self._written()
            await self.publish()
            await waiting
        if scope.cancelled_caught:
            left = self.scopes.in_flight().get(cmd.job, 0)
            raise CommandFailed(ErrorCode.DRAIN_TIMEOUT, f"{self.worker_id} still had {left} "
                                f"of job {cmd.job}'s requests in flight at the pause's "
                                "deadline; the job is paused here and they will finish")
        return AckFields(detail={"job": cmd.job})

    async def resume(self, job: str) -> AckFields:
        self.scopes.resume(job)
        self._written()
        self.rollouts.version_moved()  # pull again: its requests come back meanwhile
        await self.publish()
        return AckFields(detail={"job": job})

    async def missed(self, job: str, wait: float) -> None:
        """One of job `job`'s commands was not applied here: take its desired state instead
        (read for up to `wait` seconds)."""
        with anyio.move_on_after(wait):
            await self.take(job, await self.weights.bus.state.read(job))

    async def end(self, job: str, *, publish: bool = True) -> AckFields:
        """End job `job` (the operator's `Shutdown(job=...)`): its requests are refused from
        now on (`job_deleted`), those running cancelled, its adapters dropped. `publish`:
        write the worker's state now (not at join: it is no member yet)."""
        self.scopes.end(job)
        for key in [k for k in self.weights.engine.adapter_versions() if job_of_key(k) == job]:
            await self.weights.unload(key)
        self._written()
        if publish:
            await self.publish()
        return AckFields(detail={"job": job, "ended": "true"})

    async def take(self, job: str, state: DesiredState) -> None:
        """Take job `job`'s desired state: its adapters' newest versions, paused or not
        (ended: see `end`)."""
        if state.pause_mode == ENDED:
            await self.end(job, publish=False)
            return
        await self.weights.load_job(job, state)
        if state.paused:
            self.scopes.paused.setdefault(job, "keep")
        elif self.scopes.resume(job):
            self.rollouts.version_moved()
        self._written()
