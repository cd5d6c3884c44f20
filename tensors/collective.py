"""The collective side-channel of weight updates: a torch.distributed process group that is
not the global one (the trainer's own FSDP/DDP group stays untouched), rendezvousing on a
TCPStore at the trainer (rank 0), namespaced by `group_epoch` so an old group is never reused.

gloo on CPU; the same code with NCCL on CUDA (`backend="nccl"`). Every call blocks: run it in a
worker thread. Every wait has the group's `timeout`.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rlfabric.tensors.errors import CollectiveTimeout

CHUNK = 64 * 1024 * 1024


class CollectiveGroup:
    def __init__(self, *, backend: str, master_addr: str, master_port: int, rank: int,
                 world_size: int, group_epoch: int, timeout: float) -> None:
        self.backend = backend
        self.master_addr = master_addr
        self.master_port = master_port
        self.rank = rank
        self.world_size = world_size
        self.group_epoch = group_epoch
        self.timeout = timeout
        self._store: Any = None
        self._pg: Any = None

    def _td(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout)

    def open_store(self) -> None:
        """Rank 0: start the rendezvous server (returns at once). Others: connect to it."""
        base = dist.TCPStore(self.master_addr, self.master_port, self.world_size,
                             self.rank == 0, timeout=self._td(), wait_for_workers=False)
        self._store = dist.PrefixStore(f"rlfabric/epoch{self.group_epoch}/", base)
        self._store.set(f"joined/{self.rank}", b"1")

    def wait_joined(self, give_up: Callable[[], bool] = lambda: False) -> None:
        """Rank 0: wait for every rank to reach the store; name those that did not. Stops
        early, the same way, once `give_up()` is true (a worker refused to join)."""
        deadline = time.monotonic() + self.timeout
        keys = [f"joined/{r}" for r in range(self.world_size)]
        while True:
            missing = [r for r, k in enumerate(keys) if not self._store.check([k])]
            if not missing:
                return
            if time.monotonic() > deadline or give_up():
                raise CollectiveTimeout(
                    f"ranks {missing} did not join collective group epoch {self.group_epoch} "
                    f"at {self.master_addr}:{self.master_port} within {self.timeout}s",
                    missing)
            time.sleep(0.02)

    def connect(self) -> None:
        """Build the process group (all ranks must call it; returns when all have)."""
        if self.backend == "gloo":
            self._pg = dist.ProcessGroupGloo(self._store, self.rank, self.world_size, self._td())
        elif self.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self._td()
            self._pg = dist.ProcessGroupNCCL(self._store, self.rank, self.world_size, opts)
        else:
            raise ValueError(f"unknown collective backend {self.backend!r}: use gloo or nccl")

    def broadcast(self, flat: torch.Tensor) -> None:
        """Broadcast a flat uint8 tensor from rank 0, in chunks of 64 MiB."""
        for start in range(0, flat.numel(), CHUNK):
            self._pg.broadcast(flat[start:start + CHUNK], 0).wait()

    def close(self) -> None:
        self._pg = None
        self._store = None
