"""Model specs both sides build from: a worker's `--model tiny` and the trainer's
`build_model("tiny")` are the same architecture, defined once here.

`tiny` is a small random-init Llama with a byte-level vocabulary: ids 0-255 are bytes, then
BOS, EOS and PAD. Its initial weights are fixed by `seed`, but nothing relies on that: the
trainer pushes its weights as version 0 before the first rollout.
"""

from __future__ import annotations

import os
from typing import Any

from rlfabric.schemas._base import Message


class ModelSpec(Message, kw_only=True):
    name: str
    arch: str = "llama"
    vocab_size: int = 259
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    bos_token_id: int = 256
    eos_token_id: int = 257
    pad_token_id: int = 258
    seed: int = 0

    def hf_config(self) -> dict[str, Any]:
        """Keyword arguments for `transformers.LlamaConfig`."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": False,
        }


TINY = ModelSpec(name="tiny")
BUILTIN: dict[str, ModelSpec] = {"tiny": TINY}


def byte_tokens(text: str | bytes, *, bos: bool = True) -> list[int]:
    """Token ids of `text` in the tiny model's byte-level vocabulary."""
    data = text.encode() if isinstance(text, str) else text
    return ([TINY.bos_token_id] if bos else []) + list(data)


def build_model(name_or_path: str, *, dtype: Any = None, device: Any = None) -> Any:
    """The torch module for a built-in spec name (`"tiny"`) or a local Hugging Face checkpoint
    directory, in eval mode. Needs `transformers` (installed with rlfabric)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    dtype = dtype or torch.float32
    if name_or_path in BUILTIN:
        spec = BUILTIN[name_or_path]
        # NOTE: eager attention: bit-stable logprobs between batched decoding with a KV cache
        # and the trainer's one-pass recompute, which the weight-sync check relies on.
        cfg = LlamaConfig(**spec.hf_config(), attn_implementation="eager")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            model = LlamaForCausalLM(cfg)
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
