"""Two jobs on one pool: does one job's pause and pushes reach the other's streams? (With
`--fair`: how the pool shares its workers between jobs, `rlfabric.bench.share`.)

An embedded NATS server and 2 torch workers (`tinychat`); jobs `exp-a` and `exp-b` each push
a LoRA adapter named `policy` and stream requests without pause (B: `--b-streams` requests at
a time, A: as many). Two phases of `--seconds` each, the same workload:
- quiet: nothing else happens;
- commands: job A runs `--rounds` rounds spread over the phase, each: pause (`abort`), push a
  new adapter version, resume, pause (`keep`), push, resume, push (7 commands, 3 versions).
The table gives B's gaps between token deltas (one request's consecutive deltas) in each
phase, B's longest gap while an A command was out, A's and B's results and the versions they
name: B's must all be its own v0; A's its own versions, each a version A pushed.

Then residency: `--adapters` adapters over `--jobs` jobs on 2 workers started with
`--max-adapters 4`, `--per-adapter` requests for each, sent from every job at once in a random
order: failures, answers whose spans name the adapter's own policy (every result is also
checked against what its job pushed: `PolicyMismatch` otherwise), evictions, and the workers'
reload times (an evicted adapter loaded again for a request, from where its job staged it).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import time
import uuid
from pathlib import Path
from typing import Any

import anyio

from rlfabric.bench import share
from rlfabric.bench._util import pct, table
from rlfabric.schemas import Adapter


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=10.0, help="each phase (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3,
                   help="job A's rounds of commands in the commands phase (default %(default)s)")
    p.add_argument("--b-streams", type=int, default=8,
                   help="requests each job keeps streaming at once (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=160,
                   help="tokens per request (default %(default)s)")
    p.add_argument("--adapters", type=int, default=64,
                   help="residency: adapters over all jobs (default %(default)s)")
    p.add_argument("--jobs", type=int, default=4, help="residency: jobs (default %(default)s)")
    p.add_argument("--per-adapter", type=int, default=4,
                   help="residency: requests per adapter (default %(default)s)")
    p.add_argument("--max-adapters", type=int, default=4,
                   help="residency: each worker's --max-adapters (default %(default)s)")
    p.add_argument("--out", default=None, help="the workers' logs (default: a temp folder)")
    share.add_arguments(p)


async def _stream(c: Any, name: str, until: float, n: int, max_tokens: int,
                  gaps: list[tuple[float, float]], results: list[Any]) -> None:
    """Keep `n` streamed requests of job client `c` out until `until`; record each gap
    between one request's deltas as (arrival time, gap)."""
    from rlfabric.schemas import PackedI32, RolloutRequest, SamplingParams, TokenDelta

    ids = itertools.count()

    async def one() -> None:
        while time.monotonic() < until:
            i = next(ids)
            req = c.pushed.own(RolloutRequest(
                request_id=f"{name}-{i}", prompt_token_ids=PackedI32([256, 10 + i % 50]),
                stream=True,
                adapter="policy", sampling=SamplingParams(max_tokens=max_tokens, seed=i)))
            last: dict[int, float] = {}
            async for r in c.rollouts.generate([req], timeout=120, deltas=True):
                now = time.monotonic()
                if isinstance(r, TokenDelta):
                    if r.start in last or not last or r.start == 0:
                        last = {}  # a sample sampled again from its start (A's abort)
                    elif last:
                        gaps.append((now, now - max(last.values())))
                    last[r.start] = now
                else:
                    results.append(r)

    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(one)


async def _commands(a: Any, start: float, seconds: float, rounds: int,
                    windows: list[tuple[float, float]], versions: list[int], state: Any) -> None:
    v = itertools.count(1)
    steps = [("pause", "abort"), ("push",), ("resume",), ("pause", "keep"), ("push",),
             ("resume",), ("push",)]
    for k in range(rounds):
        await anyio.sleep_until(start + seconds * (k + 0.5) / rounds)  # spread over the phase
        for step in steps:
            t0 = time.monotonic()
            if step[0] == "pause":
                await a.pause(step[1])
            elif step[0] == "resume":
                await a.resume()
            else:
                version = next(v)
                await a.update_weights(version, state_dict=state(version), adapter=QV)
                versions.append(version)
            windows.append((t0, time.monotonic()))


QV = Adapter(name="policy", rank=8, alpha=16.0, target_modules=("q_proj", "v_proj"))


async def run(args: argparse.Namespace, url: str, model: str, prefix: str
              ) -> list[dict[str, Any]]:
    from rlfabric.schemas import RolloutResult
    from rlfabric.tensors import lora
    from rlfabric.tensors.models import build_model
    from rlfabric.trainer import FabricClient

    base = build_model(model)

    def state(seed: int) -> Any:
        return lora.random_adapter(base, QV, seed=seed, std=0.05)

    rows = []
    async with FabricClient.connect(url, prefix=prefix, job="exp-a") as a, \
            FabricClient.connect(url, prefix=prefix, job="exp-b") as b:
        await a.wait_for_workers(2, timeout=120)
        await a.update_weights(0, state_dict=state(100), adapter=QV)
        await b.update_weights(0, state_dict=state(200), adapter=QV)
        for phase in ("quiet", "commands"):
            gaps_b: list[tuple[float, float]] = []
            res_a: list[Any] = []
            res_b: list[Any] = []
            windows: list[tuple[float, float]] = []
            pushed = [0]
            start = time.monotonic()
            until = start + args.seconds
            async with anyio.create_task_group() as tg:
                tg.start_soon(_stream, b, "b", until, args.b_streams, args.max_tokens,
                              gaps_b, res_b)
                tg.start_soon(_stream, a, "a", until, args.b_streams, args.max_tokens,
                              [], res_a)
                if phase == "commands":
                    tg.start_soon(_commands, a, start, args.seconds, args.rounds, windows,
                                  pushed, state)
            during = [g for t, g in gaps_b
                      if any(s <= t and t - g <= e for s, e in windows)]
            ok_b = [r for r in res_b if isinstance(r, RolloutResult)]
            ok_a = [r for r in res_a if isinstance(r, RolloutResult)]
            rows.append({
                "phase": phase, "commands": len(windows),
                "b_p50_ms": 1e3 * pct([g for _, g in gaps_b], 0.5),
                "b_p99_ms": 1e3 * pct([g for _, g in gaps_b], 0.99),
                "b_max_during_ms": 1e3 * max(during) if during else float("nan"),
                "b_results": len(ok_b), "b_errors": len(res_b) - len(ok_b),
                "b_versions": ",".join(sorted({f"v{s.version}" for r in ok_b
                                               for s in r.version_spans})),
                "b_policies_own": all(s.policy.split("/")[1] == "exp-b:policy"
                                      for r in ok_b for s in r.version_spans),
                "a_results": len(ok_a), "a_errors": len(res_a) - len(ok_a),
                "a_versions_pushed": all(s.version in pushed for r in ok_a
                                         for s in r.version_spans),
            })
    return rows


async def residency(args: argparse.Namespace, url: str, model: str, prefix: str
                    ) -> dict[str, Any]:
    import random

    from rlfabric.schemas import PackedI32, RolloutRequest, RolloutResult, SamplingParams
    from rlfabric.tensors import lora
    from rlfabric.tensors.models import build_model
    from rlfabric.trainer import FabricClient

    base = build_model(model)
    names = [f"job{j}" for j in range(args.jobs)]
    per_job = -(-args.adapters // args.jobs)
    ads = [Adapter(name=f"p{i}", rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
           for i in range(per_job)]
    out: dict[str, list[Any]] = {}
    async with contextlib.AsyncExitStack() as stack:
        cs = {n: await stack.enter_async_context(FabricClient.connect(url, prefix=prefix, job=n))
              for n in names}
        first = cs[names[0]]
        await first.wait_for_workers(2, timeout=120)
        for j, n in enumerate(names):
            for i, ad in enumerate(ads):
                await cs[n].update_weights(0, state_dict=lora.random_adapter(
                    base, ad, seed=100 * j + i, std=0.05), adapter=ad)
        rng = random.Random(0)
        t0 = time.monotonic()

        async def run_job(n: str) -> None:
            reqs = [RolloutRequest(request_id=f"{n}-{ad.name}-{k}",
                                   prompt_token_ids=PackedI32([256, 10 + k]), adapter=ad.name,
                                   sampling=SamplingParams(max_tokens=16, seed=k))
                    for ad in ads for k in range(args.per_adapter)]
            rng.shuffle(reqs)
            out[n] = [r async for r in cs[n].generate(reqs, timeout=300)]
        async with anyio.create_task_group() as tg:
            for n in names:
                tg.start_soon(run_job, n)
        took = time.monotonic() - t0
        rep = await first.broadcast(_describe())
    results = [(n, r) for n in names for r in out[n]]
    ok = [(n, r) for n, r in results if isinstance(r, RolloutResult)]
    own = sum(all(s.policy.split("/")[1] == f"{n}:{r.request_id.split('-')[1]}"
                  and s.version == 0 for s in r.version_spans) for n, r in ok)
    reloads = [float(x) for a in rep.acks.values()
               for x in a.detail.get("reload_ms", "").split(",") if x]
    return {"adapters": per_job * args.jobs, "jobs": args.jobs,
            "max_adapters": args.max_adapters, "requests": len(results),
            "failures": len(results) - len(ok), "own_policy": own,
            "evicted": sum(int(a.detail.get("adapters_evicted", 0)) for a in rep.acks.values()),
            "reloaded": sum(int(a.detail.get("adapters_reloaded", 0))
                            for a in rep.acks.values()),
            "reload_p50_ms": pct(reloads, 0.5), "reload_p99_ms": pct(reloads, 0.99),
            "seconds": took}


def _describe() -> Any:
    from rlfabric.bus import new_cmd_id
    from rlfabric.schemas import Describe

    return Describe(cmd_id=new_cmd_id())


def main(args: argparse.Namespace) -> int:
    import tempfile

    if args.fair:
        return share.main(args)
    from rlfabric.launch.local import LocalFleet

    out = Path(args.out or tempfile.mkdtemp(prefix="rlf-bench-jobs-"))
    with LocalFleet("tinychat", workers=2, logs=out, prefix=f"j{uuid.uuid4().hex[:8]}") as f:
        rows = anyio.run(run, args, f.url, f.path, f.prefix)
    print(table(rows, [("phase", "phase", ""), ("commands", "A cmds", ""),
                       ("b_p50_ms", "B gap p50 ms", ".1f"), ("b_p99_ms", "B gap p99 ms", ".1f"),
                       ("b_max_during_ms", "B max gap in A cmd ms", ".1f"),
                       ("b_results", "B results", ""), ("b_errors", "B errors", ""),
                       ("b_versions", "B versions", ""), ("b_policies_own", "B own", ""),
                       ("a_results", "A results", ""), ("a_errors", "A errors", ""),
                       ("a_versions_pushed", "A pushed", "")]))
    quiet, busy = rows
    ratio = busy["b_max_during_ms"] / quiet["b_p99_ms"]
    print(f"\nB's longest gap while A's commands ran / B's p99 gap without them: {ratio:.2f}x "
          "(target <= 2x)")
    with LocalFleet("tinychat", workers=2, logs=out / "residency",
                    prefix=f"r{uuid.uuid4().hex[:8]}",
                    extra=("--max-adapters", str(args.max_adapters))) as f:
        res = anyio.run(residency, args, f.url, f.path, f.prefix)
    print("\nresidency (2 workers):")
    print(table([res], [("adapters", "adapters", ""), ("jobs", "jobs", ""),
                        ("max_adapters", "--max-adapters", ""), ("requests", "requests", ""),
                        ("failures", "failures", ""), ("own_policy", "own policy", ""),
                        ("evicted", "evicted", ""), ("reloaded", "reloaded", ""),
                        ("reload_p50_ms", "reload p50 ms", ".1f"),
                        ("reload_p99_ms", "reload p99 ms", ".1f"),
                        ("seconds", "s", ".1f")]))
    return 0 if res["failures"] == 0 and res["own_policy"] == res["requests"] else 1
