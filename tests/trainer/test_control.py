"""The control plane end to end: real worker processes, real nats-server, the tiny model."""

from __future__ import annotations

import functools
import importlib.util
import signal
import time
from collections import Counter
from dataclasses import dataclass

import anyio
import anyio.abc
import helpers
import msgspec
import numpy as np
import pytest
import torch
from helpers import perturbed, taken_logprobs, worst_gap

from rlfabric.bus import MembershipChanged, QuorumNotReached, QuorumPolicy
from rlfabric.schemas import (
    Adapter,
    RolloutReplies,
    RolloutReply,
    RolloutRequest,
    RolloutResult,
    TokenDelta,
    codec_for,
)
from rlfabric.telemetry import instruments
from rlfabric.tensors import lora
from rlfabric.tensors.checksums import checksum
from rlfabric.tensors.models import build_model
from rlfabric.trainer import TransportInitFailed

req = functools.partial(helpers.req, min_version=0)

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


@dataclass(frozen=True)
class Served:
    """An engine the pause tests run on: its model (vLLM's CPU attention needs tiny64's head
    size), how long its workers take to join, and how many tokens keep 200 requests in flight
    long enough to pause during them (with 24 tokens the torch engine served all 200 in
    0.15 s here, while the workers' load reports, 0.1 s apart, were still on their way)."""

    engine: str
    model: str
    join_s: float
    busy_tokens: int

    def args(self, *extra: str) -> tuple[str, ...]:
        return ("--model", self.model, *extra)


#: a keep pause freezes the engine where it is: ~30 ms for either engine here (vLLM's was 3-5 s
#: until its logprob ranking was compiled before the worker joins, see VllmEngine._warm_up)
KEEP_ACK_S = 2.0

ENGINES = [
    pytest.param(Served("torch", "tiny", 60, busy_tokens=160), id="torch"),
    pytest.param(
        Served("vllm", "tiny64", 240, busy_tokens=24), id="vllm", marks=[
            pytest.mark.vllm, pytest.mark.timeout(600),
            pytest.mark.skipif(
                importlib.util.find_spec("vllm") is None,
                reason="vLLM is not installed here (README, 'vLLM': its CPU build)")]),
]


@pytest.mark.parametrize("transport", ["shm", "filesystem", "nats", "collective"])
async def test_update_reaches_every_worker_and_results_use_it(client, workers, transport) -> None:
    ids = ["u0", "u1", "u2"]
    workers(ids, "--threads", "1")
    v0, v1 = build_model("tiny"), perturbed(1)
    async with client() as fabric:
        await fabric.wait_for_workers(3, timeout=60)
        await fabric.update_weights(0, module=v0, transport=transport)
        rep = await fabric.update_weights(1, module=v1, transport=transport)
        assert rep.ok == tuple(ids) and rep.failed == () and rep.missing == ()
        sums = {a.weights_checksum for a in rep.acks.values()}
        assert sums == {checksum(v1.state_dict())}  # one checksum, the one sent
        assert {a.weight_version for a in rep.acks.values()} == {1}
        snap = await fabric.watcher.wait_until(
            lambda s: all(m.weight_version == 1 for m in s.members), timeout=10)
        assert len(snap.members) == 3
        assert (await fabric.bus.state.read()).weight_version == 1
        reqs = [req(f"r{i}", [256, i, i + 1], min_version=1, max_tokens=12, seed=i)
                for i in range(12)]
        out = [r async for r in fabric.generate(reqs, timeout=60)]
        # a LoRA adapter over the same transport: verified against the sender, served merged
        qv = Adapter(name="qv", rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
        adapter = lora.random_adapter(v1, qv, seed=2, std=0.2)
        rep = await fabric.update_weights(7, state_dict=adapter, adapter=qv, transport=transport)
        assert rep.ok == tuple(ids)
        assert {a.weights_checksum for a in rep.acks.values()} == {checksum(adapter)}
        areqs = [req(f"q{i}", [256, i], min_version=7, max_tokens=8, seed=i, adapter="qv")
                 for i in range(6)]
        aout = [r async for r in fabric.generate(areqs, timeout=60)]
    assert worst_gap(lora.merged(v1, adapter, qv), areqs, aout) <= 1e-4
    assert all([s.version for s in r.version_spans] == [7] for r in aout)
    assert all(isinstance(r, RolloutResult) for r in out) and len(out) == 12
    assert {r.worker_id for r in out} <= set(ids)
    by_id = {r.request_id: r for r in reqs}
    for res in out:
        assert [(s.version, s.start) for s in res.version_spans] == [(1, 0)]
        prompt = by_id[res.request_id].prompt_token_ids.tolist()
        comp = res.completion_token_ids.tolist()
        got = res.logprobs.numpy()
        assert np.abs(taken_logprobs(v1, prompt, comp) - got).max() <= 1e-4
        assert np.abs(taken_logprobs(v0, prompt, comp) - got).max() > 1e-3  # not the old model


@pytest.mark.parametrize("served", ENGINES)
async def test_pause_wait_drains_200_in_flight_then_holds_until_resume(client, workers,
                                                                      served: Served) -> None:
    workers(["d0", "d1"], *served.args("--capacity", "100", "--threads", "1"),
            engine=served.engine)
    async with client() as fabric:
        await fabric.wait_for_workers(2, timeout=served.join_s)
        await fabric.update_weights(0, module=build_model(served.model))
        s = fabric.bus.subjects
        first = [req(f"a{i}", [256, i % 250], max_tokens=served.busy_tokens, seed=i)
                 for i in range(200)]
        later = [req(f"b{i}", [256, i], max_tokens=4, seed=i) for i in range(30)]
        out: list = []
        async with anyio.create_task_group() as tg:
            async def consume(reqs) -> None:
                out.extend([r async for r in fabric.generate(reqs, timeout=120)])

            tg.start_soon(consume, first)
            await fabric.watcher.wait_until(
                lambda sn: sum(m.in_flight for m in sn.members) >= 150, timeout=60)
            rep = await fabric.pause(mode="wait")
            assert rep.ok == ("d0", "d1")
            # the acks came once every request a worker had taken had its result persisted;
            # a message no worker had room for yet (requests go in batches) waits in the stream
            desc = (await fabric.describe()).acks
            served = sum(int(a.detail["served"]) for a in desc.values())
            assert [a.detail["in_flight"] for a in desc.values()] == ["0", "0"]
            assert served >= 150 and await _results_stored(fabric) == served
            sent_before = fabric.rollouts.outbox.messages
            tg.start_soon(consume, later)
            # a bounded look for what must not happen: no stream event tells "nothing came"
            with anyio.move_on_after(1.5):
                while await _results_stored(fabric) == served:  # noqa: ASYNC110
                    await anyio.sleep(0.1)
            assert await _results_stored(fabric) == served
            ci = await fabric.bus.js.consumer_info(s.rollout_stream, s.rollout_consumer)
            waiting = ci.num_pending + ci.num_ack_pending  # not taken, or handed back
            assert waiting >= fabric.rollouts.outbox.messages - sent_before > 0
            assert (await fabric.resume()).ok == ("d0", "d1")
    keys = Counter((r.request_id, r.sample_index) for r in out)
    assert len(out) == 230 and set(keys.values()) == {1}
    assert all(isinstance(r, RolloutResult) and r.finish_reason != "abort" for r in out)


async def _results_stored(fabric) -> int:
    """Replies held in the results stream (a message may hold several)."""
    s = fabric.bus.subjects
    info = await fabric.bus.js.stream_info(s.results_stream)
    codec = codec_for(RolloutReply | RolloutReplies)
    n = 0
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await fabric.bus.js.get_msg(s.results_stream, seq)
        msg = codec.decode(raw.data, raw.headers)
        n += len(msg.replies) if isinstance(msg, RolloutReplies) else 1
    return n


async def _streamed_until_tokens(fabric, reqs: list[RolloutRequest], out: list,
                                 tg: anyio.abc.TaskGroup) -> None:
    """Generate `reqs` in `tg` (streamed), their results into `out`; return once the first
    tokens of one came: some are out and most are not, whatever the device's speed."""
    first = anyio.Event()

    async def consume() -> None:
        streamed = [msgspec.structs.replace(r, stream=True) for r in reqs]
        async for item in fabric.rollouts.generate(streamed, timeout=120, deltas=True):
            if isinstance(item, TokenDelta):
                first.set()
            else:
                out.append(item)

    tg.start_soon(consume)
    with anyio.fail_after(60):
        await first.wait()


@pytest.mark.parametrize("served", ENGINES)
async def test_pause_abort_returns_partials_that_continue(client, workers, served: Served) -> None:
    workers(["x0"], *served.args("--threads", "1"), engine=served.engine)
    async with client() as fabric:
        await fabric.wait_for_workers(1, timeout=served.join_s)
        model = build_model(served.model)
        await fabric.update_weights(0, module=model)
        eos = model.config.eos_token_id
        reqs = [req(f"r{i}", [256, 3 + i], max_tokens=400, seed=i, temperature=0.0,
                    stop_token_ids=(eos,)) for i in range(4)]
        out: list = []
        async with anyio.create_task_group() as tg:
            await _streamed_until_tokens(fabric, reqs, out, tg)
            await fabric.pause(mode="abort")
        assert {r.finish_reason for r in out} == {"abort"}
        partial_lens = [len(r.completion_token_ids) for r in out]
        assert all(n < 400 for n in partial_lens) and any(n > 0 for n in partial_lens)
        await fabric.resume()
        merged = [r async for r in fabric.continue_aborted(reqs, out, timeout=120)]
        # greedy decoding: the continued sample equals one that never stopped
        whole = [r async for r in fabric.generate(
            [req(f"w{i}", [256, 3 + i], max_tokens=400, seed=i, temperature=0.0,
                 stop_token_ids=(eos,)) for i in range(4)], timeout=120)]
    by_id = {r.request_id: r for r in merged}
    for part in out:
        m = by_id[part.request_id]
        assert m.finish_reason in ("length", "stop")
        assert m.completion_token_ids.tolist()[:len(part.completion_token_ids)] == \
            part.completion_token_ids.tolist()
        assert len(m.completion_token_ids) == 400 or m.completion_token_ids.tolist()[-1] == eos
    whole_by_prompt = {w.request_id[1:]: w.completion_token_ids.tolist() for w in whole}
    for m in merged:
        assert m.completion_token_ids.tolist() == whole_by_prompt[m.request_id[1:]]


def _staleness() -> Counter[int]:
    """Tokens taken so far in this process by how many versions behind (the metric's
    buckets: 0, 1, 2, ...), over every attribute set."""
    sp = instruments.current.staleness
    out: Counter[int] = Counter()
    for _attrs, weights, _sum, _count in sp.snapshot():
        for bound, w in zip(sp.bounds, weights, strict=False):
            out[int(bound)] += w
    return out


@pytest.mark.parametrize("served", ENGINES)
async def test_pause_keep_update_resume_gives_two_version_spans(client, workers,
                                                                served: Served) -> None:
    workers(["k0"], *served.args("--threads", "1"), engine=served.engine)
    v0, v1 = build_model(served.model), perturbed(2, served.model)
    async with client() as fabric:
        await fabric.wait_for_workers(1, timeout=served.join_s)
        await fabric.update_weights(0, module=v0)
        # 16 samples: a random model ends a sample at EOS now and then; not all 16 early
        reqs = [req(f"r{i}", [256, 40 + i], max_tokens=300, seed=i) for i in range(16)]
        out: list = []
        stale_before = _staleness()
        async with anyio.create_task_group() as tg:
            await _streamed_until_tokens(fabric, reqs, out, tg)
            t0 = time.monotonic()
            rep = await fabric.pause(mode="keep")
            assert rep.ok == ("k0",) and time.monotonic() - t0 < KEEP_ACK_S
            await fabric.update_weights(1, module=v1)
            await fabric.resume()
        for r in out:  # taken after v1's push: each v0 token is 1 version behind
            fabric.check_result(r)
        stale = _staleness() - stale_before
    two = [r for r in out if len(r.version_spans) == 2]
    assert two, [r.version_spans for r in out]
    old = sum(s.end - s.start for r in out for s in r.version_spans if s.version == 0)
    assert stale == Counter({0: sum(len(r.logprobs) for r in out) - old, 1: old})
    by_id = {r.request_id: r for r in reqs}
    for r in two:
        (a, b) = r.version_spans
        assert (a.version, a.start) == (0, 0) and (b.version, b.end) == (1, len(r.logprobs))
        assert 0 < a.end == b.start < len(r.logprobs)
        prompt = by_id[r.request_id].prompt_token_ids.tolist()
        comp = r.completion_token_ids.tolist()
        lp = r.logprobs.numpy()
        before = taken_logprobs(v0, prompt, comp)[:a.end]  # the v0 part is exactly v0's
        assert np.abs(before - lp[:a.end]).max() <= 1e-4
        after = taken_logprobs(v1, prompt, comp)[b.start:]  # the rest v1's, on no stale KV
        assert np.abs(after - lp[b.start:]).max() <= 1e-4
    assert all(r.finish_reason in ("length", "stop") for r in out)


async def test_corrupted_or_wrong_payload_keeps_old_weights_and_names_workers(
        client, workers) -> None:
    workers(["c0", "c1"], "--threads", "1")
    v0 = build_model("tiny")
    async with client() as fabric:
        await fabric.wait_for_workers(2, timeout=60)
        await fabric.update_weights(0, module=v0)
        staged = await fabric.stage_weights(1, perturbed(3), "shm")
        from multiprocessing import shared_memory

        seg = shared_memory.SharedMemory(name=staged.transport.name)
        seg.buf[100] ^= 0xFF  # one flipped byte after the digest was taken
        seg.close()
        with pytest.raises(QuorumNotReached, match=r"c0 \(digest_mismatch.*c1 \(digest_mismatch"):
            await fabric.push_weights(staged, policy=QuorumPolicy(timeout=20))
        bad_shape = dict(v0.state_dict())
        bad_shape["lm_head.weight"] = torch.zeros(3, 3)
        with pytest.raises(QuorumNotReached, match=r"c0 \(load_failed.*lm_head.weight") as ei:
            await fabric.update_weights(2, state_dict=bad_shape)
        assert set(ei.value.report.failed) == {"c0", "c1"}
        assert (await fabric.bus.state.read()).weight_version == 0
        out = [r async for r in fabric.generate(
            [req(f"r{i}", [256, i], max_tokens=10, seed=i) for i in range(6)], timeout=60)]
    for r in out:
        assert [s.version for s in r.version_spans] == [0]
        comp = r.completion_token_ids.tolist()
        prompt = [256, int(r.request_id[1:])]
        assert np.abs(taken_logprobs(v0, prompt, comp) - r.logprobs.numpy()).max() <= 1e-4


async def test_late_joiner_serves_the_current_version_first(client, workers) -> None:
    (first,) = workers(["j0"], "--threads", "1")
    async with client() as fabric:
        await fabric.wait_for_workers(1, timeout=60)
        for v in range(4):
            await fabric.update_weights(v, module=perturbed(10 + v), transport="nats")
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0
        await fabric.watcher.wait_until(lambda s: not s.members, timeout=30)
        workers(["j1"], "--threads", "1")
        snap = await fabric.wait_for_workers(1, timeout=60)
        assert snap.members[0].weight_version == 3  # loaded before it registered
        (res,) = [r async for r in fabric.generate(
            [req("first", [256, 1], min_version=-1, max_tokens=6, seed=1)], timeout=60)]
    assert res.worker_id == "j1"
    assert [(s.version, s.start) for s in res.version_spans] == [(3, 0)]


async def test_gloo_init_names_the_worker_that_never_joins_then_a_new_epoch_works(
        client, workers, sims) -> None:
    workers(["g0", "g1"], "--threads", "1")
    (ghost,) = sims(["ghost"], "init_transport=600")  # acks ready, never joins the group
    async with client() as fabric:
        await fabric.wait_for_workers(3, timeout=60)
        t0 = time.monotonic()
        with pytest.raises(TransportInitFailed, match="ghost did not join") as ei:
            await fabric.init_transport("gloo", timeout=3.0)
        assert time.monotonic() - t0 < 6.0
        assert ei.value.missing_workers == ("ghost",)
        first_epoch = ei.value.group_epoch
        ghost.send_signal(signal.SIGTERM)
        await fabric.watcher.wait_until(lambda s: s.worker_ids == ("g0", "g1"), timeout=30)
        rep = await fabric.init_transport("gloo", timeout=30.0)
        assert rep.ok == ("g0", "g1")
        assert (await fabric.bus.state.read()).group_epoch > first_epoch
        v1 = perturbed(5)
        rep = await fabric.update_weights(1, module=v1, transport="collective")
        assert {a.weights_checksum for a in rep.acks.values()} == {checksum(v1.state_dict())}


async def test_worker_killed_during_update_is_missing_within_1s(client, workers) -> None:
    procs = dict(zip(["m0", "m1", "m2"], workers(["m0", "m1", "m2"], "--threads", "1"),
                     strict=True))
    async with client() as fabric:
        await fabric.wait_for_workers(3, timeout=60)
        staged = await fabric.stage_weights(1, perturbed(4), "filesystem", mark_stable=False)
        caught: list[BaseException] = []
        t_kill = 0.0

        async def push() -> None:
            try:
                await fabric.push_weights(staged, policy=QuorumPolicy(
                    timeout=30, on_membership_change="fail"))
            except MembershipChanged as exc:
                caught.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(push)
            # workers wait for the STABLE marker: every one is inside the update now
            await fabric.watcher.wait_until(
                lambda s: all(m.state == "updating" for m in s.members), timeout=30)
            procs["m1"].send_signal(signal.SIGKILL)
            t_kill = time.monotonic()
        detect = time.monotonic() - t_kill
    assert caught, "push_weights did not raise MembershipChanged"
    exc = caught[0]
    assert detect < 1.0, detect
    assert exc.left == ("m1",) and "m1" in exc.report.missing and exc.report.dead == ("m1",)
