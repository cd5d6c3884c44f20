"""Errors of the trainer side."""

from __future__ import annotations

from rlfabric.schemas import FanoutReport, RLFabricError, RolloutError


class WeightsMismatch(RLFabricError):
    """Raised when workers acked a weight update but do not all report the same weights
    checksum (or not the sender's): an update that did not land as sent. `checksums` maps
    worker id -> checksum; `expected` is what the quorum (or the sender) reported."""

    def __init__(self, message: str, *, checksums: dict[str, str], expected: str,
                 report: FanoutReport) -> None:
        super().__init__(message)
        self.checksums = checksums
        self.expected = expected
        self.report = report

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(sorted(w for w, c in self.checksums.items() if c != self.expected))


class TransportInitFailed(RLFabricError):
    """Raised when a collective group could not be formed by its deadline; `missing_workers`
    names the workers (and `missing_ranks` the ranks) that did not join."""

    def __init__(self, message: str, *, missing_workers: tuple[str, ...],
                 missing_ranks: tuple[int, ...], group_epoch: int) -> None:
        super().__init__(message)
        self.missing_workers = missing_workers
        self.missing_ranks = missing_ranks
        self.group_epoch = group_epoch


class RolloutFailed(RLFabricError):
    """Raised by the GRPO loop when a rollout it needs came back as a `RolloutError`;
    `error` is that error (its `code` and `worker_id` say what failed where)."""

    def __init__(self, message: str, *, error: RolloutError) -> None:
        super().__init__(message)
        self.error = error


class PoolOnly(RLFabricError):
    """Raised when a job's client (`FabricClient.connect(job=...)`) asks for what acts on the
    whole pool: base weights, sleep, wake, a collective group, the prefix cache. A client
    connected without `job=` (the pool's operator) does these."""
