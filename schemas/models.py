"""Model specs both sides build from: a worker's `--model tiny` and the trainer's
`build_model("tiny")` (`rlfabric.tensors.models`) are the same architecture, defined once here.

`tiny` is a small random-init Llama with a byte-level vocabulary: ids 0-255 are bytes, then
BOS, EOS and PAD; `tiny64` is the same with attention heads vLLM's CPU build accepts; `small64`
the same vocabulary in a larger body, for benchmarks where prefill must cost.
`tinyqwen` is a random-init two-layer Qwen2 with the real Qwen2.5 tokenizer (its full
151,936-row vocabulary, 64-wide heads) and a ChatML chat template with Qwen's tool calls: the
model the gateway serves agents with. Initial weights are fixed by `seed`, so a worker's
`--model tinyqwen` and the trainer's `build_model("tinyqwen")` start from the same weights.
"""

from __future__ import annotations

from typing import Any

import msgspec

from rlfabric.schemas._base import Message


class ModelSpec(Message, frozen=True, kw_only=True):
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
    #: "" = the byte-level ids above; "qwen2.5" = the real Qwen2.5 BPE (`rlfabric.text`)
    tokenizer: str = ""
    #: the chat template of a model with a tokenizer (`rlfabric.text.templates.TEMPLATES`)
    chat_template: str = ""
    #: the output head's initial weights times this: a head at the usual init (std 0.02) over
    #: RMS-normed hidden states keeps every logit within about +-2.6 of the others, so only
    #: training the head itself (not an adapter on the blocks) can make one token likely
    head_scale: float = 1.0

    def hf_config(self) -> dict[str, Any]:
        """Keyword arguments for the `transformers` config of `arch` (LlamaConfig, Qwen2Config)."""
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
#: the same vocabulary with 64-wide attention heads: vLLM's CPU attention rejects 16-wide ones
TINY64 = ModelSpec(name="tiny64", hidden_size=128, intermediate_size=256, num_attention_heads=2,
                   num_key_value_heads=1)
#: ids of `<|endoftext|>` and `<|im_end|>` in the Qwen2.5 vocabulary (`rlfabric.text.qwen`)
TINYQWEN = ModelSpec(name="tinyqwen", arch="qwen2", vocab_size=151936, hidden_size=128,
                     intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                     max_position_embeddings=4096, bos_token_id=151643, eos_token_id=151645,
                     pad_token_id=151643, tokenizer="qwen2.5", chat_template="chatml-tools")
#: the byte vocabulary in a body about 75x tiny64's (9.4M parameters, 6 layers): a 1,000-token
#: prefill costs what a prefix cache saves (`rlfabric bench agent`)
SMALL64 = ModelSpec(name="small64", hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                    num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4096)
#: the byte vocabulary with a chat's special tokens (`rlfabric.text.bytechat`: ids 256-261, the
#: last a one-token tool call), 64-wide heads: the policy `rlfabric up --task tools` trains
TINYCHAT = ModelSpec(name="tinychat", vocab_size=262, hidden_size=128, intermediate_size=256,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                     eos_token_id=260, tokenizer="bytes-chat", chat_template="tinychat")
#: tinychat with its head 4x as wide at init, as a trained model's head spreads its logits: a
#: LoRA adapter on the blocks alone can learn a task on it (`examples/trl_grpo.py --jobs`)
TINYLORA = msgspec.structs.replace(TINYCHAT, name="tinylora", head_scale=4.0)
#: Qwen2.5-0.5B's shape with an untied head (630M parameters, 2,404 MiB in fp32), random
#: weights: what `rlfabric bench weights --device cuda` pushes
QWEN05B = ModelSpec(name="qwen05b", arch="qwen2", vocab_size=151936, hidden_size=896,
                    intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=151643,
                    eos_token_id=151645, pad_token_id=151643, tokenizer="qwen2.5",
                    chat_template="chatml-tools")
BUILTIN: dict[str, ModelSpec] = {s.name: s for s in (TINY, TINY64, TINYQWEN, SMALL64,
                                                     TINYCHAT, TINYLORA, QWEN05B)}


def byte_tokens(text: str | bytes, *, bos: bool = True) -> list[int]:
    """Token ids of `text` in the tiny model's byte-level vocabulary."""
    data = text.encode() if isinstance(text, str) else text
    return ([TINY.bos_token_id] if bos else []) + list(data)
