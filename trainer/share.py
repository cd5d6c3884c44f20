"""The share the pool's operator gave this client's job (`JobShare`), read again every
`SCAN_S` seconds: a job with a quota sends one request a message, since the server counts its
quota in messages (`rlfabric.bus.nats.provision.ensure_consumer`)."""

from __future__ import annotations

import logging

import anyio
from anyio.abc import TaskStatus

from rlfabric.bus import Bus
from rlfabric.schemas import JobShare

log = logging.getLogger("rlfabric.trainer")
#: seconds between two reads of the job's share
SCAN_S = 1.0


class ShareFollower:
    def __init__(self, bus: Bus, job: str) -> None:
        self.bus = bus
        self.job = job
        self.share = JobShare()

    @property
    def per_message(self) -> int | None:
        """Requests a message may hold at most (None: as many as batching chooses)."""
        return 1 if self.share.max_in_flight else None

    async def refresh(self) -> JobShare:
        """Read the job's share now."""
        self.share = await self.bus.state.share(self.job)
        return self.share

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        started = False
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # the next read tries again
                log.debug("job %r's share not read (%s)", self.job, exc)
            if not started:
                started = True
                task_status.started()
            await anyio.sleep(SCAN_S)
