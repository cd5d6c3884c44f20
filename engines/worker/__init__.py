"""The worker runtime: an engine on the bus (`Worker`), its rollout data plane
(`RolloutServer`) and its receiving side of weight updates (`WeightSync`)."""

from rlfabric.engines.worker.rollouts import RolloutServer
from rlfabric.engines.worker.runtime import Worker
from rlfabric.engines.worker.weights import WeightSync

__all__ = ["RolloutServer", "WeightSync", "Worker"]
