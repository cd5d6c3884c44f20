"""Errors of the bus layer. All derive from `rlfabric.schemas.RLFabricError`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import nats.errors
import nats.js.errors

from rlfabric.schemas import RLFabricError

if TYPE_CHECKING:
    from rlfabric.schemas import FanoutReport, MembershipSnapshot


#: JetStream API error codes rlfabric reacts to (nats-server's errors.json)
JS_STREAM_NAME_IN_USE = 10058  # a stream of this name exists with another config
JS_CONSUMER_NAME_IN_USE = 10013  # a consumer of this name exists with another config
JS_CONSUMER_ALREADY_EXISTS = 10148  # a create-only call found the consumer already there
#: Nats-Expected-Last-(Subject-)Sequence did not hold: 10071 on a stream of one copy, 10164 on a
#: replicated one (a NATS cluster), which names no sequence
JS_WRONG_LAST_SEQUENCE = frozenset({10071, 10164})
JS_NO_SUITABLE_PEERS = 10005  # fewer JetStream peers known than a stream's replicas

#: what a publish or request raises while the connection or the server is coming back (a
#: reconnect, a restarted server whose JetStream is not up yet): worth retrying
TRANSIENT: tuple[type[Exception], ...] = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)
#: "duplicate message id is in process": a retry reached the stream while the first copy, sent
#: before a reconnect or a partition, is still being agreed on by its replicas; retried, it
#: ends stored once (a duplicate) or refused as that first copy was
JS_MSG_ID_IN_PROCESS = 10158
#: JetStream's answers when its storage has no room (insufficient resources; storage or memory
#: resources exceeded): a refusal to report at once, never a transient error to retry
JS_STORAGE_FULL = frozenset({10023, 10047, 10028})
#: "store failed": with "maximum bytes/messages exceeded", a stream with discard=new at its cap
JS_STREAM_STORE_FAILED = 10077


#: what a JetStream publish raises when not stored: `retryable` says which to send again
PUBLISH_FAILED: tuple[type[Exception], ...] = (*TRANSIENT, nats.js.errors.APIError)


def retryable(exc: BaseException) -> bool:
    """Whether a JetStream publish that raised `exc` is worth sending again as it was: a
    transient error (a stream with no room answers with one too: not that) or a copy still
    in process."""
    if storage_refused(exc):
        return False
    return isinstance(exc, TRANSIENT) or (isinstance(exc, nats.js.errors.APIError)
                                           and exc.err_code == JS_MSG_ID_IN_PROCESS)


def storage_refused(exc: BaseException) -> bool:
    """Whether `exc` is JetStream saying it has no room to store the message: the server's
    or account's store, or the stream's own cap."""
    if not isinstance(exc, nats.js.errors.APIError):
        return False
    if exc.err_code in JS_STORAGE_FULL:
        return True
    return exc.err_code == JS_STREAM_STORE_FAILED and "maximum" in (exc.description or "")


#: what reading a stored message by sequence raises when it cannot be read now or at all (the
#: server coming back, the message deleted: `NotFoundError` is an `APIError`)
READ_FAILED: tuple[type[Exception], ...] = (*TRANSIENT, nats.js.errors.APIError)


class BusError(RLFabricError):
    """Base class of errors raised by `rlfabric.bus`."""


class NatsServerError(BusError):
    """Raised when an embedded nats-server cannot start; carries the server's fatal lines."""

    def __init__(self, message: str, *, fatal_lines: list[str] | None = None) -> None:
        super().__init__(message)
        self.fatal_lines = fatal_lines or []


class NatsUnavailable(BusError):
    """Raised when no NATS server answers at any of the given URLs."""


class NatsAuthFailed(NatsUnavailable):
    """Raised when a server answered but refused this client's credentials (no key, a wrong
    key, an unknown user): the message says so and quotes the server."""


class PermissionDenied(BusError):
    """Raised when the server refused this client a subject (its role may not publish there,
    see `rlfabric nats --auth`); the message names the subject and quotes the server."""

    def __init__(self, message: str, *, subject: str) -> None:
        super().__init__(message)
        self.subject = subject


class ProvisioningError(BusError):
    """Raised when a stream or bucket exists with a config rlfabric cannot reconcile."""


class InvalidName(BusError, ValueError):
    """Raised when a name that becomes a NATS subject token or a JetStream name (a job prefix,
    worker id, client id or command id) has characters the bus cannot carry."""


class DuplicateWorker(BusError):
    """Raised when a worker starts with the id of a live worker of the same job (it answers
    pings); the message says which process holds the id."""


class CommandFailed(BusError):
    """Raised by a worker's command handler to answer with an error Ack carrying `code`
    (`load_failed`, `digest_mismatch`, `unsupported`, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class PayloadTooLarge(BusError):
    """A message larger than the server takes (its `max_payload`): refused before it is sent,
    never dropped on the way."""

    def __init__(self, message: str, *, size: int, limit: int) -> None:
        super().__init__(message)
        self.size = size
        self.limit = limit


class StorageFull(BusError):
    """JetStream refused to store a message for want of room: its stream is at its cap
    (`Limits.*_max_bytes`) or the server's store is full. `code` is `storage_full`."""

    code = "storage_full"


class QuorumNotReached(BusError):
    """Raised when a broadcast ends (timeout, errors, or too few members) without its quorum.
    `report` says who acked ok, who acked an error and who never answered."""

    def __init__(self, message: str, report: FanoutReport) -> None:
        super().__init__(message)
        self.report = report


class MembershipTimeout(BusError, TimeoutError):
    """Raised when membership did not reach an awaited state (e.g. N workers) in time; the
    message names who is there."""


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
