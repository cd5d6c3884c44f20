"""vLLM's own prefix-cache counters (tokens looked up, tokens found), kept by a stat logger
vLLM calls at every scheduler step; `rlfabric ctl describe` and `rlfabric bench agent` read
them through the engine's `describe`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class PrefixCacheCounts:
    queries: int = 0
    hits: int = 0


def counting_into(counts: PrefixCacheCounts) -> Any:
    """A stat-logger factory (`AsyncLLM(stat_loggers=[...])`) adding to `counts`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class PrefixCacheCounter(StatLoggerBase):  # type: ignore[misc]  # vLLM: untyped here
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            del vllm_config, engine_index

        def record(self, scheduler_stats: Any, iteration_stats: Any,
                   mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            stats = getattr(scheduler_stats, "prefix_cache_stats", None)
            if stats is not None:
                counts.queries += stats.queries
                counts.hits += stats.hits

        def log_engine_initialized(self) -> None:
            pass

    return PrefixCacheCounter
