"""A failed rollout is never a reward: the GRPO loop leaves a failed sample out of the loss and
out of its group's baseline, counts it per step, and stops the run, naming the cause, once more
than `max_failed` of a step's samples failed. The failures here are real: a torch worker
refuses a prompt holding a token outside its vocabulary (`bad_request`)."""

from __future__ import annotations

import pytest
from rich.console import Console

from rlfabric.cli.up_view import summary_table
from rlfabric.tensors.models import build_model
from rlfabric.trainer import RolloutFailed
from rlfabric.trainer.config import GRPOConfig
from rlfabric.trainer.grpo import GRPOTrainer
from rlfabric.trainer.task import LetterTask

pytestmark = [pytest.mark.nats, pytest.mark.anyio]

#: no tiny model's vocabulary holds it
OUTSIDE = 1_000_000


class EveryThirdFails(LetterTask):
    """The letter task, with every third prompt one no worker can serve."""

    def prompt(self, i: int) -> list[int]:
        return [OUTSIDE] if i % 3 == 0 else super().prompt(i)


def loop(fabric, max_failed: float) -> GRPOTrainer:
    cfg = GRPOConfig(steps=2, prompts_per_step=3, group_size=4, max_tokens=4,
                     max_failed=max_failed, reward_threshold=0.0)
    return GRPOTrainer(fabric, build_model("tiny"), cfg, task=EveryThirdFails(max_tokens=4))


async def test_a_third_failed_is_left_out_of_the_loss_and_counted(client, workers) -> None:
    workers(["f0"], "--threads", "1")
    async with client() as fabric:
        await fabric.wait_for_workers(1, timeout=120)
        grpo = loop(fabric, max_failed=0.5)
        trained = []
        train = grpo._train
        grpo._train = lambda batch: (trained.append(batch), train(batch))[1]  # type: ignore
        history = await grpo.run()
    assert [(h.failed, h.samples) for h in history] == [(4, 8), (4, 8)], history
    # each step learned from the two prompts served, each group of 4 whole, and nothing else
    assert [sorted({s.group: 0 for s in b}) for b in trained] == [["s0p1", "s0p2"],
                                                                   ["s1p1", "s1p2"]]
    assert [len(b) for b in trained] == [8, 8]
    # `rlfabric up`'s step table counts them
    console = Console(width=150, record=True)
    console.print(summary_table(history))
    lines = console.export_text().splitlines()
    head = next(line for line in lines if " fail " in line)
    rows = [line for line in lines if line.split()[:1] in (["1"], ["2"])]
    col = head.split().index("fail")
    assert [r.split()[col] for r in rows] == ["4", "4"], (head, rows)


async def test_a_step_past_max_failed_stops_the_run_naming_the_cause(client, workers) -> None:
    workers(["f1"], "--threads", "1")
    async with client() as fabric:
        await fabric.wait_for_workers(1, timeout=120)
        grpo = loop(fabric, max_failed=0.25)
        with pytest.raises(RolloutFailed) as got:
            await grpo.run()
    msg = str(got.value)
    assert "step 0: 4 of 12 samples failed, more than the 25% that --max-failed allows" in msg
    assert "4 x bad_request on f1" in msg and str(OUTSIDE) in msg, msg
    assert got.value.error.code == "bad_request"
    assert grpo.history == []  # no step trained on the failed one
