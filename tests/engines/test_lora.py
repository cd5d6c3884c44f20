"""LoRA adapters on torch workers, pushed and versioned like full weights: every sampled token's
logprob equals a forward pass of the merged weights (W + B A * alpha / rank); base rows and two
adapters share a batch; a new version serves new requests while running ones finish on theirs;
unknown, dropped and one-too-many adapters get their own errors and the worker goes on."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import AsyncIterator

import anyio
import pytest
import torch
from helpers import collect, packed, req, worst_gap

from rlfabric.bus import Bus, QuorumNotReached
from rlfabric.engines import running
from rlfabric.engines.torch import TorchEngine
from rlfabric.schemas import Adapter, RolloutError, RolloutResult, TokenDelta
from rlfabric.tensors import lora
from rlfabric.tensors.checksums import checksum
from rlfabric.tensors.models import build_model
from rlfabric.worker import Worker

pytestmark = [pytest.mark.nats, pytest.mark.anyio]

QV = Adapter(name="qv", rank=8, alpha=16.0, target_modules=("q_proj", "v_proj"))
MLP = Adapter(name="mlp", rank=4, alpha=4.0, target_modules=("up_proj", "down_proj"))


def adapter_state(adapter: Adapter, seed: int) -> dict[str, torch.Tensor]:
    return lora.random_adapter(build_model("tiny"), adapter, seed=seed, std=0.2)


def reference(adapter: Adapter, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    return lora.merged(build_model("tiny"), state, adapter)


@contextlib.asynccontextmanager
async def fleet(nats_url: str, prefix: str, ids: list[str], **engine_options: int
                ) -> AsyncIterator[list[TorchEngine]]:
    """In-process torch workers on this test's job."""
    engines = [TorchEngine("tiny", **engine_options) for _ in ids]
    async with Bus.connect(nats_url, prefix=prefix) as bus, anyio.create_task_group() as tg:
        for wid, engine in zip(ids, engines, strict=True):
            await tg.start(Worker(bus, engine, wid, capacity=16).run)
        yield engines
        tg.cancel_scope.cancel()


async def test_adapter_logprobs_match_the_merged_model_beside_base_and_another_adapter(
        nats_url, prefix, client) -> None:
    s_qv, s_mlp = adapter_state(QV, 1), adapter_state(MLP, 2)
    async with fleet(nats_url, prefix, ["l0"]), client() as fabric:
        await fabric.wait_for_workers(1, timeout=30)
        base = build_model("tiny")
        await fabric.update_weights(0, module=base)
        rep = await fabric.update_weights(1, state_dict=s_qv, adapter=QV)
        assert rep.acks["l0"].weights_checksum == checksum(s_qv)
        assert rep.acks["l0"].weight_version == 1
        await fabric.update_weights(1, state_dict=s_mlp, adapter=MLP, transport="nats")
        kinds = {"": base, "qv": reference(QV, s_qv), "mlp": reference(MLP, s_mlp)}
        reqs = {name: [req(f"{name or 'base'}{i}", [256, 10 + i], min_version=0, max_tokens=12,
                           seed=i, adapter=name) for i in range(4)] for name in kinds}
        out = await collect(fabric, [r for rs in reqs.values() for r in rs])  # one batch
        assert all(isinstance(r, RolloutResult) for r in out)
        members = await fabric.bus.fleet.members()
        status = await anyio.run_process([sys.executable, "-m", "rlfabric", "status", "--nats",
                                          nats_url, "--prefix", prefix, "--json"])
    for name, model in kinds.items():
        got = [r for r in out if r.request_id.startswith(name or "base")]
        assert len(got) == 4
        assert worst_gap(model, reqs[name], got) <= 1e-4
        if name:
            assert all([s.version for s in r.version_spans] == [1] for r in got)
            assert worst_gap(base, reqs[name], got) > 1e-3  # the adapter changed something
    assert members["l0"].adapters == {"qv": (1,), "mlp": (1,)}
    info = json.loads(status.stdout)
    assert info["members"][0]["adapters"] == "mlp@v1 qv@v1"
    assert info["desired_state"]["adapters"] == {"mlp": 1, "qv": 1}


async def test_v2_serves_new_requests_on_every_worker_and_differs_from_v1(
        nats_url, prefix, client) -> None:
    v1, v2 = adapter_state(QV, 3), adapter_state(QV, 4)
    async with fleet(nats_url, prefix, ["a0", "a1"]), client() as fabric:
        await fabric.wait_for_workers(2, timeout=30)
        await fabric.update_weights(0, module=build_model("tiny"))
        await fabric.update_weights(1, state_dict=v1, adapter=QV)
        rep = await fabric.update_weights(2, state_dict=v2, adapter=QV, transport="filesystem")
        assert rep.ok == ("a0", "a1")
        reqs = [req(f"r{i}", [256, 30 + i], min_version=2, max_tokens=10, seed=i, adapter="qv")
                for i in range(32)]  # messages of 8 or more: both workers take some
        out = await collect(fabric, reqs)
        members = await fabric.bus.fleet.members()
    assert {m.adapters["qv"] for m in members.values()} == {(1, 2)}
    assert {r.worker_id for r in out} == {"a0", "a1"}
    assert all([s.version for s in r.version_spans] == [2] for r in out)
    assert worst_gap(reference(QV, v2), reqs, out) <= 1e-4
    assert worst_gap(reference(QV, v1), reqs, out) > 1e-3


async def test_a_running_request_finishes_on_its_version_and_a_dropped_one_is_unavailable(
        ) -> None:
    v1, v2, v3 = (adapter_state(QV, s) for s in (5, 6, 7))
    engine = TorchEngine("tiny", adapter_versions=2)
    async with running(engine):
        with packed(v1) as w:
            await engine.load_adapter(w, QV, 1)
        started = anyio.Event()
        r1 = req("long", [256, 7], max_tokens=120, temperature=1.0, seed=1, adapter="qv")

        def on_tokens(d: TokenDelta) -> None:
            if not started.is_set():  # hold the batch between two steps: v2 lands mid-way
                engine.runner.freeze()
                started.set()

        results: list[RolloutResult] = []

        async def run() -> None:
            async for burst in engine.generate_many([req_stream(r1)], on_tokens=on_tokens):
                results.extend(burst)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            with anyio.fail_after(30):
                await started.wait()
            await anyio.to_thread.run_sync(engine.runner.wait_not_running)
            with packed(v2) as w:  # no pause: lands while r1 is being decoded
                await engine.load_adapter(w, QV, 2)
            assert not results and engine.adapter_versions() == {"qv": (1, 2)}
            engine.runner.thaw()
        (res,) = results
        # where the sample meets EOS depends on the device's random stream: 120 or fewer
        n = len(res.completion_token_ids)
        assert 0 < n <= 120 and (n == 120) == (res.finish_reason == "length"), res
        assert [(s.version, s.start, s.end) for s in res.version_spans] == [(1, 0, n)]
        assert worst_gap(reference(QV, v1), [r1], [res]) <= 1e-4
        with packed(v3) as w:
            await engine.load_adapter(w, QV, 3)
        assert engine.adapter_versions() == {"qv": (2, 3)}  # the last 2 kept
        with pytest.raises(Exception, match="v1 is not loaded") as exc:
            engine.check(req("old", [256, 7], adapter="qv", adapter_version=1))
        assert exc.value.code == "version_unavailable"


def req_stream(r):
    import msgspec

    return msgspec.structs.replace(r, stream=True)


async def test_unknown_extra_and_unloaded_adapters_get_their_codes_and_serving_goes_on(
        nats_url, prefix, client) -> None:
    async with fleet(nats_url, prefix, ["u0"], max_adapters=1), client() as fabric:
        await fabric.wait_for_workers(1, timeout=30)
        await fabric.update_weights(0, module=build_model("tiny"))
        [unknown] = await collect(fabric, [req("x", adapter="nope", min_version=0)])
        assert isinstance(unknown, RolloutError) and unknown.code == "adapter_unknown"
        await fabric.update_weights(1, state_dict=adapter_state(QV, 8), adapter=QV)
        # one adapter held at most (--max-adapters 1): the new one evicts the other
        await fabric.update_weights(1, state_dict=adapter_state(MLP, 9), adapter=MLP)
        assert (await fabric.bus.fleet.members())["u0"].adapters == {"mlp": (1,)}
        bad = adapter_state(QV, 10)
        bad[lora.key("model.layers.0.self_attn.q_proj", "lora_A")] = torch.zeros(3, 3)
        with pytest.raises(QuorumNotReached, match=r"u0 \(load_failed: .*q_proj"):
            await fabric.update_weights(2, state_dict=bad, adapter=QV)
        # evicted, and its failed v2 taken back: loaded again as v1 for the request
        ok = await collect(fabric, [req("y", adapter="qv", min_version=0, max_tokens=4)])
        assert isinstance(ok[0], RolloutResult) and ok[0].version_spans[0].version == 1
        await fabric.unload_adapter("qv")
        gone = await collect(fabric, [req("z", adapter="qv", min_version=0)])
        base = await collect(fabric, [req("b", min_version=0, max_tokens=4)])
        assert set((await fabric.bus.state.read()).adapters) == {"mlp"}  # evicted, not unloaded
    assert isinstance(gone[0], RolloutError) and gone[0].code == "adapter_unknown"
    assert isinstance(base[0], RolloutResult)
