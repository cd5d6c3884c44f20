"""A step's failed rollouts: counted, named by cause, and the check that stops a run once more
than its allowed share of a step failed.

A failure is never a reward: the GRPO loop and the TRL integration leave a failed sample out of
the loss and out of its group's baseline (scoring it 0 would teach the policy away from what
the failed environment or worker never got to judge).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from rlfabric.schemas import RolloutError, RolloutReply
from rlfabric.trainer.errors import RolloutFailed

#: causes named in a message, most frequent first
SHOWN = 3


@dataclass
class StepFailures:
    """The samples of one step: how many came back, and the errors among them."""

    step: int
    total: int = 0
    errors: list[RolloutError] = field(default_factory=list)

    def add(self, reply: RolloutReply | None) -> bool:
        """Count one sample's `reply` (None: one that ended without, as an agent episode
        does); True if it is a failure."""
        self.total += 1
        if isinstance(reply, RolloutError):
            self.errors.append(reply)
            return True
        return False

    @property
    def failed(self) -> int:
        return len(self.errors)

    def causes(self) -> str:
        """The failures by code and worker, most frequent first, each with one message."""
        by = Counter((e.code, e.worker_id or "no worker") for e in self.errors)
        first: dict[tuple[str, str], str] = {}
        for e in self.errors:
            first.setdefault((e.code, e.worker_id or "no worker"), e.message)
        shown = [f"{n} x {code} on {where} ({first[(code, where)]})"
                 for (code, where), n in by.most_common(SHOWN)]
        more = len(by) - SHOWN
        return "; ".join(shown) + (f"; and {more} other causes" if more > 0 else "")

    def check(self, max_share: float, flag: str) -> None:
        """`RolloutFailed` if more than `max_share` of the step's samples failed (`flag`: the
        setting that allows more, named in the message)."""
        if not self.errors or self.failed <= max_share * self.total:
            return
        raise RolloutFailed(
            f"step {self.step}: {self.failed} of {self.total} samples failed, more than the "
            f"{max_share:.0%} that {flag} allows: {self.causes()}. Failed samples are left out "
            f"of the loss, never scored; fix the cause, or allow more with {flag}",
            error=self.errors[0])
