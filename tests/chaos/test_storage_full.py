"""A `nats` weight push larger than the server's JetStream store fails within seconds, naming
the store and the sizes; what it stored is removed, the worker is told (it does not wait for
chunks that will not come), stays a member and acks a pause at once, the next push that fits
lands, and rollouts before and after are each answered once. The abort marker stays after the
clean-up, so a worker that subscribes late still reads it."""

from __future__ import annotations

import time

import anyio
import pytest
import torch
from helpers import collect, req

from rlfabric.bus import Bus, EmbeddedNats, QuorumPolicy
from rlfabric.engines.null import NullEngine
from rlfabric.schemas import RolloutResult
from rlfabric.trainer import FabricClient
from rlfabric.transports import TransportError
from rlfabric.worker import Worker

pytestmark = [pytest.mark.nats, pytest.mark.anyio, pytest.mark.timeout(180)]

MIB = 1024 * 1024


def weights(mib: int) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.randn(4 * MIB // 4) for i in range(mib // 4)}


async def test_a_push_past_the_jetstream_store_is_refused_at_once_and_the_next_one_lands(
        ) -> None:
    async with EmbeddedNats(max_file_store=64 * MIB) as srv, \
            Bus.connect(srv.url, prefix="full") as bus, anyio.create_task_group() as tg:
        await tg.start(Worker(bus, NullEngine(), "f0", capacity=8).run)
        async with FabricClient.connect(srv.url, prefix="full",
                                        policy=QuorumPolicy(timeout=60)) as fabric:
            await fabric.wait_for_workers(1, timeout=30)
            epoch = fabric.watcher.snapshot().epoch
            before = await collect(fabric, [req(f"b{i}", max_tokens=2) for i in range(20)])
            t0 = time.monotonic()
            with pytest.raises(TransportError, match=r"no room.*96\.0 MiB") as exc:
                await fabric.update_weights(1, state_dict=weights(96), transport="nats",
                                            verify="off")
            refused_s = time.monotonic() - t0
            t1 = time.monotonic()
            rep = await fabric.pause(policy=QuorumPolicy(timeout=10))
            pause_s = time.monotonic() - t1
            await fabric.resume()
            depths = await fabric.bus.fleet.stream_depths()
            ok = await fabric.update_weights(2, state_dict=weights(16), transport="nats",
                                             verify="off")
            after = await collect(fabric, [req(f"a{i}", max_tokens=2) for i in range(20)])
            snap = fabric.watcher.snapshot()
        tg.cancel_scope.cancel()
    assert exc.value.code == "storage_full" and refused_s < 5.0
    assert rep.ok == ("f0",) and pause_s < 2.0  # not stuck waiting for chunks
    assert depths["FULL_WEIGHTS"] == 1  # what the push stored is gone; its abort marker stays
    assert ok.ok == ("f0",) and ok.acks["f0"].weight_version == 2
    assert snap.epoch == epoch and [m.worker_id for m in snap.members] == ["f0"]
    for got, prefix in ((before, "b"), (after, "a")):
        assert sorted(r.request_id for r in got) == sorted(f"{prefix}{i}" for i in range(20))
        assert all(isinstance(r, RolloutResult) for r in got)
