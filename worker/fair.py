"""The order a worker takes waiting messages in: weighted fair between jobs, by tokens.

Each job's waiting messages keep their order; between jobs, the next message is the one with
the smallest start tag (start-time fair queuing): a job's message starts where the job's last
one finished, or at the worker's virtual time if the job was idle (so an idle job banks no
credit), and finishes `cost / weight` later. A message's cost is its requests' tokens (prompt
+ samples x max tokens): many short requests and a few long ones get the same share for the
same weight. Messages that go to the engine without waiting are charged the same way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from rlfabric.schemas import RolloutRequest

T = TypeVar("T")


def cost(reqs: list[RolloutRequest]) -> int:
    """The tokens a message's requests may take: prompt + samples x max tokens."""
    return sum(len(r.prompt_token_ids) + r.sampling.n * r.sampling.max_tokens for r in reqs)


class FairQueue(Generic[T]):
    def __init__(self) -> None:
        #: each job's weight (1 for a job not named here)
        self.weights: dict[str, float] = {}
        self._waiting: dict[str, deque[tuple[T, int]]] = {}
        self._finish: dict[str, float] = {}
        self._now = 0.0  # the start tag of the last message taken
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def count(self, job: str) -> int:
        """Messages of `job` waiting."""
        q = self._waiting.get(job)
        return len(q) if q else 0

    def push(self, job: str, item: T, tokens: int) -> None:
        self._waiting.setdefault(job, deque()).append((item, tokens))
        self._len += 1

    def head(self, accept: Callable[[T], bool] | None = None) -> tuple[str, T] | None:
        """The job whose message goes next, and that message (still waiting); with `accept`,
        of the jobs whose first message it accepts."""
        best: tuple[float, str] | None = None
        for job, q in self._waiting.items():
            if q and (accept is None or accept(q[0][0])):
                start = max(self._now, self._finish.get(job, 0.0))
                if best is None or start < best[0]:
                    best = (start, job)
        if best is None:
            return None
        return best[1], self._waiting[best[1]][0][0]

    def pop(self, job: str) -> T:
        """Take `job`'s first waiting message (charged to it)."""
        item, tokens = self._waiting[job].popleft()
        self._len -= 1
        self.charge(job, tokens)
        return item

    def push_front(self, job: str, item: T, tokens: int) -> None:
        """`item` back at the head of `job`'s queue (what is left of a message split),
        uncharged."""
        self._waiting.setdefault(job, deque()).appendleft((item, tokens))
        self._len += 1

    def take(self, job: str) -> tuple[T, int]:
        """`job`'s first waiting message and its tokens, uncharged (to split it)."""
        item, tokens = self._waiting[job].popleft()
        self._len -= 1
        return item, tokens

    def charge(self, job: str, tokens: int) -> None:
        """`tokens` of `job`'s went to the engine now."""
        start = max(self._now, self._finish.get(job, 0.0))
        self._finish[job] = start + tokens / max(self.weights.get(job, 1.0), 1e-9)
        self._now = start

    def take_all(self) -> list[T]:
        """Every waiting message, out of the queue (jobs in turn, each in its order)."""
        out = [item for q in self._waiting.values() for item, _ in q]
        self._waiting.clear()
        self._len = 0
        return out
