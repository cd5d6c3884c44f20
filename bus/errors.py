"""Errors of the bus layer. All derive from `rlfabric.schemas.RLFabricError`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlfabric.schemas import RLFabricError

if TYPE_CHECKING:
    from rlfabric.schemas import FanoutReport, MembershipSnapshot


class BusError(RLFabricError):
    """Base class of errors raised by `rlfabric.bus`."""


class NatsServerError(BusError):
    """Raised when an embedded nats-server cannot start; carries the server's fatal lines."""

    def __init__(self, message: str, *, fatal_lines: list[str] | None = None) -> None:
        super().__init__(message)
        self.fatal_lines = fatal_lines or []


class NatsUnavailable(BusError):
    """Raised when no NATS server answers at any of the given URLs."""


class ProvisioningError(BusError):
    """Raised when a stream or bucket exists with a config rlfabric cannot reconcile."""


class InvalidWorkerId(BusError, ValueError):
    """Raised when a worker id cannot be used as a NATS subject token / consumer name."""


class QuorumNotReached(BusError):
    """Raised when a broadcast ends (timeout, errors, or too few members) without its quorum.
    `report` says who acked ok, who acked an error and who never answered."""

    def __init__(self, message: str, report: FanoutReport) -> None:
        super().__init__(message)
        self.report = report


class MembershipChanged(BusError):
    """Raised under `on_membership_change="fail"` when workers join or leave (or are found
    dead) while a broadcast waits. `before`/`after` are the snapshots; `report` the acks so far."""

    def __init__(self, message: str, *, before: MembershipSnapshot, after: MembershipSnapshot,
                 report: FanoutReport) -> None:
        super().__init__(message)
        self.before = before
        self.after = after
        self.report = report

    @property
    def left(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.before.worker_ids) - set(self.after.worker_ids)))

    @property
    def joined(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.after.worker_ids) - set(self.before.worker_ids)))
