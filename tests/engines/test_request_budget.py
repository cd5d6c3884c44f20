"""A worker's own bound on what one request may ask for (`--max-request-tokens`: n x
max_tokens), for requests from any client (here `FabricClient`, no gateway): past it the
request is refused at once with `request_too_large` naming the numbers; within it, served."""

from __future__ import annotations

import time

import anyio
import pytest
from helpers import collect, req

from rlfabric.bus import Bus
from rlfabric.engines.null import NullEngine
from rlfabric.schemas import RolloutError, RolloutResult
from rlfabric.trainer import FabricClient
from rlfabric.worker import Worker

pytestmark = [pytest.mark.nats, pytest.mark.anyio, pytest.mark.timeout(60)]


async def test_a_request_past_the_workers_budget_is_refused_at_once(nats_url: str,
                                                                      prefix: str) -> None:
    async with Bus.connect(nats_url, prefix=prefix) as bus, anyio.create_task_group() as tg:
        worker = Worker(bus, NullEngine(), "b0", capacity=4, max_request_tokens=100)
        await tg.start(worker.run)
        async with FabricClient.connect(nats_url, prefix=prefix) as fabric:
            await fabric.wait_for_workers(1, timeout=30)
            t0 = time.monotonic()
            big = await collect(fabric, [req("big", n=4, max_tokens=26)], timeout=30)
            took = time.monotonic() - t0
            out = await collect(fabric, [req("fits", n=4, max_tokens=25)], timeout=30)
        tg.cancel_scope.cancel()
    assert {(type(e), e.code) for e in big} == {(RolloutError, "request_too_large")}, big
    assert "4 x 26 = 104" in big[0].message and "at most 100" in big[0].message
    assert took < 5
    assert sorted(r.sample_index for r in out if isinstance(r, RolloutResult)) == [0, 1, 2, 3]
    assert worker.rollouts.served == 1
