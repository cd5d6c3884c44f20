"""Workers as processes on a real nats-server, serving the torch engine (tiny model)."""

from __future__ import annotations

import signal
import time
from collections import Counter

import anyio
import msgspec
import numpy as np
import pytest
import torch
from helpers import collect, req

from rlfabric.schemas import RolloutError, RolloutRequest, RolloutResult, SamplingParams
from rlfabric.schemas.validation import InvalidRequest
from rlfabric.tensors.models import build_model

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


async def test_logprobs_match_the_models_own_forward_pass(client, workers) -> None:
    workers(["p0"])
    model = build_model("tiny")  # the same seeded init the worker built
    async with client() as fabric:
        await fabric.wait_for_workers(1, timeout=60)
        reqs = [req(f"r{i}", [256, *range(i + 1, i + 4 + i % 5)], max_tokens=24, n=2,
                    seed=i, temperature=1.0, logprobs=3) for i in range(10)]
        out = await collect(fabric, reqs)
    assert len(out) == 20 and all(isinstance(r, RolloutResult) for r in out)
    by_id = {r.request_id: r for r in reqs}
    worst = 0.0
    for res in out:
        prompt = by_id[res.request_id].prompt_token_ids.tolist()
        comp = res.completion_token_ids.tolist()
        assert len(comp) == len(res.logprobs) > 0
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt + comp])).logits.float(), -1)[0]
        ref = logp[len(prompt) - 1: len(prompt) - 1 + len(comp)]
        ref_taken = ref.gather(1, torch.tensor(comp)[:, None])[:, 0].numpy()
        worst = max(worst, float(np.abs(ref_taken - res.logprobs.numpy()).max()))
        # top-k alternatives are the model's top-k too
        top = res.top_logprobs
        assert top is not None and top.k == 3
        assert top.ids.numpy().reshape(-1, 3)[0].tolist() == torch.topk(ref[0], 3).indices.tolist()
        assert res.version_spans[0].start == 0 and res.version_spans[-1].end == len(comp)
    assert worst <= 1e-4, worst


async def test_same_seed_same_tokens_other_seed_differs(client, workers) -> None:
    workers(["s0", "s1"])
    async with client() as fabric:
        await fabric.wait_for_workers(2, timeout=60)
        prompt = [256, 10, 20, 30]
        reqs = [req(f"a{i}", prompt, max_tokens=32, seed=1234) for i in range(4)]
        reqs += [req("b", prompt, max_tokens=32, seed=99)]
        out = {r.request_id: r.completion_token_ids.tolist() for r in await collect(fabric, reqs)}
    assert out["a0"] == out["a1"] == out["a2"] == out["a3"]
    assert out["b"] != out["a0"]


async def test_300_requests_over_3_workers_once_each_and_spread(client, workers) -> None:
    ids = ["q0", "q1", "q2"]
    workers(ids, "--capacity", "4", "--threads", "1")  # equal shares of the 2 cores
    async with client() as fabric:
        await fabric.wait_for_workers(3, timeout=60)
        # 32 tokens each: long enough (2-4 s here) that who started first does not decide
        reqs = [req(f"r{i:03d}", [256, i % 200, 7], max_tokens=32, seed=i) for i in range(300)]
        out = await collect(fabric, reqs)
    assert all(isinstance(r, RolloutResult) for r in out)
    keys = Counter((r.request_id, r.sample_index) for r in out)
    assert len(out) == 300 and set(keys.values()) == {1}
    assert {k[0] for k in keys} == {r.request_id for r in reqs}
    share = Counter(r.worker_id for r in out)
    assert set(share) == set(ids)
    # every worker served at least 15%. Not a third each: the torch engine batches statically
    # (a batch runs to its end), so a worker whose two messages arrived a step apart can keep
    # running batches of 2 where the others run 4 (lowest share seen in 13 runs: 70, at
    # equal CPU)
    assert min(share.values()) >= 45, share


async def test_requests_sent_together_to_one_worker_go_as_one_message(client, workers) -> None:
    """32 requests for one worker of capacity 32: one message, so the torch engine (which
    batches statically) runs them as one batch; two halves would stay a batch apart."""
    workers(["m0"], "--capacity", "32")
    async with client() as fabric:
        await fabric.wait_for_workers(1, timeout=60)
        sent = fabric.rollouts.outbox.messages
        out = await collect(fabric, [req(f"m{i}", [256, i, 7], max_tokens=4, seed=i)
                                     for i in range(32)])
        assert fabric.rollouts.outbox.messages - sent == 1
    assert sorted(r.request_id for r in out) == sorted(f"m{i}" for i in range(32))
    assert all(isinstance(r, RolloutResult) for r in out)


async def test_a_message_of_ready_and_waiting_requests_gives_each_result_once(
        client, workers) -> None:
    """One message holding requests a worker can serve now and one that waits for a newer
    weight version: the ready ones come back at once, the message goes back to the stream for
    the other, which is served once that version arrives; each result reaches the caller
    once."""
    workers(["g0"], "--capacity", "16", engine="null")
    async with client() as fabric:
        await fabric.wait_for_workers(1, timeout=60)
        await fabric.update_weights(0, module=build_model("tiny"), transport="nats",
                                    verify="off")
        ready = [req(f"r{i}", [256, i + 1, 7], max_tokens=3, n=2) for i in range(5)]
        later = msgspec.structs.replace(req("later", [256, 9], max_tokens=2),
                                        min_weight_version=1, deadline=time.time() + 60)
        sent = fabric.rollouts.outbox.messages
        got: list = []
        async for r in fabric.generate([*ready, later], timeout=60):
            got.append(r)
            if len(got) == 10:  # every ready sample: now the version the other waits for
                assert "later" not in {g.request_id for g in got}
                await fabric.update_weights(1, module=build_model("tiny"), transport="nats",
                                            verify="off")
        assert fabric.rollouts.outbox.messages - sent == 1
    assert all(isinstance(r, RolloutResult) for r in got), got
    assert sorted((r.request_id, r.sample_index) for r in got) == sorted(
        [(f"r{i}", s) for i in range(5) for s in range(2)] + [("later", 0)])
    assert got[-1].request_id == "later"
    assert [v.version for v in got[-1].version_spans] == [1]
    assert {v.version for r in got[:-1] for v in r.version_spans} == {0}


async def test_a_busy_client_queues_its_fair_share_per_worker_as_one_message(
        client, workers) -> None:
    """16 requests from an idle client to 2 workers: 2 messages of 8 (none leaves a worker
    idle). 16 more while those 16 are outstanding: the client's share per worker is 16 of its
    32, so one message (one pull, store and ack, not two of each). Nothing is lost or
    doubled."""
    workers(["h0", "h1"], "--capacity", "64")
    async with client() as fabric:
        await fabric.wait_for_workers(2, timeout=60)
        assert (await fabric.pause()).ok == ("h0", "h1")  # nothing is taken: all stay outstanding
        send, recv = anyio.create_memory_object_stream[object](64)
        with send, recv:
            sent = fabric.rollouts.outbox.messages
            await fabric.submit([req(f"i{i}", [256, i], max_tokens=2) for i in range(16)], send)
            idle = fabric.rollouts.outbox.messages - sent
            await fabric.submit([req(f"b{i}", [256, i], max_tokens=2) for i in range(16)], send)
            busy = fabric.rollouts.outbox.messages - sent - idle
            assert (idle, busy) == (2, 1)
            assert (await fabric.resume()).ok == ("h0", "h1")
            with anyio.fail_after(60):
                out = [await recv.receive() for _ in range(32)]
    assert sorted(r.request_id for r in out) == sorted(
        [f"i{i}" for i in range(16)] + [f"b{i}" for i in range(16)])
    assert all(isinstance(r, RolloutResult) for r in out)


async def test_a_load_that_flips_between_messages_is_not_written(client, workers) -> None:
    """The in-flight count reaches the members bucket once it held (`LOAD_SETTLE_S`): a
    worker serving a closed loop, idle only between one message's results and the next,
    writes nothing while the loop runs (a write every `LOAD_REPORT_S` would be 15 in 1.5 s),
    and the fleet still sees it idle after."""
    workers(["c0"], "--capacity", "8", engine="null")
    async with client() as fabric:
        await fabric.wait_for_workers(1, timeout=60)
        members = f"KV_{fabric.bus.subjects.members_bucket}"
        served = 0

        async def closed_loop(seconds: float) -> None:
            until = time.monotonic() + seconds

            async def lane(i: int) -> None:
                nonlocal served
                while time.monotonic() < until:
                    out = [r async for r in fabric.generate(
                        [req(f"c{i}-{served}", [256, 1], max_tokens=2)], timeout=30)]
                    assert [type(r) for r in out] == [RolloutResult]
                    served += 1

            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(lane, i)

        await closed_loop(0.5)
        before = (await fabric.bus.js.stream_info(members)).state.last_seq
        await closed_loop(1.5)
        writes = (await fabric.bus.js.stream_info(members)).state.last_seq - before
        # at most a key refresh (every member_key_ttl / 3) falls in the window
        assert served > 200 and writes <= 1, (served, writes)
        snap = await fabric.watcher.wait_until(lambda s: s.members[0].in_flight == 0,
                                               timeout=5)
    assert [m.worker_id for m in snap.members] == ["c0"]


async def test_one_untimed_request_is_answered_once_and_forgotten_when_given_up(
        client, workers) -> None:
    """`generate` of one request without a deadline (an agent lane's turn): its result once,
    nothing left awaited after; one given up on before its result leaves nothing awaited
    either, and the next call of the same id gets its own result."""
    workers(["g0"], engine="null")
    async with client() as fabric:
        await fabric.wait_for_workers(1, timeout=60)
        plane = fabric.rollouts
        out = [r async for r in fabric.generate([req("one", [256, 1], max_tokens=2)])]
        assert [(type(r), r.request_id) for r in out] == [(RolloutResult, "one")]
        assert plane.outstanding == 0
        assert (await fabric.pause()).ok == ("g0",)
        with anyio.move_on_after(0.5):  # paused: no result can come; given up
            async for r in fabric.generate([req("one", [256, 2, 2], max_tokens=2)]):
                raise AssertionError(f"a result while paused: {r}")
        assert plane.outstanding == 0
        # an id awaited already is refused, alone or among others, and nothing is sent
        sent = plane.outbox.items
        async with anyio.create_task_group() as tg:
            tg.start_soon(collect, fabric, [req("two", [256, 2], max_tokens=2)])
            await anyio.wait_all_tasks_blocked()
            for again in ([req("two", [256, 4])], [req("three", [256, 4]), req("two", [256, 4])]):
                with pytest.raises(InvalidRequest, match="'two' is already in flight"):
                    await anext(fabric.generate(again))
            tg.cancel_scope.cancel()
        assert plane.outstanding == 0 and plane.outbox.items - sent <= 1
        assert (await fabric.resume()).ok == ("g0",)
        again = [r async for r in fabric.generate([req("one", [256, 3, 3, 3], max_tokens=2)])]
        # its own prompt's result, not the given-up one's (served after the resume)
        assert [(type(r), r.prompt_len) for r in again] == [(RolloutResult, 4)]
        assert plane.outstanding == 0


async def test_a_busy_clients_message_is_no_larger_than_a_worker_has_room_for(
        client, workers) -> None:
    """The fair share is bounded by the room a worker last reported: 2 workers of capacity
    24 each holding 18 long requests, 16 more go as 2 messages of 8 (no worker has room for
    16: one message would wait for a whole worker to free up), not one."""
    workers(["g0", "g1"], "--capacity", "24", "--threads", "1")
    async with client() as fabric:
        await fabric.wait_for_workers(2, timeout=60)
        send, recv = anyio.create_memory_object_stream[object](64)
        with send, recv:
            await fabric.submit([req(f"l{i}", [256, i], max_tokens=400) for i in range(36)],
                                send)
            await fabric.watcher.wait_until(
                lambda s: [m.in_flight for m in s.members] == [18, 18], timeout=30)
            sent = fabric.rollouts.outbox.messages
            await fabric.submit([req(f"s{i}", [256, i], max_tokens=2) for i in range(16)], send)
            assert fabric.rollouts.outbox.messages - sent == 2
            with anyio.fail_after(120):
                out = [await recv.receive() for _ in range(52)]
    assert Counter(r.request_id[0] for r in out) == {"l": 36, "s": 16}
    assert len({r.request_id for r in out}) == 52
    assert all(isinstance(r, RolloutResult) for r in out)


async def test_sigkilled_worker_mid_generation_loses_nothing(client, workers, nats_url) -> None:
    procs = dict(zip(["k0", "k1", "k2"], workers(["k0", "k1", "k2"], "--capacity", "6"),
                     strict=True))
    async with client(rollout_ack_wait=2.0) as fabric:
        await fabric.wait_for_workers(3, timeout=60)
        reqs = [req(f"r{i:03d}", [256, i % 200], max_tokens=64, seed=i, n=2)
                for i in range(24)]
        out: list = []

        async def consume() -> None:
            out.extend([r async for r in fabric.generate(reqs, timeout=180)])

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            # k2 announces what it fetched before it starts generating: kill it then
            await fabric.watcher.wait_until(
                lambda s: any(m.worker_id == "k2" and m.in_flight > 0 for m in s.members),
                timeout=60)
            procs["k2"].send_signal(signal.SIGKILL)
            killed = True
        info = await fabric.bus.js.consumer_info(fabric.bus.subjects.rollout_stream,
                                                 fabric.bus.subjects.rollout_consumer)
    assert killed
    assert all(isinstance(r, RolloutResult) for r in out), [r for r in out
                                                            if isinstance(r, RolloutError)]
    keys = Counter((r.request_id, r.sample_index) for r in out)
    assert len(keys) == 48 and set(keys.values()) == {1}  # none lost, none twice
    redelivered = [r for r in out if r.attempt > 1]
    assert redelivered, "k2 was killed with nothing in flight: the test proved nothing"
    assert all(r.worker_id in ("k0", "k1") for r in redelivered)  # the survivors served them
    assert info.num_pending == 0  # nothing left unserved in the stream


async def test_bad_requests_get_typed_errors_and_the_worker_goes_on(client, workers,
                                                                   monkeypatch) -> None:
    from rlfabric.schemas.validation import InvalidRequest

    workers(["b0"], "--capacity", "1")  # one credit at a time: a message that is not a
    async with client() as fabric:      # request must not keep the credit it used
        await fabric.wait_for_workers(1, timeout=60)
        for i in range(3):
            await fabric.bus.js.publish(fabric.bus.subjects.rollout_request, b"\xc1junk%d" % i)
        anyone = [  # wrong for any engine: the client refuses them before sending
            req("negative", [256, -1], max_tokens=4),
            req("zero-tokens", [256, 1], max_tokens=0),
            req("no-samples", [256, 1], max_tokens=4, n=0),
            req("empty", [], max_tokens=4),
        ]
        for bad in anyone:
            with pytest.raises(InvalidRequest):
                await collect(fabric, [bad])
        model = [req("vocab", [256, 5000], max_tokens=4),  # wrong for this model only
                 req("too-long", [256] * 600, max_tokens=4)]
        out = {r.request_id: r for r in await collect(fabric, model)}
        # a client that does not check (another language, an old build): the worker does
        monkeypatch.setattr("rlfabric.bus.rollouts.plane.check_request", lambda r: None)
        sent = [b for b in anyone if b.sampling.n]
        out.update({r.request_id: r for r in await collect(fabric, sent)})
        out.update({r.request_id: r async for r in fabric.generate([anyone[2]], timeout=30)})
        good = await collect(fabric, [req("good", [256, 1, 2], max_tokens=5, seed=1)],
                             timeout=30)
    assert all(isinstance(r, RolloutError) and r.worker_id == "b0" for r in out.values())
    assert out["vocab"].code == "bad_request" and "5000" in out["vocab"].message
    assert out["negative"].code == "bad_request"
    assert out["zero-tokens"].code == "bad_request" and "max_tokens" in out["zero-tokens"].message
    assert out["too-long"].code == "prompt_too_long"
    assert out["empty"].code == "bad_request"
    assert [type(g).__name__ for g in good] == ["RolloutResult"]
    assert good[0].worker_id == "b0" and len(good[0].completion_token_ids) == 5


async def test_paused_worker_takes_nothing_until_resume(client, workers) -> None:
    workers(["z0"])
    async with client() as fabric:
        await fabric.wait_for_workers(1, timeout=60)
        rep = await fabric.pause(mode="wait")
        assert rep.ok == ("z0",)
        assert (await fabric.pause(mode="wait")).ok == ("z0",)  # paused twice, resumed once
        reqs = [req(f"r{i}", [256, i], max_tokens=4, seed=i) for i in range(20)]
        out: list = []
        got_one = anyio.Event()

        async def consume() -> None:
            async for r in fabric.generate(reqs, timeout=60):
                out.append(r)
                got_one.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            with anyio.move_on_after(1.5):  # a bounded look for what must not happen
                await got_one.wait()
            assert out == []
            stream = await fabric.bus.js.stream_info(fabric.bus.subjects.rollout_stream)
            # all still in the stream, none served (requests sent together share a message)
            assert fabric.rollouts.outbox.items == 20
            assert stream.state.messages == fabric.rollouts.outbox.messages
            desc = (await fabric.describe()).acks["z0"].detail
            assert desc["in_flight"] == "0" and desc["served"] == "0"
            snap = await fabric.snapshot()
            assert snap.members[0].state == "paused"
            assert (await fabric.resume()).ok == ("z0",)
    assert len(out) == 20 and all(isinstance(r, RolloutResult) for r in out)


async def test_sigterm_finishes_in_flight_work_leaves_and_exits_0(client, workers) -> None:
    (proc,) = workers(["t0"], "--capacity", "4")
    async with client() as fabric:
        await fabric.wait_for_workers(1, timeout=60)
        reqs = [req(f"r{i}", [256, i], max_tokens=48, seed=i) for i in range(4)]
        out: list = []

        async def consume() -> None:
            out.extend([r async for r in fabric.generate(reqs, timeout=60)])

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await fabric.watcher.wait_until(
                lambda s: any(m.in_flight > 0 for m in s.members), timeout=30)
            proc.send_signal(signal.SIGTERM)
        snap = await fabric.watcher.wait_until(lambda s: s.worker_ids == (), timeout=30)
    assert proc.wait(timeout=30) == 0
    assert len(out) == 4 and all(isinstance(r, RolloutResult) for r in out)
    assert all(r.finish_reason in ("length", "stop") for r in out)  # finished, not cut off
    assert snap.members == ()


async def test_with_no_trainer_the_first_checkpoint_is_version_0_and_another_is_refused(
        client, workers, nats_url, prefix, tmp_path) -> None:
    import json
    import subprocess
    import sys

    other = build_model("tiny")
    with torch.no_grad():
        other.lm_head.weight.add_(0.5)  # the same architecture, other weights
    other.save_pretrained(tmp_path / "other")
    [first] = workers(["c0"])
    first.wait_for(r"ready \(", timeout=60)
    [second] = workers(["c1"], "--model", str(tmp_path / "other"))
    second.wait_for(r"ready \(", timeout=60)
    second.wait_for("another checkpoint", timeout=5)
    async with client() as fabric:
        snap = await fabric.wait_for_workers(2, timeout=60)
        versions = {m.worker_id: m.weight_version for m in snap.members}
        assert versions == {"c0": 0, "c1": -1}
        out = await collect(fabric, [RolloutRequest(request_id=f"v{i}", prompt_token_ids=[256, i],
                                                    sampling=SamplingParams(max_tokens=4))
                                     for i in range(8)], timeout=60)
    assert {(r.worker_id, r.version_spans[0].version) for r in out} == {("c0", 0)}
    status = subprocess.run([sys.executable, "-m", "rlfabric", "status", "--nats", nats_url,
                             "--prefix", prefix, "--json"], capture_output=True, text=True,
                            timeout=60)
    info = json.loads(status.stdout)
    notes = {m["worker_id"]: m["note"] for m in info["members"]}
    assert notes["c0"] == "" and "checkpoint differs" in notes["c1"]
    assert info["checkpoint_claim"]["worker_id"] == "c0"


async def test_prefetched_requests_go_back_at_a_pause_and_after_a_kill(client, workers) -> None:
    """A worker of capacity 2 with `--prefetch 4` takes requests beyond its capacity and holds
    them (never more than 4); a pause hands them back to the stream (nothing stays with it);
    SIGKILLed while holding some, they are served by another worker: every result once."""
    (p0,) = workers(["p0"], "--capacity", "2", "--prefetch", "4", "--threads", "1")

    async def detail(fabric) -> dict[str, str]:
        return (await fabric.describe()).acks["p0"].detail

    async def holding(fabric) -> dict[str, str]:
        # only `describe` tells what a worker holds beyond capacity: asked until it holds some
        for _ in range(1200):
            if int((d := await detail(fabric))["parked"]):
                return d
            await anyio.sleep(0.05)
        raise AssertionError("p0 never held a request beyond its capacity")

    async with client(rollout_ack_wait=2.0) as fabric:
        await fabric.wait_for_workers(1, timeout=60)
        reqs = [req(f"r{i:02d}", [256, i], max_tokens=300, seed=i) for i in range(12)]
        out: list = []

        async def consume() -> None:
            out.extend([r async for r in fabric.generate(reqs, timeout=180)])

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            held = await holding(fabric)
            assert 0 < int(held["parked"]) <= 4
            assert int(held["in_flight"]) - int(held["parked"]) <= 2  # the engine's share
            assert (await fabric.pause(mode="wait")).ok == ("p0",)
            after = await detail(fabric)
            # the held ones went back to the stream (naked: nothing else takes them off)
            assert (after["parked"], after["in_flight"]) == ("0", "0")
            assert (await fabric.resume()).ok == ("p0",)
            await holding(fabric)
            p0.send_signal(signal.SIGKILL)
            workers(["p1"], "--capacity", "4", "--threads", "1")
    assert all(isinstance(r, RolloutResult) for r in out), [r for r in out
                                                            if isinstance(r, RolloutError)]
    assert sorted(r.request_id for r in out) == [r.request_id for r in reqs]  # each once
    assert any(r.worker_id == "p1" and r.attempt > 1 for r in out)  # p0's, redelivered
