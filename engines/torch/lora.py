"""LoRA adapters on the torch engine: a forward hook on each target module adds, row by row of
the batch, the update of the adapter version that row's sequence runs under. Base rows and rows
of several adapters (and versions) share one batch; the base weights are never touched."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rlfabric.engines.errors import EngineError, WeightLoadError
from rlfabric.schemas import Adapter, ErrorCode
from rlfabric.tensors import lora
from rlfabric.tensors.checksums import checksum


@dataclass(eq=False)
class LoraWeights:
    """One loaded version of an adapter: its matrices per module, and their checksum."""

    adapter: Adapter
    version: int
    mats: dict[str, tuple[torch.Tensor, torch.Tensor]]
    checksum: str


@dataclass
class LoraBank:
    """The adapters a model holds: the last `keep` versions of at most `max_adapters` names. A
    sequence holds its `LoraWeights` itself, so one dropped here still finishes on it."""

    module: nn.Module
    max_adapters: int = 4
    keep: int = 2
    loaded: dict[str, list[LoraWeights]] = field(default_factory=dict)
    _hooked: set[str] = field(default_factory=set)
    #: per module, the rows of the current forward pass and the matrices they add
    _groups: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]] = \
        field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def prepare(self, adapter: Adapter, state: Mapping[str, Any], version: int,
                device: torch.device, dtype: torch.dtype) -> LoraWeights:
        """The adapter's tensors checked against the model, as the engine will hold them."""
        if adapter.name not in self.loaded and len(self.loaded) >= self.max_adapters:
            raise EngineError(f"adapter {adapter.name!r} would be one more than the "
                              f"{self.max_adapters} this worker holds ({', '.join(self.loaded)})"
                              "; unload one (FabricClient.unload_adapter) or start the worker "
                              "with a larger --max-adapters", code=ErrorCode.ADAPTER_LIMIT)
        if adapter.rank < 1:
            raise WeightLoadError(f"adapter {adapter.name!r}: rank {adapter.rank} must be >= 1")
        try:
            mods = lora.targets(self.module, adapter.target_modules)
            mats = lora.split(state, mods, adapter)
        except ValueError as exc:
            raise WeightLoadError(str(exc)) from None
        held = {m: (a.to(device=device, dtype=dtype).clone(), b.to(device=device, dtype=dtype)
                    .clone()) for m, (a, b) in mats.items()}
        return LoraWeights(adapter=adapter, version=version, mats=held,
                           checksum=checksum(dict(state)))

    def add(self, w: LoraWeights) -> None:
        with self._lock:
            for name in w.mats:
                if name not in self._hooked:
                    self.module.get_submodule(name).register_forward_hook(self._hook(name))
                    self._hooked.add(name)
            # the newest from now on: versions after it were a push taken back
            older = [v for v in self.loaded.get(w.adapter.name, []) if v.version < w.version]
            self.loaded[w.adapter.name] = [*older, w][-self.keep:]

    def remove(self, name: str) -> bool:
        with self._lock:
            return self.loaded.pop(name, None) is not None

    def versions(self) -> dict[str, tuple[int, ...]]:
        with self._lock:
            return {n: tuple(v.version for v in vs) for n, vs in self.loaded.items()}

    def pick(self, name: str, version: int) -> LoraWeights | None:
        """The version asked for (-1: the newest), or None if it is not held."""
        with self._lock:
            held = self.loaded.get(name, [])
            if version < 0:
                return held[-1] if held else None
            return next((v for v in held if v.version == version), None)

    @contextlib.contextmanager
    def rows(self, per_row: list[LoraWeights | None]) -> Iterator[None]:
        """For the forward passes in the block: row i adds `per_row[i]`'s update."""
        groups: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]] = {}
        by_weights: dict[int, tuple[LoraWeights, list[int]]] = {}
        for i, w in enumerate(per_row):
            if w is not None:
                by_weights.setdefault(id(w), (w, []))[1].append(i)
        for w, idx in by_weights.values():
            rows = torch.tensor(idx)
            for name, (a, b) in w.mats.items():
                groups.setdefault(name, []).append((rows, a, b, w.adapter.scale))
        self._groups = groups
        try:
            yield
        finally:
            self._groups = {}

    def _hook(self, name: str) -> Any:
        def hook(mod: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor
                 ) -> torch.Tensor | None:
            groups = self._groups.get(name)
            if not groups:
                return None
            x = inputs[0]
            for rows, a, b, scale in groups:
                rows = rows.to(x.device)
                output[rows] += (x[rows] @ a.T @ b.T) * scale
            return output
        return hook
