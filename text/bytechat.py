"""The tokenizer of `tinychat`: the byte-level vocabulary of `tiny` (ids 0-255 are bytes) and
the special tokens of a chat (`SPECIALS`, ids 256 on): ChatML's turn markers and a one-token
tool call, so a model small enough to train here in minutes can call a tool by sampling one
token (`rlfabric.text.tools`, format `tinychat`)."""

from __future__ import annotations

import json
import os

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from rlfabric.text.chat import _byte_decoder

#: the special tokens, in id order from 256
SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<tool_call>")


def write_tokenizer(directory: str, *, chat_template: str, model_max_length: int) -> str:
    """Write `tokenizer.json` and `tokenizer_config.json` (with `chat_template`) into
    `directory`; returns it."""
    tok = Tokenizer(models.BPE(vocab=dict(_byte_decoder()), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>",
              "eos_token": "<|im_end|>", "pad_token": "<|pad|>",
              "model_max_length": model_max_length, "clean_up_tokenization_spaces": False,
              "chat_template": chat_template}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return directory
