"""The tokens a checkpoint's completions end at: the set transformers' `generate` (and TRL
through it) stops at, from every file that names one: `config.json`'s `eos_token_id`,
`generation_config.json`'s (an id or a list: Llama 3 Instruct names two there), and the
tokenizer's own end token (`tokenizer_config.json`'s `eos_token`, looked up in
`tokenizer.json`). A checkpoint may name a different one in each; sampling stops at any."""

from __future__ import annotations

import json
import os
from typing import Any


def end_token_ids(directory: str, tokenizer: Any = None) -> frozenset[int]:
    """The end tokens of the checkpoint in `directory` (`tokenizer`: its `tokenizers`
    Tokenizer, if loaded already; else `tokenizer.json` is read for the end token's id)."""
    ends: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        value = _read(directory, name).get("eos_token_id")
        if isinstance(value, int) and not isinstance(value, bool):
            ends.add(value)
        elif isinstance(value, list):
            ends.update(int(i) for i in value)
    text = _token_text(_read(directory, "tokenizer_config.json").get("eos_token"))
    if text:
        found = _token_id(directory, text, tokenizer)
        if found is not None:
            ends.add(found)
    return frozenset(ends)


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<|eot_id|>", ...}
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def _token_id(directory: str, text: str, tokenizer: Any) -> int | None:
    if tokenizer is not None:
        got = tokenizer.token_to_id(text)
        return None if got is None else int(got)
    data = _read(directory, "tokenizer.json")
    for t in data.get("added_tokens", ()):  # special tokens: where an end token lives
        if isinstance(t, dict) and t.get("content") == text and isinstance(t.get("id"), int):
            return int(t["id"])
    vocab = data.get("model", {}).get("vocab")
    if isinstance(vocab, dict) and isinstance(vocab.get(text), int):
        return int(vocab[text])
    return None


def _read(directory: str, name: str) -> dict[str, Any]:
    try:
        with open(os.path.join(directory, name), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
