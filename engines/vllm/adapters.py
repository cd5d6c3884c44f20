"""LoRA adapters on the vLLM engine: each received version becomes a PEFT folder under /dev/shm
and a `LoRARequest` of its own (its own id, so vLLM's prefix cache never shares blocks between
two versions), loaded into vLLM's worker with `add_lora`. The last `keep` versions of each
adapter stay loaded: a request runs under the version it started with."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlfabric.engines.errors import EngineError, WeightLoadError
from rlfabric.engines.payload import SPILL_DIR
from rlfabric.schemas import Adapter, ErrorCode

_A, _B = ".lora_A.weight", ".lora_B.weight"
_PREFIX = "base_model.model."


@dataclass(eq=False)
class Held:
    """One loaded version: the request that names it to vLLM, its folder, its checksum."""

    adapter: Adapter
    version: int
    request: Any  # vllm.lora.request.LoRARequest
    path: str
    checksum: str


@dataclass
class VllmAdapters:
    shapes: Mapping[str, tuple[int, ...]]  # the checkpoint's tensors: name -> shape
    max_adapters: int = 0
    keep: int = 2
    loaded: dict[str, list[Held]] = field(default_factory=dict)
    _next_id: int = 1

    def check(self, adapter: Adapter, state: Mapping[str, Any]) -> None:
        """Names and shapes against the checkpoint, and the adapter count, before vLLM is
        asked: `WeightLoadError` / `EngineError` (`adapter_limit`)."""
        if self.max_adapters < 1:
            raise EngineError(f"adapter {adapter.name!r}: this vLLM worker was started without "
                              "LoRA; start it with --max-adapters N", code=ErrorCode.UNSUPPORTED)
        if adapter.name not in self.loaded and len(self.loaded) >= self.max_adapters:
            raise EngineError(f"adapter {adapter.name!r} would be one more than the "
                              f"{self.max_adapters} this worker holds ({', '.join(self.loaded)})"
                              "; unload one (FabricClient.unload_adapter) or start the worker "
                              "with a larger --max-adapters", code=ErrorCode.ADAPTER_LIMIT)
        for key, t in state.items():
            module = key.removeprefix(_PREFIX).removesuffix(_A).removesuffix(_B)
            want = self.shapes.get(f"{module}.weight")
            if not key.startswith(_PREFIX) or want is None or len(want) != 2:
                raise WeightLoadError(f"adapter {adapter.name!r}: {key} matches no linear "
                                      "module of the checkpoint")
            out, inp = want
            shape = tuple(t.shape)
            expect = (adapter.rank, inp) if key.endswith(_A) else (out, adapter.rank)
            if shape != expect:
                raise WeightLoadError(f"adapter {adapter.name!r}: {key} has shape {shape}; rank "
                                      f"{adapter.rank} on this checkpoint needs {expect}")

    def write(self, adapter: Adapter, state: Mapping[str, Any], version: int,
              checksum: str) -> Held:
        """The version as a PEFT folder, and the `LoRARequest` that names it."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        path = tempfile.mkdtemp(prefix=f"rlf_lora_{adapter.name}_v{version}_", dir=SPILL_DIR)
        save_file({k: t.contiguous() for k, t in state.items()},
                  os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": adapter.rank, "lora_alpha": adapter.alpha,
                       "target_modules": list(adapter.target_modules), "bias": "none",
                       "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}, f)
        lora_id, self._next_id = self._next_id, self._next_id + 1
        request = LoRARequest(lora_name=f"{adapter.name}@v{version}", lora_int_id=lora_id,
                              lora_path=path)
        return Held(adapter=adapter, version=version, request=request, path=path,
                    checksum=checksum)

    def add(self, held: Held) -> list[Held]:
        """Hold `held` as the adapter's newest version; returns the versions no longer held
        (for vLLM to drop): beyond `keep`, and any newer than `held` (a push taken back)."""
        before = self.loaded.get(held.adapter.name, [])
        ordered = [*(h for h in before if h.version < held.version), held]
        self.loaded[held.adapter.name] = ordered[-self.keep:]
        return [*ordered[:-self.keep], *(h for h in before if h.version >= held.version)]

    def remove(self, name: str) -> list[Held]:
        return self.loaded.pop(name, [])

    def versions(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(h.version for h in hs) for n, hs in self.loaded.items()}

    def pick(self, name: str, version: int) -> Held | None:
        held = self.loaded.get(name, [])
        if version < 0:
            return held[-1] if held else None
        return next((h for h in held if h.version == version), None)

    def every(self) -> list[Held]:
        return [h for hs in self.loaded.values() for h in hs]


def discard(held: Held) -> None:
    shutil.rmtree(held.path, ignore_errors=True)
