"""`InitTransport` on a worker: join the collective group weights are broadcast over (or hand
the command to an engine that forms its own), with the rank the trainer gave it."""

from __future__ import annotations

import time

from rlfabric.bus import AckFields, CommandContext, CommandFailed
from rlfabric.engines.protocol import JoinsGroups
from rlfabric.schemas import ErrorCode, InitTransport
from rlfabric.transports import TransportError
from rlfabric.transports.collective import join
from rlfabric.worker.weights import WeightSync


async def init_transport(sync: WeightSync, cmd: InitTransport,
                         ctx: CommandContext) -> AckFields:
    if sync.worker_id not in cmd.rank_offsets:
        raise CommandFailed(ErrorCode.NOT_IN_GROUP,
                            f"{sync.worker_id} has no rank in group epoch {cmd.group_epoch}")
    rank = cmd.rank_offsets[sync.worker_id]
    detail = {"rank": str(rank), "group_epoch": str(cmd.group_epoch)}
    if isinstance(sync.engine, JoinsGroups):
        await sync.engine.init_transport(cmd, rank)
        return AckFields(detail=detail)
    if cmd.stream is not None:
        raise CommandFailed(ErrorCode.UNSUPPORTED,
                            f"group epoch {cmd.group_epoch} streams tensors into an engine's "
                            f"own loader (vLLM's NCCL weight transfer), which only engines that "
                            f"join groups themselves take; {sync.worker_id} runs the "
                            f"{sync.engine.name} engine: push to it with "
                            "FabricClient.init_transport/update_weights")
    if sync.groups.group is not None:
        sync.groups.group.close()  # an old group is torn down, never reused
        sync.groups.group = None
    remaining = cmd.deadline - time.time() if cmd.deadline else 60.0
    try:
        sync.groups.group = await join(
            sync.worker_id, rank, backend=cmd.backend, master_addr=cmd.master_addr,
            master_port=cmd.master_port, world_size=cmd.world_size,
            group_epoch=cmd.group_epoch, timeout=max(1.0, remaining), ready=ctx.ready)
    except TransportError as exc:
        raise CommandFailed(exc.code, str(exc)) from exc
    return AckFields(detail=detail)
