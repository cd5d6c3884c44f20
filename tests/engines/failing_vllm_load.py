"""A vLLM worker extension for tests (`--worker-extension failing_vllm_load.FailingLoad`, with
this folder on PYTHONPATH): a load of weight version 2 fails inside vLLM's loader after half of
the tensors were written, leaving a half-loaded model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rlfabric.engines.vllm.extension import RLFabricWorkerExtension

FAILING_VERSION = 2


class FailingLoad(RLFabricWorkerExtension):
    def rlfabric_weights(self, items: list[tuple[str, Any]], version: int
                         ) -> Iterator[tuple[str, Any]]:
        for i, item in enumerate(items):
            if version == FAILING_VERSION and i == len(items) // 2:
                raise RuntimeError(f"injected failure loading v{version} after {i} of "
                                   f"{len(items)} tensors")
            yield item
