"""Pause -> every ack, for N lightweight responders: rlfabric vs HTTP fan-out.

- `rlfabric`: N simulated workers (membership + the ordered, idempotent command receiver, no
  engine) in `--processes` processes; `FabricClient.pause()` / `.resume()`: JetStream-persisted
  command, quorum of N acks, missing members pinged.
- `aiohttp` / `httpx`: N aiohttp servers in the same number of processes; the trainer POSTs
  `/pause` to every URL concurrently and waits for every answer (what RL stacks do today).
- `nats-py floor`: the same message pattern with nats-py alone, in the same process layout:
  one JetStream publish to a file stream, then one core publish that N subscribers receive,
  each answering to the address in a header; the caller counts N answers.
- `nats-py floor, same work`: nats-py and msgspec alone doing the work rlfabric does a call
  (`same_work_fleet`): the desired state written, the `Pause` / `Resume` persisted with its
  headers, its live copy once stored, each responder ordering, decoding, remembering and
  answering with an encoded `Ack`, the caller decoding and keeping every ack per worker. No
  membership (beats, command polls, probes): what the guarantees cost at the least.
Calls alternate pause and resume; latency is one call until all N answered. Per size, every
fleet is up at once and each path's calls are split into `--blocks` blocks, run interleaved in
an order that rotates from block to block: the host's speed swings within a minute, and this
way a slow stretch costs every path a block rather than one path its whole row. Every block
starts with `SETTLE_CALLS` calls that are not measured. A row's latencies and CPU are over all
its measured calls; `p50 / rlfabric p50` is the median over the blocks of the path's block p50
over rlfabric's in the same block, and `p50 / floor p50` (`x_floor`) the same over the
nats-py floor's. CPU time per call, in microseconds: `caller` is the calling process's (the
trainer's cost), `server` the nats-server's (all nodes of a cluster; none for HTTP),
`responders` all responder processes' together (Linux: their CPU clocks). While another path
runs, the rlfabric fleet's simulated workers are stopped (SIGSTOP, at most `FREEZE_MAX_S` a
block; a block starts once they read as stopped, or `STOP_WAIT_S` after the signal), so their
heartbeats and stream polls load no other row; a second table gives that idle cost (no
calls: heartbeats, command polls, the trainer's membership watch), measured `IDLE_SETTLE_S`
after each rlfabric fleet has joined, before any call and before the floor's and HTTP fleets
start.

With `--cluster 3`, `rlfabric` runs again on a 3-node loopback cluster (streams and buckets
R3), in the same run. Above 250 responders the simulated workers spread over one process per
250 at least (1000: 4 processes); httpx is left out above 256 (its pool's connects time out).

    rlfabric bench control [--sizes 1,8,32,128] [--rounds 200] [--blocks 10] [--cluster 3]
                           [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import msgspec

from rlfabric.bench._util import children, cpu_seconds, metrics_on, pct, table
from rlfabric.bus import EmbeddedCluster, EmbeddedNats, QuorumPolicy
from rlfabric.bus.nats.cluster import free_ports
from rlfabric.bus.nats.server import check_sync
from rlfabric.schemas import (
    CMD_ID_HEADER,
    SCHEMA_HEADER,
    SCHEMA_VERSION,
    STATE_MARK_HEADER,
    Ack,
    Command,
    DesiredState,
    Pause,
    Resume,
    op_of,
)
from rlfabric.trainer import FabricClient

PER_PROCESS = 250  # simulated workers per process, at most, unless --processes asks for fewer
HTTPX_MAX = 256  # responders; above it httpx's connection pool times out on connect
IDLE_S = 5.0  # seconds the idle cost of a job is measured over, before its calls
#: seconds an idle job runs before its cost is measured: its workers' command polls slow down
#: while nothing comes (1 s doubling up to 8 s); a fleet that just joined still polls often
IDLE_SETTLE_S = 15.0
BLOCKS = 10  # interleaved blocks a path's calls are split into
#: an idle rlfabric fleet is stopped while another path runs, at most this long a block (a
#: member unheard for `member_ttl`, 5 s, is pinged; its beats come every 1.25 s)
FREEZE_MAX_S = 2.5
#: calls a block starts with, not measured: a fleet that was stopped sends its heartbeats and
#: polls then, not in the first measured call
SETTLE_CALLS = 2
#: seconds a block waits, at most, for the fleets it stops to have stopped
STOP_WAIT_S = 1.0

T = TypeVar("T")


def split(items: list, parts: int) -> list[list]:
    per = -(-len(items) // parts)
    return [items[i:i + per] for i in range(0, len(items), per)]


@dataclass(eq=False)
class _Path:
    """One path of a fleet size: its fleet's call, and what its blocks measured."""

    name: str
    calls: int  # calls in all, over every block
    call: Callable[[int], Awaitable[None]]
    servers: list[int]  # nats-server pids (none for HTTP)
    responders: list[int]
    extra: dict[str, float] = field(default_factory=dict)  # the idle cost, for rlfabric rows
    #: processes that work while idle (the simulated workers' heartbeats and stream polls):
    #: stopped (SIGSTOP) while another path runs, so no row carries another path's idle load
    quiet: list[int] = field(default_factory=list)
    lat: list[float] = field(default_factory=list)  # ms, every call
    block_p50: list[float] = field(default_factory=list)  # ms, per block
    cpu: float = 0.0  # seconds over all blocks: caller, servers, responders
    server_cpu: float = 0.0
    responders_cpu: float = 0.0
    done: int = 0  # calls made so far (pause on even, resume on odd)
    #: a baseline (the HTTP clients) whose call raised: its row says so, the bench goes on
    may_fail: bool = False
    failed: str = ""

    async def unmeasured(self, calls: int) -> None:
        for _ in range(calls):
            await self.call(self.done)
            self.done += 1

    async def block(self, calls: int) -> None:
        """`calls` calls, timed, with the CPU each process used meanwhile."""
        lat = []
        cpu0, srv0 = time.process_time(), cpu_seconds(self.servers)
        rsp0 = cpu_seconds(self.responders)
        for _ in range(calls):
            t0 = time.perf_counter()
            await self.call(self.done)
            lat.append((time.perf_counter() - t0) * 1e3)
            self.done += 1
        self.cpu += time.process_time() - cpu0
        self.server_cpu += (cpu_seconds(self.servers) - srv0) if self.servers else math.nan
        self.responders_cpu += cpu_seconds(self.responders) - rsp0
        self.lat += lat
        self.block_p50.append(pct(lat, 0.5))

    def ratio(self, other: _Path) -> float:
        """The median over blocks of this path's block p50 over `other`'s: block b of every
        path ran in the same round; a path with fewer calls than blocks has fewer blocks,
        paired with the first of the other's."""
        return statistics.median(
            b / o for b, o in zip(self.block_p50, other.block_p50, strict=False))

    def row(self, fabric: _Path, floor: _Path) -> dict[str, Any]:
        if self.failed:
            return {"path": f"{self.name} (failed: {self.failed})", **dict.fromkeys(
                ("rounds", "blocks", "p50_ms", "p99_ms", "mean_ms", "cpu_us", "server_cpu_us",
                 "responders_cpu_us", "x_vs_fabric", "x_floor"), math.nan)}
        per_call = 1e6 / len(self.lat)
        return {"path": self.name, "rounds": len(self.lat), "blocks": len(self.block_p50),
                "p50_ms": pct(self.lat, 0.5), "p99_ms": pct(self.lat, 0.99),
                "mean_ms": sum(self.lat) / len(self.lat),
                "cpu_us": self.cpu * per_call, "server_cpu_us": self.server_cpu * per_call,
                "responders_cpu_us": self.responders_cpu * per_call,
                "x_vs_fabric": self.ratio(fabric), "x_floor": self.ratio(floor),
                "p50_ms_blocks": [round(x, 3) for x in self.block_p50], **self.extra}


def block_sizes(calls: int, blocks: int) -> list[int]:
    """`calls` split into `blocks` blocks as equal as can be (none empty: fewer blocks when
    there are fewer calls)."""
    blocks = max(1, min(blocks, calls))
    return [calls // blocks + (1 if b < calls % blocks else 0) for b in range(blocks)]


def rotations(items: list[T], blocks: int) -> list[list[T]]:
    """The order the paths run in, per block: rotated by one each block, so no path always
    runs first (after the idle of the others) or last."""
    return [items[b % len(items):] + items[:b % len(items)] for b in range(blocks)]


async def interleave(paths: list[_Path], blocks: int) -> None:
    """Warm every path up, then run `blocks` blocks, each running a block of every path's
    calls (its `calls` split evenly over the blocks) in an order that rotates, with the other
    paths' `quiet` processes stopped (`_alone`). The host's speed swings within a minute; this
    way a slow stretch hits a block of every path, not one path's whole row."""
    for p in paths:
        try:
            await p.unmeasured(10)  # warm-up
        except Exception as exc:
            if not p.may_fail:
                raise
            p.failed = f"{type(exc).__name__}: {exc}"[:120]
    plan = [(p, block_sizes(p.calls, blocks)) for p in paths]
    try:
        for b, order in enumerate(rotations(plan, max(len(sizes) for _, sizes in plan))):
            for p, sizes in order:
                if b < len(sizes) and not p.failed:
                    await _alone(p, [pid for q in paths if q is not p for pid in q.quiet],
                                 sizes[b])
    finally:
        _signal([pid for p in paths for pid in p.quiet], signal.SIGCONT)


async def _alone(p: _Path, quiet: list[int], calls: int) -> None:
    """A block of `p`, after `SETTLE_CALLS` unmeasured calls, with the other paths' `quiet`
    processes stopped (for `FREEZE_MAX_S` at most: a longer block lets them go on, rather
    than have their members expire)."""
    await _stop(quiet)
    try:
        async with anyio.create_task_group() as tg:
            async def thaw() -> None:
                await anyio.sleep(FREEZE_MAX_S)
                _signal(quiet, signal.SIGCONT)

            if quiet:
                tg.start_soon(thaw)
            try:
                await p.unmeasured(SETTLE_CALLS)  # p's fleet catches up if it was stopped
                await p.block(calls)
            except Exception as exc:
                if not p.may_fail:
                    raise
                p.failed = f"{type(exc).__name__}: {exc}"[:120]
            tg.cancel_scope.cancel()
    finally:
        _signal(quiet, signal.SIGCONT)


async def _stop(pids: list[int], timeout: float = STOP_WAIT_S) -> None:
    """SIGSTOP `pids` and wait until each one has stopped: a process stops only once it next
    runs, which on a busy host can be well into the block (seen: a fleet still running after
    the block's first calls). On a host without /proc, only the signal is sent."""
    _signal(pids, signal.SIGSTOP)
    with anyio.move_on_after(timeout):
        for pid in pids:
            # no event marks another process stopping: its /proc state is read until it has
            while _proc_state(pid) not in _STOPPED_OR_GONE:  # noqa: ASYNC110
                await anyio.sleep(0.001)


#: /proc states after which a process runs no more: stopped, traced, zombie, dead, or
#: unreadable (no /proc, or the process gone)
_STOPPED_OR_GONE = frozenset("TtZX-")


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:
        return "-"


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@contextlib.asynccontextmanager
async def floor_fleet(url: str, n: int, processes: int
                      ) -> AsyncIterator[tuple[Callable[[int], Awaitable[None]], list[int]]]:
    """The nats-py floor: its responders up; yields its call and their pids."""
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

            yield call, [p.pid for p in procs]
        await sub.unsubscribe()
        await js.delete_stream(tag.upper())
    finally:
        await nc.close()


def same_work_command(tag: str, i: int) -> tuple[Command, DesiredState, dict[str, str]]:
    """Call `i`'s command of the same-work floor (`Pause` on even calls, `Resume` on odd, with
    a deadline, as `FabricClient` sends them), the desired state written with it, and the
    headers rlfabric stores the command with."""
    cmd_id, deadline = uuid.uuid4().hex, time.time() + 30
    cmd: Command = (Pause(cmd_id=cmd_id, mode="wait", deadline=deadline) if i % 2 == 0
                    else Resume(cmd_id=cmd_id, deadline=deadline))
    state = DesiredState(paused=i % 2 == 0, pause_mode="wait" if i % 2 == 0 else "",
                         updated_at=time.time(), writer=tag, serial=i)
    return cmd, state, {SCHEMA_HEADER: SCHEMA_VERSION, CMD_ID_HEADER: cmd_id,
                        "Nats-Msg-Id": cmd_id, STATE_MARK_HEADER: f"{tag}:{i}"}


@contextlib.asynccontextmanager
async def same_work_fleet(url: str, n: int, processes: int
                          ) -> AsyncIterator[tuple[Callable[[int], Awaitable[None]], list[int]]]:
    """The nats-py floor doing rlfabric's work a call (`floor.py control --same-work`): the
    desired state written (its PubAck awaited after the acks), the command persisted, its live
    copy sent once stored with the sequence in its subject, and every `Ack` decoded and kept
    per worker; done when all N are in and ok. Yields its call and the responders' pids."""
    import nats
    from nats.aio.msg import Msg
    from nats.js.api import StorageType, StreamConfig

    tag = f"same{n}"
    cmds = [["rlfabric.bench.floor", "control", "--nats", url, "--subject", f"{tag}.live",
             "--count", str(len(part)), "--first", str(part[0]), "--same-work", f"{tag}.ack."]
            for part in split(list(range(n)), processes)]
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Ack)
    nc = await nats.connect(url, name="rlfabric-same-work-caller")
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=tag.upper(), subjects=[f"{tag}.ctl.>"],
                                         storage=StorageType.FILE))
        await js.add_stream(StreamConfig(name=f"{tag.upper()}_STATE", subjects=[f"{tag}.state"],
                                         max_msgs_per_subject=1, storage=StorageType.FILE))
        got: dict[str, dict[str, Ack]] = {}
        done: dict[str, anyio.Event] = {}

        async def on_ack(msg: Msg) -> None:
            acks = got.get(msg.subject.rpartition(".")[2])
            if acks is None:
                return
            ack = dec.decode(msg.data)
            if ack.worker_id not in acks:
                acks[ack.worker_id] = ack
                if len(acks) == n:
                    done[ack.cmd_id].set()

        sub = await nc.subscribe(f"{tag}.ack.*", cb=on_ack)
        async with children(cmds, ready="floor: control ready") as procs:
            async def call(i: int) -> None:
                cmd, state, hdrs = same_work_command(tag, i)
                got[cmd.cmd_id], done[cmd.cmd_id] = {}, anyio.Event()
                stored = await js.publish_async(f"{tag}.state", enc.encode(state))
                data, op = enc.encode(cmd), op_of(cmd)
                ack = await js.publish(f"{tag}.ctl.{op}", data, headers=hdrs)
                await nc.publish(f"{tag}.live.{op}.{ack.seq}", data)
                with anyio.fail_after(30):
                    await done[cmd.cmd_id].wait()
                    await stored
                assert all(a.status == "ok" for a in got.pop(cmd.cmd_id).values())
                del done[cmd.cmd_id]

            yield call, [p.pid for p in procs]
        await sub.unsubscribe()
        for stream in (tag.upper(), f"{tag.upper()}_STATE"):
            await js.delete_stream(stream)
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def fabric_fleet(url: str, n: int, processes: int, servers: list[int], prefix: str
                       ) -> AsyncIterator[tuple[Callable[[int], Awaitable[None]], list[int],
                                                dict[str, float]]]:
    """rlfabric: N simulated workers joined; yields its call, their pids and the job's idle
    cost (measured now, before any call)."""
    ids = [f"b{i:03d}" for i in range(n)]
    cmds = [["rlfabric.bench.sim", "--nats", url, "--prefix", prefix, "--ids", ",".join(part)]
            for part in split(ids, processes)]
    async with children(cmds, ready="ready") as procs, FabricClient.connect(
            url, prefix=prefix, policy=QuorumPolicy(timeout=30)) as fabric:
        await fabric.wait_for_workers(n, timeout=120)
        pids = [p.pid for p in procs]
        await anyio.sleep(IDLE_SETTLE_S)
        idle = await idle_cpu(servers, pids)

        async def call(i: int) -> None:
            rep = await (fabric.pause(mode="wait") if i % 2 == 0 else fabric.resume())
            assert len(rep.ok) == n

        yield call, pids, idle


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


@contextlib.asynccontextmanager
async def http_fleet(n: int, processes: int, clients: list[str]
                     ) -> AsyncIterator[tuple[dict[str, Callable[[int], Awaitable[None]]],
                                              list[int]]]:
    """N aiohttp servers up; yields a call per HTTP client (`aiohttp`, `httpx`: POST to
    every URL concurrently, wait for every answer) and the servers' pids."""
    ports = free_ports(n)
    cmds = [["rlfabric.bench.http_fleet", "--ports", ",".join(map(str, part))]
            for part in split(ports, processes)]
    pause = [f"http://127.0.0.1:{p}/pause?mode=wait" for p in ports]
    resume = [f"http://127.0.0.1:{p}/resume" for p in ports]
    async with contextlib.AsyncExitStack() as stack:
        procs = await stack.enter_async_context(children(cmds, ready="http fleet ready"))
        calls: dict[str, Callable[[int], Awaitable[None]]] = {}
        if "aiohttp" in clients:
            import aiohttp

            session = await stack.enter_async_context(aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0)))

            async def post(u: str) -> None:
                async with session.post(u) as r:
                    assert (await r.json())["ok"]

            async def call(i: int) -> None:
                async with anyio.create_task_group() as tg:
                    for u in (pause if i % 2 == 0 else resume):
                        tg.start_soon(post, u)

            calls["aiohttp"] = call
        if "httpx" in clients:
            import httpx

            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            hc = await stack.enter_async_context(httpx.AsyncClient(limits=limits))

            async def hpost(u: str) -> None:
                r = await hc.post(u)
                assert r.json()["ok"]

            async def hcall(i: int) -> None:
                async with anyio.create_task_group() as tg:
                    for u in (pause if i % 2 == 0 else resume):
                        tg.start_soon(hpost, u)

            calls["httpx"] = hcall
        yield calls, [p.pid for p in procs]


async def run(sizes: list[int], rounds: int, processes: int, cluster: int = 0,
              blocks: int = BLOCKS, sync: str = "") -> list[dict]:
    """Per size, every path's fleet is started once (all up together), warmed, then measured
    in `blocks` interleaved blocks (`interleave`). A row's latencies and CPU are over all its
    calls; its ratio to rlfabric is the median of the per-block ratios of p50s."""
    rows = []
    async with contextlib.AsyncExitStack() as stack:
        nats = await stack.enter_async_context(EmbeddedNats())
        nodes = (await stack.enter_async_context(EmbeddedCluster(cluster)) if cluster
                 else None)
        synced = (await stack.enter_async_context(EmbeddedNats(sync=sync)) if sync
                  else None)
        for n in sizes:
            procs = min(n, max(processes, n // PER_PROCESS))
            r = max(20, rounds if n < 128 else rounds // 2)
            single = [nats.pid or 0]
            async with contextlib.AsyncExitStack() as fleets:
                call, pids, idle = await fleets.enter_async_context(
                    fabric_fleet(nats.url, n, procs, single, f"ctl{n}"))
                paths = [_Path("rlfabric", r, call, single, pids, idle, quiet=pids)]
                if nodes is not None:  # the same job on the cluster: every stream and bucket R3
                    nodes_pids = [node.pid or 0 for node in nodes.nodes]
                    call, pids, idle = await fleets.enter_async_context(
                        fabric_fleet(nodes.url, n, procs, nodes_pids, f"ctl{n}c"))
                    paths.append(_Path(f"rlfabric {cluster}-node cluster R{min(3, cluster)}",
                                       r, call, nodes_pids, pids, idle, quiet=pids))
                if synced is not None:  # the same job on a server flushing as --sync says
                    spid = [synced.pid or 0]
                    call, pids, idle = await fleets.enter_async_context(
                        fabric_fleet(synced.url, n, procs, spid, f"ctl{n}s"))
                    paths.append(_Path(f"rlfabric, sync {sync}", r, call, spid, pids, idle,
                                       quiet=pids))
                call, pids = await fleets.enter_async_context(
                    floor_fleet(nats.url, n, procs))
                floor = _Path("nats-py floor", r, call, single, pids)
                paths.append(floor)
                call, pids = await fleets.enter_async_context(
                    same_work_fleet(nats.url, n, procs))
                paths.append(_Path("nats-py floor, same work", r, call, single, pids))
                clients = ["aiohttp", *(["httpx"] if n <= HTTPX_MAX else [])]
                calls, pids = await fleets.enter_async_context(http_fleet(n, procs, clients))
                paths.append(_Path("aiohttp", r, calls["aiohttp"], [], pids, may_fail=True))
                if "httpx" in calls:
                    hr = max(10, r // (4 if n >= 32 else 1))
                    paths.append(_Path("httpx", hr, calls["httpx"], [], pids, may_fail=True))
                await interleave(paths, blocks)
            for p in paths:
                rows.append({"responders": n, "processes": procs, **p.row(paths[0], floor)})
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="1,8,32,128")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--blocks", type=int, default=BLOCKS, metavar="B",
                   help="split every path's calls into B blocks, run interleaved (the order "
                   "rotating block to block) with every fleet up, so a slow stretch of a shared "
                   "host hits every path alike; a ratio is the median of the per-block ratios")
    p.add_argument("--cluster", type=int, default=0, metavar="N",
                   help="also run rlfabric on an N-node (>= 3) loopback NATS cluster, every "
                   "stream and bucket with 3 copies: a row beside the single server's")
    p.add_argument("--sync", default="", metavar="always|DURATION",
                   help="also run rlfabric on a server that flushes to disk as `rlfabric nats "
                   "--sync` says (always: before acking each write): a row beside the default's")
    p.add_argument("--metrics", action="store_true",
                   help="Prometheus metrics on, in this process and every responder (what "
                   "they cost)")
    p.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    if args.blocks < 1 or args.rounds < 1:
        print("rlfabric bench control: --blocks and --rounds must be >= 1", file=sys.stderr)
        return 2
    try:
        check_sync(args.sync)
    except ValueError as exc:
        print(f"rlfabric bench control: --{exc}", file=sys.stderr)
        return 2
    with metrics_on(args.metrics):
        rows = anyio.run(run, [int(x) for x in args.sizes.split(",")], args.rounds,
                         args.processes, args.cluster, args.blocks, args.sync)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(table(rows, [("responders", "responders", ""), ("processes", "procs", ""),
                       ("path", "path", ""), ("rounds", "rounds", ""), ("blocks", "blocks", ""),
                       ("p50_ms", "p50 ms", ".2f"), ("p99_ms", "p99 ms", ".2f"),
                       ("mean_ms", "mean ms", ".2f"), ("cpu_us", "caller cpu us", ".0f"),
                       ("server_cpu_us", "server cpu us", ".0f"),
                       ("responders_cpu_us", "responders cpu us", ".0f"),
                       ("x_vs_fabric", "p50 / rlfabric p50", ".2f"),
                       ("x_floor", "p50 / floor p50", ".2f")]))
    idle = [r for r in rows if "idle_server_pct" in r]
    print(f"\nidle cost, no calls ({IDLE_S:.0f} s, from {IDLE_SETTLE_S:.0f} s after every "
          "worker joined; % of one core): beats, command polls and the trainer's membership "
          "watch")
    print(table(idle, [("responders", "responders", ""), ("path", "path", ""),
                       ("idle_caller_pct", "caller %", ".1f"),
                       ("idle_server_pct", "server %", ".1f"),
                       ("idle_responders_pct", "responders %", ".1f")]))
    return 0
