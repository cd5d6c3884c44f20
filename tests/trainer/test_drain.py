"""`rlfabric ctl drain WORKER` (`FabricClient.drain`): the worker leaves, and the samples it
was generating go on on another worker from the tokens it had sampled: every request answered
once, every token position sampled once, the kept tokens and logprobs as first streamed, and
(greedy) the answer the same as a sample that never moved."""

from __future__ import annotations

import msgspec
import pytest
from helpers import generate_moving, req, streamed_as_answered

from rlfabric.schemas import RolloutResult
from rlfabric.tensors.models import build_model

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


async def test_a_drained_workers_samples_go_on_elsewhere_from_the_tokens_it_sampled(
        client, workers) -> None:
    workers(["d0"], "--threads", "1")
    workers(["d1"], "--threads", "1", "--capacity", "2")  # most requests go to d0
    reqs = [msgspec.structs.replace(req(f"r{i}", [256, 3 + i], max_tokens=400, temperature=0.0),
                                    stream=True) for i in range(8)]
    async with client() as fabric:
        await fabric.wait_for_workers(2, timeout=120)
        await fabric.update_weights(0, module=build_model("tiny"))
        held: dict[str, str] = {}

        async def drain() -> None:
            held.update((await fabric.describe()).acks["d0"].detail)
            rep = await fabric.drain("d0")
            assert set(rep.ok) == {"d0", "d1"}, rep

        # once every request has tokens, on d0 or d1
        seen, results = await generate_moving(fabric, reqs, lambda s: len(s) == len(reqs),
                                              drain, timeout=120, wait=60)
        whole = {r.request_id: r async for r in fabric.generate(
            [req(f"w{i}", [256, 3 + i], max_tokens=400, temperature=0.0) for i in range(8)],
            timeout=120)}
    assert int(held["in_flight"]) > 0, held  # d0 had samples to hand over
    assert {rid: len(rs) for rid, rs in results.items()} == {r.request_id: 1 for r in reqs}
    moved = 0
    for r in reqs:
        (res,) = results[r.request_id]
        assert isinstance(res, RolloutResult), res
        ids = res.completion_token_ids.tolist()
        assert len(ids) == 400 or res.finish_reason == "stop"
        # who sampled which tokens: d0 then d1 for a sample that moved
        who = [s.worker for s in res.version_spans]
        assert who in (["d0"], ["d1"], ["d0", "d1"]), res.version_spans
        moved += who == ["d0", "d1"]
        # each position streamed once (none sampled twice), as it is in the answer
        streamed_as_answered(res, seen[r.request_id])
        # greedy: what moved ends as a sample that never did
        assert ids == whole["w" + r.request_id[1:]].completion_token_ids.tolist()
    assert moved > 0
