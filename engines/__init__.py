"""Inference engines and the worker runtime that puts one on the bus."""

from rlfabric.engines.protocol import Engine, PauseMode, RequestRejected, WeightLoadError


def make_engine(kind: str, model: str, **kwargs):
    """An engine by name: "torch" (the reference engine), "null" (echo, for benchmarks)."""
    if kind == "torch":
        from rlfabric.engines.torch_engine import TorchEngine

        return TorchEngine(model, **kwargs)
    if kind == "null":
        from rlfabric.engines.null_engine import NullEngine

        return NullEngine(model)
    if kind == "vllm":
        raise RequestRejected("unsupported", "the vLLM adapter is not built yet")
    raise ValueError(f"unknown engine {kind!r}: use --engine torch or --engine null")


__all__ = ["Engine", "PauseMode", "RequestRejected", "WeightLoadError", "make_engine"]
