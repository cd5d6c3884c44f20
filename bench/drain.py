"""Draining or killing a worker mid-generation: its samples go on elsewhere from the tokens it
had sampled (`rlfabric ctl drain`: the tokens it hands back; SIGKILL: the tokens its deltas
brought, once membership says it is gone), against the same workload undisturbed and with
`restart` (what a worker's leaving costs without continuation: its samples start again from
the prompt).

Two torch workers (the built-in `tiny` model, one thread each); N greedy streamed rollouts of
T tokens. The other runs drain (or kill) the worker holding more of them at `--at` of the
undisturbed run's time (every rollout has its first tokens by then). Columns: the rollouts
that worker held and that finished elsewhere, token positions streamed more than once
(sampled again), answers equal to the undisturbed run's (greedy), and the time to the last
answer.
"""

from __future__ import annotations

import argparse
import signal
import time
import uuid
from collections import defaultdict
from typing import Any

import anyio

from rlfabric.bench._util import children, table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=100, help="rollouts (default %(default)s)")
    p.add_argument("--tokens", type=int, default=300, help="tokens each (default %(default)s)")
    p.add_argument("--at", type=float, default=0.5,
                   help="drain at this share of the undisturbed run's time (default "
                   "%(default)s)")


async def _run(url: str, mode: str, args: argparse.Namespace, at: float = 0.0
               ) -> dict[str, Any]:
    from rlfabric.schemas import (
        PackedI32,
        RolloutRequest,
        RolloutResult,
        SamplingParams,
        TokenDelta,
    )
    from rlfabric.trainer import FabricClient

    prefix = f"dr{uuid.uuid4().hex[:8]}"
    cmds = [["rlfabric", "worker", "--nats", url, "--prefix", prefix, "--worker-id", w,
             "--engine", "torch", "--threads", "1", "--capacity", "256"] for w in ("m0", "m1")]
    async with children(cmds, ready="ready") as procs, \
            FabricClient.connect(url, prefix=prefix) as fabric:
        await fabric.wait_for_workers(2, timeout=120)
        reqs = [RolloutRequest(request_id=f"r{i}", prompt_token_ids=PackedI32([256, 3 + i % 200]),
                               stream=True, migration="restart" if "restart" in mode else
                               "continue", sampling=SamplingParams(max_tokens=args.tokens,
                                                                   temperature=0.0))
                for i in range(args.requests)]
        seen: dict[str, list[TokenDelta]] = defaultdict(list)
        out: dict[str, Any] = {}
        started = anyio.Event()

        async def consume() -> None:
            async for item in fabric.rollouts.generate(reqs, deltas=True, timeout=600):
                if isinstance(item, TokenDelta):
                    seen[item.request_id].append(item)
                else:
                    out[item.request_id] = item
                if len(seen) == len(reqs):
                    started.set()

        t0 = time.monotonic()
        held = 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            with anyio.fail_after(300):  # the workers' first tokens
                await started.wait()
            if mode != "undisturbed":
                await anyio.sleep(max(0.0, t0 + at - time.monotonic()))
                load = {w: int(a.detail["in_flight"])
                        for w, a in (await fabric.describe()).acks.items()}
                drained = max(load, key=lambda w: load[w])
                held = load[drained]
                if mode.startswith("killed"):
                    procs[["m0", "m1"].index(drained)].send_signal(signal.SIGKILL)
                else:
                    await fabric.drain(drained)
        took = time.monotonic() - t0
    again = sum(len(p) - len(set(p)) for p in (
        [d.start + k for d in ds for k in range(len(d.token_ids))] for ds in seen.values()))
    ok = [r for r in out.values() if isinstance(r, RolloutResult)]
    moved = sum(len({s.worker for s in r.version_spans}) > 1 for r in ok)
    return {"mode": mode, "answered": len(ok), "errors": len(out) - len(ok), "held": held,
            "moved": moved, "again": again, "seconds": took,
            "ids": {r.request_id: r.completion_token_ids.tolist() for r in ok}}


async def run(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = [await _run(url, "undisturbed", args)]
    at = args.at * rows[0]["seconds"]
    rows += [await _run(url, mode, args, at) for mode in
             ("drained", "restart", "killed", "killed, restart")]
    base, first = rows[0]["ids"], rows[0]["seconds"]
    for r in rows:
        r["same"] = sum(ids == base.get(rid) for rid, ids in r.pop("ids").items())
        r["ratio"] = r["seconds"] / first
    return rows


def main(args: argparse.Namespace) -> int:
    from rlfabric.bus import EmbeddedNats

    async def go() -> list[dict[str, Any]]:
        async with EmbeddedNats() as nats:
            return await run(nats.url, args)

    rows = anyio.run(go)
    print(f"{args.requests} greedy rollouts of {args.tokens} tokens, 2 torch workers (tiny)")
    print(table(rows, [("mode", "run", ""), ("answered", "answered", ""),
                       ("errors", "errors", ""), ("held", "that worker held", ""),
                       ("moved", "finished elsewhere", ""),
                       ("again", "tokens sampled again", ""),
                       ("same", "same as undisturbed", ""), ("seconds", "seconds", ".2f"),
                       ("ratio", "x undisturbed", ".2f")]))
    return 0
