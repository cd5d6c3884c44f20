"""JetStream's store running out, on a server with a 64 MiB store.

Every stream and bucket of a job has its own cap, set aside when it is created: a weights
stream at its cap refuses its own writes, while membership writes, commands, desired-state
writes and results go on. A push JetStream cannot set the room aside for is refused before
anything is sent, naming the sizes; the next one that fits lands. A push that a full store
stops part-way (another tenant's stream took the room) removes what it stored and tells the
workers. A request queue at its cap refuses a submit (`StorageFull`), and takes the next once
it drains."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import replace as replace

import anyio
import pytest
import torch
from helpers import collect, req
from nats.js.api import StreamConfig

from rlfabric.bus import Bus, EmbeddedNats, Limits, QuorumPolicy, StorageFull
from rlfabric.bus.errors import storage_refused
from rlfabric.engines.null import NullEngine
from rlfabric.schemas import RolloutResult
from rlfabric.trainer import FabricClient
from rlfabric.transports import TransportError
from rlfabric.worker import Worker

pytestmark = [pytest.mark.nats, pytest.mark.anyio, pytest.mark.timeout(180)]

MIB = 1024 * 1024
#: 25 MiB set aside for the job's other streams and buckets, the weights stream's from 16 MiB
SMALL = Limits(rollout_max_bytes=4 * MIB, results_max_bytes=8 * MIB, control_max_bytes=4 * MIB,
               sessions_max_bytes=4 * MIB, members_max_bytes=MIB, state_max_bytes=2 * MIB,
               affinity_max_bytes=MIB, events_max_bytes=MIB)


def weights(mib: int) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.randn(4 * MIB // 4) for i in range(mib // 4)}


def answered_once(got: list[RolloutResult], prefix: str, n: int) -> bool:
    return (sorted(r.request_id for r in got) == sorted(f"{prefix}{i}" for i in range(n))
            and all(isinstance(r, RolloutResult) for r in got))


@contextlib.asynccontextmanager
async def small_store() -> AsyncIterator[tuple[Bus, FabricClient]]:
    """A server with a 64 MiB store, a worker on it, a trainer: the job's bus and client."""
    async with EmbeddedNats(max_file_store=64 * MIB) as srv, \
            Bus.connect(srv.url, prefix="full", limits=SMALL) as bus, \
            anyio.create_task_group() as tg:
        await tg.start(Worker(bus, NullEngine(), "f0", capacity=8).run)
        async with FabricClient.connect(srv.url, prefix="full", limits=SMALL,
                                        policy=QuorumPolicy(timeout=60)) as fabric:
            await fabric.wait_for_workers(1, timeout=30)
            yield bus, fabric
        tg.cancel_scope.cancel()


async def fill_weights_stream(bus: Bus) -> int:
    """Raw chunks under version 0 until the weights stream refuses one; the bytes stored."""
    stored = 0
    for i in range(64):
        try:
            await bus.publish_stored(f"{bus.subjects.weights(0)}.{i}", b"x" * MIB)
        except Exception as exc:
            assert storage_refused(exc), exc
            return stored
        stored += MIB
    raise AssertionError("the weights stream took 64 MiB: it has no cap")


async def test_a_full_weights_stream_stops_nothing_else_and_a_push_too_big_is_refused_at_once(
        ) -> None:
    async with small_store() as (bus, fabric):
        epoch = fabric.watcher.snapshot().epoch
        before = await collect(fabric, [req(f"b{i}", max_tokens=2) for i in range(20)])
        full_at = time.time()
        stored = await fill_weights_stream(bus)
        # the weights stream is at its cap: a pause, the worker's key written (its state),
        # the desired state written, results
        rep = await fabric.pause(policy=QuorumPolicy(timeout=5))
        beat = await fabric.watcher.wait_until(
            lambda snap: any(m.heartbeat_at > full_at and m.state == "paused"
                             for m in snap.members), timeout=5)
        await fabric.resume(policy=QuorumPolicy(timeout=5))
        during = await collect(fabric, [req(f"d{i}", max_tokens=2) for i in range(20)])
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=r"96\.0 MiB beside.*cannot set aside"
                           ) as exc:
            await fabric.update_weights(1, state_dict=weights(96), transport="nats",
                                        verify="off")
        refused_s = time.monotonic() - t0
        ok = await fabric.update_weights(1, state_dict=weights(16), transport="nats",
                                         verify="off")
        after = await collect(fabric, [req(f"a{i}", max_tokens=2) for i in range(20)])
        snap = fabric.watcher.snapshot()
    print(f"\nweights stream full: push refused in {refused_s:.3f} s, pause acked")
    assert stored == 15 * MIB  # 16 MiB cap, less what a chunk's record adds
    assert beat.members and rep.ok == ("f0",)
    assert exc.value.code == "storage_full" and refused_s < 5.0
    assert ok.ok == ("f0",) and ok.acks["f0"].weight_version == 1
    assert snap.epoch == epoch and snap.worker_ids == ("f0",)
    for got, prefix in ((before, "b"), (during, "d"), (after, "a")):
        assert answered_once(got, prefix, 20)


async def test_a_push_the_store_runs_out_under_is_removed_and_the_worker_told(
        ) -> None:
    async with small_store() as (bus, fabric):
        # another tenant's stream, with no cap, takes most of the store
        await bus.js.add_stream(StreamConfig(name="OTHER", subjects=["other.>"]))
        for i in range(52):
            await bus.publish_stored(f"other.{i}", b"o" * MIB)
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=r"no room.*24\.0 MiB") as exc:
            await fabric.update_weights(1, state_dict=weights(24), transport="nats",
                                        verify="off")
        refused_s = time.monotonic() - t0
        t1 = time.monotonic()
        await bus.js.delete_stream("OTHER")
        rep = await fabric.pause(policy=QuorumPolicy(timeout=10))
        pause_s = time.monotonic() - t1
        await fabric.resume()
        depths = await fabric.bus.fleet.stream_depths()
        ok = await fabric.update_weights(2, state_dict=weights(24), transport="nats",
                                         verify="off")
        after = await collect(fabric, [req(f"a{i}", max_tokens=2) for i in range(20)])
    print(f"\nstore full mid-push: refused in {refused_s:.3f} s, pause acked in {pause_s:.3f} s")
    assert exc.value.code == "storage_full" and refused_s < 5.0
    assert rep.ok == ("f0",) and pause_s < 2.0  # not stuck waiting for chunks
    assert depths["FULL_WEIGHTS"] == 1  # what the push stored is gone; its abort marker stays
    assert ok.ok == ("f0",) and ok.acks["f0"].weight_version == 2
    assert answered_once(after, "a", 20)


async def test_a_full_request_queue_refuses_a_submit_and_takes_the_next_that_fits() -> None:
    limits = replace(SMALL, rollout_max_bytes=MIB)
    async with EmbeddedNats(max_file_store=64 * MIB) as srv, \
            Bus.connect(srv.url, prefix="full", limits=limits) as bus, \
            FabricClient.connect(srv.url, prefix="full", limits=limits) as fabric:
        t0 = time.monotonic()
        with pytest.raises(StorageFull, match=r"no room for RolloutRequest.*rollout_max_bytes"):
            # 16 prompts of 160 KB: no worker takes them, the 1 MiB queue cannot hold them
            await collect(fabric, [req(f"q{i}", range(1, 40_001)) for i in range(16)])
        refused_s = time.monotonic() - t0
        queued = (await fabric.bus.fleet.stream_depths())["FULL_ROLLOUT"]
        async with anyio.create_task_group() as tg:
            await tg.start(Worker(bus, NullEngine(), "f0", capacity=8).run)
            after = await collect(fabric, [req(f"a{i}", max_tokens=2) for i in range(20)])
            tg.cancel_scope.cancel()
    print(f"\nrequest queue full: submit refused in {refused_s:.3f} s")
    assert refused_s < 5.0 and queued == 0  # refused whole: nothing half-queued
    assert answered_once(after, "a", 20)


async def test_a_job_sized_for_a_small_store_is_joined_by_processes_with_the_defaults() -> None:
    async with EmbeddedNats(max_file_store=64 * MIB) as srv:
        async with Bus.connect(srv.url, prefix="small", limits=SMALL):
            pass  # the job, sized for the store by its first process
        # a worker and a trainer started with the defaults take the job's settings
        async with Bus.connect(srv.url, prefix="small") as bus, anyio.create_task_group() as tg:
            await tg.start(Worker(bus, NullEngine(), "d0", capacity=4).run)
            async with FabricClient.connect(srv.url, prefix="small") as fabric:
                await fabric.wait_for_workers(1, timeout=30)
                out = await collect(fabric, [req("r0", max_tokens=4)], timeout=30)
            tg.cancel_scope.cancel()
    assert [type(r) for r in out] == [RolloutResult]


def test_a_fleet_started_from_the_cli_for_a_64mb_store_serves_and_refuses_a_big_push(
        spawn, tmp_path) -> None:
    import json
    import subprocess
    import sys

    pytest.importorskip("starlette", reason="the gateway extra is not installed")
    import httpx

    async def main() -> None:
        async with EmbeddedNats(max_file_store=64 * MIB) as srv:
            budget = ("--nats", srv.url, "--prefix", "tiny", "--store-budget", "64MB")
            # the tools task's model: its trainer (`up`) and an agent's gateway share it
            spawn("worker", *budget, "--worker-id", "s0", "--model", "tinychat",
                  module="rlfabric").wait_for(r"ready \(", timeout=120)
            gw = spawn("gateway", *budget, "--model", "tinychat", "--tool-call-parser",
                       "tinychat", "--port", "0", module="rlfabric")
            base = gw.wait_for(r"serving \S+ at (http://\S+/v1)", timeout=60).group(1)
            up = await anyio.to_thread.run_sync(lambda: subprocess.run(
                [sys.executable, "-m", "rlfabric", "up", *budget, "--workers-external",
                 "--task", "tools", "--workers", "1", "--steps", "2", "--no-live", "--json",
                 "--out",
                 str(tmp_path)], capture_output=True, text=True, timeout=300))
            assert up.stdout.strip().endswith("}"), up.stdout[-1500:] + up.stderr[-1500:]
            summary = json.loads(up.stdout.strip().splitlines()[-1])
            assert summary["final_version"] == 2 and summary["all_workers_on_final"], up.stderr
            async with FabricClient.connect(srv.url, prefix="tiny",
                                            policy=QuorumPolicy(timeout=60)) as fabric:
                t0 = time.monotonic()
                with pytest.raises((StorageFull, TransportError)):
                    await fabric.update_weights(3, weights(48), transport="nats")
                assert time.monotonic() - t0 < 10
            async with httpx.AsyncClient(timeout=60) as http:
                r = await http.post(f"{base}/chat/completions", json={
                    "model": "tinychat", "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text

    anyio.run(main)
