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

Every path's fleet (and the direct engine) is started and warmed once per fleet size; then
`--rounds` rounds run every path once each, in a rotating order. A row is the median of its
rounds (latency percentiles over all of them); `x http` and `x direct` are the medians of the
per-round ratios. One run of each path lasts a second or less on these shared machines, where
a slow second is common: alternating rounds put it in one round of each path, not on one path.
The traced row, and vLLM's direct row, run their rounds on their own (see `run`).

    rlfabric bench rollout [--workers 1,4] [--engines null,torch] [--rounds 5] [--trace DIR]
                           [--max-tokens N]
    rlfabric bench rollout --engine vllm --workers 1,2
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel

from rlfabric.bench._util import children, pct, table
from rlfabric.bus import EmbeddedNats
from rlfabric.bus.cluster import free_ports
from rlfabric.engines import make_engine, registry, running
from rlfabric.schemas import PackedI32, RolloutRequest, RolloutResult, SamplingParams
from rlfabric.trainer import FabricClient

WORKLOAD = {  # engine -> (requests, concurrency, max_tokens)
    "null": (3000, 64, 16),
    "torch": (384, 32, 16),
    "vllm": (384, 32, 32),
}
#: one run of one path, at most (seconds): a stuck path ends the bench with its fleet's output
MEASURE_TIMEOUT_S = 300.0


def threads(workers: int) -> int:
    """torch threads per process: the machine's cores shared out, as an operator would."""
    return max(1, (os.cpu_count() or 1) // workers)


def requests(n: int, max_tokens: int, tag: str) -> list[RolloutRequest]:
    return [RolloutRequest(request_id=f"{tag}{i}", prompt_token_ids=PackedI32([256, *range(1, 16)]),
                           min_weight_version=-1,
                           sampling=SamplingParams(max_tokens=max_tokens, seed=i))
            for i in range(n)]


#: one request through a path; returns the tokens it got back
One = Callable[[RolloutRequest], Awaitable[int]]


async def run_lanes(reqs: list[RolloutRequest], concurrency: int, one: One) -> dict[str, Any]:
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
    return {"results_s": len(lat) / elapsed, "tokens_s": tokens / elapsed, "latencies": lat}


@contextlib.asynccontextmanager
async def direct_path(engine_kind: str, torch_threads: int) -> AsyncIterator[One]:
    if registry.kind(engine_kind).torch_threads:  # as the workers' and HTTP servers' `--threads`
        import torch

        torch.set_num_threads(torch_threads)
    model = registry.kind(engine_kind).default_model
    async with running(make_engine(engine_kind, model)) as engine:
        async def one(req: RolloutRequest) -> int:
            got = 0
            async for res in engine.generate(req, worker_id="direct"):
                got += len(res.completion_token_ids)
            return got

        yield one


@contextlib.asynccontextmanager
async def http_path(engine_kind: str, workers: int, conc: int,
                    torch_threads: int) -> AsyncIterator[One]:
    import aiohttp

    ports = free_ports(workers)
    cmds = [["rlfabric.bench.http_server", "--engine", engine_kind, "--port", str(p),
             "--threads", str(torch_threads)] for p in ports]
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

            yield one


@contextlib.asynccontextmanager
async def fabric_path(engine_kind: str, workers: int, conc: int, torch_threads: int,
                      trace: str | None = None) -> AsyncIterator[One]:
    """`trace`: the workers write their spans to that file (`--trace`; the client's are this
    process's telemetry, configured by the caller)."""
    async with EmbeddedNats() as nats:
        prefix = f"bench{engine_kind}{workers}{'t' if trace else ''}"
        model = registry.kind(engine_kind).default_model
        per_engine = (["--threads", str(torch_threads)] if engine_kind != "vllm"
                      else ["--threads-bind", "nobind"])
        cmds = [["rlfabric", "worker", "--nats", nats.url, "--prefix", prefix, "--engine",
                 engine_kind, "--model", model, "--worker-id", f"w{i}",
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

            yield one


@contextlib.asynccontextmanager
async def floor_path(workers: int) -> AsyncIterator[One]:
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
                yield one
                tg.cancel_scope.cancel()
            await sub.unsubscribe()
        finally:
            await nc.close()


class _Runs:
    """Every measured run of one path."""

    def __init__(self) -> None:
        #: (fleet size, round) -> what `run_lanes` measured; the direct path's keys are those
        #: of the fleet paths it ran beside (the same round of the same block)
        self.by_round: dict[tuple[int, int], dict[str, Any]] = {}
        self.spans: int | None = None  # the traced row: spans written

    def row(self) -> dict[str, Any]:
        runs = list(self.by_round.values())
        lat = [x for r in runs for x in r["latencies"]]
        return {"results_s": statistics.median(r["results_s"] for r in runs),
                "tokens_s": statistics.median(r["tokens_s"] for r in runs),
                "p50_ms": pct(lat, 0.5) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3,
                "rounds": len(runs),
                "results_s_rounds": [round(r["results_s"], 1) for r in runs]}


def paired(a: _Runs, b: _Runs | None, key: str) -> float:
    """The median, over the rounds both ran, of a's `key` over b's; with no round in common
    (b measured on its own), the ratio of the medians."""
    if b is None or not b.by_round:
        return float("nan")
    both = sorted(set(a.by_round) & set(b.by_round))
    if both:
        return statistics.median(a.by_round[r][key] / b.by_round[r][key] for r in both)
    return (statistics.median(r[key] for r in a.by_round.values())
            / statistics.median(r[key] for r in b.by_round.values()))


async def measure(one: One, n: int, conc: int, max_tokens: int, tag: str) -> dict[str, Any]:
    with anyio.fail_after(MEASURE_TIMEOUT_S):
        return await run_lanes(requests(n, max_tokens, tag), conc, one)


async def run(engines: list[str], sizes: list[int], scale: float, rounds: int = 1,
              trace_dir: str | None = None, torch_threads: int = 0,
              completion: int = 0) -> list[dict[str, Any]]:
    """Per engine and fleet size, every path's fleet is started and warmed once; then
    `rounds` rounds each run every path once, in an order that rotates from round to round,
    so every path meets the same host (these machines are shared: a slow second hits one
    round of each path, not one path). A row gives the median over its rounds; its ratios
    are the medians of the per-round ratios. `completion` (0: the workload's) is every
    request's `max_tokens`."""
    rows = []
    for eng in engines:
        n, conc, default_tokens = WORKLOAD[eng]
        max_tokens = completion or default_tokens
        n = max(conc, int(n * scale))
        base = {"engine": eng, "requests": n, "concurrency": conc, "max_tokens": max_tokens}
        # NOTE: an in-process vLLM sets environment variables (LD_PRELOAD, ...) that processes
        # started after it would inherit, and two vLLMs on one CPU machine contend: its direct
        # path is measured on its own, after every fleet is down
        inline = eng != "vllm"
        direct = _Runs()
        blocks: list[tuple[int, dict[str, _Runs]]] = []
        async with contextlib.AsyncExitStack() as engine_stack:
            direct_one = (await engine_stack.enter_async_context(
                direct_path(eng, torch_threads or threads(1))) if inline else None)
            if direct_one is not None:
                await measure(direct_one, 50, conc, max_tokens, "w")
            for k in sizes:
                runs: dict[str, _Runs] = {}
                async with contextlib.AsyncExitStack() as stack:
                    paths: dict[str, One] = {}
                    if eng != "vllm":  # the HTTP server serves the engines rlfabric ships
                        paths["http"] = await stack.enter_async_context(
                            http_path(eng, k, conc, torch_threads or threads(k)))
                    paths["rlfabric"] = await stack.enter_async_context(
                        fabric_path(eng, k, conc, torch_threads or threads(k)))
                    if eng == "null":  # the transport alone: nothing to compare a model with
                        paths["nats-py floor"] = await stack.enter_async_context(floor_path(k))
                    for one in paths.values():
                        await measure(one, 50, conc, max_tokens, "w")
                    if direct_one is not None:
                        paths["direct"] = direct_one
                    names = list(paths)
                    for r in range(rounds):
                        for i in range(len(names)):
                            name = names[(r + i) % len(names)]
                            measured = await measure(paths[name], n, conc, max_tokens,
                                                     f"r{r}.")
                            (direct if name == "direct" else
                             runs.setdefault(name, _Runs())).by_round[(k, r)] = measured
                if trace_dir:  # the rlfabric row again, every span written to a file
                    runs["rlfabric traced"] = await _traced(
                        eng, k, n, conc, max_tokens, rounds, trace_dir,
                        torch_threads or threads(k))
                blocks.append((k, runs))
        if not inline:
            async with direct_path(eng, torch_threads or threads(1)) as one:
                await measure(one, 50, conc, max_tokens, "w")
                for r in range(rounds):
                    direct.by_round[(0, r)] = await measure(one, n, conc, max_tokens, f"r{r}.")
        one_http = next((block.get("http") for size, block in blocks if size == 1), None)
        rows.append({**base, "path": "direct", "workers": 1, **direct.row(),
                     "vs_http": paired(direct, one_http, "results_s"), "vs_direct": 1.0})
        for k, runs in blocks:
            for name, path_runs in runs.items():
                rows.append({**base, "path": name, "workers": k, **path_runs.row(),
                             "vs_http": paired(path_runs, runs.get("http"), "results_s"),
                             "vs_direct": paired(path_runs, direct, "tokens_s"),
                             **({"spans": path_runs.spans} if path_runs.spans is not None
                                else {})})
    return rows


async def _traced(eng: str, k: int, n: int, conc: int, max_tokens: int, rounds: int,
                  trace_dir: str, torch_threads: int) -> _Runs:
    """The rlfabric path with OpenTelemetry spans on in this client and every worker, on its
    own (tracing is this process's: it would trace the untraced rows too)."""
    from rlfabric.telemetry import configure

    path = os.path.join(trace_dir, f"spans-{eng}-{k}.jsonl")
    with open(path, "wb"):
        pass  # this run's spans only
    runs = _Runs()
    tel = configure(role="trainer", trace_path=path)
    try:
        async with fabric_path(eng, k, conc, torch_threads, path) as one:
            await measure(one, 50, conc, max_tokens, "w")
            for r in range(rounds):
                runs.by_round[(-1, r)] = await measure(one, n, conc, max_tokens, f"r{r}.")
    finally:
        tel.shutdown()
    with open(path, "rb") as f:
        runs.spans = sum(1 for _ in f)
    return runs


def main(args: argparse.Namespace) -> int:
    engines = [e for e in args.engines.split(",") if e]
    sizes = [int(x) for x in args.workers.split(",") if x]
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    if args.rounds < 1 or args.threads < 0 or args.max_tokens < 0:
        print("rlfabric bench rollout: --rounds must be >= 1, --threads and --max-tokens "
              ">= 0", file=sys.stderr)
        return 2
    rows = anyio.run(run, engines, sizes, args.scale, args.rounds, args.trace, args.threads,
                     args.max_tokens)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cols = [("engine", "engine", ""), ("path", "path", ""), ("workers", "workers", ""),
            ("requests", "requests", ""), ("concurrency", "lanes", ""),
            ("max_tokens", "tokens/req", ""), ("rounds", "rounds", ""),
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
    p.add_argument("--rounds", type=int, default=5,
                   help="runs of every path, alternating (default %(default)s): a row is the "
                   "median of its runs, its ratios the medians of the per-round ratios")
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="torch threads of every engine (direct, HTTP servers, workers; not "
                   "vLLM's); default: the machine's cores shared out among a fleet's engines")
    p.add_argument("--max-tokens", type=int, default=0, metavar="N",
                   help="completion tokens per request, every engine (default: null 16, "
                   "torch 16, vllm 32; null echoes the 16-token prompt, so at most 16 there). "
                   "Through a fleet every batch pays two hops (results "
                   "out, the next requests in) that the direct path does not: longer "
                   "completions spread them over more tokens")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply the request counts (e.g. 0.1 for a quick look)")
    p.add_argument("--trace", metavar="DIR", default=None,
                   help="also run rlfabric with tracing on (client and workers writing spans to "
                   "DIR/spans-<engine>-<workers>.jsonl): a `rlfabric traced` row beside the "
                   "untraced one")
    p.add_argument("--json", action="store_true")
