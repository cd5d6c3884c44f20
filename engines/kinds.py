"""The engines rlfabric ships, registered by name (`rlfabric.engines.registry`): torch (the
reference), vllm (vLLM's AsyncLLM) and null (echoes prompts: benchmarks). Each factory imports
its engine only when called, so the CLI's help starts without torch or vLLM."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from typing import Any

from rlfabric.engines.protocol import Engine
from rlfabric.engines.registry import (
    ADAPTER_VERSIONS,
    MAX_ADAPTERS,
    MAX_BATCH,
    EngineKind,
    register,
)


@dataclass(kw_only=True, slots=True)
class VllmOptions:
    """What vLLM needs to know besides the model; each maps to a `rlfabric worker` flag."""

    max_model_len: int = 512  # --max-model-len
    kv_cache_gib: float = 1.0  # --kv-cache-gib (CPU: VLLM_CPU_KVCACHE_SPACE)
    block_size: int = 0  # --block-size: tokens a KV block holds (0: vLLM's own, 128 on CPU)
    dtype: str = "float32"  # --dtype (the worker's, shared with torch)
    threads_bind: str = "nobind"  # --threads-bind (CPU: VLLM_CPU_OMP_THREADS_BIND)
    in_process: bool = True  # --no-in-process: vLLM's default 3-process layout
    max_num_seqs: int = MAX_BATCH  # --max-batch (the worker's, shared with torch)
    enforce_eager: bool = True
    #: LoRA: adapters (by name) held at once (0: LoRA off, as vLLM's own default), versions
    #: of each kept loaded, and the largest rank taken
    max_adapters: int = 0  # --max-adapters
    adapter_versions: int = ADAPTER_VERSIONS  # --adapter-versions
    max_lora_rank: int = 64  # --max-lora-rank
    #: the class vLLM mixes into its worker processes: RLFabricWorkerExtension or a subclass
    #: of it (one that adds RPCs, or instruments loads: tests inject failures this way)
    worker_extension: str = "rlfabric.engines.vllm.extension.RLFabricWorkerExtension"
    #: CUDA: vLLM's weight-transfer backend, "nccl" (collective updates from VllmNcclSync) or
    #: "ipc" (every full-weights update enters vLLM through its CUDA IPC backend)
    weight_transfer: str = "nccl"  # --weight-transfer


def _torch(model: str, **options: Any) -> Engine:
    from rlfabric.engines.torch import TorchEngine

    return TorchEngine(model, **options)


#: the engines' weights and compute dtypes (`rlfabric worker --dtype`, `rlfabric up --dtype`)
DTYPES = ("float32", "bfloat16", "float16")

#: iterations an idle OpenMP thread spins before it sleeps (libgomp's `GOMP_SPINCOUNT`)
OPENMP_SPIN = "20000"


def _torch_prepare() -> None:
    # NOTE: libgomp's default spin keeps each idle OpenMP thread on a core for milliseconds
    # after every batch, while the worker's loop and the broker need that core to hand the
    # results over and take the next requests; this spin still spans the gaps inside a batch
    # (docs/benchmarks.md). An OpenMP wait setting of the user's own wins.
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN)


def _torch_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("torch engine")
    g.add_argument("--device", default=None, help="torch device (default: cuda if available)")


def _vllm(model: str, **options: Any) -> Engine:
    from rlfabric.engines import checkpoint_dir
    from rlfabric.engines.vllm import VllmEngine

    return VllmEngine(checkpoint_dir(model), **options)


def _vllm_options(p: argparse.ArgumentParser) -> None:
    d = {f.name: f.default for f in fields(VllmOptions)}
    g = p.add_argument_group("vllm engine")
    g.add_argument("--max-model-len", type=int, default=d["max_model_len"],
                   help="context length vLLM reserves KV cache for (default %(default)s)")
    g.add_argument("--kv-cache-gib", type=float, default=d["kv_cache_gib"],
                   help="KV cache size in GiB (CPU: VLLM_CPU_KVCACHE_SPACE; default "
                   "%(default)s)")
    g.add_argument("--block-size", type=int, default=d["block_size"],
                   help="tokens per KV-cache block, the unit the prefix cache reuses (0: "
                   "vLLM's own, 128 on CPU; CPU takes multiples of 32)")
    g.add_argument("--threads-bind", default=d["threads_bind"],
                   help="CPU: VLLM_CPU_OMP_THREADS_BIND ('auto' binds every engine to the same "
                   "cores; give each its own, e.g. 0-3, or nobind; default %(default)s)")
    g.add_argument("--no-in-process", dest="in_process", action="store_false",
                   default=d["in_process"],
                   help="vLLM's own 3-process layout instead of the model in its EngineCore "
                   "process (slower to start here)")
    g.add_argument("--max-lora-rank", type=int, default=d["max_lora_rank"],
                   help="the largest LoRA rank vLLM makes room for (default %(default)s)")
    g.add_argument("--worker-extension", default=d["worker_extension"], metavar="CLASS",
                   help="the class vLLM mixes into its worker processes, as module.Class: "
                   "rlfabric's own or a subclass of it (default %(default)s)")
    g.add_argument("--weight-transfer", choices=("nccl", "ipc"), default=d["weight_transfer"],
                   help="CUDA only: the weight-transfer backend vLLM starts with. nccl: "
                   "collective updates from rlfabric.integrations.vllm_sync.VllmNcclSync "
                   "(trainer on its own GPU). ipc: for a trainer on this host's GPUs "
                   "(colocated): cuda_ipc pushes, and shm/filesystem/nats pushes staged to the "
                   "GPU, enter vLLM through its "
                   "own IPC backend, device to device (default %(default)s)")


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _null(model: str, **options: Any) -> Engine:
    from rlfabric.engines.null import NullEngine

    return NullEngine(model, **options)


TORCH = register(EngineKind(
    name="torch", help="the reference engine", factory=_torch, add_options=_torch_options,
    options=lambda a: {"device": a.device, "dtype": _torch_dtype(a.dtype),
                       "max_batch": a.max_batch,
                       "max_adapters": _or(a.max_adapters, MAX_ADAPTERS),
                       "adapter_versions": a.adapter_versions}, torch_threads=True,
    up_worker_args=("--threads", "1"), prepare=_torch_prepare))
VLLM = register(EngineKind(
    name="vllm", help="vLLM's AsyncLLM (needs vLLM, see the README)", factory=_vllm,
    add_options=_vllm_options,
    options=lambda a: {"options": VllmOptions(
        max_model_len=a.max_model_len, kv_cache_gib=a.kv_cache_gib, dtype=a.dtype,
        block_size=a.block_size, threads_bind=a.threads_bind, in_process=a.in_process,
        max_num_seqs=a.max_batch,
        max_adapters=_or(a.max_adapters, 0), adapter_versions=a.adapter_versions,
        max_lora_rank=a.max_lora_rank, worker_extension=a.worker_extension,
        weight_transfer=a.weight_transfer)},
    # vLLM's CPU build takes 64-wide heads only
    default_model="tiny64", up_worker_args=("--kv-cache-gib", "1")))
def _null_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("null engine")
    g.add_argument("--token-s", type=float, default=0.0, metavar="S",
                   help="seconds of wall time a request takes per max token, sleeping, not "
                   "computing: a device's decode time without the CPU, for benchmarks of "
                   "scheduling on machines without one (default 0: at once)")


NULL = register(EngineKind(
    name="null", help="echoes prompts (benchmarks)", factory=_null, trains=False,
    add_options=_null_options, options=lambda a: {"token_s": a.token_s},
    torch_threads=False))
