"""Jobs on one pool: two training runs share the workers, each with its own adapters (the same
name in both), versions and pause, and neither touches the other's requests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import msgspec
import pytest
import torch
from helpers import collect, req, worst_gap

from rlfabric.bus import Bus, QuorumNotReached, fleet_view
from rlfabric.cli._fleet import job_rows
from rlfabric.engines.torch import TorchEngine
from rlfabric.schemas import (
    Adapter,
    RolloutError,
    RolloutReply,
    RolloutRequest,
    RolloutResult,
    TokenDelta,
    UpdateWeights,
)
from rlfabric.tensors import lora
from rlfabric.tensors.models import build_model
from rlfabric.trainer import FabricClient, PoolOnly
from rlfabric.worker import Worker

pytestmark = [pytest.mark.nats, pytest.mark.anyio]

QV = Adapter(name="policy", rank=8, alpha=16.0, target_modules=("q_proj", "v_proj"))


@contextlib.asynccontextmanager
async def pool(nats_url: str, prefix: str, ids: list[str]) -> AsyncIterator[Bus]:
    async with Bus.connect(nats_url, prefix=prefix) as bus, anyio.create_task_group() as tg:
        for wid in ids:
            await tg.start(Worker(bus, TorchEngine("tiny"), wid, capacity=16).run)
        yield bus
        tg.cancel_scope.cancel()


def job(nats_url: str, prefix: str, name: str = "") -> contextlib.AbstractAsyncContextManager[
        FabricClient]:
    return FabricClient.connect(nats_url, prefix=prefix, job=name)


def adapter_state(seed: int) -> dict[str, torch.Tensor]:
    return lora.random_adapter(build_model("tiny"), QV, seed=seed, std=0.2)


async def test_two_jobs_name_their_adapters_alike_and_each_is_served_its_own(
        nats_url, prefix) -> None:
    """Jobs `exp-a` and `exp-b` both push an adapter named `policy`; each job's requests are
    served by its own (logprobs match its merged model), named by its job in the policy, and
    the default job's `policy` is a third."""
    async with pool(nats_url, prefix, ["j0", "j1"]), job(nats_url, prefix, "exp-a") as a, \
            job(nats_url, prefix, "exp-b") as b, job(nats_url, prefix) as default:
        await a.wait_for_workers(2, timeout=30)
        states = {"exp-a": adapter_state(1), "exp-b": adapter_state(2), "": adapter_state(3)}
        await a.update_weights(0, state_dict=states["exp-a"], adapter=QV)
        await b.update_weights(0, state_dict=states["exp-b"], adapter=QV)
        await b.update_weights(1, state_dict=states["exp-b"], adapter=QV)
        await default.update_weights(4, state_dict=states[""], adapter=QV)
        out = {}
        for name, c in (("exp-a", a), ("exp-b", b), ("", default)):
            reqs = [req(f"{name}{i}", [256, 30 + i], max_tokens=12, seed=i, adapter="policy")
                    for i in range(6)]
            out[name] = (reqs, await collect(c, reqs))
        members = await a.bus.fleet.members()
    base = build_model("tiny")
    for name, (reqs, got) in out.items():
        assert all(isinstance(r, RolloutResult) for r in got), got
        assert worst_gap(lora.merged(base, states[name], QV), reqs, got) <= 1e-4, name
    assert {s.version for r in out["exp-b"][1] for s in r.version_spans} == {1}
    assert {s.policy.split("/")[1] for r in out["exp-a"][1] for s in r.version_spans} == \
        {"exp-a:policy"}
    assert {s.policy.split("/")[1] for r in out[""][1] for s in r.version_spans} == {"policy"}
    for m in members.values():
        assert m.adapters == {"exp-a:policy": (0,), "exp-b:policy": (0, 1), "policy": (4,)}


async def _first_delta(c: FabricClient, reqs: list[RolloutRequest], began: anyio.Event,
                       into: list[RolloutReply]) -> None:
    async for r in c.rollouts.generate([c.pushed.own(q) for q in reqs], timeout=120,
                                       deltas=True):
        if isinstance(r, TokenDelta):
            began.set()
        else:
            into.append(r)


async def test_a_jobs_abort_pause_and_pushes_leave_the_other_job_serving(
        nats_url, prefix) -> None:
    """Job A's long requests are generating when A pauses with `abort`: the pause acks with
    none of them answered, job B's requests are served from start to end while A is paused,
    A pushes a new adapter version, and after A's resume its requests are sampled again from
    the start under that version only."""
    async with pool(nats_url, prefix, ["p0", "p1"]), job(nats_url, prefix, "exp-a") as a, \
            job(nats_url, prefix, "exp-b") as b:
        await a.wait_for_workers(2, timeout=30)
        await a.update_weights(0, state_dict=adapter_state(1), adapter=QV)
        await b.update_weights(0, state_dict=adapter_state(2), adapter=QV)
        long = [req(f"a{i}", [256, 7 + i], max_tokens=400, seed=i, adapter="policy")
                for i in range(4)]
        long = [msgspec.structs.replace(q, stream=True) for q in long]
        got_a: list[RolloutReply] = []
        began = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_first_delta, a, long, began, got_a)
            with anyio.fail_after(60):
                await began.wait()
            rep = await a.pause("abort")
            assert set(rep.ok) == {"p0", "p1"}
            assert got_a == []  # cut short, not answered: they are sampled again
            members = await a.bus.fleet.members()
            assert {m.paused_jobs for m in members.values()} == {("exp-a",)}
            assert {m.state for m in members.values()} == {"ready"}
            b_reqs = [req(f"b{i}", [256, 50 + i], max_tokens=24, seed=i, adapter="policy")
                      for i in range(8)]
            got_b = await collect(b, b_reqs, timeout=60)
            assert all(isinstance(r, RolloutResult) for r in got_b), got_b
            assert got_a == []  # still held while its job is paused
            new = adapter_state(7)
            await a.update_weights(1, state_dict=new, adapter=QV)
            await a.resume()
        assert len(got_a) == 4 and all(isinstance(r, RolloutResult) for r in got_a), got_a
    assert {s.version for r in got_a for s in r.version_spans} == {1}
    assert all(r.attempt > 1 for r in got_a if isinstance(r, RolloutResult))
    assert worst_gap(lora.merged(build_model("tiny"), new, QV), long, got_a) <= 1e-4


async def test_a_jobs_keep_pause_holds_its_new_requests_only(nats_url, prefix) -> None:
    """While job A is paused with `keep`, its new requests wait (not answered, not failed)
    and job B's, sent after them, are served; A's resume serves them."""
    async with pool(nats_url, prefix, ["k0"]), job(nats_url, prefix, "exp-a") as a, \
            job(nats_url, prefix, "exp-b") as b:
        await a.wait_for_workers(1, timeout=30)
        await a.pause("keep")
        got_a: list[RolloutReply] = []

        async def run_a() -> None:
            got_a.extend(await collect(a, [req("held", [256, 3], max_tokens=8, seed=1)]))
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_a)
            got_b = await collect(b, [req(f"b{i}", [256, 4 + i], max_tokens=8, seed=i)
                                      for i in range(4)], timeout=60)
            assert len(got_b) == 4 and all(isinstance(r, RolloutResult) for r in got_b)
            assert got_a == []
            await a.resume()
        assert [type(r) for r in got_a] == [RolloutResult]


async def test_a_jobs_client_cannot_act_on_the_pool(nats_url, prefix) -> None:
    """Base weights, sleep and wake are the pool's: a job's client is refused before
    anything is sent, and a worker refuses base weights that name a job (`pool_only`)."""
    async with pool(nats_url, prefix, ["o0"]), job(nats_url, prefix, "exp-a") as a, \
            job(nats_url, prefix) as operator:
        await a.wait_for_workers(1, timeout=30)
        with pytest.raises(PoolOnly, match="job 'exp-a'"):
            await a.update_weights(1, module=build_model("tiny"))
        with pytest.raises(PoolOnly):
            await a.sleep()
        with pytest.raises(ValueError, match="may not hold ':'"):
            await a.update_weights(0, state_dict=adapter_state(1),
                                   adapter=Adapter(name="x:y", rank=8, alpha=16.0,
                                                   target_modules=("q_proj",)))
        staged = await operator.stage_weights(1, build_model("tiny"))
        cmd = staged.command("forged", job="exp-a")
        assert isinstance(cmd, UpdateWeights)
        with pytest.raises(QuorumNotReached) as refused:
            await operator.broadcast(cmd)
        await staged.release()
    assert refused.value.report.acks["o0"].error_code == "pool_only"


async def test_a_joining_worker_takes_every_jobs_adapters_and_pause(nats_url, prefix) -> None:
    """A worker that joins after job A pushed its adapter and paused, and job B pushed its
    own, loads both jobs' adapters and holds A's requests."""
    async with pool(nats_url, prefix, ["w0"]) as bus, job(nats_url, prefix, "exp-a") as a, \
            job(nats_url, prefix, "exp-b") as b:
        await a.wait_for_workers(1, timeout=30)
        await a.update_weights(2, state_dict=adapter_state(1), adapter=QV)
        await b.update_weights(5, state_dict=adapter_state(2), adapter=QV)
        await a.pause("wait")
        async with anyio.create_task_group() as tg:
            await tg.start(Worker(bus, TorchEngine("tiny"), "w1", capacity=4).run)
            info = (await a.bus.fleet.members())["w1"]
            rows = job_rows(await fleet_view(bus))
            tg.cancel_scope.cancel()
    assert info.adapters == {"exp-a:policy": (2,), "exp-b:policy": (5,)}
    assert info.paused_jobs == ("exp-a",)
    # what `rlfabric status` prints of the jobs
    assert [(r["job"], r["state"], r["adapters"], r["held_by"]) for r in rows] == [
        ("exp-a", "paused (wait)", "policy@v2", "w0,w1"), ("exp-b", "running", "policy@v5", "-")]


async def test_more_adapters_than_a_worker_holds_are_all_served_by_their_own(
        nats_url, prefix) -> None:
    """16 adapters over 4 jobs on 2 workers that hold 4 each (`--max-adapters 4`): requests
    spread over all of them, in one go from every job, are all answered (none fails for
    capacity), each by its own adapter (logprobs match its merged model); the workers
    evicted and reloaded adapters to do it."""
    from rlfabric.worker.residency import Residency

    names = ["exp-a", "exp-b", "exp-c", "exp-d"]
    adapters = [Adapter(name=f"p{i}", rank=4, alpha=8.0, target_modules=("q_proj",))
                for i in range(4)]
    async with Bus.connect(nats_url, prefix=prefix) as bus, anyio.create_task_group() as tg:
        workers = [Worker(bus, TorchEngine("tiny", max_adapters=4), w, capacity=16)
                   for w in ("m0", "m1")]
        for w in workers:
            await tg.start(w.run)
        async with contextlib.AsyncExitStack() as stack:
            clients = {n: await stack.enter_async_context(job(nats_url, prefix, n))
                       for n in names}
            await clients["exp-a"].wait_for_workers(2, timeout=30)
            states = {}
            for j, n in enumerate(names):
                for i, ad in enumerate(adapters):
                    states[n, ad.name] = lora.random_adapter(build_model("tiny"), ad,
                                                             seed=10 * j + i, std=0.2)
                    await clients[n].update_weights(0, state_dict=states[n, ad.name],
                                                    adapter=ad)
            reqs = {n: [req(f"{n}-{ad.name}-{k}", [256, 20 + k], max_tokens=6, seed=k,
                            adapter=ad.name) for k in range(2) for ad in adapters]
                    for n in names}
            out: dict[str, list[RolloutReply]] = {}

            async def run(n: str) -> None:
                out[n] = await collect(clients[n], reqs[n], timeout=120)
            async with anyio.create_task_group() as jobs:
                for n in names:
                    jobs.start_soon(run, n)
        residency: list[Residency] = [w.weights.residency for w in workers]
        tg.cancel_scope.cancel()
    base = build_model("tiny")
    for n in names:
        assert all(isinstance(r, RolloutResult) for r in out[n]), out[n]
        for ad in adapters:
            mine = [q for q in reqs[n] if q.adapter == ad.name]
            got = [r for r in out[n] if r.request_id.startswith(f"{n}-{ad.name}-")]
            assert worst_gap(lora.merged(base, states[n, ad.name], ad), mine, got) <= 1e-4
            assert {s.policy.split("/")[1] for r in got for s in r.version_spans} == \
                {f"{n}:{ad.name}"}
    assert all(len(w.engine.adapter_versions()) <= 4 for w in workers)
    assert sum(r.reloaded for r in residency) > 0 and sum(r.evicted for r in residency) > 0


async def test_two_jobs_pushing_the_same_versions_at_once_over_nats_each_serve_their_own(
        nats_url, prefix) -> None:
    """Jobs A and B push their versions 0-2 of `policy` at the same moment over the nats
    transport (the same version numbers): no push takes another's chunks, and each job is
    served its own v2."""
    async with pool(nats_url, prefix, ["n0", "n1"]), job(nats_url, prefix, "exp-a") as a, \
            job(nats_url, prefix, "exp-b") as b:
        await a.wait_for_workers(2, timeout=30)
        last = {"exp-a": adapter_state(22), "exp-b": adapter_state(33)}

        async def push(c: FabricClient, seed: int) -> None:
            for v in range(3):
                state = last[c.job] if v == 2 else adapter_state(seed + v)
                await c.update_weights(v, state_dict=state, adapter=QV, transport="nats")
        async with anyio.create_task_group() as tg:
            tg.start_soon(push, a, 100)
            tg.start_soon(push, b, 200)
        out = {}
        for c in (a, b):
            reqs = [req(f"{c.job}{i}", [256, 60 + i], max_tokens=8, seed=i, adapter="policy")
                    for i in range(4)]
            out[c.job] = (reqs, await collect(c, reqs))
    base = build_model("tiny")
    for name, (reqs, got) in out.items():
        assert {s.version for r in got for s in r.version_spans} == {2}
        assert worst_gap(lora.merged(base, last[name], QV), reqs, got) <= 1e-4, name


async def test_the_operator_ends_a_job_its_requests_get_job_deleted_and_the_others_serve(
        nats_url, prefix) -> None:
    """Job A has long requests running when the pool's operator ends it: they, and the ones
    A sends after, are answered `job_deleted` (none lost, none served), A's adapter is
    dropped, a worker that joins later refuses A too, and job B serves throughout."""
    async with pool(nats_url, prefix, ["e0"]) as bus, job(nats_url, prefix, "exp-a") as a, \
            job(nats_url, prefix, "exp-b") as b, job(nats_url, prefix) as operator:
        await a.wait_for_workers(1, timeout=30)
        await a.update_weights(0, state_dict=adapter_state(1), adapter=QV)
        long = [msgspec.structs.replace(req(f"a{i}", [256, 7 + i], max_tokens=400, seed=i,
                                            adapter="policy"), stream=True) for i in range(2)]
        got_a: list[RolloutReply] = []
        began = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_first_delta, a, long, began, got_a)
            with anyio.fail_after(60):
                await began.wait()
            with pytest.raises(PoolOnly):
                await a.end_job("exp-b")
            rep = await operator.end_job("exp-a")
            assert rep.ok == ("e0",)
        assert sorted(r.request_id for r in got_a) == ["a0", "a1"]
        assert {(type(r), getattr(r, "code", "")) for r in got_a} == {(RolloutError,
                                                                       "job_deleted")}
        later = await collect(a, [req("a-later", [256, 3], max_tokens=4)], timeout=30)
        assert [getattr(r, "code", "") for r in later] == ["job_deleted"]
        assert "exp-a:policy" not in (await a.bus.fleet.members())["e0"].adapters
        async with anyio.create_task_group() as tg:
            await tg.start(Worker(bus, TorchEngine("tiny"), "e1", capacity=4).run)
            info = (await a.bus.fleet.members())["e1"]
            tg.cancel_scope.cancel()
        b_out = await collect(b, [req("b", [256, 3], max_tokens=4)], timeout=30)
    assert [type(r) for r in b_out] == [RolloutResult]
    assert "exp-a:policy" not in info.adapters


async def test_a_push_with_every_adapter_in_use_under_a_keep_pause_fails_at_once(
        nats_url, prefix) -> None:
    """One adapter held at most, its request frozen by the pool's `keep` pause: a push of
    another adapter finds no room and fails at once (`adapter_limit`) instead of holding the
    worker's commands, so the resume goes through; the frozen request then finishes, and a
    request for the other adapter gets it loaded."""
    y = Adapter(name="other", rank=8, alpha=16.0, target_modules=("q_proj", "v_proj"))
    async with Bus.connect(nats_url, prefix=prefix) as bus, anyio.create_task_group() as tg:
        await tg.start(Worker(bus, TorchEngine("tiny", max_adapters=1), "r0", capacity=8).run)
        async with job(nats_url, prefix) as c:
            await c.wait_for_workers(1, timeout=30)
            await c.update_weights(0, state_dict=adapter_state(1), adapter=QV)
            long = [msgspec.structs.replace(req("x", [256, 7], max_tokens=400, seed=1,
                                                adapter="policy"), stream=True)]
            got: list[RolloutReply] = []
            began = anyio.Event()
            async with anyio.create_task_group() as run:
                run.start_soon(_first_delta, c, long, began, got)
                with anyio.fail_after(60):
                    await began.wait()
                await c.pause("keep")
                with anyio.fail_after(10), pytest.raises(QuorumNotReached) as full:
                    await c.update_weights(0, state_dict=adapter_state(2), adapter=y)
                assert full.value.report.acks["r0"].error_code == "adapter_limit"
                assert (await c.resume()).ok == ("r0",)
            assert [type(r) for r in got] == [RolloutResult]
            await c.update_weights(0, state_dict=adapter_state(2), adapter=y)
            other = await collect(c, [req("y", [256, 9], max_tokens=4, adapter="other"),
                                      req("x2", [256, 9], max_tokens=4, adapter="policy")])
        tg.cancel_scope.cancel()
    assert all(isinstance(r, RolloutResult) for r in other), other
