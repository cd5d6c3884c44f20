"""The toy task of `rlfabric up`: teach the tiny byte-level model to answer in one letter.

Prompts read "say a #<i>:"; the reward of a completion is the fraction of its `max_tokens`
positions that hold the byte `a` (tokens after an early EOS count as misses). A random-init
model spreads its mass over 259 ids and scores about 0.004; a policy that learned the task
scores near 1. If weights did not reach the workers, the samples would keep coming from the
random policy and the reward would stay flat.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfabric.schemas.models import byte_tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class LetterTask:
    letter: str = "a"
    max_tokens: int = 8

    @property
    def target(self) -> int:
        return ord(self.letter)

    def prompt(self, i: int) -> list[int]:
        return byte_tokens(f"say {self.letter} #{i}:")

    def reward(self, completion: list[int]) -> float:
        return sum(1 for t in completion[: self.max_tokens] if t == self.target) / self.max_tokens
