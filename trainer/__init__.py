"""The trainer side: `FabricClient`, weight staging, and the model builder shared with workers.

`build_model` and `Staged` need torch and are imported on first use, so `rlfabric ctl` and
other control-only users of `FabricClient` start without it.
"""

from typing import Any

from rlfabric.bus import QuorumPolicy
from rlfabric.trainer.client import FabricClient
from rlfabric.trainer.continuation import continuation, merge
from rlfabric.trainer.errors import (
    PoolOnly,
    RolloutFailed,
    TransportInitFailed,
    WeightsMismatch,
)
from rlfabric.trainer.policies import PolicyMismatch

_LAZY = {"build_model": "rlfabric.tensors.models", "Staged": "rlfabric.transports"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlfabric.trainer' has no attribute {name!r}")


__all__ = [
    "FabricClient",
    "PolicyMismatch",
    "PoolOnly",
    "QuorumPolicy",
    "RolloutFailed",
    "Staged",
    "TransportInitFailed",
    "WeightsMismatch",
    "build_model",
    "continuation",
    "merge",
]
