"""How a vLLM engine starts: `AsyncEngineArgs` from the worker's `VllmOptions`, the
environment vLLM reads, and what the machine can give it (CPU build or CUDA, memory for the
KV cache)."""

from __future__ import annotations

import os
from typing import Any

from rlfabric.engines.errors import EngineDied
from rlfabric.engines.kinds import VllmOptions
from rlfabric.schemas import ErrorCode

GIB = 1024 ** 3


def engine_args(model: str, o: VllmOptions) -> Any:
    """vLLM's `AsyncEngineArgs` for `model`, after setting the environment it reads."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # logs go to logging, not stdout
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if o.in_process else "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(o.kv_cache_gib))))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", o.threads_bind)
    # NOTE: OpenMP threads that sleep when idle instead of spinning 200 ms: the engine
    # shares its cores with the bus, the worker and often other engines
    os.environ.setdefault("KMP_BLOCKTIME", "0")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from vllm.engine.arg_utils import AsyncEngineArgs

    # NOTE: on CPU a seeded request whose prefill is split over steps kills the engine
    # (vLLM rewinds its generator's offset, which a CPU generator has not): prefills whole
    cpu = on_cpu()
    return AsyncEngineArgs(
        enable_chunked_prefill=False if cpu else None,
        max_num_batched_tokens=max(o.max_model_len, 4096) if cpu else None,
        block_size=o.block_size or None,
        model=model, skip_tokenizer_init=True, dtype=o.dtype,
        enforce_eager=o.enforce_eager, max_model_len=o.max_model_len,
        max_num_seqs=o.max_num_seqs, logprobs_mode="raw_logprobs",
        worker_extension_cls=o.worker_extension, disable_log_stats=True,
        **lora_args(o),
        enable_sleep_mode=not cpu, **weight_transfer_args(o.weight_transfer))


IPC_CPU = (
    "--weight-transfer ipc maps CUDA memory through vLLM's ipc backend, which needs vLLM's "
    "CUDA build; this is the CPU build: drop --weight-transfer")


def check_machine(o: VllmOptions) -> None:
    """`EngineDied` at once where this machine cannot run vLLM as `o` asks (the memory for
    its KV cache, a CUDA build for the ipc weight transfer)."""
    check_memory(o.kv_cache_gib)
    if o.weight_transfer == "ipc" and on_cpu():
        raise EngineDied(IPC_CPU, code=ErrorCode.UNSUPPORTED)


def lora_args(o: VllmOptions) -> dict[str, Any]:
    """vLLM's LoRA support, on when the worker holds adapters: room for every version of
    every adapter at once."""
    if o.max_adapters < 1:
        return {}
    slots = o.max_adapters * o.adapter_versions
    return {"enable_lora": True, "max_loras": slots, "max_cpu_loras": slots,
            "max_lora_rank": o.max_lora_rank}


def weight_transfer_args(backend: str) -> dict[str, Any]:
    """vLLM's weight-transfer engine (`backend`: nccl or ipc), on CUDA only (the CPU build
    runs neither)."""
    if on_cpu():
        return {}
    from vllm.config.weight_transfer import WeightTransferConfig

    return {"weight_transfer_config": WeightTransferConfig(backend=backend)}


def check_memory(kv_cache_gib: float) -> None:
    """On a CPU build, refuse at once a KV cache larger than the memory available now, which
    vLLM finds only after loading the model, behind a generic error."""
    if not on_cpu():
        return
    available = mem_available()
    if available is None or kv_cache_gib * GIB <= available:
        return
    raise EngineDied(
        f"vLLM cannot get the {kv_cache_gib:g} GiB of KV cache this worker was given "
        f"(--kv-cache-gib {kv_cache_gib:g}): this machine has {available / GIB:.1f} GiB of "
        "memory available. Lower --kv-cache-gib, or run fewer engines on this machine",
        code=ErrorCode.MEMORY_UNAVAILABLE)


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo, in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())
