"""Helpers the tests share (on the path through pytest's `pythonpath`): requests, collecting
results, samples moved mid-generation, moved weights, and the logprobs a model assigns to
sampled tokens."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import anyio
import numpy as np
import torch

from rlfabric.schemas import RolloutRequest, RolloutResult, SamplingParams, TokenDelta
from rlfabric.tensors.models import build_model


def req(rid: str, prompt: Sequence[int] = (256, 5, 6), *, min_version: int = -1,
        deadline: float = 0.0, adapter: str = "", adapter_version: int = -1,
        **sampling: Any) -> RolloutRequest:
    """A request; `min_version=-1` serves the workers' initial weights (no push needed)."""
    return RolloutRequest(request_id=rid, prompt_token_ids=list(prompt),
                          min_weight_version=min_version, deadline=deadline, adapter=adapter,
                          adapter_version=adapter_version, sampling=SamplingParams(**sampling))


async def collect(fabric: Any, requests: Iterable[RolloutRequest],
                  timeout: float = 120.0) -> list:
    """Every reply of `requests`, in arrival order."""
    return [r async for r in fabric.generate(requests, timeout=timeout)]


async def generate_moving(fabric: Any, requests: list[RolloutRequest],
                          ready: Callable[[dict[str, list[TokenDelta]]], bool],
                          act: Callable[[], Awaitable[None]], *, timeout: float = 180.0,
                          wait: float = 120.0, session: str | None = None,
                          ) -> tuple[dict[str, list[TokenDelta]], dict[str, list[Any]]]:
    """`requests` generated with their deltas; once `ready(deltas so far)` holds (within
    `wait` s), `act()` runs beside them (a drain, a kill). Their deltas and replies, by request
    id. `session`: the requests are a turn of it."""
    seen: dict[str, list[TokenDelta]] = defaultdict(list)
    replies: dict[str, list[Any]] = defaultdict(list)
    going = anyio.Event()

    async def run() -> None:
        async for item in fabric.rollouts.generate(requests, deltas=True, timeout=timeout,
                                                   session=session):
            if isinstance(item, TokenDelta):
                seen[item.request_id].append(item)
                if ready(seen):
                    going.set()
            else:
                replies[item.request_id].append(item)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        with anyio.fail_after(wait):
            await going.wait()
        await act()
    return seen, replies


def streamed_as_answered(res: RolloutResult, deltas: list[TokenDelta]) -> list[int]:
    """Assert each position of `res` streamed at most once, with the answer's token and
    logprob; the positions streamed."""
    ids, lps = res.completion_token_ids.tolist(), res.logprobs.tolist()
    positions = [d.start + k for d in deltas for k in range(len(d.token_ids))]
    assert len(positions) == len(set(positions)), res.request_id
    for d in deltas:
        end = d.start + len(d.token_ids)
        assert ids[d.start:end] == d.token_ids.tolist(), res.request_id
        assert lps[d.start:end] == d.logprobs.tolist(), res.request_id
    return positions


def perturbed(seed: int, model_name: str = "tiny") -> torch.nn.Module:
    """The built-in model with every weight moved: a v1 that differs from v0."""
    model = build_model(model_name)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def taken_logprobs(model: torch.nn.Module, prompt: list[int], comp: list[int]) -> np.ndarray:
    """The logprob `model` gives each token of `comp` after `prompt` (one forward pass)."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + comp])).logits.float(), -1)[0]
    idx = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(comp))
    return logp[idx, torch.tensor(comp)].numpy()


def packed(state: dict[str, torch.Tensor]) -> Any:
    """`with packed(state) as weights`: `state` as the payload a worker hands its engine."""
    from rlfabric.engines.payload import payload
    from rlfabric.tensors.packing import pack_into, plan

    metas, size = plan(state)
    buf = bytearray(size)
    pack_into(state, metas, buf)
    return payload(memoryview(buf), metas)


def worst_gap(model: torch.nn.Module, reqs: Iterable[RolloutRequest], out: Iterable[Any]
              ) -> float:
    """The largest |logprob| difference between results and `model`'s own forward pass."""
    by_id = {r.request_id: r.prompt_token_ids.tolist() for r in reqs}
    gaps = [float(np.abs(taken_logprobs(model, by_id[r.request_id],
                                        r.completion_token_ids.tolist())
                         - r.logprobs.numpy()).max())
            for r in out if len(r.completion_token_ids)]
    return max(gaps)


def llama3_like(directory: str) -> str:
    """A checkpoint that names a different end token in each file, as Llama-3-8B-Instruct's
    does: config.json 257 (`<|eos|>`), generation_config.json [257, 260], the tokenizer's
    `eos_token` `<|im_end|>` (260). transformers' generate stops at either."""
    import json
    import os

    from rlfabric.tensors.models import write_checkpoint

    ckpt = write_checkpoint("tinychat", directory)
    for name, key, value in (("config.json", "eos_token_id", 257),
                             ("generation_config.json", "eos_token_id", [257, 260]),
                             ("tokenizer_config.json", "eos_token", "<|im_end|>")):
        path = os.path.join(ckpt, name)
        with open(path) as f:
            data = json.load(f)
        data[key] = value
        with open(path, "w") as f:
            json.dump(data, f)
    return ckpt


#: the end tokens of `llama3_like`
LLAMA3_ENDS = frozenset({257, 260})


def past_an_end(results: Iterable[Any], ends: frozenset[int]) -> list[str]:
    """The samples with an end token anywhere but last (they ran past it)."""
    return [f"{r.request_id}/{r.sample_index}" for r in results
            if any(t in ends for t in r.completion_token_ids.tolist()[:-1])]


def rlfabric_exe() -> str:
    """The console script installed next to this Python (what the README's command runs)."""
    import sysconfig
    from pathlib import Path

    exe = Path(sysconfig.get_path("scripts")) / "rlfabric"
    assert exe.exists(), "rlfabric console script not installed: pip install -e ."
    return str(exe)
