"""A worker's one state (`WorkerStatus`): a sleeping worker stays asleep, and takes nothing,
across every command that does not wake it; pause and sleep are undone each by its own
command only. A real in-process worker (null engine) on the test session's nats-server."""

from __future__ import annotations

import time

import anyio
import pytest
import torch
from helpers import collect, req

from rlfabric.bus import Bus
from rlfabric.engines.null import NullEngine
from rlfabric.schemas import RolloutError, RolloutResult
from rlfabric.trainer import FabricClient
from rlfabric.worker import Worker

pytestmark = [pytest.mark.nats, pytest.mark.anyio, pytest.mark.timeout(120)]


async def state_of(fabric: FabricClient, wid: str) -> str:
    return (await fabric.bus.fleet.members())[wid].state


async def served(fabric: FabricClient, rid: str, wait: float) -> bool:
    """Whether a request with a deadline `wait` seconds away is served (else it expires)."""
    (out,) = await collect(fabric, [req(rid, deadline=time.time() + wait)], timeout=wait + 30)
    if isinstance(out, RolloutError):
        assert out.code == "deadline_exceeded", out
        return False
    assert isinstance(out, RolloutResult)
    return True


async def test_a_sleeping_worker_stays_asleep_until_woken(nats_url: str, prefix: str) -> None:
    async with Bus.connect(nats_url, prefix=prefix) as bus, anyio.create_task_group() as tg:
        worker = Worker(bus, NullEngine(), "s0", capacity=4)
        await tg.start(worker.run)
        async with FabricClient.connect(nats_url, prefix=prefix) as fabric:
            await fabric.wait_for_workers(1, timeout=30)
            assert await state_of(fabric, "s0") == "ready"
            assert (await fabric.sleep(1)).ok == ("s0",)
            seen = {"sleep": await state_of(fabric, "s0")}
            # every command that does not wake it: acked, and it is still asleep
            steps = {
                "pause": lambda: fabric.pause("keep"),
                "resume": fabric.resume,
                "update_weights": lambda: fabric.update_weights(
                    1, {"w": torch.zeros(4)}, transport="nats", verify="workers"),
                "unload_adapter": lambda: fabric.unload_adapter("none"),
                "reset_prefix_cache": fabric.reset_prefix_cache,
                "describe": fabric.describe,
            }
            for name, step in steps.items():
                rep = await step()
                assert rep.ok == ("s0",), (name, rep)
                seen[name] = await state_of(fabric, "s0")
            assert worker.status.asleep and not worker.status.paused
            asleep_served = await served(fabric, "while-asleep", 1.0)
            assert (await fabric.wake()).ok == ("s0",)
            seen["wake"] = await state_of(fabric, "s0")
            awake_served = await served(fabric, "after-wake", 20.0)
            # paused, then woken: still paused until resumed
            await fabric.pause("keep")
            await fabric.sleep(1)
            await fabric.wake()
            seen["pause, sleep, wake"] = await state_of(fabric, "s0")
            paused_served = await served(fabric, "woken-paused", 1.0)
            await fabric.resume()
            seen["resume, awake"] = await state_of(fabric, "s0")
            resumed_served = await served(fabric, "resumed", 20.0)
        tg.cancel_scope.cancel()
    assert seen == {"sleep": "sleeping", "pause": "sleeping", "resume": "sleeping",
                    "update_weights": "sleeping", "unload_adapter": "sleeping",
                    "reset_prefix_cache": "sleeping", "describe": "sleeping",
                    "wake": "ready", "pause, sleep, wake": "paused", "resume, awake": "ready"}
    assert (asleep_served, awake_served, paused_served, resumed_served) == (
        False, True, False, True)
