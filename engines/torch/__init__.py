"""The torch reference engine, split the way nano-vllm splits its engine: `sequence` (one
sample), `sampling` (one decode step's tokens), `scheduler` (what runs next), `model_runner`
(the module and the decode loop in a worker thread), `engine` (the `Engine` the worker
drives)."""

from rlfabric.engines.torch.engine import TorchEngine

__all__ = ["TorchEngine"]
