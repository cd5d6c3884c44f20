"""The worker runtime: an engine on the bus (`Worker`), its rollout data plane
(`RolloutServer`) and its receiving side of weight updates (`WeightSync`)."""

from rlfabric.worker.rollouts import RolloutServer
from rlfabric.worker.runtime import Worker
from rlfabric.worker.weights import WeightSync

__all__ = ["RolloutServer", "WeightSync", "Worker"]
