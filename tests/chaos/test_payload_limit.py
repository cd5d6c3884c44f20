"""Against a server at the stock 1 MiB max_payload: a request too large for one message is
refused by the client before it is sent, naming its size and the limit; a result too large is
answered `payload_too_large` (not retryable) while the other requests of the same call are
served; batches of requests and of results several MiB in all go in messages under the limit;
nothing is dropped and the worker stays."""

from __future__ import annotations

import anyio
import pytest
from helpers import collect, req

from rlfabric.bus import Bus, EmbeddedNats, PayloadTooLarge, QuorumPolicy
from rlfabric.engines.null import NullEngine
from rlfabric.schemas import RolloutError, RolloutResult
from rlfabric.trainer import FabricClient
from rlfabric.worker import Worker

pytestmark = [pytest.mark.nats, pytest.mark.anyio, pytest.mark.timeout(120)]


async def test_oversized_requests_and_results_get_clear_errors_and_the_rest_is_served(
        ) -> None:
    async with EmbeddedNats(max_payload=1 << 20) as srv, \
            Bus.connect(srv.url, prefix="stock") as bus, anyio.create_task_group() as tg:
        await tg.start(Worker(bus, NullEngine(), "p0", capacity=8).run)
        async with FabricClient.connect(srv.url, prefix="stock") as fabric:
            await fabric.wait_for_workers(1, timeout=30)
            huge = req("huge", range(1, 300_001), max_tokens=2)  # 1.2 MB of prompt
            too_big = r"request huge is 1,2\d\d,\d\d\d bytes, over the 1,04\d,\d\d\d"
            with pytest.raises(PayloadTooLarge, match=too_big):
                await collect(fabric, [huge])
            with pytest.raises(PayloadTooLarge, match=too_big):  # alone
                await anext(fabric.generate([huge]))
            # refused, it is awaited no more: its id may be sent again
            assert fabric.rollouts.outstanding == 0
            # echoed back, 200,000 ids and their logprobs make a 1.6 MB result
            big = req("big", range(1, 200_001), max_tokens=200_000)
            small = [req(f"s{i}", max_tokens=2) for i in range(6)]
            with anyio.fail_after(60):
                out = await collect(fabric, [big, *small])
            # batched both ways: 64 requests of 160 KB, then 32 results of about 100 KB each,
            # several MiB in all, in messages under the limit
            with anyio.fail_after(60):
                long_prompts = await collect(fabric, [req(f"m{i}", range(1, 40_001),
                                                          max_tokens=2) for i in range(64)])
                long_outputs = await collect(fabric, [req(f"o{i}", range(1, 12_001),
                                                          max_tokens=12_000) for i in range(32)])
            members = await fabric.bus.fleet.members()
            paused = await fabric.pause(policy=QuorumPolicy(timeout=5))
            await fabric.resume()
        tg.cancel_scope.cancel()
    errors = [r for r in out if isinstance(r, RolloutError)]
    assert [(e.request_id, e.code, e.retryable) for e in errors] == [
        ("big", "payload_too_large", False)]
    assert "max_payload" in errors[0].message
    assert sorted(r.request_id for r in out if isinstance(r, RolloutResult)) == [
        f"s{i}" for i in range(6)]
    assert list(members) == ["p0"] and paused.ok == ("p0",)
    for got, prefix, n in ((long_prompts, "m", 64), (long_outputs, "o", 32)):
        assert sorted(r.request_id for r in got if isinstance(r, RolloutResult)) == sorted(
            f"{prefix}{i}" for i in range(n))
    assert all(len(r.completion_token_ids) == 12_000 for r in long_outputs)
