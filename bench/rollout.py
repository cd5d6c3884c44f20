"""Rollout throughput and latency: rlfabric vs an aiohttp server vs a direct in-process call.

For each engine (null: echoes the prompt; torch: the tiny model; vllm: vLLM on tiny64) and each
fleet size, the same requests go through
- `direct`: `engine.generate()` in this process (one engine: there is no fleet to spread over;
  for vllm that is `AsyncLLM` in this process, no bus);
- `http` (null, torch): N `aiohttp` servers, one engine each, a client round-robining JSON
  POSTs (token ids and logprobs as JSON lists, the way RL stacks call inference servers today;
  the torch engine runs a batch to its end, so POSTs arriving one by one start small batches:
  for torch, `x http` measures that batcher as much as HTTP);
- `rlfabric`: N `rlfabric worker` processes on an embedded nats-server, `FabricClient.generate`;
- `nats-py floor` (null, torch): the same message pattern with nats-py alone: requests queued
  by the lanes go out together as one persisted message, N processes pull them from one durable
  consumer, answer them (null: echo the prompt, as the null engine does; torch: the same torch
  engine in that process, a message's requests in one `generate_many` call) and persist each
  message's results as one message before acking; the client reads them through an ordered
  consumer. What rlfabric adds to a worker's turnaround is the gap between its row and this.

The CPU columns are microseconds per request, over all of a row's rounds: `client` the event
loop of the bench's process (the lanes; for `direct` also the engine's intake, not its model
threads), `workers` the main threads of the processes the path started (their event loops:
not the engines' model threads, nor vLLM's EngineCore process), `nats` its nats-servers (Linux:
the processes' CPU clocks and the threads' scheduler counts, to the nanosecond; NaN where a
path has none, for the traced row, or off Linux).

With `--sync always|DURATION`, `rlfabric sync=...` is the rlfabric row again on a server that
flushes what it stores to disk as that says (always: before each acknowledgement), the cost of
that durability (docs/reliability.md).

With `--trace DIR`, `rlfabric traced` is the rlfabric row again with OpenTelemetry spans on in
the client and every worker, written to a file (its `spans` column counts them). Every path
runs `--lanes` lanes, each sending one request at a time, so latency is one
request's round trip and throughput is what the fleet sustains.

Every path's fleet (and the direct engine) is started and warmed once per fleet size; then
`--rounds` rounds run every path once each, in a rotating order. A row is the median of its
rounds (latency percentiles over all of them); `x http` and `x direct` are the medians of the
per-round ratios. One run of each path lasts a second or less on these shared machines, where
a slow second is common: alternating rounds put it in one round of each path, not on one path.
The traced row, and vLLM's direct row, run their rounds on their own (see `run`).

With `--lanes` above a worker's `--capacity` the queue is deeper than the fleet takes at once
(a GRPO step's prompts, say): `--lanes 128 --capacity 64` keeps a second batch of requests
waiting for each engine batch of 64 (the torch engine's own batch size, so the direct path's
batches are the same size), and `--prefetch N` has each worker hold up to N of them beside
its engine. The request count grows with the lanes, so a run holds as many batches.

    rlfabric bench rollout [--workers 1,4] [--engines null,torch] [--rounds 5] [--trace DIR]
                           [--max-tokens N]
    rlfabric bench rollout --engine torch --workers 1 --lanes 128 --capacity 64 [--prefetch 64]
    rlfabric bench rollout --engine vllm --workers 1,2
    rlfabric bench rollout --engine null,torch --workers 1,4 --sync always
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel

from rlfabric.bench._util import (
    child_pids,
    children,
    cpu_seconds,
    metrics_on,
    named,
    pct,
    table,
)
from rlfabric.bus import EmbeddedNats
from rlfabric.bus.nats.cluster import free_ports
from rlfabric.bus.nats.server import check_sync
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
    # as the workers and HTTP servers run theirs (`--threads`)
    registry.prepare_process(engine_kind, torch_threads)
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
                      trace: str | None = None, *, capacity: int = 0, prefetch: int = 0,
                      sync: str = "") -> AsyncIterator[One]:
    """`trace`: the workers write their spans to that file (`--trace`; the client's are this
    process's telemetry, configured by the caller). `capacity` (0: `conc`) and `prefetch`:
    each worker's `--capacity` and `--prefetch`. `sync`: the server's (`EmbeddedNats`)."""
    async with EmbeddedNats(sync=sync) as nats:
        prefix = f"bench{engine_kind}{workers}{'t' if trace else ''}{'s' if sync else ''}"
        model = registry.kind(engine_kind).default_model
        per_engine = (["--threads", str(torch_threads)] if engine_kind != "vllm"
                      else ["--threads-bind", "nobind"])
        cmds = [["rlfabric", "worker", "--nats", nats.url, "--prefix", prefix, "--engine",
                 engine_kind, "--model", model, "--worker-id", f"w{i}",
                 "--capacity", str(capacity or conc), "--prefetch", str(prefetch), *per_engine,
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
async def floor_path(workers: int, engine: str = "", torch_threads: int = 1
                     ) -> AsyncIterator[One]:
    """The same rollouts over raw nats-py: requests batched into a JetStream stream, `workers`
    processes (`rlfabric.bench.floor rollout`) echoing them or serving them with `engine`,
    results back through a second stream."""
    import nats

    async with EmbeddedNats() as srv:
        nc = await nats.connect(srv.url, name="rlfabric-floor-client")
        try:
            js = nc.jetstream(publish_async_max_pending=4096)
            await _floor_streams(js)
            per_engine = (["--engine", engine, "--threads", str(torch_threads)] if engine
                          else [])
            cmds = [["rlfabric.bench.floor", "rollout", "--nats", srv.url, "--subject",
                     "floor.req", *per_engine] for _ in range(workers)]
            async with _FloorClient(js) as one, children(cmds, ready="floor: rollout ready",
                                                         timeout=300):
                yield one
        finally:
            await nc.close()


async def _floor_streams(js: Any) -> None:
    from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

    for name, subj in (("FLOORREQ", "floor.req"), ("FLOORRES", "floor.res.>")):
        await js.add_stream(StreamConfig(name=name, subjects=[subj], storage=StorageType.FILE))
    await js.add_consumer("FLOORREQ", ConsumerConfig(
        durable_name="FLOOR", ack_policy=AckPolicy.EXPLICIT, max_ack_pending=4096))


class _FloorClient:
    """`async with _FloorClient(js) as one`: `one(request)` queues it, a sender publishes
    queued requests in batches of 64, and it returns once its result is back."""

    def __init__(self, js: Any) -> None:
        import msgspec

        from rlfabric.bench.floor import FloorResult

        self.js = js
        self.enc = msgspec.msgpack.Encoder()
        self.dec = msgspec.msgpack.Decoder(list[FloorResult])
        self.waiting: dict[str, anyio.Event] = {}
        self.tokens: dict[str, int] = {}  # request id -> tokens its result brought
        self.queue: list[Any] = []
        self.queued = anyio.Event()
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> One:
        from nats.js.api import DeliverPolicy

        sub = await self.js.subscribe("floor.res.c", cb=self._on_results,
                                      ordered_consumer=True, deliver_policy=DeliverPolicy.NEW)
        self._stack.push_async_callback(sub.unsubscribe)
        tg = await self._stack.enter_async_context(anyio.create_task_group())
        self._stack.callback(tg.cancel_scope.cancel)
        tg.start_soon(self._sender)
        return self.one

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _on_results(self, msg: Any) -> None:
        for r in self.dec.decode(msg.data):
            ev = self.waiting.pop(r.request_id, None)
            if ev is not None:
                self.tokens[r.request_id] = len(r.tokens) // 4
                ev.set()

    async def _sender(self) -> None:
        from rlfabric.bench.floor import REPLY_TO

        while True:
            if not self.queue:
                await self.queued.wait()
                self.queued = anyio.Event()
                continue
            batch, self.queue = self.queue[:64], self.queue[64:]
            await self.js.publish_async("floor.req", self.enc.encode(batch),
                                        headers={REPLY_TO: "floor.res.c"})
            await anyio.lowlevel.checkpoint()

    async def one(self, req: RolloutRequest) -> int:
        from rlfabric.bench.floor import FloorRequest

        ev = anyio.Event()
        self.waiting[req.request_id] = ev
        self.queue.append(FloorRequest(request_id=req.request_id,
                                       prompt=req.prompt_token_ids.tobytes(),
                                       max_tokens=req.sampling.max_tokens,
                                       seed=req.sampling.seed or 0))
        self.queued.set()
        await ev.wait()
        return self.tokens.pop(req.request_id)


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
                "results_s_rounds": [round(r["results_s"], 1) for r in runs],
                **{f"{who}_cpu_us": 1e6 * sum(r.get("cpu", _NO_CPU)[i] for r in runs)
                   / len(lat) for i, who in enumerate(_CPU)}}


#: whose CPU a round measures (`_Procs.cpu`): the client's event loop, the fleet's workers'
#: event loops (their main threads: not an engine's own threads), the fleet's nats-servers
_CPU = ("client", "workers", "nats")
_NO_CPU = (math.nan,) * len(_CPU)


@dataclass(frozen=True)
class _Procs:
    """The processes a path started: its nats-servers, and the rest (its workers, HTTP
    servers or floor responders)."""

    nats: list[int]
    workers: list[int]

    @classmethod
    def started(cls, pids: set[int]) -> _Procs:
        nats = sorted(p for p in pids if named(p, "nats-server"))
        return cls(nats=nats, workers=sorted(pids - set(nats)))

    def cpu(self) -> tuple[float, float, float]:
        """CPU seconds so far, as `_CPU` names them (none: NaN)."""
        return (time.thread_time(),
                cpu_seconds(self.workers, thread=True) if self.workers else math.nan,
                cpu_seconds(self.nats) if self.nats else math.nan)


_IN_PROCESS = _Procs(nats=[], workers=[])


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


async def measure(one: One, n: int, conc: int, max_tokens: int, tag: str,
                  procs: _Procs | None = None) -> dict[str, Any]:
    """One run of a path; with `procs`, what it cost each of them (`cpu`, as `_CPU`)."""
    before = procs.cpu() if procs is not None else _NO_CPU
    with anyio.fail_after(MEASURE_TIMEOUT_S):
        out = await run_lanes(requests(n, max_tokens, tag), conc, one)
    if procs is not None:
        out["cpu"] = tuple(b - a for a, b in zip(before, procs.cpu(), strict=True))
    return out


@dataclass(frozen=True)
class _Load:
    """One engine's workload: how many requests, how many at once, how long each."""

    eng: str
    n: int
    conc: int
    max_tokens: int
    rounds: int
    torch_threads: int  # 0: by fleet size (`threads`)
    capacity: int = 0  # each worker's; 0: `conc`
    prefetch: int = 0
    sync: str = ""  # a second rlfabric row on a server flushing as this says ("": none)

    def threads(self, k: int) -> int:
        return self.torch_threads or threads(k)


async def run(engines: list[str], sizes: list[int], scale: float, rounds: int = 1,
              trace_dir: str | None = None, torch_threads: int = 0,
              completion: int = 0, lanes: int = 0, capacity: int = 0, prefetch: int = 0,
              sync: str = "") -> list[dict[str, Any]]:
    """Per engine and fleet size, every path's fleet is started and warmed once; then
    `rounds` rounds each run every path once, in an order that rotates from round to round,
    so every path meets the same host (these machines are shared: a slow second hits one
    round of each path, not one path). A row gives the median over its rounds; its ratios
    are the medians of the per-round ratios. `completion` (0: the workload's) is every
    request's `max_tokens`. `lanes` (0: the workload's) is every path's; the request count
    grows with it. `capacity` / `prefetch`: every rlfabric worker's (0 capacity: the lanes).
    `sync`: an `rlfabric sync=...` row, the same fleet on a server flushing as it says."""
    rows = []
    for eng in engines:
        n, default_lanes, default_tokens = WORKLOAD[eng]
        conc = lanes or default_lanes
        n = int(n * scale * conc / default_lanes)
        load = _Load(eng=eng, n=max(conc, n), conc=conc,
                     max_tokens=completion or default_tokens, rounds=rounds,
                     torch_threads=torch_threads, capacity=capacity, prefetch=prefetch,
                     sync=sync)
        direct, blocks = await _engine(load, sizes, trace_dir)
        rows += _rows(load, direct, blocks)
    return rows


async def _engine(load: _Load, sizes: list[int], trace_dir: str | None
                  ) -> tuple[_Runs, list[tuple[int, dict[str, _Runs]]]]:
    """Every fleet size of one engine, and its direct path."""
    # NOTE: an in-process vLLM sets environment variables (LD_PRELOAD, ...) that processes
    # started after it would inherit, and two vLLMs on one CPU machine contend: its direct
    # path is measured on its own, after every fleet is down
    inline = load.eng != "vllm"
    direct = _Runs()
    blocks: list[tuple[int, dict[str, _Runs]]] = []
    async with contextlib.AsyncExitStack() as engine_stack:
        direct_one = (await engine_stack.enter_async_context(
            direct_path(load.eng, load.threads(1))) if inline else None)
        if direct_one is not None:
            await measure(direct_one, 50, load.conc, load.max_tokens, "w")
        for k in sizes:
            runs = await _block(load, k, direct_one, direct)
            if trace_dir:  # the rlfabric row again, every span written to a file
                runs["rlfabric traced"] = await _traced(load, k, trace_dir)
            blocks.append((k, runs))
    if not inline:
        async with direct_path(load.eng, load.threads(1)) as one:
            await measure(one, 50, load.conc, load.max_tokens, "w")
            for r in range(load.rounds):
                direct.by_round[(0, r)] = await measure(one, load.n, load.conc,
                                                        load.max_tokens, f"r{r}.",
                                                        _IN_PROCESS)
    return direct, blocks


async def _block(load: _Load, k: int, direct_one: One | None, direct: _Runs
                 ) -> dict[str, _Runs]:
    """Every path at fleet size k, started and warmed, then measured round by round in a
    rotating order (the direct path's rounds go into `direct`)."""
    runs: dict[str, _Runs] = {}
    async with contextlib.AsyncExitStack() as stack:
        paths: dict[str, One] = {}
        procs: dict[str, _Procs] = {}  # what each path started

        async def start(name: str, path: contextlib.AbstractAsyncContextManager[One]) -> None:
            before = child_pids()
            paths[name] = await stack.enter_async_context(path)
            procs[name] = _Procs.started(child_pids() - before)

        if load.eng != "vllm":  # the HTTP server serves the engines rlfabric ships
            await start("http", http_path(load.eng, k, load.conc, load.threads(k)))
        await start("rlfabric", fabric_path(load.eng, k, load.conc, load.threads(k),
                                            capacity=load.capacity, prefetch=load.prefetch))
        if load.sync:  # the same fleet on a server that flushes as --sync says
            await start(f"rlfabric sync={load.sync}", fabric_path(
                load.eng, k, load.conc, load.threads(k), capacity=load.capacity,
                prefetch=load.prefetch, sync=load.sync))
        if load.eng != "vllm":  # the same messages with nats-py alone (and the same engine)
            await start("nats-py floor", floor_path(
                k, "" if load.eng == "null" else load.eng, load.threads(k)))
        for one in paths.values():
            await measure(one, 50, load.conc, load.max_tokens, "w")
        if direct_one is not None:
            paths["direct"] = direct_one
        names = list(paths)
        for r in range(load.rounds):
            for i in range(len(names)):
                name = names[(r + i) % len(names)]
                measured = await measure(paths[name], load.n, load.conc, load.max_tokens,
                                         f"r{r}.", procs.get(name, _IN_PROCESS))
                (direct if name == "direct" else
                 runs.setdefault(name, _Runs())).by_round[(k, r)] = measured
    return runs


def _rows(load: _Load, direct: _Runs, blocks: list[tuple[int, dict[str, _Runs]]]
          ) -> list[dict[str, Any]]:
    base = {"engine": load.eng, "requests": load.n, "concurrency": load.conc,
            "max_tokens": load.max_tokens, "worker_capacity": load.capacity or load.conc,
            "prefetch": load.prefetch}
    one_http = next((block.get("http") for size, block in blocks if size == 1), None)
    rows = [{**base, "path": "direct", "workers": 1, **direct.row(),
             "vs_http": paired(direct, one_http, "results_s"), "vs_direct": 1.0}]
    for k, runs in blocks:
        for name, path_runs in runs.items():
            rows.append({**base, "path": name, "workers": k, **path_runs.row(),
                         "vs_http": paired(path_runs, runs.get("http"), "results_s"),
                         "vs_direct": paired(path_runs, direct, "tokens_s"),
                         **({"spans": path_runs.spans} if path_runs.spans is not None
                            else {})})
    return rows


async def _traced(load: _Load, k: int, trace_dir: str) -> _Runs:
    """The rlfabric path with OpenTelemetry spans on in this client and every worker, on its
    own (tracing is this process's: it would trace the untraced rows too)."""
    from rlfabric.telemetry import configure

    eng, n, conc, max_tokens = load.eng, load.n, load.conc, load.max_tokens
    path = os.path.join(trace_dir, f"spans-{eng}-{k}.jsonl")
    with open(path, "wb"):
        pass  # this run's spans only
    runs = _Runs()
    tel = configure(role="trainer", trace_path=path)
    try:
        async with fabric_path(eng, k, conc, load.threads(k), path, capacity=load.capacity,
                               prefetch=load.prefetch) as one:
            await measure(one, 50, conc, max_tokens, "w")
            for r in range(load.rounds):
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
    if args.rounds < 1 or min(args.threads, args.max_tokens, args.lanes, args.capacity,
                              args.prefetch) < 0:
        print("rlfabric bench rollout: --rounds must be >= 1; --threads, --max-tokens, --lanes, "
              "--capacity and --prefetch >= 0", file=sys.stderr)
        return 2
    try:
        check_sync(args.sync)
    except ValueError as exc:
        print(f"rlfabric bench rollout: --{exc}", file=sys.stderr)
        return 2
    with metrics_on(args.metrics):
        rows = anyio.run(run, engines, sizes, args.scale, args.rounds, args.trace,
                         args.threads, args.max_tokens, args.lanes, args.capacity,
                         args.prefetch, args.sync)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cols = [("engine", "engine", ""), ("path", "path", ""), ("workers", "workers", ""),
            ("requests", "requests", ""), ("concurrency", "lanes", ""),
            ("max_tokens", "tokens/req", ""), ("rounds", "rounds", ""),
            ("results_s", "results/s", ".0f"), ("tokens_s", "tokens/s", ".0f"),
            ("p50_ms", "p50 ms", ".2f"), ("p99_ms", "p99 ms", ".2f"),
            ("vs_http", "x http", ".2f"), ("vs_direct", "x direct tok/s", ".2f"),
            ("client_cpu_us", "client us/req", ".0f"),
            ("workers_cpu_us", "workers us/req", ".0f"), ("nats_cpu_us", "nats us/req", ".0f")]
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
    p.add_argument("--lanes", type=int, default=0, metavar="N",
                   help="requests in flight at once, every path (default: null 64, torch 32, "
                   "vllm 32); the request count grows with it")
    p.add_argument("--capacity", type=int, default=0, metavar="N",
                   help="each rlfabric worker's --capacity (default: the lanes); below the "
                   "lanes, requests queue for the fleet")
    p.add_argument("--prefetch", type=int, default=0, metavar="N",
                   help="each rlfabric worker's --prefetch (default %(default)s)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply the request counts (e.g. 0.1 for a quick look)")
    p.add_argument("--trace", metavar="DIR", default=None,
                   help="also run rlfabric with tracing on (client and workers writing spans to "
                   "DIR/spans-<engine>-<workers>.jsonl): a `rlfabric traced` row beside the "
                   "untraced one")
    p.add_argument("--sync", default="", metavar="always|DURATION",
                   help="also run rlfabric on a server that flushes to disk as --sync says "
                   "(always: before acknowledging each write): a row beside the default's")
    p.add_argument("--metrics", action="store_true",
                   help="Prometheus metrics on, in this process and every worker (what they "
                   "cost)")
    p.add_argument("--json", action="store_true")
