"""A chat request's messages as the template and the session see them: checked (roles, tool
results answering calls), normalized (content parts joined, `developer` as `system`, tool-call
arguments as objects) and digested (what the next turn of a session must start with, and which
returned choice an assistant message is)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import msgspec

from rlfabric.gateway.api import ChatMessage, ToolCall
from rlfabric.gateway.errors import bad_request, unsupported
from rlfabric.schemas import ErrorCode

ROLES = ("system", "user", "assistant", "tool")
#: roles read as another one (OpenAI's newer name for the system role)
ALIASES = {"developer": "system"}


@dataclass(frozen=True, slots=True)
class Conversation:
    #: the messages as dicts for the chat template (role, content, tool_calls, ...)
    messages: list[dict[str, Any]]
    #: a digest per message: equal messages, equal digests, whatever the agent's formatting
    digests: tuple[str, ...]


def digest(value: Any) -> str:
    return hashlib.blake2b(msgspec.json.encode(value, order="sorted"), digest_size=12).hexdigest()


def _text(content: str | list[Any] | None, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise unsupported(f"{where}.content[{i}]", f"a {part.type!r} part; the gateway "
                              "serves text models: send text parts only")
        parts.append(part.text)
    return "".join(parts)


def _arguments(call: ToolCall, where: str) -> Any:
    args = call.function.arguments
    if isinstance(args, dict):
        return args
    try:
        return json.loads(args) if args.strip() else {}
    except ValueError:
        return args  # kept as text: the template renders what the agent sent


def assistant_digest(content: str | None, calls: list[tuple[str, Any]]) -> str:
    """The digest that identifies an assistant message: its text and its calls (names and
    arguments as JSON values; call ids and JSON spacing do not count)."""
    return digest(["assistant", content or "", [[n, a] for n, a in calls]])


def read(messages: list[ChatMessage]) -> Conversation:
    """Check and normalize a request's messages; `APIError` (400) naming the first bad one."""
    if not messages:
        raise bad_request("messages must hold at least one message", "messages")
    out: list[dict[str, Any]] = []
    digests: list[str] = []
    open_calls: set[str] | None = None  # ids of the last assistant message's calls
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = ALIASES.get(m.role, m.role)
        if role not in ROLES:
            raise bad_request(f"{where}.role {m.role!r} is not one of "
                              f"{', '.join((*ROLES, *ALIASES))}", f"{where}.role")
        text = _text(m.content, where)
        msg: dict[str, Any] = {"role": role, "content": text}
        if role == "assistant" and m.tool_calls:
            calls: list[dict[str, Any]] = []
            for j, c in enumerate(m.tool_calls):
                args = _arguments(c, f"{where}.tool_calls[{j}]")
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            msg["tool_calls"] = calls
            open_calls = {c.id for c in m.tool_calls}
            digests.append(assistant_digest(text, [(c["function"]["name"],
                                                     c["function"]["arguments"])
                                                    for c in calls]))
        elif role == "assistant":
            open_calls = None
            digests.append(assistant_digest(text, []))
        elif role == "tool":
            if open_calls is None:
                raise bad_request(f"{where} is a tool result, but no assistant message with "
                                  "tool_calls comes before it", where,
                                  ErrorCode.TOOL_RESULT_WITHOUT_CALL)
            if m.tool_call_id and open_calls and "" not in open_calls and \
                    m.tool_call_id not in open_calls:
                raise bad_request(f"{where}.tool_call_id {m.tool_call_id!r} answers none of "
                                  f"the calls before it ({', '.join(sorted(open_calls))})",
                                  f"{where}.tool_call_id", ErrorCode.TOOL_RESULT_WITHOUT_CALL)
            msg["tool_call_id"] = m.tool_call_id or ""
            digests.append(digest(["tool", text, m.tool_call_id or ""]))
        else:
            open_calls = None
            if m.name:
                msg["name"] = m.name
            digests.append(digest([role, text, m.name or ""]))
        out.append(msg)
    return Conversation(messages=out, digests=tuple(digests))
