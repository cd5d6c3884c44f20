"""The trainer side: `FabricClient` and the model builder shared with workers."""

from rlfabric.bus import QuorumPolicy
from rlfabric.schemas.models import build_model
from rlfabric.trainer.client import FabricClient

__all__ = ["FabricClient", "QuorumPolicy", "build_model"]
