"""A worker SIGKILLed mid-generation: each sample it was generating goes on on another worker
from the tokens its deltas brought (every step of a streamed request, every 32 tokens or so of
another), once membership says it is gone: every request answered once, no position sampled
twice, the kept tokens and logprobs as first streamed and within 1e-5 of the trainer's forward
pass, each span naming the worker that sampled it, and (greedy) the answer the same as a sample
that never moved."""

from __future__ import annotations

import signal

import anyio
import msgspec
import numpy as np
import pytest
from helpers import generate_moving, req, streamed_as_answered, taken_logprobs

from rlfabric.schemas import RolloutResult
from rlfabric.tensors.models import build_model

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


async def test_a_killed_workers_samples_go_on_elsewhere_from_the_tokens_it_sampled(
        client, workers) -> None:
    (k0,) = workers(["k0"], "--threads", "1")
    workers(["k1"], "--threads", "1", "--capacity", "2")  # most requests go to k0
    # half streamed (every step's delta), half not (a delta every 32 tokens or so)
    reqs = [msgspec.structs.replace(req(f"r{i}", [256, 3 + i], max_tokens=400,
                                        temperature=0.0), stream=i % 2 == 0)
            for i in range(8)]
    async with client() as fabric:
        await fabric.wait_for_workers(2, timeout=120)
        model = build_model("tiny")
        await fabric.update_weights(0, module=model)
        held: dict[str, str] = {}

        async def kill() -> None:
            held.update((await fabric.describe()).acks["k0"].detail)
            k0.send_signal(signal.SIGKILL)

        # once every streamed request has 64 tokens, on k0 or k1
        seen, results = await generate_moving(
            fabric, reqs, lambda s: len(s) == len(reqs) // 2 and all(
                sum(len(d.token_ids) for d in ds) >= 64 for ds in s.values()), kill)
        whole = {r.request_id: r async for r in fabric.generate(
            [req(f"w{i}", [256, 3 + i], max_tokens=400, temperature=0.0) for i in range(8)],
            timeout=120)}
    assert int(held["in_flight"]) > 0, held  # k0 had samples to lose
    assert {rid: len(rs) for rid, rs in results.items()} == {r.request_id: 1 for r in reqs}
    moved = {"streamed": 0, "not": 0}
    for r in reqs:
        (res,) = results[r.request_id]
        assert isinstance(res, RolloutResult), res
        ids, lps = res.completion_token_ids.tolist(), res.logprobs.tolist()
        assert len(ids) == 400 or res.finish_reason == "stop"
        who = [s.worker for s in res.version_spans]
        assert who in (["k0"], ["k1"], ["k0", "k1"], []), res.version_spans
        if who == ["k0", "k1"]:  # k0's part kept, not sampled again
            moved["streamed" if r.stream else "not"] += 1
            assert res.version_spans[0].end >= 32, res.version_spans
            assert all(s.policy for s in res.version_spans), res.version_spans
            # every token's logprob is the trainer's at the version that sampled it
            ref = taken_logprobs(model, r.prompt_token_ids.tolist(), ids)
            assert float(np.abs(ref - np.array(lps)).max()) <= 1e-5, r.request_id
        positions = streamed_as_answered(res, seen[r.request_id])
        assert not r.stream or positions == list(range(len(ids)))  # none missing either
        assert ids == whole["w" + r.request_id[1:]].completion_token_ids.tolist()
    assert moved["streamed"] > 0 and moved["not"] > 0, moved


async def test_a_grpo_step_counts_the_samples_a_drained_worker_handed_on(client, workers) -> None:
    """`rlfabric up`'s step table: the samples that went on from a worker drained mid-step are
    counted (`moved`), and the step trains on all of them."""
    from rich.console import Console

    from rlfabric.cli.up_view import summary_table
    from rlfabric.trainer.config import GRPOConfig
    from rlfabric.trainer.grpo import GRPOTrainer
    from rlfabric.trainer.task import LetterTask

    workers(["d0", "d1"], "--threads", "1")
    async with client() as fabric, anyio.create_task_group() as tg:
        await fabric.wait_for_workers(2, timeout=120)
        first: list[str] = []
        heard = fabric.rollouts.awaited.on_worker
        assert heard is not None  # the quiet-worker watch hears every delta message

        def on_worker(worker: str) -> None:
            heard(worker)
            if not first:  # the step's first progress: that worker is mid-sample
                first.append(worker)
                tg.start_soon(fabric.drain, worker)

        fabric.rollouts.awaited.on_worker = on_worker
        cfg = GRPOConfig(steps=1, prompts_per_step=4, group_size=4, max_tokens=200,
                         reward_threshold=0.0)
        grpo = GRPOTrainer(fabric, build_model("tiny"), cfg, task=LetterTask(max_tokens=200))
        history = await grpo.run()
    (step,) = history
    assert first and step.samples == 16 and step.failed == 0, step
    assert step.moved > 0, step
    console = Console(width=150, record=True)
    console.print(summary_table(history))
    lines = console.export_text().splitlines()
    head = next(line for line in lines if " moved " in line)
    row = next(line for line in lines if line.split()[:1] == ["1"])
    assert row.split()[head.split().index("moved")] == str(step.moved), (head, row)
