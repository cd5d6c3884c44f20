"""`RolloutBuffer`: results waiting to be trained on, with a staleness bound.

A sample's version is the oldest weight version that produced any of its tokens (its first
`version_span`). When the trainer is at version `v`, samples older than `v - max_staleness`
are dropped (or, with `stale="flag"`, kept and counted), so one-step-off-policy training sees
at most the staleness it asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlfabric.schemas import RolloutResult


def sample_version(res: RolloutResult) -> int:
    return min((s.version for s in res.version_spans), default=-1)


@dataclass(kw_only=True, slots=True)
class RolloutBuffer:
    max_staleness: int = 0
    stale: Literal["drop", "flag"] = "drop"
    _items: list[RolloutResult] = field(default_factory=list)
    dropped: int = 0
    flagged: int = 0

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"RolloutBuffer.max_staleness={self.max_staleness}: must be >= 0")

    def add(self, results: list[RolloutResult]) -> None:
        self._items.extend(results)

    def __len__(self) -> int:
        return len(self._items)

    def take(self, current_version: int) -> list[RolloutResult]:
        """Everything usable at `current_version`; the buffer is emptied."""
        items, self._items = self._items, []
        keep = []
        for res in items:
            if current_version - sample_version(res) > self.max_staleness:
                if self.stale == "drop":
                    self.dropped += 1
                    continue
                self.flagged += 1
            keep.append(res)
        return keep
