"""The bus: NATS connection, embedded server, subjects, streams/KV, membership, quorum."""

from rlfabric.bus.acks import AckFields
from rlfabric.bus.cluster import EmbeddedCluster
from rlfabric.bus.connect import ConnectOptions, connect
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
    StorageFull,
)
from rlfabric.bus.membership import MembershipWatcher, Registration, fingerprint, new_worker_info
from rlfabric.bus.provision import Limits, provision
from rlfabric.bus.quorum import Broadcaster, Fanout, QuorumPolicy, new_cmd_id
from rlfabric.bus.receiver import CommandContext, CommandReceiver
from rlfabric.bus.server import EmbeddedNats, find_nats_server
from rlfabric.bus.session import Bus
from rlfabric.bus.subjects import Subjects
from rlfabric.bus.view import fleet_view

__all__ = [
    "AckFields",
    "Broadcaster",
    "Bus",
    "BusError",
    "CommandContext",
    "CommandFailed",
    "CommandReceiver",
    "ConnectOptions",
    "DuplicateWorker",
    "EmbeddedCluster",
    "EmbeddedNats",
    "Fanout",
    "InvalidName",
    "Limits",
    "MembershipChanged",
    "MembershipTimeout",
    "MembershipWatcher",
    "NatsAuthFailed",
    "NatsServerError",
    "NatsUnavailable",
    "PayloadTooLarge",
    "PermissionDenied",
    "ProvisioningError",
    "QuorumNotReached",
    "QuorumPolicy",
    "Registration",
    "StorageFull",
    "Subjects",
    "connect",
    "find_nats_server",
    "fingerprint",
    "fleet_view",
    "new_cmd_id",
    "new_worker_info",
    "provision",
]
