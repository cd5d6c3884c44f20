"""Tool calls in a model's output, in the format its chat template teaches.

`qwen` (vLLM calls it `hermes`): one `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
block per call; the content is the text before the first block. An output whose blocks do not
all parse (a truncated or malformed call) has no calls: it is all content, as vLLM reads it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_OPEN = "<tool_call>"


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    #: the arguments as a JSON object's text (what OpenAI's `function.arguments` holds)
    arguments: str


def parse_qwen(text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of an assistant output; content None when there is none."""
    start = text.find(_OPEN)
    if start < 0:
        return (text or None), []
    calls: list[ParsedCall] = []
    for body in _BLOCK.findall(text):
        call = _one(body)
        if call is None:
            return (text or None), []
        calls.append(call)
    if not calls:  # an opening tag that never closed
        return (text or None), []
    content = text[:start].rstrip()
    return (content or None), calls


def _one(body: str) -> ParsedCall | None:
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


_TOKEN = "<tool_call>"


def parse_token(text: str) -> tuple[str | None, list[ParsedCall]]:
    """`tinychat`'s calls: each `<tool_call>` token calls the request's one tool, with no
    arguments (the name is left empty for the gateway to fill: `OutputRules.only_tool`)."""
    start = text.find(_TOKEN)
    if start < 0:
        return (text or None), []
    content = text[:start].rstrip()
    return (content or None), [ParsedCall(name="", arguments="{}")] * text.count(_TOKEN)


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How one family of templates writes tool calls: the parser, where a call opens in the
    text, and the opening a gateway writes (not sampled) to make the model call a tool
    (`tool_choice` "required") or a named one."""

    name: str
    parse: Callable[[str], tuple[str | None, list[ParsedCall]]]
    open: str
    opening: str
    named_opening: str

    def prefill(self, function: str | None) -> str:
        if function is None:
            return self.opening
        return self.named_opening.format(name=json.dumps(function, ensure_ascii=False)[1:-1])


QWEN = ToolFormat(name="qwen", parse=parse_qwen, open=_OPEN,
                  opening='<tool_call>\n{"name": "',
                  named_opening='<tool_call>\n{{"name": "{name}", "arguments": ')
#: tool formats by the name `rlfabric gateway --tool-call-parser` takes (vLLM's name too)
TINYCHAT = ToolFormat(name="tinychat", parse=parse_token, open=_TOKEN, opening=_TOKEN,
                      named_opening=_TOKEN)
PARSERS: dict[str, ToolFormat] = {"qwen": QWEN, "hermes": QWEN, "tinychat": TINYCHAT}
