"""`ChatFormat`: a model's tokenizer and chat template, read from a Hugging Face checkpoint
directory (`tokenizer.json`, `tokenizer_config.json` or `chat_template.jinja`,
`generation_config.json`, `config.json`) or built for a built-in model name.

Templates render as Hugging Face renders them (a sandboxed Jinja environment with
`trim_blocks`, `lstrip_blocks`, loop controls, its `tojson`, `raise_exception` and
`strftime_now`), so a checkpoint's own template gives the text its model was trained on. Text
is encoded with no special tokens added (a template writes its own) and decoded with special
tokens kept, so `decode(encode(text)) == text` for a byte-level BPE.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from rlfabric.schemas import RLFabricError
from rlfabric.text.ends import end_token_ids


class ChatFormatError(RLFabricError):
    """Raised when a model's tokenizer or chat template cannot be loaded, or the template
    refuses a conversation (its `raise_exception`); the message names the file or the
    template's words."""


@dataclass(eq=False)
class ChatFormat:
    tokenizer: Tokenizer
    template: str
    #: token ids that end an assistant turn (the template's end-of-turn and the model's EOS)
    stop_token_ids: frozenset[int]
    #: the longest sequence the model takes (prompt + completion)
    context_len: int
    name: str = ""
    special: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token for templates

    @functools.cached_property
    def _compiled(self) -> jinja2.Template:
        try:
            return _environment().from_string(self.template)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatFormatError(f"chat template of {self.name}: line {exc.lineno}: "
                                  f"{exc.message}") from None

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The template's text for `messages` (dicts with `role`, `content`, ...)."""
        try:
            return self._compiled.render(messages=list(messages), tools=list(tools or ()) or None,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.special, **kwargs)
        except TemplateRefused as exc:
            raise ChatFormatError(f"the chat template of {self.name} refused the "
                                  f"conversation: {exc}") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            raise ChatFormatError(f"the chat template of {self.name} failed on this "
                                  f"conversation: {type(exc).__name__}: {exc}") from None

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level token may hold part of a character)."""
        return _token_bytes(self.tokenizer, token_id)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))


class TemplateRefused(Exception):
    """A template's own `raise_exception(...)`."""


def _raise(message: str) -> None:
    raise TemplateRefused(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.cache
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


@functools.lru_cache(maxsize=8)
def _byte_decoder() -> dict[str, int]:
    # GPT-2's byte <-> printable character map that byte-level BPE vocabularies are written in
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _token_bytes(tok: Tokenizer, token_id: int) -> bytes:
    piece = tok.id_to_token(token_id)
    if piece is None:
        return b""
    dec = _byte_decoder()
    if all(ch in dec for ch in piece) and tok.token_to_id(piece) == token_id and \
            not _is_added(tok, token_id):
        return bytes(dec[ch] for ch in piece)
    return str(tok.decode([token_id], skip_special_tokens=False)).encode()


def _is_added(tok: Tokenizer, token_id: int) -> bool:
    return token_id in tok.get_added_tokens_decoder()


# ---- loading ----
def load_chat_format(model: str, *, template: str | None = None) -> ChatFormat:
    """The chat format of a built-in model name (`tinyqwen`) or a checkpoint directory;
    `template` (a file path, or a built-in template name such as `chatml-think`) replaces the
    checkpoint's own."""
    from rlfabric.text.builtin import tokenizer_dir

    directory = tokenizer_dir(model) if not os.path.isdir(model) else model
    fmt = _load_dir(directory, name=model)
    if template is not None:
        fmt.template = _template_text(template)
    if not fmt.template:
        raise ChatFormatError(f"{model} has no chat template (tokenizer_config.json "
                              "'chat_template' or chat_template.jinja): pass one with "
                              "--chat-template")
    return fmt


def _template_text(template: str) -> str:
    from rlfabric.text.templates import TEMPLATES

    if template in TEMPLATES:
        return TEMPLATES[template]
    try:
        with open(template, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ChatFormatError(f"chat template {template!r} is neither a file nor one of "
                              f"{', '.join(TEMPLATES)}: {exc}") from None


def _read_json(directory: str, name: str) -> dict[str, Any]:
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ChatFormatError(f"{path} is unreadable: {exc}") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...}
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def _load_dir(directory: str, *, name: str) -> ChatFormat:
    path = os.path.join(directory, "tokenizer.json")
    try:
        tok = Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises its own Exception subclass
        raise ChatFormatError(f"{name}: no usable tokenizer.json in {directory} ({exc}); a "
                              "gateway needs the model's fast tokenizer") from None
    cfg = _read_json(directory, "tokenizer_config.json")
    template = cfg.get("chat_template") or ""
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), "")
    jinja_file = os.path.join(directory, "chat_template.jinja")
    if not template and os.path.exists(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    model_cfg = _read_json(directory, "config.json")
    _read_json(directory, "generation_config.json")  # unreadable: said, not skipped
    stops = end_token_ids(directory, tok)
    eos_text = _token_text(cfg.get("eos_token"))
    context = int(model_cfg.get("max_position_embeddings") or cfg.get("model_max_length")
                  or 2048)
    context = min(context, int(cfg.get("model_max_length") or context))
    special = {"bos_token": _token_text(cfg.get("bos_token")), "eos_token": eos_text}
    return ChatFormat(tokenizer=tok, template=str(template), stop_token_ids=stops,
                      context_len=context, name=name, special=special)
