"""What a chat or completion request must be before anything is sampled: the model (or LoRA
adapter) served, fields the workers support and in range, and sampling that fits the model's
context. Each failure is the `APIError` OpenAI's API answers with (400, 404, 413)."""

from __future__ import annotations

from typing import Any

from rlfabric.bus import MembershipWatcher
from rlfabric.gateway.api import ChatRequest, CompletionRequest, NamedToolChoice
from rlfabric.gateway.config import GatewayConfig
from rlfabric.gateway.errors import APIError, bad_request, unsupported
from rlfabric.schemas import ErrorCode, SamplingParams, job_of_key
from rlfabric.schemas.validation import MAX_LOGPROBS, MAX_SAMPLES
from rlfabric.text import PARSERS, ChatFormat, ToolFormat

#: stop strings a request may give
MAX_STOPS = 16
_SEED_MOD = 1 << 63


class RequestChecks:
    def __init__(self, fmt: ChatFormat, config: GatewayConfig,
                 watcher: MembershipWatcher) -> None:
        self.fmt = fmt
        self.config = config
        self.watcher = watcher
        self.context_len = config.max_model_len or fmt.context_len
        if config.tool_parser not in PARSERS:
            raise ValueError(f"--tool-call-parser {config.tool_parser!r}: use one of "
                             f"{', '.join(PARSERS)}")
        self.tools: ToolFormat = PARSERS[config.tool_parser]

    def adapters(self, job: str = "") -> list[str]:
        """The adapters a worker holds, as job `job` names them (its own only)."""
        held = {n for m in self.watcher.members.values() for n in m.adapters}
        if job:
            mine = {n[len(job) + 1:] for n in held if job_of_key(n) == job}
        else:
            mine = {n for n in held if not job_of_key(n)}
        return sorted(mine - {self.config.name})


    def adapter_of(self, model: str, job: str = "") -> str:
        """The adapter `model` names ("" for the base model) within job `job`, or 404."""
        if model == self.config.name:
            return ""
        if model in self.adapters(job):
            return model
        served = ", ".join(repr(n) for n in [self.config.name, *self.adapters(job)])
        raise APIError(404, f"model {model!r} is not served here; this gateway serves "
                       f"{served} (GET /v1/models)", param="model",
                       code=ErrorCode.MODEL_NOT_FOUND)

    def budget(self, asked: list[int]) -> None:
        """A request of several prompts, each asking `asked[i]` tokens (n x max_tokens): their
        sum within the per-request budget (each one's was checked by `sampling`)."""
        total = sum(asked)
        if len(asked) > 1 and total > self.config.max_request_tokens:
            raise bad_request(f"{len(asked)} prompts x n x max_tokens = {total} tokens: this "
                              f"gateway samples at most {self.config.max_request_tokens} per "
                              "request over all its prompts (rlfabric gateway "
                              "--max-request-tokens): send fewer prompts a request", "prompt",
                              ErrorCode.REQUEST_TOO_LARGE)

    def sampling(self, *, n: int, temperature: float | None, top_p: float | None,
                  top_k: int | None, max_tokens: int | None, seed: int | None,
                  stop: str | list[str] | None, stop_ids: list[int] | None, logprobs: int,
                  prompt_len: int, max_param: str) -> tuple[SamplingParams, tuple[str, ...]]:
        limit = min(MAX_SAMPLES, self.config.max_n)
        if not 1 <= n <= limit:
            raise bad_request(f"n={n}: needs 1 to {limit} (rlfabric gateway --max-n)", "n")
        if max_tokens is not None and max_tokens < 1:
            raise bad_request(f"{max_param}={max_tokens}: needs at least 1", max_param)
        room = self.context_len - prompt_len
        if room < 1:
            raise APIError(413, f"the prompt has {prompt_len} tokens; the model's context is "
                           f"{self.context_len}: no room for a completion", param="messages",
                           code=ErrorCode.CONTEXT_LENGTH_EXCEEDED)
        if max_tokens is not None and max_tokens > room:
            raise bad_request(f"{max_param}={max_tokens} is more than the context leaves: the "
                              f"model's context is {self.context_len} tokens and the prompt "
                              f"has {prompt_len} ({max_tokens} > {self.context_len} - "
                              f"{prompt_len})", max_param, ErrorCode.CONTEXT_LENGTH_EXCEEDED)
        max_tokens = max_tokens or min(self.config.default_max_tokens, room)
        if n * max_tokens > self.config.max_request_tokens:
            raise bad_request(f"n x {max_param} = {n} x {max_tokens} = {n * max_tokens} tokens: "
                              f"this gateway samples at most {self.config.max_request_tokens} "
                              "per request (rlfabric gateway --max-request-tokens)", max_param,
                              ErrorCode.REQUEST_TOO_LARGE)
        t = 1.0 if temperature is None else temperature
        if not 0.0 <= t <= 2.0:
            raise bad_request(f"temperature={temperature}: needs 0 to 2", "temperature")
        p = 1.0 if top_p is None else top_p
        if not 0.0 < p <= 1.0:
            raise bad_request(f"top_p={top_p}: needs 0 < top_p <= 1", "top_p")
        k = 0 if top_k is None or top_k == -1 else top_k
        if k < 0:
            raise bad_request(f"top_k={top_k}: needs -1, 0 or more", "top_k")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise bad_request(f"stop: at most {MAX_STOPS} non-empty strings", "stop")
        ids = set(self.fmt.stop_token_ids) | set(stop_ids or ())
        for s in stops:  # a stop string that is one token stops the engine at once
            one = self.fmt.encode(s)
            if len(one) == 1:
                ids.add(one[0])
        vocab = self.fmt.vocab_size
        if any(not 0 <= i < max(vocab, 1 << 31) for i in ids):
            raise bad_request("stop_token_ids must be token ids", "stop_token_ids")
        sp = SamplingParams(max_tokens=max_tokens, temperature=t, top_p=p,
                            top_k=k, stop_token_ids=tuple(sorted(ids)),
                            seed=None if seed is None else seed % _SEED_MOD, n=n,
                            logprobs=logprobs)
        return sp, stops

    def _refuse_unsupported(self, req: ChatRequest | CompletionRequest) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name):
                raise unsupported(name, "the workers sample without penalties; leave it 0")
        if req.logit_bias:
            raise unsupported("logit_bias", "the workers take no logit bias")


    def chat(self, req: ChatRequest, job: str = "") -> str:
        """The adapter the request's `model` names ("": the base), once every field checks."""
        adapter = self.adapter_of(req.model, job)
        self._refuse_unsupported(req)
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise unsupported("response_format", "structured output needs constrained "
                              "sampling, which the workers do not do")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs={req.top_logprobs}: needs 0 to {MAX_LOGPROBS}",
                              "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options needs stream: true", "stream_options")
        return adapter

    def forced_call(self, choice: Any, tools: list[dict[str, Any]] | None) -> str | None:
        """The text that opens a forced tool call (tool_choice required or named), if any."""
        if isinstance(choice, NamedToolChoice):
            names = {t["function"]["name"] for t in tools or ()}
            if choice.function.name not in names:
                raise bad_request(f"tool_choice names {choice.function.name!r}, which is not "
                                  "among tools", "tool_choice")
            return self.tools.prefill(choice.function.name)
        if choice not in (None, "auto", "none", "required"):
            raise bad_request(f"tool_choice {choice!r}: use auto, none, required or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                              "tool_choice")
        if choice == "required":
            if not tools:
                raise bad_request("tool_choice required needs tools", "tool_choice")
            return self.tools.prefill(None)
        return None

    def completion(self, req: CompletionRequest, job: str = "") -> str:
        """The adapter the request's `model` names ("": the base), once every field checks
        (the sampling fields: `sampling`, per prompt)."""
        adapter = self.adapter_of(req.model, job)
        self._refuse_unsupported(req)
        if req.echo:
            raise unsupported("echo", "the prompt is returned as prompt_token_ids")
        if req.suffix:
            raise unsupported("suffix", "no fill-in-the-middle")
        if req.best_of not in (None, 1):
            raise unsupported("best_of", "use n")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs={req.logprobs}: needs 0 to {MAX_LOGPROBS}",
                              "logprobs")
        if req.stream:
            raise unsupported("stream", "streamed completions are served on "
                              "/v1/chat/completions only")
        return adapter
