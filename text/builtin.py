"""Tokenizer files of the built-in models that have a tokenizer (`tinyqwen`, `tinychat`), written
once under the user's cache; the checkpoint of such a model carries the same files."""

from __future__ import annotations

import os

from rlfabric.schemas.models import BUILTIN, ModelSpec


def cache_dir(*parts: str) -> str:
    """Where rlfabric writes what no one named a path for: `$XDG_CACHE_HOME/rlfabric` (by
    default `~/.cache/rlfabric`): checkpoints, tokenizers, runs, keys and certificates. Never
    the working directory."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(cache, "rlfabric", *parts)


def runs_dir() -> str:
    """The runs' folder (`rlfabric up`, examples/trl_grpo.py), a folder per run under it."""
    return cache_dir("runs")


def tokenizer_dir(model: str) -> str:
    """The directory of a built-in model's tokenizer files (written on first use, then cached);
    ValueError for a name that is neither a built-in model with a tokenizer nor a directory."""
    spec = BUILTIN.get(model)
    if spec is None or not spec.tokenizer:
        with_tok = [n for n, s in BUILTIN.items() if s.tokenizer]
        raise ValueError(f"model {model!r} is neither a checkpoint directory nor a built-in "
                         f"model with a tokenizer ({', '.join(with_tok)})")
    return write_tokenizer_files(spec, cache_dir("tokenizers", spec.name))


def write_tokenizer_files(spec: ModelSpec, directory: str) -> str:
    """Write `spec`'s tokenizer and chat template into `directory` (kept if already there)."""
    from rlfabric.text.templates import TEMPLATES

    if spec.tokenizer == "qwen2.5":
        from rlfabric.text.qwen import write_tokenizer
    elif spec.tokenizer == "bytes-chat":
        from rlfabric.text.bytechat import write_tokenizer
    else:
        raise ValueError(f"model {spec.name!r} has no tokenizer to write ({spec.tokenizer!r})")
    return write_tokenizer(directory, chat_template=TEMPLATES[spec.chat_template],
                           model_max_length=spec.max_position_embeddings)
