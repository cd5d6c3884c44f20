"""The gateway's work, apart from HTTP: a chat or completion request becomes a rollout request
on the bus (its prompt from the session's exact tokens, `splice.plan`), its results become
OpenAI's response shapes (or a stream of chunks while the worker samples), and the turn's
record is stored in the session's log before the response ends (`SessionStore.record`)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, TypeVar, cast

import msgspec

from rlfabric.bus import Bus, MembershipWatcher
from rlfabric.bus.rollouts.plane import RolloutPlane
from rlfabric.bus.sessions.log import SessionConflict
from rlfabric.gateway import conversation
from rlfabric.gateway.api import (
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
    ModelCard,
    ModelList,
    Tool,
    ToolCallDelta,
    Usage,
)
from rlfabric.gateway.checks import RequestChecks
from rlfabric.gateway.claims import SessionTurns
from rlfabric.gateway.config import GatewayConfig
from rlfabric.gateway.errors import APIError, bad_request, unsupported
from rlfabric.gateway.output import Final, OutputRules, StreamText, logprob_rows
from rlfabric.gateway.responses import (
    Turn,
    chat_response,
    final_of,
    message,
    result_of,
    top_rows,
    versions,
)
from rlfabric.gateway.sessions import Session, SessionStore
from rlfabric.gateway.splice import Plan, plan
from rlfabric.schemas import (
    ErrorCode,
    PackedF32,
    PackedI32,
    RolloutRequest,
    SamplingParams,
    SessionTurn,
    TokenDelta,
    TurnChoice,
)
from rlfabric.schemas.models import BUILTIN
from rlfabric.telemetry import instruments
from rlfabric.text import ChatFormat
from rlfabric.text.builtin import cache_dir

T = TypeVar("T")


def served_as(config: GatewayConfig) -> set[str]:
    """The model names a worker serving the gateway's model reports (an engine that loads
    from a directory names a built-in model by the checkpoint written for it)."""
    return {config.model, config.name} | (
        {cache_dir("checkpoints", config.model)} if config.model in BUILTIN else set())


class Gateway:
    def __init__(self, bus: Bus, plane: RolloutPlane, watcher: MembershipWatcher,
                 store: SessionStore, fmt: ChatFormat, config: GatewayConfig) -> None:
        self.bus = bus
        self.plane = plane
        self.watcher = watcher
        self.store = store
        self.fmt = fmt
        self.config = config
        self.served_as = served_as(config)
        #: what a request must be to be sampled (checked before anything is sent)
        self.checks = RequestChecks(fmt, config, watcher)
        #: one turn of a session in flight, across every gateway of the job
        self.turns = SessionTurns(bus, store, config)
        self.created = int(time.time())

    # ---- plain endpoints ----
    def models(self, tenant: str = "default") -> ModelList:
        """The base model, then the LoRA adapters workers hold (a job's tenant: its job's)."""
        base = self.config.name
        return ModelList(data=[ModelCard(id=name, created=self.created, parent=None if
                                         name == base else base,
                                         max_model_len=self.checks.context_len)
                               for name in [base, *self.checks.adapters(self.config.job_of(
                                   tenant))]])

    def health(self) -> dict[str, Any]:
        members = self.watcher.members
        return {"status": "ok" if self.bus.nc.is_connected else "bus_unreachable",
                "workers": len(members),
                "versions": sorted({m.weight_version for m in members.values()}),
                **self.store.load()}

    def ready(self) -> dict[str, Any]:
        """Whether a request would be served now: the bus reachable and a worker serving the
        model a member (what an orchestrator's readiness probe asks)."""
        serving = sorted(w for w, m in self.watcher.members.items()
                         if m.model in self.served_as)
        up = self.bus.nc.is_connected
        why = ("" if up and serving else "the bus is unreachable" if not up
               else f"no worker serving {self.config.name!r} is a member yet")
        return {"ready": not why, "workers": serving, **({"why": why} if why else {})}

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

    # ---- chat ----
    async def chat(self, req: ChatRequest, *, session_id: str | None, tenant: str = "default",
                   ) -> ChatCompletion | AsyncIterator[bytes]:
        adapter = self.checks.chat(req, job := self.config.job_of(tenant))
        conv = conversation.read(req.messages)
        tools = _tools(req.tools)
        forced = self.checks.forced_call(req.tool_choice, tools)
        parse = tools is not None and req.tool_choice != "none"
        prefill = self.fmt.encode(forced) if forced else []
        self._check_workers()
        kwargs = req.chat_template_kwargs or {}

        def make_plan(s: Session) -> Plan:
            return plan(self.fmt, None if s.new else s.fold, conv.messages, conv.digests,
                        tools=tools, prompt_text=s.prompt_text, prefill=prefill,
                        texts=s.texts, **kwargs)

        if session_id:
            await self.turns.claim(session_id)  # 409 at once if a turn of it is in flight
        try:
            session, p, planned_on = await self._planned(session_id, make_plan)
        except BaseException:
            await self.turns.end(self.store.entry(session_id) if session_id else None)
            raise
        self.store.begin(session)
        try:
            return await self._chat_turn(req, Turn(
                session=session, plan=p, rules=OutputRules(), digests=conv.digests,
                prefill=prefill, tenant=tenant, model=req.model, planned_on=planned_on,
                affinity=session.key if session_id else None,
                request=RolloutRequest(request_id=f"gw-{uuid.uuid4().hex}",
                                       prompt_token_ids=PackedI32(p.prompt), stream=req.stream,
                                       adapter=adapter, job=job)), parse,
                only_tool=tools[0]["function"]["name"] if tools and len(tools) == 1 else "")
        except BaseException:
            await self.turns.end(session)
            raise

    async def _chat_turn(self, req: ChatRequest, turn: Turn, parse: bool, *,
                         only_tool: str = "") -> ChatCompletion | AsyncIterator[bytes]:
        """`turn` sampled as `req` asks; `store.done(turn.session)` once it ends (a stream:
        when its generator ends)."""
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None \
            else "max_tokens"
        sp, stops = self.checks.sampling(
            n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            max_tokens=req.max_completion_tokens if req.max_completion_tokens is not None
            else req.max_tokens, seed=req.seed, stop=req.stop, stop_ids=req.stop_token_ids,
            logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
            prompt_len=len(turn.plan.prompt), max_param=max_param)
        turn.rules = OutputRules(stops=stops, stop_ids=frozenset(sp.stop_token_ids),
                                 parser=self.checks.tools.parse if parse else None,
                                 call_open=self.checks.tools.open, only_tool=only_tool)
        turn.request = msgspec.structs.replace(turn.request, sampling=sp)
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return self._stream_chat(turn, logprobs=req.logprobs, include_usage=usage)
        try:
            finals = await self._generate(turn)
            await self._record(turn, finals)
        finally:
            await self.turns.end(turn.session)
        return chat_response(self.fmt, turn, finals, logprobs=req.logprobs)

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

    async def _generate(self, turn: Turn) -> list[Final]:
        n = turn.request.sampling.n
        finals: list[Final | None] = [None] * n
        replies = _closable(self.plane.generate([turn.request], session=turn.affinity,
                                                timeout=self.config.request_timeout))
        async with contextlib.aclosing(replies):  # cancelled: the workers stop sampling
            async for reply in replies:
                i = reply.sample_index or 0
                finals[i] = final_of(self.fmt, turn, result_of(reply))
        return [f for f in finals if f is not None]

    async def _record(self, turn: Turn, finals: Sequence[Final]) -> None:
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

    async def _stream_chat(self, turn: Turn, *, logprobs: bool,
                           include_usage: bool) -> AsyncIterator[bytes]:
        n, created = turn.request.sampling.n, int(time.time())
        cid = f"chatcmpl-{turn.request.request_id[3:]}"

        def chunk(choices: list[ChunkChoice], **extra: Any) -> bytes:
            return b"data: " + msgspec.json.encode(ChatChunk(
                id=cid, created=created, model=turn.model, choices=choices, **extra)) + b"\n\n"

        yield chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))
                     for i in range(n)], prompt_token_ids=turn.plan.prompt,
                    session_id=turn.session.session_id)
        texts = [StreamText(self.fmt, turn.rules, held=bool(turn.prefill)) for _ in range(n)]
        finals: list[Final | None] = [None] * n
        try:
            # closed with this stream (a client that hung up): the workers stop sampling
            replies = _closable(self.plane.generate(
                [turn.request], deltas=True, session=turn.affinity,
                timeout=self.config.request_timeout))
            async with contextlib.aclosing(replies):
                async for item in replies:
                    if isinstance(item, TokenDelta):
                        choice = _delta_choice(self.fmt, texts[item.sample_index], item,
                                               logprobs)
                        if choice is not None:
                            yield chunk([choice])
                        continue
                    i = item.sample_index or 0
                    f = finals[i] = final_of(self.fmt, turn, result_of(item))
                    text, a, b = texts[i].rest(f)
                    msg = message(f)
                    calls = [ToolCallDelta(index=j, id=c.id, function=c.function)
                             for j, c in enumerate(msg.tool_calls or ())]
                    yield chunk([ChunkChoice(
                        index=i, delta=Delta(content=text or None, tool_calls=calls or None),
                        finish_reason=f.finish_reason, token_ids=f.ids[a:b],
                        weight_versions=versions(f.spans),
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
            await self.turns.end(turn.session)
        yield b"data: [DONE]\n\n"

    # ---- completions ----
    async def complete(self, req: CompletionRequest, *, tenant: str = "default",
                       ) -> Completion | AsyncIterator[bytes]:
        adapter = self.checks.completion(req, job := self.config.job_of(tenant))
        prompts = _prompts(self.fmt, req.prompt)
        self._check_workers()
        choices: list[CompletionChoice] = []
        n_prompt = n_done = 0
        last_ids: list[int] = []
        for pi, (ids, sp, stops) in enumerate(_checked(self.checks, self.fmt, req, prompts)):
            session = self.store.local(f"one-{uuid.uuid4().hex}")
            p = Plan(prompt=ids, added=ids, text=None, reason="new_session")
            turn = Turn(session=session, plan=p, digests=(),
                         rules=OutputRules(stops=stops, stop_ids=frozenset(sp.stop_token_ids)),
                         prefill=[], tenant=tenant, model=req.model,
                         request=RolloutRequest(request_id=f"gw-{uuid.uuid4().hex}",
                                                prompt_token_ids=PackedI32(ids), sampling=sp,
                                                adapter=adapter, job=job))
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
                    token_ids=f.ids, weight_versions=versions(f.spans), logprobs=lp))
            n_prompt += len(ids)
            n_done += sum(len(f.ids) for f in finals)
            last_ids = ids
        return Completion(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()),
                          model=req.model, choices=choices,
                          usage=Usage(prompt_tokens=n_prompt, completion_tokens=n_done,
                                      total_tokens=n_prompt + n_done),
                          prompt_token_ids=last_ids if len(prompts) == 1 else None)

    # ---- sessions ----
    async def trajectory(self, session_id: str, key: str | None = None) -> dict[str, Any]:
        traj = await self.store.trajectory(key or session_id)
        if traj is None:
            raise APIError(404, f"no session {session_id!r} (none was served, or its records "
                           "aged out)", param="session_id", code=ErrorCode.SESSION_NOT_FOUND)
        return {"session_id": session_id, "turns": traj.turns, "ended": traj.ended,
                "segments": [{"token_ids": s.token_ids.tolist(),
                              "loss_mask": s.loss_mask.tolist(),
                              "logprobs": s.logprobs.tolist(),
                              "weight_versions": [{"version": v.version, "start": v.start,
                                                   "end": v.end, "policy": v.policy}
                                                  for v in s.weight_versions],
                              "reason": s.reason, "detail": s.detail, "turns": list(s.turns)}
                             for s in traj.segments]}

    async def finish(self, session_id: str, key: str | None = None) -> dict[str, Any]:
        s = await self.store.end(key or session_id, "finished")
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


Planned = tuple[list[int], SamplingParams, tuple[str, ...]]  # a prompt, its sampling, stops


def _checked(checks: RequestChecks, fmt: ChatFormat, req: CompletionRequest,
             prompts: list[list[int]]) -> list[Planned]:
    """Each prompt of a completion request with its sampling and stop strings: every prompt
    checked, and the request's budget over all of them, before any is sampled."""
    out = []
    for ids in prompts:
        sp, stops = checks.sampling(
            n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            max_tokens=req.max_tokens, seed=req.seed, stop=req.stop,
            stop_ids=req.stop_token_ids, logprobs=req.logprobs or 0,
            prompt_len=len(ids), max_param="max_tokens")
        if any(not 0 <= t < fmt.vocab_size for t in ids):
            raise bad_request("prompt holds a token id outside the vocabulary", "prompt")
        out.append((ids, sp, stops))
    checks.budget([sp.n * sp.max_tokens for _, sp, _ in out])
    return out


def _delta_choice(fmt: ChatFormat, st: StreamText, item: TokenDelta,
                  logprobs: bool) -> ChunkChoice | None:
    """A streamed chunk's choice for a token delta (None while its text is held back)."""
    out = st.add(item.start, item.token_ids.tolist(), item.logprobs.tolist(),
                 top_rows(item.top_logprobs))
    if out is None:
        return None
    text, a, b = out
    if not text and a == b:
        return None
    return ChunkChoice(index=item.sample_index, delta=Delta(content=text or None),
                       token_ids=st.ids[a:b],
                       logprobs=ChoiceLogprobs(content=logprob_rows(
                           fmt, st.ids[a:b], st.logprobs[a:b], st.top[a:b]))
                       if logprobs else None)


def _closable(replies: AsyncIterator[T]) -> AsyncGenerator[T, None]:
    """`RolloutPlane.generate`'s replies as the generator they are, to close at once (not
    when collected): a turn given up on tells the workers then."""
    return cast(AsyncGenerator[T, None], replies)


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

