"""The vLLM engine (`VllmEngine`, on `AsyncLLM`) and the worker extension vLLM loads in its
worker process. Needs vLLM: `pip install 'rlfabric[vllm]'` on CUDA, or the CPU build (README,
"vLLM")."""

try:
    import vllm  # noqa: F401  (fail here, with the way to install it)
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        f"--engine vllm needs vLLM ({exc}): on a CUDA machine `pip install 'rlfabric[vllm]'`; "
        "on a CPU machine install its CPU build as the README's vLLM section shows") from exc

from rlfabric.engines.kinds import VllmOptions
from rlfabric.engines.vllm.engine import VllmEngine

__all__ = ["VllmEngine", "VllmOptions"]
