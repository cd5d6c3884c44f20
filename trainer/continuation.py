"""Continuing samples that an `abort` pause cut short.

An aborted sample comes back with `finish_reason="abort"` and the tokens (and logprobs, and
version spans) it had. `continuation()` makes the request that picks up where it stopped;
`merge()` joins the two halves into one result (`rlfabric.bus.rollouts.moves`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

import msgspec

from rlfabric.bus.rollouts.moves import continuation, merge
from rlfabric.bus.rollouts.plane import RolloutPlane
from rlfabric.schemas import RolloutReply, RolloutRequest, RolloutResult

__all__ = ["continuation", "continue_aborted", "merge"]


async def continue_aborted(plane: RolloutPlane, requests: Iterable[RolloutRequest],
                           results: Iterable[RolloutReply], *,
                           timeout: float | None = None) -> AsyncIterator[RolloutReply]:
    """`results` with every aborted sample continued through `plane` and merged back."""
    by_id = {r.request_id: r for r in requests}
    partials: dict[str, RolloutResult] = {}
    for res in results:
        if isinstance(res, RolloutResult) and res.finish_reason == "abort":
            partials[continuation(by_id[res.request_id], res).request_id] = res
        else:
            yield res
    conts = [continuation(by_id[p.request_id], p) for p in partials.values()]
    async for rest in plane.generate(conts, timeout=timeout):
        part = partials[rest.request_id]
        if isinstance(rest, RolloutResult):
            yield merge(part, rest)
        else:
            yield msgspec.structs.replace(rest, request_id=part.request_id,
                                          sample_index=part.sample_index)
