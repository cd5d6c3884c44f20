"""Agent sessions on vLLM workers with prefix caching: session affinity on, then off, the same
workload in one run.

`--sessions` concurrent sessions of `--turns` turns each, through `FabricClient.generate`
token-in/token-out as an agent harness's trainer-side loop drives it: a session opens with the
row's shared system prompt and tool definitions (`--system-tokens`) and its own task
(`--first-tokens`); each later turn's prompt is the previous one, the tokens sampled for it
and `--user-tokens` new ones (a tool result, the next user message), so a session's context
grows past 1,000 tokens. The model is `small64` (9.4M
parameters, byte vocabulary): large enough that prefilling a long context costs what a prefix
cache saves. With affinity each turn goes to the worker that served the session's previous turn
(`generate(..., session=)`); without it, to the workers' shared queue. Each row starts from an
empty prefix cache and its own tokens. Columns: turn latency p50/p99, completion tokens/s,
vLLM's own prefix-cache hit rate over the row (tokens found in the cache over tokens looked
up, from its scheduler stats), and the share of turns after the first served by the worker of
the session's previous turn.

    rlfabric bench agent [--sessions 16] [--turns 8] [--workers 2] [--engine vllm|torch]
                         [--json]

`--engine torch` runs the same rows on the torch engine (no prefix cache: no hit rate), a quick
run where vLLM is not installed.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from typing import Any

import anyio

from rlfabric.bench._util import children, environ, pct, table
from rlfabric.bus import EmbeddedNats
from rlfabric.engines import checkpoint_dir, registry
from rlfabric.schemas import PackedI32, RolloutRequest, RolloutResult, SamplingParams
from rlfabric.trainer import FabricClient

MODEL = "small64"
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=16, help="concurrent sessions")
    p.add_argument("--turns", type=int, default=8, help="turns per session")
    p.add_argument("--system-tokens", type=int, default=768,
                   help="the system prompt and tool definitions every session opens with")
    p.add_argument("--first-tokens", type=int, default=64, help="a session's own task")
    p.add_argument("--user-tokens", type=int, default=48, help="tokens each turn adds")
    p.add_argument("--max-tokens", type=int, default=16, help="completion tokens per turn")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--engine", default="vllm", choices=registry.names())
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=32,
                   help="the workers' KV block, the unit vLLM's prefix cache reuses")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _worker_cmd(url: str, i: int, args: argparse.Namespace) -> list[str]:
    extra = (["--max-model-len", "4096", "--kv-cache-gib", str(args.kv_cache_gib),
              "--block-size", str(args.block_size), "--threads-bind", "nobind"]
             if args.engine == "vllm" else [])
    return ["rlfabric", "worker", "--nats", url, "--prefix", "benchagent", "--model",
            checkpoint_dir(MODEL), "--engine", args.engine, "--worker-id", f"a{i}",
            "--capacity", str(args.sessions), *extra]


async def _cache_counts(fabric: FabricClient) -> tuple[int, int] | None:
    """vLLM's prefix-cache counters summed over the workers (None: the engine keeps none)."""
    rep = await fabric.describe()
    details = [a.detail for a in rep.acks.values()]
    if not details or any("prefix_cache_queries" not in d for d in details):
        return None
    return (sum(int(d["prefix_cache_queries"]) for d in details),
            sum(int(d["prefix_cache_hits"]) for d in details))


async def _row(fabric: FabricClient, args: argparse.Namespace, affinity: bool
               ) -> dict[str, Any]:
    tag = "on" if affinity else "off"
    lat: list[float] = []
    tokens = 0
    stayed = later = 0
    context = 0

    # each row its own tokens: no cache shared between rows
    system = [random.Random(tag).randrange(256) for _ in range(args.system_tokens)]

    async def session(k: int) -> None:
        nonlocal tokens, stayed, later, context
        rng = random.Random(f"{tag}-{k}")
        prompt = system + [rng.randrange(256) for _ in range(args.first_tokens)]
        last = ""
        for t in range(args.turns):
            req = RolloutRequest(request_id=f"{tag}{k}.{t}", prompt_token_ids=PackedI32(prompt),
                                 sampling=SamplingParams(max_tokens=args.max_tokens,
                                                         seed=1000 * k + t))
            t0 = time.perf_counter()
            [res] = [r async for r in fabric.generate(
                [req], timeout=600, session=f"{tag}-{k}" if affinity else None)]
            lat.append(time.perf_counter() - t0)
            if not isinstance(res, RolloutResult):
                raise RuntimeError(f"turn {req.request_id} failed: {res.code}: {res.message}")
            comp = res.completion_token_ids.tolist()
            tokens += len(comp)
            if t:
                later += 1
                stayed += res.worker_id == last
            last = res.worker_id
            prompt = prompt + comp + [rng.randrange(256) for _ in range(args.user_tokens)]
        context = max(context, len(prompt))

    await fabric.reset_prefix_cache()
    before = await _cache_counts(fabric)
    routed = Counter(fabric.affinity.counts)
    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for k in range(args.sessions):
            tg.start_soon(session, k)
    wall = time.perf_counter() - t0
    after = await _cache_counts(fabric)
    hit = (float("nan") if before is None or after is None or after[0] == before[0]
           else round((after[1] - before[1]) / (after[0] - before[0]), 4))
    return {"affinity": tag, "turns": len(lat), "p50_ms": 1e3 * pct(lat, 0.5),
            "p99_ms": 1e3 * pct(lat, 0.99), "tokens_s": tokens / wall, "hit_rate": hit,
            "same_worker": stayed / later if later else float("nan"), "wall_s": wall,
            "longest_prompt": context,
            "routed": dict(Counter(fabric.affinity.counts) - routed)}


async def _warm_up(fabric: FabricClient, args: argparse.Namespace) -> None:
    """A long prompt on every worker before the rows (the first call on an engine pays for
    its set-up): one session each, routed to the least-loaded worker."""
    prompt = PackedI32([7] * (args.system_tokens + args.first_tokens
                              + args.turns * args.user_tokens))
    async with anyio.create_task_group() as tg:
        for i in range(args.workers):
            req = RolloutRequest(request_id=f"warm{i}", prompt_token_ids=prompt,
                                 sampling=SamplingParams(max_tokens=2))

            async def one(req: RolloutRequest = req, i: int = i) -> None:
                async for _ in fabric.generate([req], timeout=600, session=f"warm-{i}"):
                    pass
            tg.start_soon(one)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    checkpoint_dir(MODEL)  # written once, before the workers read it
    with environ(ENV):
        async with EmbeddedNats() as nats, \
                children([_worker_cmd(nats.url, i, args) for i in range(args.workers)],
                         ready="ready (", timeout=300), \
                FabricClient.connect(nats.url, prefix="benchagent") as fabric:
            await fabric.wait_for_workers(args.workers, timeout=120)
            await _warm_up(fabric, args)
            rows = [await _row(fabric, args, affinity) for affinity in (True, False)]
    off = rows[1]["p50_ms"]
    for r in rows:
        r["x_off_p50"] = r["p50_ms"] / off
    return {"engine": args.engine, "workers": args.workers, "sessions": args.sessions,
            "turns": args.turns, "model": MODEL, "rows": rows}


def main(args: argparse.Namespace) -> int:
    out = anyio.run(run, args)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{out['sessions']} sessions x {out['turns']} turns on {out['workers']} "
          f"{out['engine']} workers (model {MODEL}; contexts up to "
          f"{max(r['longest_prompt'] for r in out['rows'])} tokens)")
    for r in out["rows"]:  # nan: an engine with no prefix cache
        r["hit_rate"] = "n/a" if r["hit_rate"] != r["hit_rate"] else f"{r['hit_rate']:.1%}"
    print(table(out["rows"], [("affinity", "affinity", ""), ("turns", "turns", "d"),
                              ("p50_ms", "turn p50 ms", ".1f"), ("p99_ms", "p99 ms", ".1f"),
                              ("x_off_p50", "p50 x off", ".2f"),
                              ("tokens_s", "tok/s", ".1f"), ("hit_rate", "prefix hit", ""),
                              ("same_worker", "same worker", ".1%")]))
    return 0
