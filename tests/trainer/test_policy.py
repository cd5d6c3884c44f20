"""Policy identity: every result names the exact weights that produced it, and a trainer never
takes one from weights it did not push. Each test is a seam where a run went silently wrong
before: a second LoRA run on the same workers, a LoRA run on another run's trained base, a
result of another run's weights, a failed push that left the fleet split."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import AsyncIterator

import anyio
import msgspec
import pytest
import torch
from helpers import collect, perturbed, req, worst_gap

from rlfabric.bus import Bus, MembershipChanged, QuorumNotReached
from rlfabric.engines.torch import TorchEngine
from rlfabric.schemas import Adapter, RolloutError, RolloutResult, base_policy
from rlfabric.tensors import lora
from rlfabric.tensors.models import build_model
from rlfabric.trainer import FabricClient
from rlfabric.trainer.policies import PolicyMismatch
from rlfabric.worker import Worker

pytestmark = [pytest.mark.nats, pytest.mark.anyio]

QV = Adapter(name="policy", rank=8, alpha=16.0, target_modules=("q_proj", "v_proj"))


@contextlib.asynccontextmanager
async def fleet(nats_url: str, prefix: str, ids: list[str]) -> AsyncIterator[None]:
    """In-process torch workers on this test's job."""
    async with Bus.connect(nats_url, prefix=prefix) as bus, anyio.create_task_group() as tg:
        for wid in ids:
            await tg.start(Worker(bus, TorchEngine("tiny"), wid, capacity=16).run)
        yield
        tg.cancel_scope.cancel()


def adapter_state(seed: int) -> dict[str, torch.Tensor]:
    return lora.random_adapter(build_model("tiny"), QV, seed=seed, std=0.2)


async def test_a_second_lora_run_on_the_same_workers_is_served_by_its_own_adapter(
        nats_url, prefix, client) -> None:
    """Run A pushes versions 0-4 of adapter `policy`; run B, on the same workers, pushes its
    own versions 0 and 1 under the same name. B's requests are served by B's v1: versions
    are never compared across runs."""
    async with fleet(nats_url, prefix, ["l0", "l1"]), client() as first, client() as second:
        await first.wait_for_workers(2, timeout=30)
        await first.update_weights(0, module=build_model("tiny"))
        for v in range(5):
            await first.update_weights(v, state_dict=adapter_state(10 + v), adapter=QV)
        mine = adapter_state(99)
        await second.update_weights(0, state_dict=adapter_state(98), adapter=QV)
        await second.update_weights(1, state_dict=mine, adapter=QV)
        reqs = [req(f"b{i}", [256, 40 + i], min_version=1, max_tokens=16, seed=i,
                    adapter="policy") for i in range(16)]
        out = await collect(second, reqs)
        members = await second.bus.fleet.members()
    assert all(isinstance(r, RolloutResult) for r in out), out
    assert worst_gap(lora.merged(build_model("tiny"), mine, QV), reqs, out) <= 1e-4
    assert {s.version for r in out for s in r.version_spans} == {1}
    # named by run B, version and digest, on the base run A pushed (no base named: any)
    assert {s.policy.split("@")[0] for r in out for s in r.version_spans} == \
        {second.pushed.names("policy")[-1]}
    assert {m.adapters["policy"] for m in members.values()} == {(0, 1)}  # run A's are gone


async def test_an_adapter_trained_on_another_base_is_refused_by_name(
        nats_url, prefix, client) -> None:
    """An adapter names the base policy it was trained on; a worker serving another base
    (here: another run's trained weights) refuses it with `base_mismatch`, and serves the
    adapter once that base is pushed."""
    async with fleet(nats_url, prefix, ["b0"]), client() as trained, client() as lora_run:
        await trained.wait_for_workers(1, timeout=30)
        for v in range(3):  # a full-weight run: the workers keep its last weights
            await trained.update_weights(v, module=perturbed(v + 1))
        base = build_model("tiny")
        staged = await lora_run.stage_weights(0, base)  # the base's name, as pushed
        expected = base_policy(lora_run.run, 0, staged.digest)
        await staged.release()
        state = adapter_state(5)
        based = Adapter(name=QV.name, rank=QV.rank, alpha=QV.alpha,
                        target_modules=QV.target_modules, base=expected)
        with pytest.raises(QuorumNotReached) as refused:
            await lora_run.update_weights(0, state_dict=state, adapter=based)
        ack = refused.value.report.acks["b0"]
        assert ack.error_code == "base_mismatch"
        assert expected in ack.error_message and trained.run in ack.error_message
        await lora_run.update_weights(0, module=base)  # its own base, then the adapter
        assert lora_run.pushed.names("")[-1] == expected
        await lora_run.update_weights(0, state_dict=state, adapter=based)
        reqs = [req(f"a{i}", [256, 9 + i], min_version=0, max_tokens=12, seed=i,
                    adapter="policy") for i in range(4)]
        out = await collect(lora_run, reqs)
    assert worst_gap(lora.merged(base, state, QV), reqs, out) <= 1e-4
    assert {s.policy.rsplit("@", 1)[1] for r in out for s in r.version_spans} == {expected}


async def test_a_result_of_another_runs_weights_is_refused_naming_worker_and_policies(
        nats_url, prefix, client) -> None:
    """A request that asks for another run's weights (here on purpose: `run=` set) is served
    by them; the client that pushed its own refuses the result, naming both policies."""
    async with fleet(nats_url, prefix, ["r0"]), client() as mine, client() as other:
        await mine.wait_for_workers(1, timeout=30)
        await mine.update_weights(1, module=build_model("tiny"))
        await other.update_weights(1, module=perturbed(3))  # the same version number
        theirs = other.pushed.names("")[-1]
        own = [req("own", [256, 3], min_version=1, max_tokens=4, seed=1)]
        with anyio.fail_after(10):  # its own run's weights are gone: it waits, unserved
            waited = await collect(mine, own, timeout=2)
        assert [r.code for r in waited] == ["deadline_exceeded"]
        forced = msgspec.structs.replace(
            req("forced", [256, 3], min_version=1, max_tokens=4, seed=1), run=other.run)
        with pytest.raises(PolicyMismatch) as refused:
            await collect(mine, [forced])
    err = refused.value
    assert err.worker_id == "r0" and err.policy == theirs
    assert err.pushed == mine.pushed.names("") and len(err.pushed) == 1
    assert "r0" in str(err) and theirs in str(err) and mine.run in str(err)


async def test_a_failed_push_is_taken_back_and_the_fleet_serves_one_version(
        client, workers) -> None:
    """v2 pushed while a worker is dead but still a member: the push fails (membership
    changed) after the others applied v2; they go back to v1, the error says so, results
    are v1's, and a worker joining then loads v1."""
    procs = dict(zip(["f0", "f1", "f2"], workers(["f0", "f1", "f2"], "--threads", "1"),
                     strict=True))
    v1 = perturbed(1)
    async with client() as fabric:
        await fabric.wait_for_workers(3, timeout=60)
        await fabric.update_weights(1, module=v1)
        procs["f2"].send_signal(signal.SIGKILL)
        with pytest.raises(MembershipChanged) as failed:
            await fabric.update_weights(2, module=perturbed(2))
        assert sorted(failed.value.report.ok) == ["f0", "f1"]  # they had applied v2
        assert "taken back to v1: the fleet serves it again (f0 v1, f1 v1" in str(failed.value)
        state = await fabric.bus.state.read()
        assert state.weight_version == 1 and state.policy == fabric.pushed.names("")[-1]
        reqs = [req(f"r{i}", [256, i], min_version=0, max_tokens=8, seed=i) for i in range(16)]
        out = await collect(fabric, reqs)
        workers(["f3"], "--threads", "1")
        snap = await fabric.watcher.wait_until(
            lambda s: "f3" in s.worker_ids and all(m.weight_version == 1 for m in s.members),
            timeout=60)
    assert all(isinstance(r, RolloutResult) for r in out), out
    assert {s.version for r in out for s in r.version_spans} == {1}
    assert worst_gap(v1, reqs, out) <= 1e-4
    assert {m.policy for m in snap.members} == {fabric.pushed.names("")[-1]}


async def test_a_client_that_pushed_nothing_is_served_any_policy(nats_url, prefix) -> None:
    """A client that only samples (an evaluation, a reference policy) checks nothing."""
    async with fleet(nats_url, prefix, ["e0"]), \
            FabricClient.connect(nats_url, prefix=prefix) as trainer, \
            FabricClient.connect(nats_url, prefix=prefix) as evaluator:
        await trainer.wait_for_workers(1, timeout=30)
        await trainer.update_weights(0, module=build_model("tiny"))
        out = await collect(evaluator, [req("e", [256, 1], min_version=0, max_tokens=4)])
    assert not isinstance(out[0], RolloutError)
    assert out[0].version_spans[0].policy == trainer.pushed.names("")[-1]
