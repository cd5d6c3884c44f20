"""Per-sequence sampling: temperature, top-k, top-p, with one RNG per sequence so a seed gives
the same tokens whatever else shares the batch."""

from __future__ import annotations

import torch

from rlfabric.schemas import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """One token id from a row of raw logits (shape [vocab])."""
    if params.temperature <= 0.0:
        return int(torch.argmax(logits))
    scaled = logits.float() / params.temperature
    if 0 < params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        order = torch.argsort(scaled, descending=True)
        probs = torch.softmax(scaled[order], dim=-1)
        # drop a token once the mass before it already reaches top_p (the first always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        scaled[order[drop]] = float("-inf")
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
