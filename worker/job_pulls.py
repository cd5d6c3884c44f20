"""The jobs a worker pulls requests for: one `Puller` per job's consumer, and each job's share.

A job is pulled for once the worker sees it: requests queued on its subject, a share its
operator set (`JobShare`, `rlfabric job create|set`) or a desired state of its own. The worker
looks every `SCAN_S` seconds (a new job's first request waits that long at most), makes the
job's consumer if it is not there, and keeps it on the job's quota (`max_in_flight`: the
server delivers no more of its messages while that many are unacked). Weights go to the
worker's fair order (`Credits.weights`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import TaskGroup, TaskStatus
from nats.aio.msg import Msg

from rlfabric.bus import Bus
from rlfabric.bus.nats.provision import ensure_consumer
from rlfabric.bus.nats.pull import Puller
from rlfabric.concurrency.sync import Signal
from rlfabric.schemas import JobShare
from rlfabric.worker.credits import Credits

log = logging.getLogger("rlfabric.worker.jobs")
#: seconds between two looks for jobs and their shares
SCAN_S = 1.0


class JobPulls:
    def __init__(self, bus: Bus, credits: Credits, on_message: Callable[[Msg], Awaitable[None]],
                 *, kick: Signal, ack_wait: float,
                 on_silent: Callable[[str], None] | None = None) -> None:
        self.bus = bus
        self.credits = credits
        self.on_message = on_message
        self.kick = kick
        self.ack_wait = ack_wait
        self.on_silent = on_silent
        #: the job each puller takes requests of ("": the pool's own)
        self.pullers: dict[str, Puller] = {}
        #: each job's share as last read
        self.shares: dict[str, JobShare] = {}

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            await self._add(tg, "")
            try:
                await self._scan(tg)
            except Exception as exc:  # the next scan tries again
                log.warning("jobs not read yet (%s); again in %.0fs", exc, SCAN_S)
            task_status.started()
            while True:
                await anyio.sleep(SCAN_S)
                try:
                    await self._scan(tg)
                except Exception as exc:
                    log.debug("jobs not read (%s); again in %.0fs", exc, SCAN_S)

    async def _queued(self) -> set[str]:
        """Jobs with requests queued on their subjects."""
        s = self.bus.subjects
        info = await self.bus.js.stream_info(s.rollout_stream,
                                             subjects_filter=f"{s.rollout_request}.*")
        return {s.job_of_request(subject) for subject in (info.state.subjects or {})}

    async def _scan(self, tg: TaskGroup) -> None:
        shares, named = await self.bus.state.shares()
        jobs = named | await self._queued() | {""}
        for job in sorted(jobs):
            share = shares.get(job, JobShare())
            self.credits.weights[job] = share.weight
            if job not in self.shares or share != self.shares[job]:
                await ensure_consumer(self.bus.js, self.bus.subjects, job,
                                      ack_wait=self.ack_wait,
                                      max_in_flight=share.max_in_flight)
            self.shares[job] = share
            if job not in self.pullers:
                await self._add(tg, job)

    async def _add(self, tg: TaskGroup, job: str) -> None:
        s = self.bus.subjects
        puller = Puller(self.bus, s.rollout_stream, s.consumer_of(job), self.on_message,
                        kick=self.kick, on_silent=self.on_silent)
        await tg.start(puller.run)
        self.pullers[job] = puller
        self.credits.several = len(self.pullers) > 1
        self.kick.fire()
