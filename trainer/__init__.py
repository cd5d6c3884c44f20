"""The trainer side: `FabricClient`, weight staging, and the model builder shared with workers."""

from rlfabric.bus import QuorumPolicy
from rlfabric.schemas.models import build_model
from rlfabric.trainer.client import FabricClient
from rlfabric.trainer.continuation import continuation, merge
from rlfabric.trainer.errors import TransportInitFailed, WeightsMismatch
from rlfabric.trainer.weights import TRANSPORTS, Staged

__all__ = [
    "TRANSPORTS",
    "FabricClient",
    "QuorumPolicy",
    "Staged",
    "TransportInitFailed",
    "WeightsMismatch",
    "build_model",
    "continuation",
    "merge",
]
