"""The torch module a model name stands for: a built-in spec (`tiny`) or a local Hugging Face
checkpoint directory. A worker's `--model NAME` and the trainer's `build_model(NAME)` build the
same architecture."""

from __future__ import annotations

import os
from typing import Any

import msgspec
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlfabric.schemas.models import BUILTIN


def build_model(name_or_path: str, *, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None) -> Any:
    """The torch module for a built-in spec name (`"tiny"`) or a local Hugging Face checkpoint
    directory, in eval mode."""
    dtype = dtype or torch.float32
    if name_or_path in BUILTIN:
        spec = BUILTIN[name_or_path]
        # NOTE: eager attention: bit-stable logprobs between batched decoding with a KV cache
        # and the trainer's one-pass recompute, which the weight-sync check relies on.
        cfg = AutoConfig.for_model(spec.arch, **spec.hf_config(), attn_implementation="eager")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            model: Any = AutoModelForCausalLM.from_config(cfg)
        if spec.head_scale != 1.0:
            with torch.no_grad():
                model.get_output_embeddings().weight.mul_(spec.head_scale)
        model = model.to(dtype=dtype)
    elif os.path.isdir(name_or_path):
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype,
                                                     attn_implementation="eager")
    else:
        raise ValueError(
            f"model {name_or_path!r} is neither a built-in spec ({', '.join(BUILTIN)}) nor a "
            "local checkpoint directory; pass --model tiny or a path with config.json"
        )
    if device is not None:
        model = model.to(device)
    return model.eval()


def write_checkpoint(name: str, path: str) -> str:
    """Write a built-in spec's model (its seeded initial weights, fp32) as a local Hugging Face
    checkpoint directory at `path`, the form engines such as vLLM load, with its tokenizer files
    and chat template if it has a tokenizer; returns `path`. Rewriting an existing checkpoint of
    the same spec leaves it as it is."""
    if name not in BUILTIN:
        raise ValueError(f"no built-in spec {name!r}: use one of {', '.join(BUILTIN)}")
    spec = BUILTIN[name]
    marker = os.path.join(path, "rlfabric-spec.json")
    spec_json = msgspec.json.encode(spec).decode()
    if os.path.exists(marker):
        with open(marker) as f:
            if f.read() == spec_json:
                return path
    os.makedirs(path, exist_ok=True)
    model = build_model(name)
    model.generation_config.eos_token_id = spec.eos_token_id
    model.save_pretrained(path)
    if spec.tokenizer:
        from rlfabric.text.builtin import write_tokenizer_files

        write_tokenizer_files(spec, path)
    # NOTE: the marker last: a checkpoint interrupted while written is written again
    with open(marker, "w") as f:
        f.write(spec_json)
    return path
