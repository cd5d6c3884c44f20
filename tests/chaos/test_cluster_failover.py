"""A 3-node NATS cluster loses the node leading the rollout stream (SIGKILL) with 300 rollouts
in flight and a pause / update_weights / resume cycle on its way: every result reaches the
caller exactly once, the control calls complete (retried after a `QuorumNotReached` or a bus
error that says why), and the node, restarted on its store, catches up (every node's copy of
every stream current). The failover figures are printed (run with -s to see them)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import nats
import pytest

from rlfabric.bus import EmbeddedCluster, QuorumNotReached, QuorumPolicy
from rlfabric.errors import RLFabricError
from rlfabric.schemas import FanoutReport, RolloutRequest, SamplingParams
from rlfabric.tensors.models import build_model
from rlfabric.trainer import FabricClient

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.anyio, pytest.mark.timeout(400)]


async def retried(call: Callable[[], Awaitable[FanoutReport]], tries: list[str]
                  ) -> FanoutReport:
    """`call()` until it succeeds (a new cmd_id each time) for at most 60 s (a stream whose
    leader was lost takes seconds to elect another), each failure's message kept."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            return await call()
        except (QuorumNotReached, RLFabricError, nats.errors.Error) as exc:
            tries.append(f"{type(exc).__name__}: {exc}")
            await anyio.sleep(0.5)
    pytest.fail(f"still failing after 60 s, {len(tries)} tries: {tries}")


async def all_current(cluster: EmbeddedCluster, streams: list[str]) -> dict[str, set[int]]:
    """Each stream's last sequence as each node reports it, once every copy is current."""
    seen: dict[str, set[int]] = {}
    for url in cluster.urls:
        nc = await nats.connect(url, allow_reconnect=False)
        try:
            js = nc.jetstream()
            for name in streams:
                info = await js.stream_info(name)
                assert info.cluster is not None
                peers = info.cluster.replicas or []
                if len(peers) != 2 or not all(p.current and not p.offline for p in peers):
                    raise AssertionError(f"{name} via {url}: {peers}")
                seen.setdefault(name, set()).add(info.state.last_seq)
        finally:
            await nc.close()
    return seen


async def test_losing_the_rollout_stream_leader_loses_no_result_and_the_node_catches_up(
        spawn, tmp_path, prefix, tally) -> None:
    cluster = EmbeddedCluster(3, store_dir=str(tmp_path / "store"))
    await anyio.to_thread.run_sync(cluster.start)
    try:
        # each worker knows one node (and learns the others from it): three different nodes
        for i, url in enumerate(cluster.urls):
            spawn("worker", "--nats", url, "--prefix", prefix, "--worker-id", f"c{i}",
                  "--engine", "torch", "--threads", "1", "--capacity", "32", module="rlfabric")
        policy = QuorumPolicy(timeout=20)
        async with FabricClient.connect(cluster.url, prefix=prefix, policy=policy) as fabric:
            await fabric.wait_for_workers(3, timeout=120)
            await fabric.update_weights(0, module=build_model("tiny"))
            s = fabric.bus.subjects
            leader = (await fabric.bus.js.stream_info(s.rollout_stream)).cluster.leader
            victim = int(leader[1:])  # "n1" -> 1
            row = await _kill_during_rollouts_and_update(fabric, cluster, victim, tally)
            # the restarted node rejoins and catches up
            await anyio.to_thread.run_sync(cluster.start_node, victim)
            streams = [s.rollout_stream, s.results_stream, s.control_stream,
                       f"KV_{s.members_bucket}", f"KV_{s.state_bucket}"]
            t_back = time.monotonic()
            seen: dict[str, set[int]] = {}
            with anyio.move_on_after(60) as waited:
                while True:
                    try:
                        seen = await all_current(cluster, streams)
                    except (AssertionError, nats.errors.Error, nats.js.errors.Error):
                        pass  # a copy still catching up: ask again
                    else:
                        # every node's copy of the job's buckets and control log agrees (a
                        # heartbeat landing between two nodes' answers: ask again)
                        if all(len(v) == 1 for k, v in seen.items() if k != s.results_stream):
                            break
                    await anyio.sleep(0.5)
            if waited.cancelled_caught:
                pytest.fail(f"the restarted node's copies not current after 60 s: {seen}")
            caught_up = time.monotonic() - t_back
            snap = await fabric.watcher.wait_until(
                lambda sn: len(sn.members) == 3 and all(m.weight_version == 1
                                                       for m in sn.members), timeout=30)
            assert {m.worker_id for m in snap.members} == {"c0", "c1", "c2"}
    finally:
        await anyio.to_thread.run_sync(cluster.stop)
    print(f"\ncluster failover (3 nodes, R3, 300 rollouts in flight, 3 torch workers): killed "
          f"{leader} (rollout stream leader); first result {row['first_result']:.2f}s after "
          f"the kill; pause/update/resume done {row['cycle']:.2f}s after it "
          f"({row['retries']} retries: {row['why']}; caught up from the stream: "
          f"{row['caught_up']}); results {row['results']} for 300 "
          f"requests, duplicates dropped {row['dropped']}; node back and current after "
          f"{caught_up:.2f}s")


async def _kill_during_rollouts_and_update(fabric: FabricClient, cluster: EmbeddedCluster,
                                           victim: int, tally: Callable[..., Any]) -> dict:
    reqs = [RolloutRequest(request_id=f"f{i}", prompt_token_ids=[256, 5, 6],
                           sampling=SamplingParams(max_tokens=64, seed=i)) for i in range(300)]
    t = tally(fabric, reqs, timeout=180)
    tries: list[str] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(t.consume)
        with anyio.fail_after(30):  # the requests are stored and being served
            await t.serving.wait()
        await anyio.to_thread.run_sync(cluster.kill, victim)
        t_kill = time.monotonic()
        await retried(lambda: fabric.pause("keep"), tries)
        rep = await retried(lambda: fabric.update_weights(1, module=build_model("tiny")),
                            tries)
        await retried(fabric.resume, tries)
        cycle = time.monotonic() - t_kill
    # a worker on the killed node answers nobody until it has reconnected to another node: a
    # ping that finds it gone then makes the call raise `MembershipChanged` naming it, and the
    # retry goes on without it; it applies the update from the stream when back (the caller
    # checks every member reaches version 1)
    missed = {"c0", "c1", "c2"} - set(rep.ok)
    for w in missed:
        assert any("found dead by ping" in x and f"'{w}'" in x for x in tries), (rep, tries)
    t.assert_each_once()
    return {"first_result": t.first_after(t_kill), "cycle": cycle, "retries": len(tries),
            "why": "; ".join(x[:120] for x in tries) or "none", "results": t.results,
            "caught_up": ", ".join(sorted(missed)) or "none",
            "dropped": t.dropped}
