"""The `nats` transport sizes its chunks from the `max_payload` the server announces: a server
at the stock 1 MiB takes a push of several MiB in chunks under it, and the worker rebuilds the
exact bytes (its digest check passes)."""

from __future__ import annotations

import anyio
import pytest
import torch

from rlfabric.bus import Bus, EmbeddedNats
from rlfabric.engines.null import NullEngine
from rlfabric.trainer import FabricClient
from rlfabric.worker import Worker

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


async def test_a_push_to_a_server_with_a_1_mib_payload_limit_goes_in_smaller_chunks() -> None:
    state = {f"w{i}": torch.randn(256 * 1024) for i in range(3)}  # 3 MiB
    async with EmbeddedNats(max_payload=1 << 20) as srv, \
            Bus.connect(srv.url, prefix="stock") as bus, anyio.create_task_group() as tg:
        await tg.start(Worker(bus, NullEngine(), "s0", capacity=4).run)
        async with FabricClient.connect(srv.url, prefix="stock") as fabric:
            await fabric.wait_for_workers(1, timeout=30)
            staged = await fabric.stage_weights(1, state, "nats", with_checksum=False)
            t = staged.transport
            assert t.chunk_bytes <= (1 << 20) - 4096 and t.chunks == -(-staged.nbytes //
                                                                           t.chunk_bytes)
            rep = await fabric.push_weights(staged, verify="off")
        assert rep.ok == ("s0",) and rep.acks["s0"].weight_version == 1
        tg.cancel_scope.cancel()
