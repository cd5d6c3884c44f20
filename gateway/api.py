"""The OpenAI API as the gateway reads and writes it: msgspec Structs for `/v1/chat/completions`
and `/v1/completions`, requests and responses, streamed chunks included.

Unknown request fields are ignored (clients send what their version knows); a field of the
wrong type is a 400 naming it. rlfabric's own fields: per choice `token_ids` (the sampled
completion ids) and `weight_versions` (`{version, start, end}` over them), at the top level
`prompt_token_ids` and `session_id`.
"""

from __future__ import annotations

from typing import Any

import msgspec


class _In(msgspec.Struct, kw_only=True):
    """A request body part: unknown fields are ignored."""


class _Out(msgspec.Struct, kw_only=True):
    """A response part: every field is written, None as null (as OpenAI and vLLM do)."""


# ---- requests ----
class FunctionCall(_In, kw_only=True):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_In, kw_only=True):
    function: FunctionCall
    id: str = ""
    type: str = "function"


class ContentPart(_In, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(_In, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(_In, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_In, kw_only=True):
    function: FunctionDef
    type: str = "function"


class NamedFunction(_In, kw_only=True):
    name: str


class NamedToolChoice(_In, kw_only=True):
    function: NamedFunction
    type: str = "function"


class StreamOptions(_In, kw_only=True):
    include_usage: bool = False


class _Sampling(_In, kw_only=True):
    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class ChatRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    #: as sent: a template renders the agent's own JSON (field order included); checked
    #: against `Tool` by the gateway
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    #: text, token ids, or a list of either (checked by the gateway: msgspec takes one
    #: list type per union)
    prompt: str | list[Any]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


# ---- responses ----
class FunctionOut(_Out, kw_only=True):
    name: str
    arguments: str


class ToolCallOut(_Out, kw_only=True):
    id: str
    function: FunctionOut
    type: str = "function"


class MessageOut(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class TopLogprob(_Out, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(_Out, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(_Out, kw_only=True):
    content: list[TokenLogprob]


class WeightVersion(_Out, kw_only=True):
    version: int
    start: int
    end: int
    #: the policy's full name (run, version, digest: `rlfabric.schemas.policy`)
    policy: str = ""


class ChatChoice(_Out, kw_only=True):
    index: int
    message: MessageOut
    finish_reason: str
    token_ids: list[int]
    weight_versions: list[WeightVersion]
    logprobs: ChoiceLogprobs | None = None
    worker_id: str = ""  # the worker that sampled it (sessions stick to one: affinity)


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(_Out, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int]
    session_id: str
    object: str = "chat.completion"


class ToolCallDelta(_Out, kw_only=True):
    index: int
    id: str
    function: FunctionOut
    type: str = "function"


class Delta(_Out, kw_only=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(_Out, kw_only=True):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = None
    weight_versions: list[WeightVersion] | None = None


class ChatChunk(_Out, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
    session_id: str | None = None
    object: str = "chat.completion.chunk"


class CompletionLogprobs(_Out, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = []


class CompletionChoice(_Out, kw_only=True):
    index: int
    text: str
    finish_reason: str | None
    token_ids: list[int]
    weight_versions: list[WeightVersion]
    logprobs: CompletionLogprobs | None = None


class Completion(_Out, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
    session_id: str | None = None
    object: str = "text_completion"


class ModelCard(_Out, kw_only=True):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "rlfabric"
    #: a LoRA adapter's base model (None: a base model), as vLLM lists adapters
    parent: str | None = None


class ModelList(_Out, kw_only=True):
    data: list[ModelCard]
    object: str = "list"
