"""Helpers the tests share (on the path through pytest's `pythonpath`): requests, collecting
results, moved weights, and the logprobs a model assigns to sampled tokens."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from rlfabric.schemas import RolloutRequest, SamplingParams
from rlfabric.tensors.models import build_model


def req(rid: str, prompt: Sequence[int] = (256, 5, 6), *, min_version: int = -1,
        deadline: float = 0.0, **sampling: Any) -> RolloutRequest:
    """A request; `min_version=-1` serves the workers' initial weights (no push needed)."""
    return RolloutRequest(request_id=rid, prompt_token_ids=list(prompt),
                          min_weight_version=min_version, deadline=deadline,
                          sampling=SamplingParams(**sampling))


async def collect(fabric: Any, requests: Iterable[RolloutRequest],
                  timeout: float = 120.0) -> list:
    """Every reply of `requests`, in arrival order."""
    return [r async for r in fabric.generate(requests, timeout=timeout)]


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
