"""Broadcast -> all acks latency through rlfabric's quorum path, for N simulated workers.

    rlfabric bench quorum [--sizes 1,8,32] [--rounds 200] [--processes 2] [--json]

An embedded nats-server, N simulated workers (membership + ordered command receiver, no engine)
spread over `--processes` processes, and one trainer-side Broadcaster sending Pause/Resume
pairs; every round waits for all N `done` acks. Prints p50/p99/mean per size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import anyio

from rlfabric.bench._util import pct
from rlfabric.bus import Broadcaster, Bus, EmbeddedNats, MembershipWatcher, QuorumPolicy, new_cmd_id
from rlfabric.schemas import Pause, Resume


async def measure(url: str, prefix: str, n: int, rounds: int, processes: int) -> dict:
    ids = [f"b{i:03d}" for i in range(n)]
    per = -(-n // processes)
    procs = [
        subprocess.Popen([sys.executable, "-m", "rlfabric.bus.sim", "--nats", url, "--prefix",
                          prefix, "--ids", ",".join(ids[i:i + per])], stdout=subprocess.DEVNULL)
        for i in range(0, n, per)
    ]
    try:
        async with Bus.connect(url, prefix=prefix) as bus:
            watcher = MembershipWatcher(bus)
            await bus.tg.start(watcher.run)
            await watcher.wait_until(lambda s: len(s.members) == n, timeout=120)
            bc = Broadcaster(bus, watcher)
            policy = QuorumPolicy(timeout=30)
            for _ in range(10):  # warm-up
                await bc.broadcast(Pause(cmd_id=new_cmd_id()), policy)
            lat = []
            for i in range(rounds):
                cmd = Pause(cmd_id=new_cmd_id()) if i % 2 == 0 else Resume(cmd_id=new_cmd_id())
                t0 = time.perf_counter()
                rep = await bc.broadcast(cmd, policy)
                lat.append(time.perf_counter() - t0)
                assert len(rep.ok) == n
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    ms = [x * 1e3 for x in lat]
    return {"workers": n, "processes": len(procs), "rounds": rounds,
            "p50_ms": pct(ms, 0.5), "p99_ms": pct(ms, 0.99), "mean_ms": statistics.fmean(ms)}


async def _main(args: argparse.Namespace) -> None:
    rows = []
    async with EmbeddedNats() as nats:
        for n in [int(x) for x in args.sizes.split(",")]:
            rows.append(await measure(nats.url, f"bench{n}", n, args.rounds, args.processes))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'workers':>8} {'procs':>6} {'rounds':>7} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    for r in rows:
        print(f"{r['workers']:>8} {r['processes']:>6} {r['rounds']:>7} {r['p50_ms']:>8.2f} "
              f"{r['p99_ms']:>8.2f} {r['mean_ms']:>8.2f}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="1,8,32")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    anyio.run(_main, args)
    return 0
