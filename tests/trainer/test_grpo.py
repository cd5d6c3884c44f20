"""The reference GRPO loop's training step, on the tiny model (no bus needed for a step)."""

from __future__ import annotations

import math

import torch

from rlfabric.schemas import RolloutResult, VersionSpan
from rlfabric.tensors.models import build_model
from rlfabric.trainer.grpo import GRPOConfig, GRPOTrainer


def trainer() -> GRPOTrainer:
    # the step never touches the fabric: the bus is exercised by tests/cli/test_up.py
    return GRPOTrainer(None, build_model("tiny"), GRPOConfig(steps=1))  # type: ignore[arg-type]


def test_an_empty_batch_is_no_step_and_no_crash() -> None:
    t = trainer()
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    reward, std, mismatch = t._train([])
    assert math.isnan(reward) and math.isnan(std) and mismatch is None
    assert all(torch.equal(before[k], v) for k, v in t.model.state_dict().items())


def test_a_batch_of_empty_completions_reports_rewards_without_a_step() -> None:
    t = trainer()
    t._prompt_ids["r"] = t.task.prompt(0)
    empty = [RolloutResult(request_id="r", sample_index=i, worker_id="w",
                           completion_token_ids=[], logprobs=[], finish_reason="stop",
                           version_spans=()) for i in range(2)]
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    reward, _, mismatch = t._train(t._samples(empty))
    assert reward == 0.0 and mismatch is None
    assert all(torch.equal(before[k], v) for k, v in t.model.state_dict().items())


def test_a_step_moves_the_weights() -> None:
    t = trainer()
    prompt = t.task.prompt(0)
    t._prompt_ids["r"] = prompt

    def own_logprobs(comp: list[int]) -> list[float]:
        with torch.no_grad():
            logits = t.model(torch.tensor([prompt + comp])).logits.float()
        logp = torch.log_softmax(logits, -1)[0]
        return [float(logp[len(prompt) - 1 + i, tok]) for i, tok in enumerate(comp)]

    comps = [[98, 98], [97, 98]]
    batch = [RolloutResult(request_id="r", sample_index=i, worker_id="w",
                           completion_token_ids=c, logprobs=own_logprobs(c),
                           finish_reason="length",
                           version_spans=(VersionSpan(version=0, start=0, end=2),))
             for i, c in enumerate(comps)]
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    reward, _, mismatch = t._train(t._samples(batch))
    assert reward == 1 / 16  # one 'a' in 2 x 8 positions
    assert mismatch is not None and mismatch < 1e-4  # the logprobs are the model's own
    assert any(not torch.equal(before[k], v) for k, v in t.model.state_dict().items())


def test_a_multi_turn_sample_learns_from_its_sampled_tokens_only() -> None:
    """A trajectory segment: prompt, a sampled turn, inserted tokens (a tool's result), a
    second sampled turn. The inserted tokens carry nonsense logprobs: the mismatch, over the
    sampled tokens only, still reads the model's own logprobs."""
    from rlfabric.trainer.tools import Sample

    t = trainer()
    ids = [*t.task.prompt(0), 97, 98, 40, 41, 42, 97]  # a turn, a tool result, a turn
    mask = [0] * (len(ids) - 6) + [1, 1, 0, 0, 0, 1]
    with torch.no_grad():
        logp = torch.log_softmax(t.model(torch.tensor([ids])).logits.float(), -1)[0]
    old = [float(logp[i - 1, tok]) if mask[i] else -100.0 for i, tok in enumerate(ids)]
    samples = [Sample(ids=ids, mask=mask, old=old, version=0, group="g", reward=r)
               for r in (1.0, 0.0)]
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    reward, _, mismatch = t._train(samples)
    assert reward == 0.5 and mismatch is not None and mismatch < 1e-4
    assert any(not torch.equal(before[k], v) for k, v in t.model.state_dict().items())
