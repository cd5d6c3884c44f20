"""`rlfabric bench weights --device cuda`: a model's state dict, on the trainer's GPU, pushed
to torch workers on the same GPU over each transport, beside the floors of the same bytes
measured in the same run: host->device from pageable and from pinned memory, and
device->device.

Each row is the best of `--rounds` `update_weights(..., verify="off")` calls (stage, push,
every worker's digest check and load, acks). The workers serve `--model` (default `qwen05b`,
Qwen2.5-0.5B's shape in fp32: 2,404 MiB) with `--engine torch --device cuda`.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rlfabric.bench._util import children
from rlfabric.bus import EmbeddedNats, QuorumPolicy
from rlfabric.errors import LaunchError
from rlfabric.tensors.models import build_model
from rlfabric.trainer import FabricClient

MIB = 1024 * 1024


def _best(rounds: int, fn: Any) -> float:
    best = float("inf")
    for _ in range(rounds + 1):  # one more: the first pays for allocation
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def floors(sd: dict[str, torch.Tensor], rounds: int) -> list[dict[str, Any]]:
    """host->device (pageable, pinned) and device->device copies of `sd`'s bytes."""
    dev = {k: torch.empty_like(v) for k, v in sd.items()}
    pageable = {k: v.cpu() for k, v in sd.items()}
    pinned = {k: v.cpu().pin_memory() for k, v in sd.items()}

    def copy(src: dict[str, torch.Tensor], blocking: bool) -> None:
        for k, v in src.items():
            dev[k].copy_(v, non_blocking=not blocking)

    return [
        {"path": "host->device, pageable (copy_)", "seconds": _best(rounds,
                                                                    lambda: copy(pageable, True))},
        {"path": "host->device, pinned (copy_)", "seconds": _best(rounds,
                                                                  lambda: copy(pinned, False))},
        {"path": "device->device (copy_)", "seconds": _best(rounds, lambda: copy(sd, False))},
    ]


async def bench(model: str, transports: list[str], workers: int, rounds: int
                ) -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        raise LaunchError("bench weights --device cuda needs a CUDA device; none is visible "
                          "here (run it on the GPU machine, or drop --device)")
    sd = dict(build_model(model, device="cuda").state_dict())
    nbytes = sum(v.numel() * v.element_size() for v in sd.values())
    rows = floors(sd, rounds)
    async with EmbeddedNats() as nats:
        for tr in transports:
            prefix = f"wc{tr.replace('_', '')}"
            cmds = [["rlfabric", "worker", "--nats", nats.url, "--prefix", prefix,
                     "--engine", "torch", "--model", model, "--device", "cuda",
                     "--worker-id", f"gpu{i}"] for i in range(workers)]
            async with FabricClient.connect(nats.url, prefix=prefix,
                                            policy=QuorumPolicy(timeout=600)) as fab, \
                    children(cmds, ready="ready", timeout=600):
                await fab.wait_for_workers(workers, timeout=600)
                best = float("inf")
                for version in range(1, rounds + 1):
                    t0 = time.perf_counter()
                    await fab.update_weights(version, state_dict=sd, transport=tr,
                                             verify="off")
                    best = min(best, time.perf_counter() - t0)
            rows.append({"path": f"rlfabric {tr} -> {workers} workers", "seconds": best})
    for r in rows:
        r["size_mib"] = round(nbytes / MIB)
        r["mb_s"] = nbytes / 1e6 / r["seconds"]
    return rows
