"""The gateway's work, apart from HTTP: a chat or completion request becomes a rollout request
on the bus (its prompt from the session's exact tokens, `splice.plan`), its results become
OpenAI's response shapes (or a stream of chunks while the worker samples), and the turn's
record is stored in the session's log before the response ends (`SessionStore.record`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rlfabric.bus import Bus, MembershipWatcher
from rlfabric.bus.rollouts import RolloutPlane
from rlfabric.bus.sessions import SessionConflict
from rlfabric.gateway import conversation
from rlfabric.gateway.api import (
    ChatChoice,
    ChatChunk,
    ChatCompletion,
    ChatRequest,
    ChoiceLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    FunctionOut,
    MessageOut,
    ModelCard,
    ModelList,
    NamedToolChoice,
    Tool,
    ToolCallDelta,
    ToolCallOut,
    Usage,
    WeightVersion,
)
from rlfabric.gateway.config import GatewayConfig
from rlfabric.gateway.errors import WORKER_ERRORS, APIError, bad_request, unsupported
from rlfabric.gateway.output import Final, OutputRules, StreamText, finalize, logprob_rows
from rlfabric.gateway.sessions import Session, SessionStore
from rlfabric.gateway.splice import Plan, plan
from rlfabric.schemas import (
    ErrorCode,
    PackedF32,
    PackedI32,
    RolloutError,
    RolloutReply,
    RolloutRequest,
    RolloutResult,
    SamplingParams,
    SessionTurn,
    TokenDelta,
    TopLogprobs,
    TurnChoice,
    VersionSpan,
)
from rlfabric.schemas.validation import MAX_LOGPROBS, MAX_SAMPLES
from rlfabric.telemetry import instruments
from rlfabric.text import PARSERS, ChatFormat, ToolFormat

#: stop strings a request may give
MAX_STOPS = 16
_SEED_MOD = 1 << 63


@dataclass(slots=True)
class _Turn:
    """One request on its way: its session, prompt plan and how its output is read."""

    session: Session
    plan: Plan
    request: RolloutRequest
    rules: OutputRules
    digests: tuple[str, ...]
    prefill: list[int]
    tenant: str
    model: str
    planned_on: int = 0  # the session's `changes` when planned
    #: the session whose worker the turn goes to (None: a one-turn request, any worker)
    affinity: str | None = None
    started: float = field(default_factory=time.monotonic)


class Gateway:
    def __init__(self, bus: Bus, plane: RolloutPlane, watcher: MembershipWatcher,
                 store: SessionStore, fmt: ChatFormat, config: GatewayConfig) -> None:
        self.bus = bus
        self.plane = plane
        self.watcher = watcher
        self.store = store
        self.fmt = fmt
        self.config = config
        self.context_len = config.max_model_len or fmt.context_len
        if config.tool_parser not in PARSERS:
            raise ValueError(f"--tool-call-parser {config.tool_parser!r}: use one of "
                             f"{', '.join(PARSERS)}")
        self.tools: ToolFormat = PARSERS[config.tool_parser]
        self.created = int(time.time())

    # ---- plain endpoints ----
    def models(self) -> ModelList:
        """The base model, then every LoRA adapter a worker holds (by its name)."""
        return ModelList(data=[ModelCard(id=name, created=self.created,
                                         max_model_len=self.context_len,
                                         parent=None if name == self.config.name
                                         else self.config.name)
                               for name in [self.config.name, *self._adapters()]])

    def _adapters(self) -> list[str]:
        return sorted({n for m in self.watcher.members.values() for n in m.adapters}
                      - {self.config.name})

    def health(self) -> dict[str, Any]:
        members = self.watcher.members
        return {"status": "ok" if self.bus.nc.is_connected else "bus_unreachable",
                "workers": len(members),
                "versions": sorted({m.weight_version for m in members.values()}),
                **self.store.load()}

    def _adapter_of(self, model: str) -> str:
        """The adapter `model` names ("" for the base model), or 404."""
        if model == self.config.name:
            return ""
        if model in self._adapters():
            return model
        served = ", ".join(repr(n) for n in [self.config.name, *self._adapters()])
        raise APIError(404, f"model {model!r} is not served here; this gateway serves "
                       f"{served} (GET /v1/models)", param="model",
                       code=ErrorCode.MODEL_NOT_FOUND)

    @staticmethod
    def _check_not_ended(s: Session) -> None:
        if s.fold.ended:
            raise APIError(409, f"session {s.session_id!r} has ended ({s.fold.ended}); "
                           "start a new session", code=ErrorCode.SESSION_ENDED)

    def _check_workers(self) -> None:
        if not self.watcher.members:
            raise APIError(503, "no rollout workers are members of this job "
                           f"(prefix {self.bus.subjects.prefix!r}): start one with `rlfabric "
                           "worker`", code=ErrorCode.NO_WORKERS)

    # ---- sampling ----
    def _sampling(self, *, n: int, temperature: float | None, top_p: float | None,
                  top_k: int | None, max_tokens: int | None, seed: int | None,
                  stop: str | list[str] | None, stop_ids: list[int] | None, logprobs: int,
                  prompt_len: int, max_param: str) -> tuple[SamplingParams, tuple[str, ...]]:
        if not 1 <= n <= MAX_SAMPLES:
            raise bad_request(f"n={n}: needs 1 to {MAX_SAMPLES}", "n")
        if max_tokens is not None and max_tokens < 1:
            raise bad_request(f"{max_param}={max_tokens}: needs at least 1", max_param)
        room = self.context_len - prompt_len
        if room < 1:
            raise APIError(413, f"the prompt has {prompt_len} tokens; the model's context is "
                           f"{self.context_len}: no room for a completion", param="messages",
                           code=ErrorCode.CONTEXT_LENGTH_EXCEEDED)
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
        sp = SamplingParams(max_tokens=min(max_tokens or room, room), temperature=t, top_p=p,
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

    # ---- chat ----
    async def chat(self, req: ChatRequest, *, session_id: str | None, tenant: str = "default",
                   ) -> ChatCompletion | AsyncIterator[bytes]:
        adapter = self._check_chat(req)
        conv = conversation.read(req.messages)
        tools = _tools(req.tools)
        forced = self._forced_call(req.tool_choice, tools)
        parse = tools is not None and req.tool_choice != "none"
        prefill = self.fmt.encode(forced) if forced else []
        self._check_workers()
        kwargs = req.chat_template_kwargs or {}

        def make_plan(s: Session) -> Plan:
            return plan(self.fmt, None if s.new else s.fold, conv.messages, conv.digests,
                        tools=tools, prompt_text=s.prompt_text, prefill=prefill,
                        texts=s.texts, **kwargs)

        session, p, planned_on = await self._planned(session_id, make_plan)
        self.store.begin(session)
        try:
            return await self._chat_turn(req, _Turn(
                session=session, plan=p, rules=OutputRules(), digests=conv.digests,
                prefill=prefill, tenant=tenant, model=req.model, planned_on=planned_on,
                affinity=session.key if session_id else None,
                request=RolloutRequest(request_id=f"gw-{uuid.uuid4().hex}",
                                       prompt_token_ids=PackedI32(p.prompt), stream=req.stream,
                                       adapter=adapter)), parse,
                only_tool=tools[0]["function"]["name"] if tools and len(tools) == 1 else "")
        except BaseException:
            self.store.done(session)
            raise

    async def _chat_turn(self, req: ChatRequest, turn: _Turn, parse: bool, *,
                         only_tool: str = "") -> ChatCompletion | AsyncIterator[bytes]:
        """`turn` sampled as `req` asks; `store.done(turn.session)` once it ends (a stream:
        when its generator ends)."""
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None \
            else "max_tokens"
        sp, stops = self._sampling(
            n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            max_tokens=req.max_completion_tokens if req.max_completion_tokens is not None
            else req.max_tokens, seed=req.seed, stop=req.stop, stop_ids=req.stop_token_ids,
            logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
            prompt_len=len(turn.plan.prompt), max_param=max_param)
        turn.rules = OutputRules(stops=stops, stop_ids=frozenset(sp.stop_token_ids),
                                 parser=self.tools.parse if parse else None,
                                 call_open=self.tools.open, only_tool=only_tool)
        turn.request = msgspec.structs.replace(turn.request, sampling=sp)
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return self._stream_chat(turn, logprobs=req.logprobs, include_usage=usage)
        finals = await self._generate(turn)
        await self._record(turn, finals)
        self.store.done(turn.session)
        return self._chat_response(turn, finals, logprobs=req.logprobs)

    def _check_chat(self, req: ChatRequest) -> str:
        """The adapter the request's `model` names ("": the base), once every field checks."""
        adapter = self._adapter_of(req.model)
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

    def _forced_call(self, choice: Any, tools: list[dict[str, Any]] | None) -> str | None:
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

    async def _planned(self, session_id: str | None, make_plan: Callable[[Session], Plan]
                       ) -> tuple[Session, Plan, int]:
        """The session, the turn's plan, and the session state it was planned on."""
        if not session_id:
            session = self.store.local(f"one-{uuid.uuid4().hex}")
            return session, make_plan(session), session.changes
        session = self.store.entry(session_id)
        async with session.lock:
            await self.store.open(session)
            self._check_not_ended(session)
            p = make_plan(session)
            # a new segment is declared only against the freshest state
            if p.reason and not session.new and await self.store.refresh(session):
                self._check_not_ended(session)
                p = make_plan(session)
            return session, p, session.changes

    async def _generate(self, turn: _Turn) -> list[Final]:
        n = turn.request.sampling.n
        finals: list[Final | None] = [None] * n
        async for reply in self.plane.generate([turn.request], session=turn.affinity,
                                               timeout=self.config.request_timeout):
            i = reply.sample_index or 0
            finals[i] = self._final(turn, _result(reply))
        return [f for f in finals if f is not None]

    def _final(self, turn: _Turn, res: RolloutResult) -> Final:
        f = self._finalize(turn, res)
        f.worker_id = res.worker_id
        return f

    def _finalize(self, turn: _Turn, res: RolloutResult) -> Final:
        top = _top_rows(res.top_logprobs)
        ids = res.completion_token_ids.tolist()
        if turn.prefill:  # the text is the opening the gateway wrote, then the sample
            f = finalize(self.fmt, turn.prefill + ids, [0.0] * len(turn.prefill)
                         + res.logprobs.tolist(), [], res.finish_reason, turn.rules)
            kept = ids[:max(0, len(f.ids) - len(turn.prefill))]
            n = len(kept)
            f.ids, f.logprobs = kept, res.logprobs.tolist()[:n]
            f.spans = _clip(res.version_spans, n)
            f.top = top[:n]
            return f
        return finalize(self.fmt, ids, res.logprobs.tolist(), res.version_spans,
                        res.finish_reason, turn.rules, top)

    async def _record(self, turn: _Turn, finals: Sequence[Final]) -> None:
        s, p = turn.session, turn.plan
        record = SessionTurn(
            session_id=s.session_id, turn=s.fold.turns, added=PackedI32(p.added),
            branch=p.branch,
            reason=p.reason, detail=p.detail, message_digests=turn.digests,
            resample=p.resample, model=turn.model, tenant=turn.tenant,
            gateway=self.config.gateway_id, at=time.time(),
            choices=tuple(TurnChoice(completion_token_ids=PackedI32(f.ids),
                                     logprobs=PackedF32(f.logprobs),
                                     version_spans=tuple(f.spans),
                                     finish_reason=f.finish_reason, message_digest=f.digest,
                                     prefill=PackedI32(turn.prefill)) for f in finals))
        try:
            await self.store.record(s, record, planned_on=turn.planned_on,
                                    prompt_text=p.text if not turn.prefill else None)
        except SessionConflict as exc:
            raise APIError(409, str(exc), code=ErrorCode.SESSION_CONFLICT) from None
        m = instruments.current
        if p.reason:
            m.gateway_segments.add(1, {"reason": p.reason, "rlfabric.tenant": turn.tenant})
        m.gateway_turns.record(time.monotonic() - turn.started,
                               {"rlfabric.tenant": turn.tenant})

    def _message(self, f: Final) -> MessageOut:
        calls = [ToolCallOut(id=f"call_{uuid.uuid4().hex[:24]}",
                             function=FunctionOut(name=c.name, arguments=c.arguments))
                 for c in f.calls]
        return MessageOut(content=f.content if (f.content or not calls) else None,
                          tool_calls=calls or None)

    def _chat_response(self, turn: _Turn, finals: Sequence[Final], *,
                       logprobs: bool) -> ChatCompletion:
        choices = [ChatChoice(
            index=i, message=self._message(f), finish_reason=f.finish_reason,
            token_ids=f.ids, weight_versions=_versions(f.spans), worker_id=f.worker_id,
            logprobs=ChoiceLogprobs(content=logprob_rows(self.fmt, f.ids, f.logprobs, f.top))
            if logprobs else None) for i, f in enumerate(finals)]
        done = sum(len(f.ids) for f in finals)
        n_prompt = len(turn.plan.prompt)
        return ChatCompletion(
            id=f"chatcmpl-{turn.request.request_id[3:]}", created=int(time.time()),
            model=turn.model, choices=choices,
            usage=Usage(prompt_tokens=n_prompt, completion_tokens=done,
                        total_tokens=n_prompt + done),
            prompt_token_ids=turn.plan.prompt, session_id=turn.session.session_id)

    async def _stream_chat(self, turn: _Turn, *, logprobs: bool,
                           include_usage: bool) -> AsyncIterator[bytes]:
        n, created = turn.request.sampling.n, int(time.time())
        cid = f"chatcmpl-{turn.request.request_id[3:]}"

        def chunk(choices: list[ChunkChoice], **extra: Any) -> bytes:
            return b"data: " + msgspec.json.encode(ChatChunk(
                id=cid, created=created, model=turn.model, choices=choices, **extra)) + b"\n\n"

        yield chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))
                     for i in range(n)], prompt_token_ids=turn.plan.prompt,
                    session_id=turn.session.session_id)
        texts = [StreamText(self.fmt, turn.rules) for _ in range(n)]
        finals: list[Final | None] = [None] * n
        try:
            async for item in self.plane.generate([turn.request], deltas=True,
                                                  session=turn.affinity,
                                                  timeout=self.config.request_timeout):
                if isinstance(item, TokenDelta):
                    st = texts[item.sample_index]
                    top = _top_rows(item.top_logprobs)
                    out = st.add(item.start, item.token_ids.tolist(), item.logprobs.tolist(),
                                 top)
                    if out is None:
                        continue
                    text, a, b = out
                    if not text and a == b:
                        continue
                    yield chunk([ChunkChoice(
                        index=item.sample_index, delta=Delta(content=text or None),
                        token_ids=st.ids[a:b],
                        logprobs=ChoiceLogprobs(content=logprob_rows(
                            self.fmt, st.ids[a:b], st.logprobs[a:b], st.top[a:b]))
                        if logprobs else None)])
                    continue
                i = item.sample_index or 0
                f = finals[i] = self._final(turn, _result(item))
                text, a, b = texts[i].rest(f)
                msg = self._message(f)
                calls = [ToolCallDelta(index=j, id=c.id, function=c.function)
                         for j, c in enumerate(msg.tool_calls or ())]
                yield chunk([ChunkChoice(
                    index=i, delta=Delta(content=text or None, tool_calls=calls or None),
                    finish_reason=f.finish_reason, token_ids=f.ids[a:b],
                    weight_versions=_versions(f.spans),
                    logprobs=ChoiceLogprobs(content=logprob_rows(
                        self.fmt, f.ids[a:b], f.logprobs[a:b], f.top[a:b]))
                    if logprobs else None)])
            done = [f for f in finals if f is not None]
            await self._record(turn, done)
            if include_usage:
                n_prompt = len(turn.plan.prompt)
                n_done = sum(len(f.ids) for f in done)
                yield chunk([], usage=Usage(prompt_tokens=n_prompt, completion_tokens=n_done,
                                            total_tokens=n_prompt + n_done))
        except APIError as exc:
            yield b"data: " + exc.body() + b"\n\n"
        finally:
            self.store.done(turn.session)
        yield b"data: [DONE]\n\n"

    # ---- completions ----
    async def complete(self, req: CompletionRequest, *, tenant: str = "default",
                       ) -> Completion | AsyncIterator[bytes]:
        adapter = self._adapter_of(req.model)
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
        prompts = _prompts(self.fmt, req.prompt)
        self._check_workers()
        choices: list[CompletionChoice] = []
        n_prompt = n_done = 0
        last_ids: list[int] = []
        for pi, ids in enumerate(prompts):
            sp, stops = self._sampling(
                n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                max_tokens=req.max_tokens, seed=req.seed, stop=req.stop,
                stop_ids=req.stop_token_ids, logprobs=req.logprobs or 0,
                prompt_len=len(ids), max_param="max_tokens")
            if any(not 0 <= t < self.fmt.vocab_size for t in ids):
                raise bad_request("prompt holds a token id outside the vocabulary", "prompt")
            session = self.store.local(f"one-{uuid.uuid4().hex}")
            p = Plan(prompt=ids, added=ids, text=None, reason="new_session")
            turn = _Turn(session=session, plan=p, digests=(),
                         rules=OutputRules(stops=stops, stop_ids=frozenset(sp.stop_token_ids)),
                         prefill=[], tenant=tenant, model=req.model,
                         request=RolloutRequest(request_id=f"gw-{uuid.uuid4().hex}",
                                                prompt_token_ids=PackedI32(ids), sampling=sp,
                                                adapter=adapter))
            finals = await self._generate(turn)
            await self._record(turn, finals)
            for j, f in enumerate(finals):
                lp = None
                if req.logprobs is not None:
                    lp = CompletionLogprobs(
                        tokens=[self.fmt.decode([t]) for t in f.ids],
                        token_logprobs=f.logprobs,
                        top_logprobs=[{self.fmt.decode([a]): v for a, v in row}
                                      for row in f.top] if req.logprobs else None)
                choices.append(CompletionChoice(
                    index=pi * req.n + j, text=f.content or "", finish_reason=f.finish_reason,
                    token_ids=f.ids, weight_versions=_versions(f.spans), logprobs=lp))
            n_prompt += len(ids)
            n_done += sum(len(f.ids) for f in finals)
            last_ids = ids
        return Completion(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()),
                          model=req.model, choices=choices,
                          usage=Usage(prompt_tokens=n_prompt, completion_tokens=n_done,
                                      total_tokens=n_prompt + n_done),
                          prompt_token_ids=last_ids if len(prompts) == 1 else None)

    # ---- sessions ----
    async def trajectory(self, session_id: str) -> dict[str, Any]:
        traj = await self.store.trajectory(session_id)
        if traj is None:
            raise APIError(404, f"no session {session_id!r} (none was served, or its records "
                           "aged out)", param="session_id", code=ErrorCode.SESSION_NOT_FOUND)
        return {"session_id": traj.session_id, "turns": traj.turns, "ended": traj.ended,
                "segments": [{"token_ids": s.token_ids.tolist(),
                              "loss_mask": s.loss_mask.tolist(),
                              "logprobs": s.logprobs.tolist(),
                              "weight_versions": [{"version": v.version, "start": v.start,
                                                   "end": v.end} for v in s.weight_versions],
                              "reason": s.reason, "detail": s.detail, "turns": list(s.turns)}
                             for s in traj.segments]}

    async def finish(self, session_id: str) -> dict[str, Any]:
        s = await self.store.end(session_id, "finished")
        if s is None:
            raise APIError(404, f"no session {session_id!r}", param="session_id",
                           code=ErrorCode.SESSION_NOT_FOUND)
        return {"session_id": session_id, "ended": s.fold.ended, "turns": s.fold.turns}


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The request's tools, checked, as the agent wrote them (a template renders them)."""
    if not tools:
        return None
    for i, t in enumerate(tools):
        try:
            msgspec.convert(t, Tool)
        except msgspec.ValidationError as exc:
            raise bad_request(f"tools[{i}]: {exc}", f"tools[{i}]") from None
        if t.get("type", "function") != "function":
            raise unsupported(f"tools[{i}].type", "only function tools")
    return tools


def _result(reply: RolloutReply) -> RolloutResult:
    """A result, or the worker's error as the agent's."""
    if isinstance(reply, RolloutError):
        status, code = WORKER_ERRORS.get(reply.code, (502, reply.code))
        raise APIError(status, f"the rollout failed ({reply.code}): {reply.message}",
                       code=code)
    return reply


def _top_rows(t: TopLogprobs | None) -> list[list[tuple[int, float]]]:
    """Per token, its top-k alternatives as (id, logprob) pairs."""
    if t is None or not t.k:
        return []
    ids, lps = t.ids.tolist(), t.logprobs.tolist()
    return [list(zip(ids[i:i + t.k], lps[i:i + t.k], strict=True))
            for i in range(0, len(ids), t.k)]


def _clip(spans: Sequence[VersionSpan], n: int) -> list[VersionSpan]:
    return [VersionSpan(version=s.version, start=s.start, end=min(s.end, n))
            for s in spans if s.start < n]


def _versions(spans: Sequence[VersionSpan]) -> list[WeightVersion]:
    return [WeightVersion(version=s.version, start=s.start, end=s.end) for s in spans]


def _prompts(fmt: ChatFormat, prompt: str | list[Any]) -> list[list[int]]:
    """Token ids of each prompt: text, token ids, or a list of either."""
    def ids(p: Any, where: str) -> list[int]:
        if isinstance(p, str):
            out = fmt.encode(p)
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in p):
            out = list(p)
        else:
            raise bad_request(f"{where} must be text or a list of token ids", where)
        if not out:
            raise bad_request(f"{where} is empty", where)
        return out

    if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
        return [ids(prompt, "prompt")]
    return [ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]

