"""TRL's `GRPOTrainer` on rlfabric workers: two of its arguments change, nothing else.

    with TrlFabric("nats://127.0.0.1:4222", prefix="rl") as fabric:
        trainer = GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=...,
                              rollout_func=fabric.rollout_func, callbacks=[fabric.sync])
        trainer.train()

`rollout_func` renders and tokenizes TRL's prompts as TRL does, sends one request per prompt
TRL hands it (TRL repeats each prompt `num_generations` times) with TRL's sampling settings, its
end tokens (the tokenizer's and the model's generation config's, as TRL's own generation stops
at) and `min_weight_version` = the version of the current step, and returns the completions,
the workers' logprobs of them, and as extra fields (which reward functions and logs can read)
the `worker_id` and `weight_version` behind each. `sync` (a `TrainerCallback`) pushes the
model's weights, or its PEFT adapter, to every worker before training and after each optimizer
step, as versions 0, 1, 2, ... of this run's own count (`state.global_step` when every step
ends in a push); a push the quorum did not ack is taken back and stops training with its
report (`WeightSyncFailed`, saying where each worker is).

A rollout that fails (refused, past its deadline, its worker lost) is never a reward: its row
comes back as a one-token placeholder with `env_mask` 0 and extra field `rollout_failed` (the
code and message; "" for the others), and the reward functions TRL was given answer None for
it, so TRL leaves it out of the loss and out of its group's baseline. `failed` counts them per
step; more than `max_failed` of a step's rollouts failing raises `RolloutFailed` naming the
causes (`rlfabric.trainer.failures`).

Several runs share one pool as jobs (`rlfabric.schemas.jobs`): `TrlFabric(..., job="exp-a",
adapter="policy")` puts this run's requests and PEFT adapter in job `exp-a` (another job may
name its adapter `policy` too), on the base weights the pool serves.

Every version this run pushes is named by its run (`TrlFabric.run`, fresh per instance) and
digest: the workers serve this run's requests with this run's weights only (a second run on the
same workers, with the same adapter name and versions from 0 again, is never served by the
first one's adapter), and a completion from any other policy raises `PolicyMismatch` instead of
being trained on. A PEFT adapter names the base it was trained on: where the workers serve
another run's trained base, this run pushes its own base weights once before its first
adapter, and a worker on another base refuses the adapter (`base_mismatch`).
`agent_rollout_func` runs each prompt as an agent episode against `rlfabric gateway` and returns
the session's recorded trajectory, with `env_mask` 0 on the tokens the model did not sample.

TRL calls both from its training thread; the bus client runs in a thread of its own (an anyio
blocking portal). Install with `pip install 'rlfabric[trl]'`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, cast

import msgspec
from anyio.from_thread import BlockingPortal, start_blocking_portal

try:
    import trl  # noqa: F401  # what this module drives
    from transformers import TrainerCallback
except ImportError as exc:  # an optional extra
    raise ImportError(f"rlfabric.integrations.trl needs TRL ({exc}): "
                      "pip install 'rlfabric[trl]'") from exc

from rlfabric.bus import QuorumPolicy
from rlfabric.bus.sessions.log import read_trajectory
from rlfabric.errors import RLFabricError
from rlfabric.schemas import (
    Adapter,
    PackedI32,
    RolloutError,
    RolloutReply,
    RolloutRequest,
    SamplingParams,
    checkpoint_policy,
)
from rlfabric.tensors.checksums import checksum
from rlfabric.trainer import FabricClient
from rlfabric.trainer.errors import RolloutFailed
from rlfabric.trainer.failures import StepFailures

#: an agent episode: (openai.AsyncOpenAI on the gateway, TRL's prompt, the session id to send
#: as `X-Session-ID`) -> extra fields for the reward functions (e.g. the final answer)
Episode = Callable[[Any, Any, str], Awaitable[dict[str, Any]]]
#: the adapter name PEFT models are served under
ADAPTER = "trl"
log = logging.getLogger("rlfabric.integrations.trl")


class WeightSyncFailed(RLFabricError):
    """A step's weights did not reach the quorum: the push is taken back and training stops
    rather than sample from weights the trainer no longer holds. `report` names who acked and
    who did not; the message says which version each worker serves now."""

    def __init__(self, message: str, report: Any = None) -> None:
        super().__init__(message)
        self.report = report


class TrajectoryMissing(RLFabricError):
    """An agent episode left no trajectory on the bus under its session id."""


class TrlFabric:
    """A connection to an rlfabric job for one TRL run (use it as a context manager)."""

    def __init__(self, nats: str, *, prefix: str = "rl", transport: str = "shm",
                 policy: QuorumPolicy | None = None, timeout: float = 600.0,
                 run: str | None = None, job: str = "", adapter: str = ADAPTER,
                 max_failed: float = 0.1, delta: bool = False, **connect: Any) -> None:
        self.nats = nats
        #: the job this run is on a shared pool ("": the pool's own; `rlfabric.schemas.jobs`)
        #: and the name its PEFT adapter is served under there
        self.job = job
        self.adapter = adapter
        self.prefix = prefix
        self.transport = transport
        #: each sync sends what changed since the last one every worker holds
        #: (`update_weights(..., delta=True)`)
        self.delta = delta
        self.policy = policy
        self.timeout = timeout
        self._connect = connect
        #: the version the workers serve (the last one pushed); requests ask for it
        self.version = -1
        #: the version the next push gets: this run's own count (0 before training, then one
        #: per optimizer step), not another run's
        self.next_version = 0
        #: each push's FanoutReport, by version
        self.reports: dict[int, Any] = {}
        #: the share of a step's rollouts that may fail (each left out of the loss)
        if not 0.0 <= max_failed <= 1.0:
            raise ValueError(f"TrlFabric(max_failed={max_failed}): a share of a step's "
                             "rollouts, 0 to 1")
        self.max_failed = max_failed
        #: failed rollouts, by step
        self.failed: dict[int, int] = {}
        self.sync = _Sync(self)
        self._stack = contextlib.ExitStack()
        self._portal: BlockingPortal | None = None
        self.fabric: FabricClient | None = None
        #: this training run's id: the policies it pushes are named by it
        self.run = run or uuid.uuid4().hex[:12]
        #: the base policy this run's adapters are trained on (found at the first push)
        self.base = ""

    def __enter__(self) -> TrlFabric:
        try:
            self._portal = self._stack.enter_context(start_blocking_portal())
            self.fabric = self._stack.enter_context(self._portal.wrap_async_context_manager(
                FabricClient.connect(self.nats, prefix=self.prefix, run=self.run,
                                     job=self.job, **self._connect)))
        except BaseException:  # e.g. no server: nothing stays behind to keep the process up
            self._stack.close()
            self._portal = None
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            # an exception (Ctrl-C among them) cancels what still runs on the bus client's loop
            self._stack.__exit__(*exc)
        finally:
            self._portal = self.fabric = None

    def call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run `fn(*args)` on the bus client's loop, from TRL's thread. Interrupted (Ctrl-C),
        the call is cancelled there at once."""
        if self._portal is None:
            raise RuntimeError("TrlFabric is not open: use it as `with TrlFabric(...) as f:`")
        fut = self._portal.start_task_soon(fn, *args)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            raise

    @property
    def client(self) -> FabricClient:
        if self.fabric is None:
            raise RuntimeError("TrlFabric is not open: use it as `with TrlFabric(...) as f:`")
        return self.fabric

    # ---- weights ----
    def push(self, model: Any, version: int | None = None) -> None:
        """`model`'s weights (a PEFT model: its adapter) to every worker as `version` (by
        default the next of this run's own count)."""
        version = self.next_version if version is None else version
        adapter, state = _weights(model, self.adapter)
        try:
            if adapter is not None:
                if not self.base:
                    self.base = self.call(self._base_of, model)
                adapter = msgspec.structs.replace(adapter, base=self.base)
            rep = self.call(self._push, state, adapter, version)
        except RLFabricError as exc:
            raise WeightSyncFailed(f"the weights of step {version} did not reach the fleet: "
                                   f"{exc}; training stops", getattr(exc, "report", None)
                                   ) from exc
        self.reports[version] = rep
        self.version = version
        self.next_version = version + 1

    async def _push(self, state: dict[str, Any], adapter: Adapter | None, version: int) -> Any:
        return await self.client.update_weights(version, state_dict=state, adapter=adapter,
                                                transport=self.transport, policy=self.policy,
                                                delta=self.delta)

    async def _base_of(self, model: Any) -> str:
        """The base policy a PEFT model's adapters run on: the checkpoint the workers serve,
        where they serve it; else (another run's base weights) this run's own base, pushed
        once as base version 0."""
        desired = await self.client.bus.state.read()
        claim = await self.client.bus.state.checkpoint_claim()
        if self.client.job and desired.policy:  # base weights are the pool's, not a job's
            return desired.policy
        if (self.client.job or (not desired.policy and desired.locator is None)) and \
                claim is not None:
            mine = _base_checksum(model)
            if mine != claim.checksum:
                log.warning("this run's base weights (checksum %s) are not the checkpoint the "
                            "workers serve (%s, checksum %s: another checkpoint, or another "
                            "dtype); its adapters are checked against the workers' checkpoint",
                            mine[:12], claim.model, claim.checksum[:12])
            return checkpoint_policy(claim.checksum)
        log.info("the workers serve %s, not this run's base: pushing this run's base weights "
                 "once before its adapter", desired.policy or "weights of another run")
        await self.client.update_weights(0, state_dict=_base_state(model),
                                         transport=self.transport, policy=self.policy)
        return self.client.pushed.names("")[-1]

    # ---- single-turn rollouts ----
    def rollout_func(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """TRL's `rollout_func`: one completion per prompt received."""
        leave_failed_unscored(trainer)
        ids = tokenize(prompts, trainer)
        step = trainer.state.global_step
        sampling = sampling_of(trainer)
        seed = getattr(trainer.args, "seed", 0)
        reqs = [RolloutRequest(
            request_id=f"trl-{self.run}-s{step}-{i}", prompt_token_ids=PackedI32(p),
            min_weight_version=max(self.version, 0), adapter=self._adapter_name(trainer),
            sampling=SamplingParams(**sampling, seed=(seed * 1_000_003 + step) * 4096 + i))
            for i, p in enumerate(ids)]
        got = self.call(self._collect, reqs)
        failures = StepFailures(step)
        for r in reqs:
            failures.add(got[r.request_id])
        self._count(failures, trainer)
        out: dict[str, list[Any]] = {"prompt_ids": ids, "completion_ids": [], "logprobs": [],
                                     "worker_id": [], "weight_version": [],
                                     "rollout_failed": []}
        for r in reqs:
            res = got[r.request_id]
            out["worker_id"].append(res.worker_id)
            if isinstance(res, RolloutError):  # a placeholder the loss never sees
                out["completion_ids"].append(list(sampling["stop_token_ids"][:1] or (0,)))
                out["logprobs"].append([0.0])
                out["weight_version"].append(-1)
                out["rollout_failed"].append(f"{res.code}: {res.message}")
                continue
            out["completion_ids"].append(res.completion_token_ids.tolist())
            out["logprobs"].append(res.logprobs.tolist())
            spans = {s.version for s in res.version_spans}
            out["weight_version"].append(spans.pop() if len(spans) == 1 else -2)
            out["rollout_failed"].append("")
        if failures.failed:
            out["env_mask"] = [[0 if f else 1] * len(c) for c, f in
                               zip(out["completion_ids"], out["rollout_failed"], strict=True)]
        return out

    def _count(self, failures: StepFailures, trainer: Any) -> None:
        """Record a step's failures; `RolloutFailed` past `max_failed`, or where a reward
        model (which scores every row) would score one."""
        self.failed[failures.step] = self.failed.get(failures.step, 0) + failures.failed
        if not failures.failed:
            return
        failures.check(self.max_failed, "TrlFabric(max_failed=)")
        if any(not unscored(f) for f in trainer.reward_funcs):
            raise RolloutFailed(f"step {failures.step}: {failures.failed} rollouts failed "
                                f"({failures.causes()}), and a reward model scores every "
                                "completion, so they cannot be left out: fix the cause, or "
                                "give GRPOTrainer reward functions only", error=failures.errors[0])
        log.warning("step %d: %d of %d rollouts failed, left out of the loss: %s",
                    failures.step, failures.failed, failures.total, failures.causes())

    def _adapter_name(self, trainer: Any) -> str:
        return self.adapter if hasattr(trainer.model, "peft_config") else ""

    async def _collect(self, reqs: list[RolloutRequest]) -> dict[str, RolloutReply]:
        got: dict[str, RolloutReply] = {}
        async for r in self.client.generate(reqs, timeout=self.timeout):
            got[r.request_id] = r
        return got

    # ---- multi-turn rollouts ----
    def agent_rollout_func(self, base_url: str, episode: Episode, *, concurrency: int = 32,
                           api_key: str = "-") -> Callable[[list[Any], Any], dict[str, Any]]:
        """A `rollout_func` running `episode` once per prompt against the gateway at
        `base_url`, each in a session of its own; what it returns is read from the session's
        trajectory on the bus: the tokens before the model's first sampled one are
        `prompt_ids`, the rest `completion_ids`, with `env_mask` 1 on sampled tokens and 0 on
        tool results and template tokens, and the rollout logprobs (0 where not sampled)."""

        def rollout(prompts: list[Any], trainer: Any) -> dict[str, Any]:
            leave_failed_unscored(trainer)
            step = trainer.state.global_step
            sids = [f"trl-{self.run}-s{step}-{i}" for i in range(len(prompts))]
            extras, errors = self.call(self._episodes, base_url, api_key, episode, prompts,
                                       sids, concurrency)
            failures = StepFailures(step)
            for sid, exc in zip(sids, errors, strict=True):
                failures.add(None if exc is None else RolloutError(
                    request_id=sid, worker_id="", code=type(exc).__name__, message=str(exc)))
            self._count(failures, trainer)
            keys = ("prompt_ids", "completion_ids", "logprobs", "env_mask", "weight_version",
                    "segments", "session_id", "rollout_failed")
            out: dict[str, list[Any]] = {k: [] for k in keys}
            names = {k for extra in extras for k in extra}
            end = end_tokens(trainer)[:1] or (0,)
            for prompt, sid, extra, exc in zip(prompts, sids, extras, errors, strict=True):
                row = (self.call(self._trajectory, sid) | {"rollout_failed": ""}
                       if exc is None else {  # a placeholder the loss never sees
                           "prompt_ids": tokenize([prompt], trainer)[0],
                           "completion_ids": list(end), "logprobs": [0.0], "env_mask": [0],
                           "weight_version": -1, "segments": 0, "session_id": sid,
                           "rollout_failed": f"{type(exc).__name__}: {exc}"})
                for k in keys:
                    out[k].append(row[k])
                for k in names:
                    out.setdefault(k, []).append(extra.get(k))
            return out

        return rollout

    async def _episodes(self, base_url: str, api_key: str, episode: Episode,
                        prompts: list[Any], sids: list[str], concurrency: int
                        ) -> tuple[list[dict[str, Any]], list[Exception | None]]:
        """Each episode's extra fields, and the error it raised (None where it ended)."""
        import anyio
        import openai

        out: list[dict[str, Any]] = [{} for _ in prompts]
        errors: list[Exception | None] = [None] * len(prompts)
        limit = anyio.Semaphore(concurrency)
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key,
                                      max_retries=0, timeout=self.timeout) as client:
            async def one(i: int) -> None:
                async with limit:
                    try:
                        out[i] = await episode(client, prompts[i], sids[i])
                    except Exception as exc:  # the gateway's, a tool's, the environment's
                        errors[i] = exc

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
        return out, errors

    async def _trajectory(self, sid: str) -> dict[str, Any]:
        traj = await read_trajectory(self.client.bus, sid)
        if traj is None or not traj.segments:
            raise TrajectoryMissing(f"session {sid}: no trajectory was recorded (did the "
                                    "episode send its turns with this X-Session-ID?)")
        # branched sessions have several segments: TRL takes one sequence, the longest
        seg = max(traj.segments, key=lambda s: len(s.token_ids))
        self.client.pushed.check_spans(seg.weight_versions, f"session {sid}'s trajectory")
        ids, mask = seg.token_ids.tolist(), seg.loss_mask.tolist()
        first = mask.index(1) if 1 in mask else len(ids)
        versions = {v.version for v in seg.weight_versions}
        return {"prompt_ids": ids[:first], "completion_ids": ids[first:],
                "logprobs": seg.logprobs.tolist()[first:], "env_mask": mask[first:],
                "weight_version": versions.pop() if len(versions) == 1 else -2,
                "segments": len(traj.segments), "session_id": sid}


class _Sync(TrainerCallback):
    """The weights after each optimizer step (and before the first) to every worker."""

    def __init__(self, owner: TrlFabric) -> None:
        self.owner = owner

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.owner.push(kw["model"])

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.owner.push(kw["model"])


def unscored(fn: Any) -> bool:
    """Whether reward function `fn` answers None for failed rollouts (`leave_failed_unscored`)."""
    return bool(getattr(fn, "rlfabric_unscored", False))


def leave_failed_unscored(trainer: Any) -> None:
    """Each of `trainer`'s reward functions (not its reward models) answers None for a row
    whose `rollout_failed` is set: TRL leaves such a row out of its group's baseline and gives
    it no advantage. Done in place, once per function."""
    from torch import nn

    funcs = trainer.reward_funcs
    for i, fn in enumerate(funcs):
        if not unscored(fn) and not isinstance(fn, nn.Module):
            funcs[i] = _unscoring(fn)


def _unscoring(fn: Callable[..., Any]) -> Callable[..., Any]:
    def blank(rewards: list[Any], failed: list[str] | None) -> list[Any]:
        if not failed or not any(failed):
            return rewards
        return [None if f else r for r, f in zip(rewards, failed, strict=True)]

    wrapped: Any
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)):  # noqa: B004  # an object with an async __call__
        @functools.wraps(fn)
        async def wrapped(*args: Any, **kw: Any) -> list[Any]:
            return blank(await fn(*args, **kw), kw.get("rollout_failed"))
    else:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kw: Any) -> list[Any]:
            return blank(fn(*args, **kw), kw.get("rollout_failed"))
    wrapped.rlfabric_unscored = True
    return cast(Callable[..., Any], wrapped)


def tokenize(prompts: list[Any], trainer: Any) -> list[list[int]]:
    """TRL's prompts as its own generation tokenizes them: chats through the chat template
    (with its tools and `chat_template_kwargs`), text as is."""
    tok = trainer.processing_class
    if prompts and isinstance(prompts[0], list):
        got = tok.apply_chat_template(
            conversation=prompts, tools=getattr(trainer, "tools", None) or None,
            chat_template=getattr(trainer, "chat_template", None), add_generation_prompt=True,
            tokenize=True, return_dict=True, **(trainer.chat_template_kwargs or {}))
        return [list(x) for x in got["input_ids"]]
    return [list(x) for x in tok(text=prompts)["input_ids"]]


def sampling_of(trainer: Any) -> dict[str, Any]:
    """TRL's sampling settings as rlfabric's; `ValueError` for one rlfabric cannot honour."""
    for name, off in (("min_p", None), ("repetition_penalty", 1.0)):
        if getattr(trainer, name, off) not in (off, 0.0):
            raise ValueError(f"GRPOConfig({name}={getattr(trainer, name)}): rlfabric workers "
                             f"sample with temperature, top_p and top_k only; leave {name} at "
                             "its default")
    return {"max_tokens": int(trainer.max_completion_length),
            "temperature": float(trainer.temperature), "top_p": float(trainer.top_p),
            "top_k": int(trainer.top_k or 0), "stop_token_ids": end_tokens(trainer)}


def end_tokens(trainer: Any) -> tuple[int, ...]:
    """The tokens TRL's own generation ends a completion at: the model's generation config's
    end tokens and the tokenizer's (`GRPOTrainer.eos_token_ids`, computed as TRL does where
    this TRL has no such attribute)."""
    ids = getattr(trainer, "eos_token_ids", None)
    if ids is None:
        gen = getattr(getattr(trainer, "model", None), "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        tok = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        if getattr(tok, "eos_token_id", None) is not None:
            ids.append(tok.eos_token_id)
    return tuple(sorted({int(i) for i in ids}))


def _base_state(model: Any) -> dict[str, Any]:
    """A PEFT model's base weights as the base model names them (what workers serve)."""
    out = {}
    for k, v in model.get_base_model().state_dict().items():
        if "lora_" in k:
            continue
        out[k.replace(".base_layer.", ".")] = v.detach()
    return out


def _base_checksum(model: Any) -> str:
    return checksum(_base_state(model))


def _weights(model: Any, name: str = ADAPTER) -> tuple[Adapter | None, dict[str, Any]]:
    if hasattr(model, "peft_config"):  # a PEFT model: its adapter, in PEFT's own layout
        from peft import get_peft_model_state_dict

        cfg = model.peft_config["default"]
        adapter = Adapter(name=name, rank=cfg.r, alpha=float(cfg.lora_alpha),
                          target_modules=tuple(sorted(cfg.target_modules)))
        return adapter, {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}
    return None, {k: v.detach() for k, v in model.state_dict().items()}
