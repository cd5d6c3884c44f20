"""A push too large for its transport's storage, then one that fits, with a worker serving
throughout (tests/chaos/test_fs_full.py). Run as a script inside a mount namespace whose
/dev/shm is a small tmpfs for the shm transport (`python tests/small_storage.py URL PREFIX`:
prints what happened as JSON)."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import anyio
import torch
from helpers import collect, req

from rlfabric.bus import Bus, QuorumPolicy
from rlfabric.engines.null import NullEngine
from rlfabric.schemas import RolloutResult
from rlfabric.trainer import FabricClient
from rlfabric.transports import TransportError
from rlfabric.worker import Worker

MIB = 1024 * 1024


async def scenario(url: str, prefix: str, transport: str, where: str) -> dict[str, Any]:
    """Push 12 MiB (refused), pause and resume, push 0.5 MiB, serve 8 requests; what `where`
    holds after the refusal."""
    async with Bus.connect(url, prefix=prefix) as bus, anyio.create_task_group() as tg:
        await tg.start(Worker(bus, NullEngine(), "d0", capacity=8).run)
        async with FabricClient.connect(url, prefix=prefix,
                                        policy=QuorumPolicy(timeout=30)) as fabric:
            await fabric.wait_for_workers(1, timeout=30)
            epoch = fabric.watcher.snapshot().epoch
            t0 = time.monotonic()
            try:
                await fabric.update_weights(1, state_dict={"w": torch.randn(3 * MIB)},
                                            transport=transport, verify="off")
                error = ("", "")
            except TransportError as exc:
                error = (exc.code, str(exc))
            refused_s = time.monotonic() - t0
            left = [f for _, _, files in os.walk(where) for f in files]
            pause = await fabric.pause(policy=QuorumPolicy(timeout=5))
            await fabric.resume()
            ok = await fabric.update_weights(2, state_dict={"w": torch.randn(MIB // 2)},
                                             transport=transport, verify="off")
            out = await collect(fabric, [req(f"r{i}", max_tokens=2) for i in range(8)])
            snap = fabric.watcher.snapshot()
        tg.cancel_scope.cancel()
    return {"code": error[0], "message": error[1], "refused_s": refused_s, "left": left,
            "paused": list(pause.ok), "loaded": ok.acks["d0"].weight_version if ok.ok else -1,
            "served": sorted(r.request_id for r in out if isinstance(r, RolloutResult)),
            "same_members": snap.epoch == epoch and snap.worker_ids == ("d0",)}


if __name__ == "__main__":
    print(json.dumps(anyio.run(scenario, sys.argv[1], sys.argv[2], "shm", "/dev/shm")))
