"""The torch reference engine in-process (no bus): sampling, stopping, serving many at once
(and the null engine's `generate_many` beside it)."""

from __future__ import annotations

import time

import anyio
import pytest
import torch
from helpers import LLAMA3_ENDS, llama3_like, past_an_end, req

from rlfabric.engines import make_engine, running
from rlfabric.engines.torch.sampling import sample
from rlfabric.schemas import RolloutRequest, RolloutResult, SamplingParams

pytestmark = pytest.mark.anyio


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_a_rows_tokens_depend_on_its_own_seed_not_on_its_batch() -> None:
    logits = torch.randn(4, 50, generator=gen(0))
    p = SamplingParams(temperature=1.0)
    alone = [int(sample(logits[r:r + 1], [p], [gen(100 + r)])[0]) for r in range(4)]
    together = sample(logits, [p] * 4, [gen(100 + r) for r in range(4)]).tolist()
    assert together == alone


def test_greedy_top_k_1_and_tiny_top_p_all_pick_the_argmax_in_one_batch() -> None:
    logits = torch.randn(3, 50, generator=gen(1))
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1),
              SamplingParams(top_p=1e-6)]
    for seed in range(20):
        got = sample(logits, params, [gen(seed + r) for r in range(3)])
        assert got.tolist() == logits.argmax(-1).tolist()


def test_top_k_never_samples_outside_the_k_best() -> None:
    logits = torch.randn(1, 50, generator=gen(2))
    best = set(torch.topk(logits[0], 5).indices.tolist())
    drawn = {int(sample(logits, [SamplingParams(top_k=5, temperature=2.0)], [gen(s)])[0])
             for s in range(300)}
    assert drawn <= best and len(drawn) > 1


async def test_same_seed_same_tokens_whatever_shares_the_batch() -> None:
    async with running(make_engine("torch", "tiny")) as engine:
        async def one(r: RolloutRequest) -> list[int]:
            out = [res async for res in engine.generate(r)]
            assert isinstance(out[0], RolloutResult)
            return out[0].completion_token_ids.tolist()

        alone = await one(req("a", [256, 5, 6], max_tokens=24, seed=7))
        crowd: dict[str, list[int]] = {}
        async with anyio.create_task_group() as tg:
            async def keep(r: RolloutRequest) -> None:
                crowd[r.request_id] = await one(r)

            for i in range(6):
                tg.start_soon(keep, req(f"x{i}", [256, 40 + i], max_tokens=24, seed=i,
                                        top_p=0.9, top_k=20))
            tg.start_soon(keep, req("b", [256, 5, 6], max_tokens=24, seed=7))
    assert crowd["b"] == alone


async def test_stopping_the_engine_aborts_a_running_batch_at_once() -> None:
    engine = make_engine("torch", "tiny")
    out: list[RolloutResult] = []
    async with anyio.create_task_group() as tg:
        async def consume() -> None:
            out.extend([r async for r in engine.generate(
                req("long", [256, 1], max_tokens=480, temperature=0.0))])

        async with running(engine):
            tg.start_soon(consume)
            with anyio.fail_after(30):
                while not engine.scheduler.running:  # noqa: ASYNC110  (no event for "batch taken")
                    await anyio.sleep(0.01)
            t0 = time.monotonic()
        stop_s = time.monotonic() - t0
    assert stop_s < 2.0, stop_s
    (res,) = out
    assert res.finish_reason == "abort" and 0 <= len(res.completion_token_ids) < 480


@pytest.mark.parametrize("kind", ["torch", "null"])
async def test_generate_many_gives_every_sample_once_and_what_generate_gives(kind) -> None:
    from rlfabric.engines.protocol import ServesMany

    reqs = [req("a", [256, 5, 6], max_tokens=12, seed=3, n=2),
            req("b", [256, 7], max_tokens=5, seed=4),
            req("c", [256, 8, 9, 10], max_tokens=9, seed=5, n=3)]
    async with running(make_engine(kind, "tiny" if kind == "torch" else "none")) as engine:
        assert isinstance(engine, ServesMany)
        alone = {(r.request_id, res.sample_index): res.completion_token_ids.tolist()
                 for r in reqs async for res in engine.generate(r, worker_id="w")}
        bursts = [burst async for burst in engine.generate_many(reqs, worker_id="w")]
    many = [(res.request_id, res.sample_index, res.completion_token_ids.tolist(), res.worker_id)
            for burst in bursts for res in burst]
    assert len(bursts) == 1  # one decode batch: its samples together
    assert sorted((rid, i) for rid, i, _, _ in many) == sorted(alone)  # each once, none more
    assert {(rid, i): toks for rid, i, toks, _ in many} == alone
    assert {w for *_, w in many} == {"w"}
    # torch: max_tokens each (no EOS this short); null: the prompt, cut at max_tokens
    want = [5, 9] if kind == "torch" else [2, 4]
    assert [len(alone[("b", 0)]), len(alone[("c", 2)])] == want


async def test_generate_many_yields_each_decode_batch_together() -> None:
    reqs = [req(f"r{i}", [256, i + 1], max_tokens=3, seed=i) for i in range(3)]
    async with running(make_engine("torch", "tiny", max_batch=2)) as engine:
        bursts = [sorted(r.request_id for r in burst)
                  async for burst in engine.generate_many(reqs, worker_id="w")]
    assert bursts == [["r0", "r1"], ["r2"]]  # admission order, two to a batch


async def test_a_checkpoint_stops_at_every_end_token_its_files_name(tmp_path) -> None:
    """config.json, generation_config.json and the tokenizer each name an end token (as
    Llama 3 Instruct's do): sampling stops at any of them, as transformers' generate does."""
    engine = make_engine("torch", llama3_like(str(tmp_path / "ckpt")))
    reqs = [req(f"e{i}", [256, 5 + i], max_tokens=128, seed=i, n=4) for i in range(12)]
    async with running(engine):
        out = [r for q in reqs async for r in engine.generate(q)]
    assert len(out) == 48
    assert past_an_end(out, LLAMA3_ENDS) == []
    ended = {r.completion_token_ids.tolist()[-1] for r in out if r.finish_reason == "stop"}
    assert ended == LLAMA3_ENDS  # stopped at the config's and at the tokenizer's


def test_tinylora_is_tinychat_with_a_head_an_adapter_can_steer() -> None:
    """The same blocks as tinychat; only the head is wider, so a hidden state the blocks turn
    toward one token's row can make that token likely (tinychat's head cannot)."""
    from rlfabric.tensors.models import build_model

    chat, wide = build_model("tinychat"), build_model("tinylora")
    a, b = chat.state_dict(), wide.state_dict()
    assert [k for k in a if not torch.equal(a[k], b[k])] == ["lm_head.weight"]
    assert torch.equal(b["lm_head.weight"], 4 * a["lm_head.weight"])

    def best_chance(head: torch.Tensor, token: int) -> float:
        h = head[token] / head[token].norm() * head.shape[1] ** 0.5  # an RMS-normed state
        return float(torch.softmax(head @ h, dim=0)[token])

    assert best_chance(a["lm_head.weight"], ord("a")) < 0.1
    assert best_chance(b["lm_head.weight"], ord("a")) > 0.5
