"""Fair share between jobs on one pool: tokens by weight while jobs compete, a light job beside
a heavy one's burst, and a job's quota held by the server."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncIterator

import anyio
import pytest
from helpers import req

from rlfabric.bus import Bus
from rlfabric.engines.torch import TorchEngine
from rlfabric.schemas import JobShare, RolloutResult
from rlfabric.trainer import FabricClient
from rlfabric.worker import Worker
from rlfabric.worker.credits import Credits
from rlfabric.worker.jobs import JobScopes

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


@contextlib.asynccontextmanager
async def pool(nats_url: str, prefix: str, workers: int, capacity: int) -> AsyncIterator[Bus]:
    async with Bus.connect(nats_url, prefix=prefix) as bus, anyio.create_task_group() as tg:
        for i in range(workers):
            await tg.start(Worker(bus, TorchEngine("tiny"), f"f{i}", capacity=capacity).run)
        yield bus
        tg.cancel_scope.cancel()


async def answered(client: FabricClient, n: int, tag: str, out: list[tuple[float, int]],
                   max_tokens: int = 16, *, started: anyio.Event | None = None) -> None:
    """`n` requests of `client`'s job, each answer's arrival and tokens appended to `out`;
    `started` set at the 8th."""
    reqs = [req(f"{tag}{i}", [256, 7 + i % 50], max_tokens=max_tokens, seed=i)
            for i in range(n)]
    async for r in client.generate(reqs, timeout=120):
        assert isinstance(r, RolloutResult), r
        out.append((time.monotonic(), len(r.completion_token_ids)))
        if started is not None and len(out) == 8:
            started.set()


async def test_jobs_that_compete_get_tokens_by_weight(nats_url, prefix) -> None:
    """Three jobs of weights 1 : 1 : 2 with work queued at once on one worker: until the first
    runs out, the weight-2 job is served half the tokens."""
    async with pool(nats_url, prefix, 1, 4), \
            FabricClient.connect(nats_url, prefix=prefix) as op, \
            FabricClient.connect(nats_url, prefix=prefix, job="a") as a, \
            FabricClient.connect(nats_url, prefix=prefix, job="b") as b, \
            FabricClient.connect(nats_url, prefix=prefix, job="c") as c:
        await op.set_share("c", JobShare(weight=2.0))
        await op.wait_for_workers(1, timeout=30)
        got: dict[str, list[tuple[float, int]]] = {"a": [], "b": [], "c": []}
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for name, client in (("a", a), ("b", b), ("c", c)):
                    tg.start_soon(answered, client, 60, name, got[name])
    first_done = min(max(t for t, _ in rs) for rs in got.values())
    tokens = {n: sum(k for t, k in rs if t <= first_done) for n, rs in got.items()}
    share = {n: k / sum(tokens.values()) for n, k in tokens.items()}
    assert abs(share["c"] - 0.5) <= 0.1, share
    assert abs(share["a"] - share["b"]) <= 0.1, share


async def test_a_light_job_is_served_beside_a_heavy_jobs_burst(nats_url, prefix) -> None:
    """A job sending one request at a time is answered while another job's burst is still
    queued: each of its requests waits for a free slot, not for the burst."""
    async with pool(nats_url, prefix, 1, 4), \
            FabricClient.connect(nats_url, prefix=prefix, job="heavy") as heavy, \
            FabricClient.connect(nats_url, prefix=prefix, job="light") as light:
        await heavy.wait_for_workers(1, timeout=30)
        burst: list[tuple[float, int]] = []
        mine: list[tuple[float, int]] = []
        await answered(light, 1, "warm", [])  # the worker pulls for the light job by now
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                serving = anyio.Event()
                tg.start_soon(functools.partial(answered, heavy, 200, "h", burst,
                                                started=serving))
                await serving.wait()  # the burst is being served
                for i in range(5):
                    await answered(light, 1, f"l{i}-", mine)
                light_done = time.monotonic()
    assert len(mine) == 5
    served_by_then = sum(1 for t, _ in burst if t <= light_done)
    assert served_by_then < 60, f"{served_by_then} of the burst's 200 were served first"


async def test_a_light_jobs_slot_is_kept_while_its_last_result_is_stored() -> None:
    """A slot freed by the light job's request whose samples are all generated stays the
    light job's (its next request comes as soon as the result is stored): the heavy job's
    next part does not take it."""
    jobs, credits = JobScopes(), Credits(capacity=4, prefetch=0)
    credits.several, credits.running_of = True, jobs.generating
    credits.came(1, "light")
    credits.came(3, "heavy", pending=100)
    credits.in_flight = 4  # the light job's 1 and the heavy job's 3
    with jobs.serving("heavy", 3), jobs.serving("light") as scope:
        assert credits.room_for("heavy") == 0
        jobs.generated(scope)
        credits.generated()
        assert jobs.generating("light") == 0 and jobs.in_flight() == {"heavy": 3, "light": 1}
        assert credits.room_for("heavy") == 0  # kept for the light job
        assert credits.room_for("light") == 1


async def test_a_job_over_its_quota_waits_and_is_answered_in_full(nats_url, prefix) -> None:
    """A job at `max_in_flight=2`: never more than 2 of its requests held by the workers
    (sampled), and all 30 answered."""
    async with pool(nats_url, prefix, 2, 8) as bus, \
            FabricClient.connect(nats_url, prefix=prefix) as op, \
            FabricClient.connect(nats_url, prefix=prefix, job="q") as q:
        await op.set_share("q", JobShare(max_in_flight=2))
        await op.wait_for_workers(2, timeout=30)
        assert (await q.share.refresh()).max_in_flight == 2
        assert q.share.per_message == 1  # one request a message: the quota counts messages
        got: list[tuple[float, int]] = []
        held: list[int] = []
        s = bus.subjects
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(answered, q, 30, "q", got)
                while len(got) < 30:
                    info = await bus.js.consumer_info(s.rollout_stream, s.consumer_of("q"))
                    held.append(info.num_ack_pending)
                    await anyio.sleep(0.01)
    assert len(got) == 30
    assert max(held) == 2, held  # the quota was reached, never passed
