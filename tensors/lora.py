"""LoRA adapters in PEFT's layout, shared by the trainer and the torch engine.

An adapter's tensors are `base_model.model.<module>.lora_A.weight` ([rank, in]) and
`base_model.model.<module>.lora_B.weight` ([out, rank]) for each target `nn.Linear`; its output
gains `B @ A @ x * alpha / rank`. `LoraModel` trains only those matrices (the base is frozen);
`merged` is the reference a served adapter is checked against.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from rlfabric.schemas import Adapter

PREFIX = "base_model.model."


def key(module: str, part: str) -> str:
    """The PEFT key of `module`'s `part` ("lora_A" or "lora_B")."""
    return f"{PREFIX}{module}.{part}.weight"


def targets(model: nn.Module, names: tuple[str, ...]) -> dict[str, nn.Linear]:
    """The model's `nn.Linear` modules whose name ends in one of `names`, by full name."""
    found = {n: m for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in names}
    if not found:
        raise ValueError(f"the model has no linear module named {', '.join(names)}")
    return found


def split(state: Mapping[str, Any], modules: Mapping[str, nn.Linear], adapter: Adapter
          ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`state` as (A, B) per module name, checked against the modules' shapes and the rank;
    ValueError naming the first tensor that does not fit."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    unused = set(state)
    for name, mod in modules.items():
        ka, kb = key(name, "lora_A"), key(name, "lora_B")
        if ka not in state or kb not in state:
            continue
        a, b = torch.as_tensor(state[ka]), torch.as_tensor(state[kb])
        want_a, want_b = (adapter.rank, mod.in_features), (mod.out_features, adapter.rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise ValueError(f"adapter {adapter.name!r}: {name} has A {tuple(a.shape)} and B "
                             f"{tuple(b.shape)}; rank {adapter.rank} on this model needs "
                             f"{want_a} and {want_b}")
        out[name] = (a, b)
        unused -= {ka, kb}
    if unused:
        raise ValueError(f"adapter {adapter.name!r}: {len(unused)} tensors match no target "
                         f"module of the model, e.g. {sorted(unused)[0]!r}")
    if not out:
        raise ValueError(f"adapter {adapter.name!r} has no tensor for any of "
                         f"{', '.join(adapter.target_modules)}")
    return out


def random_adapter(model: nn.Module, adapter: Adapter, *, seed: int, std: float = 0.05
                   ) -> dict[str, torch.Tensor]:
    """An adapter with both matrices random (B too, unlike PEFT's init: it changes outputs)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, mod in targets(model, adapter.target_modules).items():
        state[key(name, "lora_A")] = torch.randn(adapter.rank, mod.in_features, generator=g) * std
        state[key(name, "lora_B")] = torch.randn(mod.out_features, adapter.rank, generator=g) * std
    return state


def merged(model: nn.Module, state: Mapping[str, Any], adapter: Adapter) -> nn.Module:
    """A copy of `model` with the adapter merged in: W + B @ A * alpha / rank."""
    out = copy.deepcopy(model)
    mods = targets(out, adapter.target_modules)
    with torch.no_grad():
        for name, (a, b) in split(state, mods, adapter).items():
            w = mods[name].weight
            w.add_((b.float() @ a.float() * adapter.scale).to(w.dtype))
    return out


class LoraLinear(nn.Module):
    """A frozen `nn.Linear` plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, *, seed: int) -> None:
        super().__init__()
        self.base = base
        self.scale = scale
        g = torch.Generator().manual_seed(seed)
        dtype = base.weight.dtype
        # PEFT's init: A random, B zero, so the adapter starts as the base model
        self.lora_A = nn.Parameter(torch.randn(rank, base.in_features, generator=g,
                                               dtype=dtype) / rank)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scale
        return out


class LoraModel(nn.Module):
    """`model` with its target modules wrapped in `LoraLinear`; only the adapter trains."""

    def __init__(self, model: nn.Module, adapter: Adapter, *, seed: int = 0) -> None:
        super().__init__()
        self.adapter = adapter
        for p in model.parameters():
            p.requires_grad_(False)
        self.names = sorted(targets(model, adapter.target_modules))
        for i, name in enumerate(self.names):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, LoraLinear(getattr(parent, child), adapter.rank,
                                              adapter.scale, seed=seed + i))
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def _layers(self) -> Iterator[tuple[str, LoraLinear]]:
        for name in self.names:
            mod = self.model.get_submodule(name)
            assert isinstance(mod, LoraLinear)  # wrapped in __init__
            yield name, mod

    def lora_parameters(self) -> Iterator[nn.Parameter]:
        for _, mod in self._layers():
            yield mod.lora_A
            yield mod.lora_B

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors in PEFT's layout (detached; what an update sends)."""
        out = {}
        for name, mod in self._layers():
            out[key(name, "lora_A")] = mod.lora_A.detach()
            out[key(name, "lora_B")] = mod.lora_B.detach()
        return out
