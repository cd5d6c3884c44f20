"""What a vLLM worker reads from its checkpoint directory once: its end tokens, vocabulary,
tensor shapes (a pushed payload is checked against them) and weights checksum (what a fleet
serves as version 0)."""

from __future__ import annotations

import os
from typing import Any


def config(model: str) -> dict[str, Any]:
    import json

    with open(os.path.join(model, "config.json")) as f:
        cfg: dict[str, Any] = json.load(f)
    return cfg


def eos_ids(model: str) -> frozenset[int]:
    from rlfabric.text.ends import end_token_ids

    return end_token_ids(model)


def vocab_size(model: str) -> int:
    return int(config(model)["vocab_size"])


def shapes(model: str) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for name in sorted(os.listdir(model)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model, name), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118  (a safetensors handle, not a dict)
                    shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def checksum(model: str) -> str:
    from safetensors.torch import load_file

    from rlfabric.tensors.checksums import checksum

    state: dict[str, Any] = {}
    for name in sorted(os.listdir(model)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(model, name)))
    return checksum(state)
