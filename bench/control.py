"""Pause -> every ack, for N lightweight responders: rlfabric vs HTTP fan-out.

- `rlfabric`: N simulated workers (membership + the ordered, idempotent command receiver, no
  engine) in `--processes` processes; `FabricClient.pause()` / `.resume()`: JetStream-persisted
  command, quorum of N acks, missing members pinged.
- `aiohttp` / `httpx`: N aiohttp servers in the same number of processes; the trainer POSTs
  `/pause` to every URL concurrently and waits for every answer (what RL stacks do today).
- `nats-py floor`: the same message pattern with nats-py alone, in the same process layout:
  one JetStream publish to a file stream, then one core publish that N subscribers receive,
  each answering to the address in a header; the caller counts N answers.
Each round alternates pause and resume; latency is one call until all N answered. CPU time per
call, in microseconds: `caller` is the calling process's (the trainer's cost), `server` the
nats-server's (all nodes of a cluster; none for HTTP), `responders` all responder processes'
together (Linux /proc). A second table gives the same three with no calls (the job's idle cost:
heartbeats, the trainer's membership watch), measured before each rlfabric row's rounds.

With `--cluster 3`, `rlfabric` runs again on a 3-node loopback cluster (streams and buckets
R3), in the same run. Above 250 responders the simulated workers spread over one process per
250 at least (1000: 4 processes); httpx is left out above 256 (its pool's connects time out).

    rlfabric bench control [--sizes 1,8,32,128] [--rounds 200] [--cluster 3] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Awaitable, Callable

import anyio

from rlfabric.bench._util import children, cpu_seconds, pct, table
from rlfabric.bus import EmbeddedCluster, EmbeddedNats, QuorumPolicy
from rlfabric.bus.cluster import free_ports
from rlfabric.trainer import FabricClient

PER_PROCESS = 250  # simulated workers per process, at most, unless --processes asks for fewer
HTTPX_MAX = 256  # responders; above it httpx's connection pool times out on connect
IDLE_S = 5.0  # seconds the idle cost of a job is measured over, before its calls


def split(items: list, parts: int) -> list[list]:
    per = -(-len(items) // parts)
    return [items[i:i + per] for i in range(0, len(items), per)]


async def timed(rounds: int, call: Callable[[int], Awaitable[None]], *,
                servers: list[int], responders: list[int]) -> dict[str, float]:
    """Latency of `call` over `rounds`, and the CPU per call of the caller (this process), of
    the `servers` (nats-server pids; none for HTTP) and of the `responders` processes."""
    for i in range(10):  # warm-up
        await call(i)
    lat = []
    cpu0, srv0, rsp0 = time.process_time(), cpu_seconds(servers), cpu_seconds(responders)
    for i in range(rounds):
        t0 = time.perf_counter()
        await call(i)
        lat.append((time.perf_counter() - t0) * 1e3)
    per_call = 1e6 / rounds
    return {"p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99), "mean_ms": sum(lat) / len(lat),
            "cpu_us": (time.process_time() - cpu0) * per_call,
            "server_cpu_us": ((cpu_seconds(servers) - srv0) * per_call if servers
                              else float("nan")),
            "responders_cpu_us": (cpu_seconds(responders) - rsp0) * per_call}


async def bench_floor(url: str, n: int, rounds: int, processes: int,
                      servers: list[int]) -> dict[str, float]:
    import nats
    from nats.aio.msg import Msg
    from nats.js.api import StorageType, StreamConfig

    from rlfabric.bench.floor import ACK_TO

    tag = f"floor{n}"
    cmds = [["rlfabric.bench.floor", "control", "--nats", url, "--subject", f"{tag}.live",
             "--count", str(len(part))] for part in split(list(range(n)), processes)]
    nc = await nats.connect(url, name="rlfabric-floor-caller")
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=tag.upper(), subjects=[f"{tag}.ctl.>"],
                                         storage=StorageType.FILE))
        counts: dict[str, int] = {}
        done: dict[str, anyio.Event] = {}

        async def on_ack(msg: Msg) -> None:
            call_id = msg.subject.rpartition(".")[2]
            counts[call_id] = counts.get(call_id, 0) + 1
            if counts[call_id] == n:
                done[call_id].set()

        sub = await nc.subscribe(f"{tag}.ack.*", cb=on_ack)
        async with children(cmds, ready="floor: control ready") as procs:
            async def call(i: int) -> None:
                call_id = f"c{i}-{time.perf_counter_ns()}"
                done[call_id] = anyio.Event()
                body = b"pause" if i % 2 == 0 else b"resume"
                ack = await js.publish(f"{tag}.ctl.x", body, headers={"Nats-Msg-Id": call_id})
                await nc.publish(f"{tag}.live.x", body,
                                 headers={ACK_TO: f"{tag}.ack.{call_id}", "seq": str(ack.seq)})
                with anyio.fail_after(30):
                    await done[call_id].wait()
                del done[call_id], counts[call_id]

            out = await timed(rounds, call, servers=servers,
                              responders=[p.pid for p in procs])
        await sub.unsubscribe()
        await js.delete_stream(tag.upper())
        return out
    finally:
        await nc.close()


async def bench_fabric(url: str, n: int, rounds: int, processes: int,
                       servers: list[int]) -> dict[str, float]:
    prefix = f"ctl{n}"
    ids = [f"b{i:03d}" for i in range(n)]
    cmds = [["rlfabric.bench.sim", "--nats", url, "--prefix", prefix, "--ids", ",".join(part)]
            for part in split(ids, processes)]
    async with children(cmds, ready="ready") as procs, FabricClient.connect(
            url, prefix=prefix, policy=QuorumPolicy(timeout=30)) as fabric:
        await fabric.wait_for_workers(n, timeout=120)
        pids = [p.pid for p in procs]
        idle = await idle_cpu(servers, pids)

        async def call(i: int) -> None:
            rep = await (fabric.pause(mode="wait") if i % 2 == 0 else fabric.resume())
            assert len(rep.ok) == n

        return {**await timed(rounds, call, servers=servers, responders=pids), **idle}


async def idle_cpu(servers: list[int], responders: list[int], seconds: float = IDLE_S
                   ) -> dict[str, float]:
    """CPU per second (in % of one core) with the job up and no call: heartbeats, watches."""
    t0 = time.perf_counter()
    cpu0, srv0, rsp0 = time.process_time(), cpu_seconds(servers), cpu_seconds(responders)
    await anyio.sleep(seconds)
    pct_of = 100 / (time.perf_counter() - t0)
    return {"idle_caller_pct": (time.process_time() - cpu0) * pct_of,
            "idle_server_pct": (cpu_seconds(servers) - srv0) * pct_of,
            "idle_responders_pct": (cpu_seconds(responders) - rsp0) * pct_of}


async def bench_http(n: int, rounds: int, processes: int, client: str) -> dict[str, float]:
    ports = free_ports(n)
    cmds = [["rlfabric.bench.http_fleet", "--ports", ",".join(map(str, part))]
            for part in split(ports, processes)]
    async with children(cmds, ready="http fleet ready") as procs:
        fleet = {"servers": [], "responders": [p.pid for p in procs]}
        pause = [f"http://127.0.0.1:{p}/pause?mode=wait" for p in ports]
        resume = [f"http://127.0.0.1:{p}/resume" for p in ports]
        if client == "aiohttp":
            import aiohttp

            async with aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0)) as session:
                async def post(u: str) -> None:
                    async with session.post(u) as r:
                        assert (await r.json())["ok"]

                async def call(i: int) -> None:
                    async with anyio.create_task_group() as tg:
                        for u in (pause if i % 2 == 0 else resume):
                            tg.start_soon(post, u)

                return await timed(rounds, call, **fleet)
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(limits=limits) as hc:
            async def hpost(u: str) -> None:
                r = await hc.post(u)
                assert r.json()["ok"]

            async def hcall(i: int) -> None:
                async with anyio.create_task_group() as tg:
                    for u in (pause if i % 2 == 0 else resume):
                        tg.start_soon(hpost, u)

            return await timed(rounds, hcall, **fleet)


async def run(sizes: list[int], rounds: int, processes: int, cluster: int = 0) -> list[dict]:
    rows = []
    async with contextlib.AsyncExitStack() as stack:
        nats = await stack.enter_async_context(EmbeddedNats())
        nodes = (await stack.enter_async_context(EmbeddedCluster(cluster)) if cluster
                 else None)
        for n in sizes:
            procs = min(n, max(processes, n // PER_PROCESS))
            r = max(20, rounds if n < 128 else rounds // 2)
            single = [nats.pid or 0]
            fab = await bench_fabric(nats.url, n, r, procs, single)
            paths = [("rlfabric", r, fab)]
            if nodes is not None:  # the same job on the cluster: every stream and bucket R3
                paths.append((f"rlfabric {cluster}-node cluster R{min(3, cluster)}", r,
                              await bench_fabric(nodes.url, n, r, procs,
                                                 [node.pid or 0 for node in nodes.nodes])))
            paths.append(("nats-py floor", r, await bench_floor(nats.url, n, r, procs, single)))
            paths.append(("aiohttp", r, await bench_http(n, r, procs, "aiohttp")))
            if n <= HTTPX_MAX:
                hr = max(10, r // (4 if n >= 32 else 1))
                paths.append(("httpx", hr, await bench_http(n, hr, procs, "httpx")))
            for path, used, res in paths:
                rows.append({"responders": n, "processes": procs, "path": path,
                             "rounds": used, **res,
                             "x_vs_fabric": res["p50_ms"] / fab["p50_ms"]})
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="1,8,32,128")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--cluster", type=int, default=0, metavar="N",
                   help="also run rlfabric on an N-node (>= 3) loopback NATS cluster, every "
                   "stream and bucket with 3 copies: a row beside the single server's")
    p.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    rows = anyio.run(run, [int(x) for x in args.sizes.split(",")], args.rounds, args.processes,
                     args.cluster)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(table(rows, [("responders", "responders", ""), ("processes", "procs", ""),
                       ("path", "path", ""), ("rounds", "rounds", ""),
                       ("p50_ms", "p50 ms", ".2f"), ("p99_ms", "p99 ms", ".2f"),
                       ("mean_ms", "mean ms", ".2f"), ("cpu_us", "caller cpu us", ".0f"),
                       ("server_cpu_us", "server cpu us", ".0f"),
                       ("responders_cpu_us", "responders cpu us", ".0f"),
                       ("x_vs_fabric", "p50 / rlfabric p50", ".2f")]))
    idle = [r for r in rows if "idle_server_pct" in r]
    print(f"\nidle cost, no calls ({IDLE_S:.0f} s with every worker joined; % of one core): "
          "heartbeats and the trainer's membership watch")
    print(table(idle, [("responders", "responders", ""), ("path", "path", ""),
                       ("idle_caller_pct", "caller %", ".1f"),
                       ("idle_server_pct", "server %", ".1f"),
                       ("idle_responders_pct", "responders %", ".1f")]))
    return 0
