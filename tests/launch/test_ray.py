"""Workers as Ray actors (`rlfabric.launch.ray`) on a local Ray runtime: placed in one
placement group, joined over NATS like any worker, serving rollouts and taking an update; a
`ray.kill`ed actor is found missing within 2 s and its requests complete on the other."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator

import anyio
import pytest

from rlfabric.launch.ray import RayFleet, WorkerSpec
from rlfabric.schemas import RolloutError, RolloutRequest, SamplingParams
from rlfabric.tensors.models import build_model
from rlfabric.trainer import QuorumPolicy

ray = pytest.importorskip("ray", reason="Ray is not installed here (pip install "
                          "'rlfabric[ray]')")

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.anyio, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ray_runtime() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:  # undone after this module's tests
        if "RAY_USAGE_STATS_ENABLED" not in os.environ:
            mp.setenv("RAY_USAGE_STATS_ENABLED", "0")  # no prompt, nothing sent out
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 object_store_memory=100 * 2**20)
        try:
            yield
        finally:
            ray.shutdown()  # its raylet, GCS and actors stop with it


def requests(prefix: str, n: int, max_tokens: int) -> list[RolloutRequest]:
    return [RolloutRequest(request_id=f"{prefix}{i}", prompt_token_ids=[256, i % 200, 7],
                           sampling=SamplingParams(max_tokens=max_tokens, seed=i))
            for i in range(n)]


async def test_ray_actors_join_serve_update_and_a_killed_one_is_missing_within_2s(
        ray_runtime, nats_url, prefix, client) -> None:
    spec = WorkerSpec(engine="torch", model="tiny", capacity=8, threads=1, prefetch=4,
                      poll_max=2.0)
    fleet = RayFleet(2, nats_url, prefix, spec, cpus_per_worker=1)
    await anyio.to_thread.run_sync(fleet.start)
    try:
        async with client(rollout_ack_wait=2.0) as fabric:
            # a member is listed from the moment it answers commands; "ready" (serving) is
            # its next state
            await fabric.watcher.wait_until(
                lambda s: [m.state for m in s.members] == ["ready", "ready"], timeout=120)
            # one placement group, a 1-CPU bundle per worker, each actor in its own process
            table = ray.util.placement_group_table(fleet.pg)
            assert table["state"] == "CREATED"
            assert [b for b in table["bundles"].values()] == [{"CPU": 1.0}, {"CPU": 1.0}]
            health = await anyio.to_thread.run_sync(fleet.health)
            assert [h["state"] for h in health] == ["ready", "ready"], health
            assert [h["prefetch"] for h in health] == [4, 4], health
            pids = {h["pid"] for h in health}
            assert len(pids) == 2 and os.getpid() not in pids

            rep = await fabric.update_weights(1, module=build_model("tiny"))
            assert rep.ok == ("w0", "w1")
            described = await anyio.to_thread.run_sync(fleet.describe, 0)
            assert described["version"] == "1" and described["engine"] == "torch"
            out = [r async for r in fabric.generate(requests("a", 40, 8), timeout=120)]
            assert not [r for r in out if isinstance(r, RolloutError)]
            assert {s.version for r in out for s in r.version_spans} == {1}
            assert {r.worker_id for r in out} == {"w0", "w1"}  # both served

            # w1 killed with requests in flight: found missing, its requests served by w0
            got: Counter[str] = Counter()
            served_by: dict[str, str] = {}
            errors: list[RolloutError] = []

            async def consume() -> None:
                async for r in fabric.generate(requests("b", 60, 64), timeout=180):
                    got[r.request_id] += 1
                    if isinstance(r, RolloutError):
                        errors.append(r)
                    else:
                        served_by[r.request_id] = r.worker_id

            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                await fabric.watcher.wait_until(
                    lambda s: any(m.worker_id == "w1" and m.in_flight > 0 for m in s.members),
                    timeout=60)
                t0 = time.monotonic()  # the probe group answers while the engines are busy
                busy = await anyio.to_thread.run_sync(fleet.health)
                probe_s = time.monotonic() - t0
                assert [h["state"] for h in busy] == ["ready", "ready"], busy
                await anyio.to_thread.run_sync(fleet.kill, 1)
                t_kill = time.monotonic()
                rep = await fabric.describe(
                    policy=QuorumPolicy(timeout=10, on_membership_change="shrink"))
                found_s = time.monotonic() - t_kill
            assert rep.ok == ("w0",) and rep.missing == ("w1",) and rep.dead == ("w1",), rep
            assert found_s < 2.0, f"w1 found missing {found_s:.2f}s after ray.kill"
            assert not errors, errors[:3]
            assert len(got) == 60 and set(got.values()) == {1}  # none lost, none twice
            late = {r for r, w in served_by.items() if w == "w0"}
            assert len(late) > 30, "w1 served most of them: the kill proved nothing"
            ended = await anyio.to_thread.run_sync(fleet.dead)
            assert len(ended) == 1 and ended[0].startswith("w1 ended:"), ended
    finally:
        await anyio.to_thread.run_sync(fleet.stop)
    print(f"\nray: health answered in {probe_s * 1000:.0f} ms with both engines busy; w1 "
          f"found missing {found_s:.2f}s after ray.kill; 60 results, each once")


def test_a_group_that_cannot_be_placed_says_what_the_cluster_has(ray_runtime) -> None:
    from rlfabric.errors import LaunchError

    fleet = RayFleet(2, "nats://127.0.0.1:1", "none", cpus_per_worker=64)
    with pytest.raises(LaunchError, match=r"could not place 2 bundles of \{'CPU': 64\}.*free"):
        fleet.start(timeout=2)
    assert fleet.pg is None and fleet.actors == []


@pytest.mark.parametrize("knob", [{"capacity": 0}, {"prefetch": -1}, {"poll_max": 0.5}])
def test_a_spec_with_a_knob_out_of_range_is_refused_before_anything_is_placed(knob) -> None:
    with pytest.raises(ValueError, match=r"capacity >= 1, prefetch >= 0 and poll_max >= 1"):
        WorkerSpec(**knob)
    assert WorkerSpec(prefetch=8, poll_max=1.0).prefetch == 8
