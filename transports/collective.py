"""`collective`: a flat buffer broadcast from the trainer (rank 0) over a group formed by
`init_transport` (gloo on CPU, NCCL on CUDA). Two-phase: each worker acks `ready` once its
receive buffer exists and it is about to enter the broadcast, then `done`. Delivered live to
the workers in the group: a worker joining later waits for the next push."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import anyio

from rlfabric import tensors
from rlfabric.schemas import Collective, ErrorCode
from rlfabric.transports.protocol import (
    Received,
    ReceiveJob,
    Staged,
    StageJob,
    TransportError,
)

if TYPE_CHECKING:
    from rlfabric.bus import Bus
    from rlfabric.tensors import CollectiveGroup


class CollectiveTransport:
    name = "collective"
    help = "a broadcast over a gloo/NCCL group the trainer forms (init_transport)"
    locator = Collective
    pull = False
    lasting = False

    def __init__(self, bus: Bus) -> None:
        del bus

    def close(self) -> None:
        pass

    async def stage(self, job: StageJob) -> Staged:
        import torch

        flat = torch.empty(job.size, dtype=torch.uint8)
        dg = await anyio.to_thread.run_sync(tensors.pack_buffer, job.state, job.tensors,
                                            flat.numpy().data)
        return Staged(job.version, Collective(group_epoch=job.group_epoch, tensors=job.tensors),
                      dg, job.expected_checksum, job.size, flat=flat)

    @contextlib.asynccontextmanager
    async def receive(self, locator: Collective, job: ReceiveJob) -> AsyncIterator[Received]:
        import torch

        group = job.groups.group
        if group is None or group.group_epoch != locator.group_epoch:
            have = group.group_epoch if group else None
            raise TransportError(ErrorCode.NO_GROUP,
                                 f"{job.worker_id} is in group epoch {have}, not "
                                 f"{locator.group_epoch}: init_transport first")
        flat = torch.empty(tensors.buffer_size(locator.tensors), dtype=torch.uint8)
        if job.ready is not None:
            await job.ready()
        try:
            await anyio.to_thread.run_sync(group.broadcast, flat)
        except Exception as exc:
            job.groups.group = None  # a broken group is stale
            raise TransportError(ErrorCode.BROADCAST_FAILED,
                                 f"{job.worker_id}: broadcast of v{job.version} failed: "
                                 f"{exc}") from exc
        yield Received(flat.numpy().data)


async def join(worker_id: str, rank: int, *, backend: str, master_addr: str, master_port: int,
               world_size: int, group_epoch: int, timeout: float,
               ready: Callable[[], Awaitable[None]]) -> CollectiveGroup:
    """(worker) Join the group the trainer opened: reach its store, ack `ready`, connect."""
    group = tensors.CollectiveGroup(backend=backend, master_addr=master_addr,
                                    master_port=master_port, rank=rank, world_size=world_size,
                                    group_epoch=group_epoch, timeout=timeout)
    try:
        await anyio.to_thread.run_sync(group.open_store)
        await ready()
        await anyio.to_thread.run_sync(group.connect)
    except Exception as exc:
        group.close()
        raise TransportError(ErrorCode.GROUP_JOIN_FAILED, f"{worker_id} could not join group "
                             f"epoch {group_epoch}: {exc}") from exc
    return group
