"""Rollout throughput and latency: rlfabric vs an aiohttp server vs a direct in-process call.

For each engine (null: echoes the prompt; torch: the tiny model; vllm: vLLM on tiny64) and each
fleet size, the same requests go through
- `direct`: `engine.generate()` in this process (one engine: there is no fleet to spread over;
  for vllm that is `AsyncLLM` in this process, no bus);
- `http` (null, torch): N `aiohttp` servers, one engine each, a client round-robining JSON
  POSTs (token ids and logprobs as JSON lists, the way RL stacks call inference servers today);
- `rlfabric`: N `rlfabric worker` processes on an embedded nats-server, `FabricClient.generate`;
- `nats-py floor` (null only): the same message pattern with nats-py alone: requests queued by
  the lanes go out together as one persisted message, N processes pull them from one durable
  consumer, echo the prompt (what the null engine does) and persist each message's results as
  one message before acking; the client reads them through an ordered consumer.
With `--trace DIR`, `rlfabric traced` is the rlfabric row again with OpenTelemetry spans on in
the client and every worker, written to a file (its `spans` column counts them). Every path
runs `--concurrency` lanes, each sending one request at a time, so latency is one
request's round trip and throughput is what the fleet sustains.

    rlfabric bench rollout [--workers 1,4] [--engines null,torch] [--trace DIR] [--json]
    rlfabric bench rollout --engine vllm --workers 1,2
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel

from rlfabric.bench._util import children, pct, table
from rlfabric.bus import EmbeddedNats
from rlfabric.bus.cluster import free_ports
from rlfabric.engines import make_engine, running
from rlfabric.schemas import PackedI32, RolloutRequest, RolloutResult, SamplingParams
from rlfabric.trainer import FabricClient

WORKLOAD = {  # engine -> (requests, concurrency, max_tokens)
    "null": (3000, 64, 16),
    "torch": (384, 32, 16),
    "vllm": (384, 32, 32),
}
#: vLLM's CPU build rejects the 16-wide heads of `tiny`
MODEL = {"null": "tiny", "torch": "tiny", "vllm": "tiny64"}


def threads(workers: int) -> int:
    """torch threads per process: the machine's cores shared out, as an operator would."""
    return max(1, (os.cpu_count() or 1) // workers)


def requests(n: int, max_tokens: int, tag: str) -> list[RolloutRequest]:
    return [RolloutRequest(request_id=f"{tag}{i}", prompt_token_ids=PackedI32([256, *range(1, 16)]),
                           min_weight_version=-1,
                           sampling=SamplingParams(max_tokens=max_tokens, seed=i))
            for i in range(n)]


async def run_lanes(reqs: list[RolloutRequest], concurrency: int,
                    one: Callable[[RolloutRequest], Awaitable[int]]) -> dict[str, float]:
    it = iter(reqs)
    lat: list[float] = []
    tokens = 0

    async def lane() -> None:
        nonlocal tokens
        for req in it:
            t0 = time.perf_counter()
            got = await one(req)  # NOTE: not `tokens += await ...`: that reads tokens first
            lat.append(time.perf_counter() - t0)
            tokens += got

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(lane)
    elapsed = time.perf_counter() - t0
    return {"results_s": len(lat) / elapsed, "tokens_s": tokens / elapsed,
            "p50_ms": pct(lat, 0.5) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3}


async def bench_direct(engine_kind: str, n: int, conc: int, max_tokens: int) -> dict:
    async with running(make_engine(engine_kind, MODEL[engine_kind])) as engine:
        async def one(req: RolloutRequest) -> int:
            got = 0
            async for res in engine.generate(req, worker_id="direct"):
                got += len(res.completion_token_ids)
            return got

        await run_lanes(requests(50, max_tokens, "w"), conc, one)
        return await run_lanes(requests(n, max_tokens, "r"), conc, one)


async def bench_http(engine_kind: str, workers: int, n: int, conc: int, max_tokens: int) -> dict:
    import aiohttp

    ports = free_ports(workers)
    cmds = [["rlfabric.bench.http_server", "--engine", engine_kind, "--port", str(p),
             "--threads", str(threads(workers))] for p in ports]
    async with children(cmds, ready="http server ready"):
        urls = itertools.cycle([f"http://127.0.0.1:{p}/generate" for p in ports])
        conn = aiohttp.TCPConnector(limit=conc * 2)
        async with aiohttp.ClientSession(connector=conn) as session:
            async def one(req: RolloutRequest) -> int:
                sp = req.sampling
                body = {"request_id": req.request_id,
                        "prompt_token_ids": req.prompt_token_ids.tolist(),
                        "sampling": {"max_tokens": sp.max_tokens, "seed": sp.seed}}
                async with session.post(next(urls), json=body) as resp:
                    out = await resp.json()
                return sum(len(o["token_ids"]) for o in out)

            await run_lanes(requests(50, max_tokens, "w"), conc, one)
            return await run_lanes(requests(n, max_tokens, "r"), conc, one)


async def bench_fabric(engine_kind: str, workers: int, n: int, conc: int,
                       max_tokens: int, trace: str | None = None) -> dict:
    """`trace`: spans of the workers and of this client go to that file (`--trace`)."""
    from rlfabric.telemetry import Telemetry, configure

    tel = configure(role="trainer", trace_path=trace) if trace else Telemetry()
    try:
        out = await _bench_fabric(engine_kind, workers, n, conc, max_tokens, trace)
    finally:
        tel.shutdown()
    if trace:
        with open(trace, "rb") as f:
            out["spans"] = sum(1 for _ in f)
    return out


async def _bench_fabric(engine_kind: str, workers: int, n: int, conc: int,
                        max_tokens: int, trace: str | None) -> dict:
    async with EmbeddedNats() as nats:
        prefix = f"bench{engine_kind}{workers}"
        per_engine = (["--threads", str(threads(workers))] if engine_kind != "vllm"
                      else ["--threads-bind", "nobind"])
        cmds = [["rlfabric", "worker", "--nats", nats.url, "--prefix", prefix, "--engine",
                 engine_kind, "--model", MODEL[engine_kind], "--worker-id", f"w{i}",
                 "--capacity", str(conc), *per_engine,
                 *(["--trace", trace] if trace else [])]
                for i in range(workers)]
        async with children(cmds, ready="ready", timeout=300), \
                FabricClient.connect(nats.url, prefix=prefix) as fabric:
            await fabric.wait_for_workers(workers, timeout=120)

            async def one(req: RolloutRequest) -> int:
                got = 0
                async for res in fabric.generate([req]):
                    assert isinstance(res, RolloutResult), res
                    got += len(res.completion_token_ids)
                return got

            await run_lanes(requests(50, max_tokens, "w"), conc, one)
            return await run_lanes(requests(n, max_tokens, "r"), conc, one)


async def bench_floor(workers: int, n: int, conc: int, max_tokens: int) -> dict:
    import msgspec
    import nats
    from nats.aio.msg import Msg
    from nats.js.api import (
        AckPolicy,
        ConsumerConfig,
        DeliverPolicy,
        StorageType,
        StreamConfig,
    )

    from rlfabric.bench.floor import REPLY_TO, FloorRequest, FloorResult

    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(list[FloorResult])
    async with EmbeddedNats() as srv:
        nc = await nats.connect(srv.url, name="rlfabric-floor-client")
        try:
            js = nc.jetstream(publish_async_max_pending=4096)
            for name, subj in (("FLOORREQ", "floor.req"), ("FLOORRES", "floor.res.>")):
                await js.add_stream(StreamConfig(name=name, subjects=[subj],
                                                 storage=StorageType.FILE))
            await js.add_consumer("FLOORREQ", ConsumerConfig(
                durable_name="FLOOR", ack_policy=AckPolicy.EXPLICIT, max_ack_pending=4096))
            waiting: dict[str, anyio.Event] = {}

            async def on_results(msg: Msg) -> None:
                for r in dec.decode(msg.data):
                    ev = waiting.pop(r.request_id, None)
                    if ev is not None:
                        ev.set()

            sub = await js.subscribe("floor.res.c", cb=on_results, ordered_consumer=True,
                                     deliver_policy=DeliverPolicy.NEW)
            queue: list[FloorRequest] = []
            queued = [anyio.Event()]

            async def sender() -> None:
                while True:
                    if not queue:
                        await queued[0].wait()
                        queued[0] = anyio.Event()
                        continue
                    batch = queue[:64]
                    del queue[:64]
                    await js.publish_async("floor.req", enc.encode(batch),
                                           headers={REPLY_TO: "floor.res.c"})
                    await anyio.lowlevel.checkpoint()

            async def one(req: RolloutRequest) -> int:
                ev = anyio.Event()
                waiting[req.request_id] = ev
                queue.append(FloorRequest(request_id=req.request_id,
                                          prompt=req.prompt_token_ids.tobytes(),
                                          max_tokens=req.sampling.max_tokens))
                queued[0].set()
                await ev.wait()
                return req.sampling.max_tokens

            cmds = [["rlfabric.bench.floor", "rollout", "--nats", srv.url, "--subject",
                     "floor.req"] for _ in range(workers)]
            async with children(cmds, ready="floor: rollout ready"), \
                    anyio.create_task_group() as tg:
                tg.start_soon(sender)
                await run_lanes(requests(50, max_tokens, "w"), conc, one)
                out = await run_lanes(requests(n, max_tokens, "r"), conc, one)
                tg.cancel_scope.cancel()
            await sub.unsubscribe()
            return out
        finally:
            await nc.close()


async def run(engines: list[str], sizes: list[int], scale: float,
              trace_dir: str | None = None) -> list[dict[str, Any]]:
    rows = []
    for eng in engines:
        n, conc, max_tokens = WORKLOAD[eng]
        n = max(conc, int(n * scale))
        base = {"engine": eng, "requests": n, "concurrency": conc}
        fleet_rows = []
        for k in sizes:
            if eng != "vllm":  # the HTTP server serves the engines rlfabric ships in-process
                fleet_rows.append({**base, "path": "http", "workers": k,
                                   **await bench_http(eng, k, n, conc, max_tokens)})
            fleet_rows.append({**base, "path": "rlfabric", "workers": k,
                               **await bench_fabric(eng, k, n, conc, max_tokens)})
            if trace_dir:  # the same, with every span written to a file
                path = os.path.join(trace_dir, f"spans-{eng}-{k}.jsonl")
                with open(path, "wb"):
                    pass  # this run's spans only
                fleet_rows.append({**base, "path": "rlfabric traced", "workers": k,
                                   **await bench_fabric(eng, k, n, conc, max_tokens, path)})
            if eng == "null":  # the transport alone: nothing to compare a model with
                fleet_rows.append({**base, "path": "nats-py floor", "workers": k,
                                   **await bench_floor(k, n, conc, max_tokens)})
        # NOTE: measured last: an in-process vLLM sets environment variables (LD_PRELOAD, ...)
        # that processes started after it would inherit
        rows += [{**base, "path": "direct", "workers": 1,
                  **await bench_direct(eng, n, conc, max_tokens)}, *fleet_rows]
    http = {(r["engine"], r["workers"]): r["results_s"] for r in rows if r["path"] == "http"}
    direct = {r["engine"]: r["tokens_s"] for r in rows if r["path"] == "direct"}
    for r in rows:
        ref = http.get((r["engine"], r["workers"]))
        r["vs_http"] = r["results_s"] / ref if ref else float("nan")
        r["vs_direct"] = r["tokens_s"] / direct[r["engine"]] if direct.get(r["engine"]) \
            else float("nan")
    return rows


def main(args: argparse.Namespace) -> int:
    engines = [e for e in args.engines.split(",") if e]
    sizes = [int(x) for x in args.workers.split(",") if x]
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    rows = anyio.run(run, engines, sizes, args.scale, args.trace)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cols = [("engine", "engine", ""), ("path", "path", ""), ("workers", "workers", ""),
            ("requests", "requests", ""), ("concurrency", "lanes", ""),
            ("results_s", "results/s", ".0f"), ("tokens_s", "tokens/s", ".0f"),
            ("p50_ms", "p50 ms", ".2f"), ("p99_ms", "p99 ms", ".2f"),
            ("vs_http", "x http", ".2f"), ("vs_direct", "x direct tok/s", ".2f")]
    if args.trace:
        for r in rows:
            r.setdefault("spans", "-")
        cols.append(("spans", "spans", ""))
    print(table(rows, cols))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", "--engine", default="null,torch",
                   help="comma-separated: null,torch,vllm (vllm needs vLLM installed; its "
                   "rows are direct AsyncLLM in-process vs rlfabric workers, no HTTP row)")
    p.add_argument("--workers", default="1,4", help="fleet sizes (default %(default)s)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply the request counts (e.g. 0.1 for a quick look)")
    p.add_argument("--trace", metavar="DIR", default=None,
                   help="also run rlfabric with tracing on (client and workers writing spans to "
                   "DIR/spans-<engine>-<workers>.jsonl): a `rlfabric traced` row beside the "
                   "untraced one")
    p.add_argument("--json", action="store_true")
