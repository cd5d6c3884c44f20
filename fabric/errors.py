"""Every exception rlfabric raises, in one place. All derive from `RLFabricError`.

The errors of the launchers on top (`rlfabric up`, the benchmarks) are defined here; the
others where they are raised.
"""

from rlfabric.bus.errors import (
    BusError,
    CommandFailed,
    DuplicateWorker,
    InvalidName,
    MembershipChanged,
    MembershipTimeout,
    NatsAuthFailed,
    NatsServerError,
    NatsUnavailable,
    PayloadTooLarge,
    PermissionDenied,
    ProvisioningError,
    QuorumNotReached,
)
from rlfabric.engines.errors import (
    EngineDied,
    EngineError,
    RequestRejected,
    Unsupported,
    WeightLoadError,
)
from rlfabric.schemas.errors import (
    MalformedMessage,
    RLFabricError,
    SchemaError,
    UnknownSchemaVersion,
)
from rlfabric.schemas.validation import InvalidRequest
from rlfabric.tensors.errors import CollectiveTimeout
from rlfabric.trainer.errors import RolloutFailed, TransportInitFailed, WeightsMismatch
from rlfabric.trainer.policies import PolicyMismatch
from rlfabric.transports.protocol import TransportError


class LaunchError(RLFabricError):
    """Raised when processes a launcher started (`rlfabric up`'s workers, a benchmark's
    servers) exit or do not get ready in time; the message carries the tail of their output."""


__all__ = [
    "BusError",
    "CollectiveTimeout",
    "CommandFailed",
    "DuplicateWorker",
    "EngineDied",
    "EngineError",
    "InvalidName",
    "InvalidRequest",
    "LaunchError",
    "MalformedMessage",
    "MembershipChanged",
    "MembershipTimeout",
    "NatsAuthFailed",
    "NatsServerError",
    "NatsUnavailable",
    "PayloadTooLarge",
    "PermissionDenied",
    "PolicyMismatch",
    "ProvisioningError",
    "QuorumNotReached",
    "RLFabricError",
    "RequestRejected",
    "RolloutFailed",
    "SchemaError",
    "TransportError",
    "TransportInitFailed",
    "UnknownSchemaVersion",
    "Unsupported",
    "WeightLoadError",
    "WeightsMismatch",
]
