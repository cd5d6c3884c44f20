"""The tool-use task of `rlfabric up --task tools`: agent episodes through the gateway, learned
from as the trajectories the bus recorded.

An episode is an agent loop written as harnesses write them, with the official `openai`
client against `rlfabric gateway`: the question `a+b=` (a and b digits, the sum one digit) with
a `calculator` tool. If the model calls the tool, the harness answers each call with the sum
and asks for the answer (`tool_choice="none"`, as harnesses end a tool loop); a turn without a
call is the answer. Reward: 0.4 for calling the calculator first, 0.2 for an answer that starts
with a digit (the format), 0.4 more when that digit is the sum.
The model is `tinychat` (a byte vocabulary whose tool call is the one token `<tool_call>`):
random-init, it calls the tool in about one episode in ten, so there is something to learn.

The episodes of a step run concurrently; their trajectories are then read off the bus
(`read_trajectory`: token ids, the loss mask over sampled tokens, the rollout logprobs and the
weight version behind each token), one `Sample` per segment.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import anyio

from rlfabric.bus import Bus
from rlfabric.bus.sessions.log import read_trajectory
from rlfabric.schemas import Trajectory, VersionSpan

MODEL = "tinychat"
#: typed loosely: the client's own types are for literals, this is data
CALCULATOR: Any = {"type": "function", "function": {
    "name": "calculator", "description": "adds the numbers of the question",
    "parameters": {"type": "object", "properties": {}}}}


@dataclass(slots=True)
class Sample:
    """One sequence to learn from: its tokens, 1 where the model sampled the token, the rollout
    logprobs (0 elsewhere), the version that sampled it (-2: several), its group and reward."""

    ids: list[int]
    mask: list[int]
    old: list[float]
    version: int
    group: str
    reward: float


@dataclass(slots=True)
class Episode:
    session_id: str
    group: str
    turns: int
    calls: int
    answer: str
    reward: float
    segments: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolTask:
    turn_tokens: int = 8  # what the first turn (the call) may sample
    answer_tokens: int = 2  # what the answer may (its first character is read)

    def question(self, i: int) -> tuple[int, int]:
        rng = random.Random(i)
        a = rng.randrange(5)
        return a, rng.randrange(5)

    def reward(self, called: bool, answer: str, a: int, b: int) -> float:
        if not called:
            return 0.0
        digit = answer[:1].isdigit()
        return 0.4 + 0.2 * digit + 0.4 * (digit and answer[:1] == str(a + b))


class AgentRollouts:
    """A step's episodes through the gateway at `base_url`, and their trajectories."""

    def __init__(self, bus: Bus, base_url: str, *, task: ToolTask | None = None,
                 concurrency: int = 32, temperature: float = 1.0,
                 check: Callable[[Iterable[VersionSpan], str], None] | None = None) -> None:
        import openai

        self.bus = bus
        #: refuses a trajectory holding tokens of a policy the trainer did not push
        #: (`FabricClient.pushed.check_spans`)
        self.check = check
        self.base_url = base_url
        self.task = task or ToolTask()
        self.temperature = temperature
        self.concurrency = concurrency
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0,
                                         timeout=120.0)
        self.run_id = f"{random.getrandbits(32):08x}"

    async def episode(self, sid: str, group: str, a: int, b: int) -> Episode:
        msgs: Any = [{"role": "user", "content": f"{a}+{b}="}]
        turns = calls = 0
        answer = ""
        for choice in ("auto", "none"):  # a call, then the answer
            r = await self.client.chat.completions.create(
                model=MODEL, messages=msgs, tools=[CALCULATOR], tool_choice=choice,
                temperature=self.temperature,
                max_tokens=self.task.turn_tokens if choice == "auto" else self.task.answer_tokens,
                extra_headers={"X-Session-ID": sid})
            turns += 1
            m = r.choices[0].message
            msgs.append(m.model_dump(exclude_none=True))
            if not m.tool_calls:
                answer = m.content or ""
                break
            calls += len(m.tool_calls)
            msgs += [{"role": "tool", "tool_call_id": c.id, "content": str(a + b)}
                     for c in m.tool_calls]
        return Episode(sid, group, turns, calls, answer,
                       self.task.reward(calls > 0, answer, a, b))

    async def step(self, step: int, prompts: int, group_size: int,
                   ) -> tuple[list[Episode], list[Sample]]:
        """`prompts` questions, `group_size` episodes each, then every episode's samples."""
        jobs = [(f"up-{self.run_id}-s{step}q{i}g{g}", f"s{step}q{i}",
                 *self.task.question(step * prompts + i))
                for i in range(prompts) for g in range(group_size)]
        episodes: list[Episode] = []
        limit = anyio.Semaphore(self.concurrency)

        async def one(job: tuple[str, str, int, int]) -> None:
            async with limit:
                episodes.append(await self.episode(*job))

        async with anyio.create_task_group() as tg:
            for job in jobs:
                tg.start_soon(one, job)
        samples: list[Sample] = []
        for e in episodes:
            traj = await read_trajectory(self.bus, e.session_id)
            if traj is not None:
                if self.check is not None:
                    for seg in traj.segments:
                        self.check(seg.weight_versions, f"session {e.session_id}")
                got = _samples(traj, e)
                e.segments = len(got)
                samples += got
        return episodes, samples

    async def close(self) -> None:
        await self.client.close()


def _samples(traj: Trajectory, e: Episode) -> list[Sample]:
    out = []
    for seg in traj.segments:
        versions = {v.version for v in seg.weight_versions}
        out.append(Sample(ids=seg.token_ids.tolist(), mask=seg.loss_mask.tolist(),
                          old=seg.logprobs.tolist(),
                          version=versions.pop() if len(versions) == 1 else -2,
                          group=e.group, reward=e.reward))
    return out
