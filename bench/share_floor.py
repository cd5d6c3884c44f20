"""The starvation part's floors (`rlfabric bench jobs --fair`): a light job's latency beside a
heavy job's burst at best on this machine, without rlfabric's scheduling.

- null: nats-py alone. The light job's and the heavy job's requests each have a durable
  consumer and 2 responder processes of their own (`rlfabric.bench.floor rollout
  --consumer`), so a light request never waits behind a heavy one in any queue: only the
  machine's cores are shared. The heavy consumer holds 2 workers' capacity unacked at most.
- torch: the engine alone in this process, a batch of `capacity` requests against one
  request, the same tokens. A static-batching engine starts a request that comes mid-batch
  when that batch ends: beside a full pool it waits up to one batch and is served in the next.

    python -m rlfabric.bench.share_floor heavy --nats URL --n N --max-tokens T
        the heavy job's burst (the null floor's), as a process of its own.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import anyio

from rlfabric.bench._util import children, pct

HEAVY_PER_MSG = 8  # requests in each of the heavy burst's messages


def _requests(name: str, n: int, max_tokens: int, first: int = 0) -> list[Any]:
    from rlfabric.bench.floor import FloorRequest

    return [FloorRequest(request_id=f"{name}-{first + i}",
                         prompt=bytes(4) + (10 + (first + i) % 50).to_bytes(4, "little"),
                         max_tokens=max_tokens) for i in range(n)]


class _Light:
    """The light job's requests over `js`, one at a time, each answered on `floor.res.light`
    (the heavy job's answers' arrival times kept too)."""

    def __init__(self, nc: Any, max_tokens: int) -> None:
        import msgspec

        self.nc, self.js, self.max_tokens = nc, nc.jetstream(), max_tokens
        self.enc = msgspec.msgpack.Encoder()
        self.answered = anyio.Event()
        self.heavy_at: list[float] = []  # when each heavy answer came
        self.ids = iter(range(10**9))

    async def subscribe(self) -> None:
        async def on_light(msg: Any) -> None:
            self.answered.set()

        async def on_heavy(msg: Any) -> None:
            self.heavy_at.append(time.monotonic())

        await self.nc.subscribe("floor.res.light", cb=on_light)
        await self.nc.subscribe("floor.res.heavy", cb=on_heavy)

    async def until(self, end: float, done: anyio.Event | None = None
                    ) -> list[tuple[float, float]]:
        """(sent, latency) of each request until `end` (or `done`)."""
        from rlfabric.bench.floor import REPLY_TO

        out = []
        while time.monotonic() < end and not (done and done.is_set()):
            self.answered = anyio.Event()
            sent = time.monotonic()
            await self.js.publish("floor.req.light", self.enc.encode(
                _requests("light", 1, self.max_tokens, next(self.ids))),
                headers={REPLY_TO: "floor.res.light"})
            with anyio.fail_after(60):
                await self.answered.wait()
            out.append((sent, time.monotonic() - sent))
        return out


async def _streams(js: Any, capacity: int) -> None:
    from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

    for name, subj in (("FLOORREQ", "floor.req.>"), ("FLOORRES", "floor.res.>")):
        await js.add_stream(StreamConfig(name=name, subjects=[subj], storage=StorageType.FILE))
    for job, held in (("light", 1), ("heavy", max(1, 2 * capacity // HEAVY_PER_MSG))):
        await js.add_consumer("FLOORREQ", ConsumerConfig(
            durable_name=job.upper(), filter_subject=f"floor.req.{job}",
            ack_policy=AckPolicy.EXPLICIT, max_ack_pending=held))


async def null_floor(capacity: int, burst: int, max_tokens: int, seconds: float
                     ) -> dict[str, Any]:
    """The light job's p99 latency alone for `seconds`, then beside the burst (sent while it
    was being answered)."""
    import nats

    from rlfabric.bus import EmbeddedNats

    async with EmbeddedNats() as srv:
        nc = await nats.connect(srv.url, name="rlfabric-floor-light")
        try:
            await _streams(nc.jetstream(), capacity)
            light = _Light(nc, max_tokens)
            await light.subscribe()
            cmds = [["rlfabric.bench.floor", "rollout", "--nats", srv.url, "--subject",
                     f"floor.req.{job}", "--consumer", job.upper()]
                    for job in ("light", "heavy") for _ in range(2)]
            async with children(cmds, ready="floor: rollout ready", timeout=120):
                await light.until(time.monotonic() + 1)  # warm
                alone = [lat for _, lat in await light.until(time.monotonic() + seconds)]
                heavy_done = anyio.Event()
                async with anyio.create_task_group() as tg:
                    async def heavy() -> None:
                        await anyio.run_process(
                            [sys.executable, "-m", "rlfabric.bench.share_floor", "heavy",
                             "--nats", srv.url, "--n", str(burst), "--max-tokens",
                             str(max_tokens)])
                        heavy_done.set()
                    tg.start_soon(heavy)
                    sent = await light.until(time.monotonic() + seconds, heavy_done)
        finally:
            await nc.close()
    at = light.heavy_at
    beside = [lat for t, lat in sent if at and at[0] <= t <= at[-1]]
    return {"alone_p99_ms": pct(alone, 0.99) * 1e3, "beside_p99_ms": pct(beside, 0.99) * 1e3,
            "ratio_p99": pct(beside, 0.99) / pct(alone, 0.99), "light_n": len(beside),
            "burst_s": at[-1] - at[0] if at else 0.0}


async def _heavy(a: argparse.Namespace) -> None:
    """Publish the burst in messages of `HEAVY_PER_MSG`, then wait for every answer."""
    import msgspec
    import nats

    from rlfabric.bench.floor import REPLY_TO

    nc = await nats.connect(a.nats, name="rlfabric-floor-heavy")
    try:
        js = nc.jetstream(publish_async_max_pending=4096)
        got = 0
        all_in = anyio.Event()

        async def on_result(msg: Any) -> None:
            nonlocal got
            got += len(msgspec.msgpack.decode(msg.data))
            if got >= a.n:
                all_in.set()

        await nc.subscribe("floor.res.heavy", cb=on_result)
        enc = msgspec.msgpack.Encoder()
        reqs = _requests("heavy", a.n, a.max_tokens)
        for i in range(0, a.n, HEAVY_PER_MSG):
            await js.publish_async("floor.req.heavy", enc.encode(reqs[i:i + HEAVY_PER_MSG]),
                                   headers={REPLY_TO: "floor.res.heavy"})
        with anyio.fail_after(600):
            await all_in.wait()
    finally:
        await nc.close()


async def torch_floor(capacity: int, max_tokens: int) -> dict[str, Any]:
    """The torch engine alone: medians of 5 single requests and of 3 batches of
    `capacity`."""
    from rlfabric.engines import make_engine, registry
    from rlfabric.engines.protocol import ServesMany
    from rlfabric.schemas import PackedI32, RolloutRequest, SamplingParams

    registry.prepare_process("torch", 1)
    engine = make_engine("torch", registry.kind("torch").default_model)
    assert isinstance(engine, ServesMany)

    def batch(n: int, k: int) -> list[RolloutRequest]:
        return [RolloutRequest(request_id=f"t{k}-{i}", prompt_token_ids=PackedI32([256, 10 + i]),
                               sampling=SamplingParams(max_tokens=max_tokens, seed=i))
                for i in range(n)]

    async def timed(n: int, k: int) -> float:
        t = time.monotonic()
        async for _ in engine.generate_many(batch(n, k), worker_id="floor"):
            pass
        return time.monotonic() - t

    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        await timed(1, -1)  # warm
        one = statistics.median([await timed(1, k) for k in range(5)])
        full = statistics.median([await timed(capacity, k) for k in range(3)])
        tg.cancel_scope.cancel()
    return {"one_ms": one * 1e3, "full_ms": full * 1e3, "ratio": full / one,
            "ratio_p99": 2 * full / one}


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m rlfabric.bench.share_floor",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["heavy"])
    p.add_argument("--nats", required=True)
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--max-tokens", type=int, default=32)
    anyio.run(_heavy, p.parse_args())
