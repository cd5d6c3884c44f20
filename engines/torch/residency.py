"""Where the torch engine's weights are while it sleeps, as peers define the levels: level 1
moves them to pinned host memory (wake copies them back), level 2 drops them (the next weight
load brings them). No KV cache outlives a batch in this engine, so what a sleep frees on a GPU
is the weights, cuBLAS's workspaces and the allocator's cached blocks.
"""

from __future__ import annotations

import torch
from torch import nn


class Residency:
    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.device = device
        persistent = set(module.state_dict())
        #: every weight tensor the module owns (tied ones once): what a sleep moves
        self.owned: list[torch.Tensor] = [p for _, p in module.named_parameters()]
        self.owned += [b for _, b in module.named_buffers()]
        #: what a level-2 sleep drops: the state dict's tensors (small non-persistent buffers,
        #: such as rotary frequencies, are not in it and no load would bring them back)
        named: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
        named.update(module.named_buffers(remove_duplicate=False))
        self.loadable = {name: t for name, t in named.items() if name in persistent}
        self.spec = {name: (tuple(t.shape), t.dtype) for name, t in self.loadable.items()}
        self.level = 0

    @property
    def dropped(self) -> bool:
        """Level 2: the weights are gone until the next load."""
        return self.level >= 2

    def sleep(self, level: int) -> None:
        if level >= 2:
            for t in self.loadable.values():
                t.data = torch.empty(0, dtype=t.dtype, device=self.device)
        if self.device.type == "cuda":
            for t in self.owned:
                if t.device.type == "cuda" and t.numel():
                    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                    host.copy_(t.data)
                    t.data = host
            torch.cuda.synchronize(self.device)
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:  # cuBLAS keeps a workspace per thread until told
                clear()
            torch.cuda.empty_cache()
        self.level = max(self.level, level)

    def wake(self) -> None:
        if self.device.type == "cuda":
            for t in self.owned:
                if t.device.type != "cuda" and t.numel():
                    t.data = t.data.to(self.device, non_blocking=True)
            torch.cuda.synchronize(self.device)
        if not self.dropped:
            self.level = 0

    def materialize(self) -> None:
        """Before a load into dropped weights: room for them on the device, contents unset."""
        for name, t in self.loadable.items():
            shape, dtype = self.spec[name]
            if tuple(t.shape) != shape:
                t.data = torch.empty(shape, dtype=dtype, device=self.device)
        self.level = 0
