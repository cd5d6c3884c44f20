"""A fault for 10 s while 2,000 rollouts run and a pause / weight push / resume is issued,
each fault in a cluster of 3 nodes with a worker beside each node and the trainer apart:

- the node leading the rollout stream, and the worker beside it, cut off from the rest, while
  chat completions also go through a gateway (in a host of its own);
- the node leading JetStream's metadata paused (SIGSTOP), as a stalled VM is.

Every result reaches the trainer exactly once; a command issued during the cut names the
cut-off worker and is never ok for it; the same commands succeed after the fault; then every
worker serves the one desired version. The counts and recovery times are printed (-s)."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import pytest
from helpers import req
from netns import pause, resume
from tally import Commands, Outcome, Tally

from rlfabric.bus import QuorumPolicy
from rlfabric.tensors.models import build_model
from rlfabric.trainer import FabricClient

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.anyio, pytest.mark.timeout(300)]

FAULT_S = 10.0
N_ROLLOUTS = 2000
POLICY = QuorumPolicy(timeout=4)


def push(fabric: FabricClient, version: int):
    """A push of the tiny model over the bus (the hosts share no memory); the null engine
    holds no tensors, so no checksum to compare."""
    return fabric.update_weights(version, module=build_model("tiny"), transport="nats",
                                 verify="off")


async def test_cutting_the_stream_leaders_node_loses_no_rollout(site, prefix) -> None:
    s = await anyio.to_thread.run_sync(lambda: site(gateway=True))
    with s.net.hosts["tr"].entered():
        async with FabricClient.connect(s.cluster.url, prefix=prefix, policy=POLICY) as fabric:
            await fabric.wait_for_workers(3, timeout=120)
            lead = await _leader_away_from_trainer(fabric, s.cluster.urls)
            row = await _under_fault(fabric, f"stream leader n{lead} and w{lead} cut off",
                                     lambda: s.net.split([f"n{lead}", f"w{lead}"]), s.net.heal,
                                     gateway=s.gateway)
    for out in row["during"]:
        assert f"w{lead}" not in out.ok and out.error, out
        assert f"w{lead}" in out.error or f"w{lead}" in out.missing, out


async def _leader_away_from_trainer(fabric: FabricClient, urls: list[str]) -> int:
    """The node leading the rollout stream, moved off the node the trainer talks to; the
    streams a command is stored in (control, weights, the state and members buckets) moved
    off it. A trainer on the cut-off side, or a command's own stream without a leader, could
    store no command at all: the metadata leader's test has that case."""
    s = fabric.bus.subjects
    mine = urls.index(str(fabric.bus.nc.connected_url.geturl()))
    lead = await _leader_off(fabric, s.rollout_stream, {mine})
    for stream in (s.control_stream, s.weights_stream, f"KV_{s.state_bucket}",
                   f"KV_{s.members_bucket}"):
        await _leader_off(fabric, stream, {lead})
    return lead


async def _leader_off(fabric: FabricClient, stream: str, nodes: set[int]) -> int:
    """`stream`'s leader once it is on none of `nodes` (asking it to step down meanwhile)."""
    with anyio.fail_after(60):
        while True:
            leader = (await fabric.bus.js.stream_info(stream)).cluster.leader
            if leader and int(leader[1:]) not in nodes:
                return int(leader[1:])
            if leader:
                await fabric.bus.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}",
                                            b"", timeout=5)
            await anyio.sleep(0.5)


async def test_pausing_the_metadata_leader_loses_no_rollout(site, prefix) -> None:
    s = await anyio.to_thread.run_sync(site)
    with s.net.hosts["tr"].entered():
        lead = s.cluster.meta_leader()
        node = s.cluster.nodes[lead]
        async with FabricClient.connect(s.cluster.url, prefix=prefix, policy=POLICY) as fabric:
            await fabric.wait_for_workers(3, timeout=120)
            await _under_fault(fabric, f"metadata leader n{lead} paused",
                               lambda: pause(node), lambda: resume(node))


async def _under_fault(fabric: FabricClient, what: str, start: Callable[[], None],
                       end: Callable[[], None], gateway: str = "") -> dict:
    """2,000 rollouts sent 50 every 0.25 s; the fault 2 s in, for FAULT_S; a pause, a push of
    version 1 and a resume issued once each during it, and until ok after it. With a
    `gateway`, chat completions through it meanwhile, one every 0.1 s."""
    await push(fabric, 0)
    reqs = [req(f"r{i}", max_tokens=3, seed=i) for i in range(N_ROLLOUTS)]
    t = Tally(fabric, reqs, timeout=180)
    cmds = Commands()
    during: list[Outcome] = []
    chats: list[int] = []  # each completion's HTTP status
    async with anyio.create_task_group() as tg:
        tg.start_soon(t.consume_paced, 50, 0.25)
        if gateway:
            tg.start_soon(_chat_paced, gateway, 150, 0.1, chats)
        with anyio.fail_after(30):
            await t.serving.wait()
        await anyio.sleep(2.0)
        start()
        t_fault = time.monotonic()
        try:
            during.append(await cmds.once("pause keep", lambda: fabric.pause("keep")))
            during.append(await cmds.once("update_weights 1", lambda: push(fabric, 1)))
            during.append(await cmds.once("resume", fabric.resume))
            await anyio.sleep(max(0.0, t_fault + FAULT_S - time.monotonic()))
        finally:
            end()
        t_end = time.monotonic()
        await cmds.until_ok("pause keep", lambda: fabric.pause("keep"))
        await cmds.until_ok("update_weights 1", lambda: push(fabric, 1))
        await cmds.until_ok("resume", fabric.resume)
        t_ok = time.monotonic()
    snap = await fabric.watcher.wait_until(
        lambda sn: len(sn.members) == 3 and all(m.weight_version == 1 for m in sn.members),
        timeout=60)
    t_current = time.monotonic()
    # min_weight_version=1: a worker still on v0 would hold them, not serve them
    after = [r async for r in fabric.generate(
        [req(f"after{i}", max_tokens=3, seed=i, min_version=1) for i in range(60)],
        timeout=60)]
    chatted = (f"; through the gateway {len(chats)} chat completions, "
               f"{chats.count(200)} answered 200" if gateway else "")
    print(f"\n{what} for {FAULT_S:.0f}s{chatted}: {N_ROLLOUTS} rollouts sent, {t.results} "
          f"answered, {len(t.got)} distinct, duplicates dropped {t.dropped}, errors "
          f"{len(t.errors)}; "
          f"longest gap between results {t.longest_gap():.2f}s; commands ok "
          f"{t_ok - t_end:.2f}s after the fault ended, every worker at v1 "
          f"{t_current - t_end:.2f}s after it\n{cmds.table()}")
    t.assert_each_once()
    assert {m.worker_id for m in snap.members} == {"w0", "w1", "w2"}
    assert chats == [200] * (150 if gateway else 0)
    assert len(after) == 60
    assert {sp.version for r in after for sp in r.version_spans} == {1}
    return {"during": during}


async def _chat_paced(base: str, n: int, every: float, statuses: list[int]) -> None:
    """`n` chat completions through the gateway, one started every `every` seconds."""
    import httpx

    async with httpx.AsyncClient(timeout=120) as http, anyio.create_task_group() as tg:
        async def one(i: int) -> None:
            r = await http.post(f"{base}/chat/completions", json={
                "model": "tinyqwen", "max_tokens": 4, "seed": i,
                "messages": [{"role": "user", "content": f"count to {i}"}]})
            statuses.append(r.status_code)

        for i in range(n):
            tg.start_soon(one, i)
            await anyio.sleep(every)
