"""Batched sampling for one decode step: temperature, top-k and top-p per row, one uniform
draw per row from that row's own generator, so a seed gives the same tokens whatever else
shares the batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlfabric.schemas import SamplingParams


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Token ids (shape [B]) from raw logits (shape [B, vocab]), row `r` sampled with
    `params[r]` and `generators[r]`; temperature 0 is greedy."""
    dev = logits.device
    greedy = torch.argmax(logits, dim=-1)
    temps = [p.temperature for p in params]
    if all(t <= 0.0 for t in temps):
        return greedy
    temp = torch.tensor([t if t > 0.0 else 1.0 for t in temps], device=dev)[:, None]
    scaled = logits.float() / temp
    vocab = scaled.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                         device=dev)[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
    # NOTE: every row is sampled in descending order, truncated or not: a row's token must not
    # depend on what else shares its batch. Both cut-offs are prefixes in that order.
    scaled, order = torch.sort(scaled, dim=-1, descending=True)
    rank = torch.arange(vocab, device=dev)[None, :]
    scaled = scaled.masked_fill(rank >= top_k, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    # drop a token once the mass before it already reaches top_p (the first always stays)
    scaled = scaled.masked_fill(torch.cumsum(probs, dim=-1) - probs >= top_p, float("-inf"))
    cdf = torch.cumsum(torch.softmax(scaled, dim=-1), dim=-1)
    u = torch.cat([torch.rand(1, generator=g, device=g.device) for g in generators]).to(dev)
    # the first index whose cumulative mass exceeds u: never a token of zero probability
    idx = torch.searchsorted(cdf, (u[:, None] * cdf[:, -1:]).contiguous(), right=True)
    sampled = order.gather(1, idx.clamp(max=vocab - 1))[:, 0]
    is_greedy = torch.tensor([t <= 0.0 for t in temps], device=dev)
    return torch.where(is_greedy, greedy, sampled)
