"""TRL's `GRPOTrainer` on rlfabric workers: two of its arguments change, nothing else.

    with TrlFabric("nats://127.0.0.1:4222", prefix="rl") as fabric:
        trainer = GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=...,
                              rollout_func=fabric.rollout_func, callbacks=[fabric.sync])
        trainer.train()

`rollout_func` renders and tokenizes TRL's prompts as TRL does, sends one request per prompt
TRL hands it (TRL repeats each prompt `num_generations` times) with TRL's sampling settings and
`min_weight_version` = the version of the current step, and returns the completions, the
workers' logprobs of them, and as extra fields (which reward functions and logs can read) the
`worker_id` and `weight_version` behind each. `sync` (a `TrainerCallback`) pushes the model's
weights, or its PEFT adapter, to every worker after each optimizer step as version =
`state.global_step`; a push the quorum did not ack stops training with its report
(`WeightSyncFailed`), so nothing ever trains on rollouts from weights it did not push.
`agent_rollout_func` runs each prompt as an agent episode against `rlfabric gateway` and returns
the session's recorded trajectory, with `env_mask` 0 on the tokens the model did not sample.

TRL calls both from its training thread; the bus client runs in a thread of its own (an anyio
blocking portal). Install with `pip install 'rlfabric[trl]'`.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from anyio.from_thread import BlockingPortal, start_blocking_portal

try:
    import trl  # noqa: F401  # what this module drives
    from transformers import TrainerCallback
except ImportError as exc:  # an optional extra
    raise ImportError(f"rlfabric.integrations.trl needs TRL ({exc}): "
                      "pip install 'rlfabric[trl]'") from exc

from rlfabric.bus import QuorumPolicy
from rlfabric.bus.sessions import read_trajectory
from rlfabric.errors import RLFabricError
from rlfabric.schemas import (
    Adapter,
    PackedI32,
    RolloutError,
    RolloutRequest,
    RolloutResult,
    SamplingParams,
)
from rlfabric.trainer import FabricClient
from rlfabric.trainer.errors import RolloutFailed

#: an agent episode: (openai.AsyncOpenAI on the gateway, TRL's prompt, the session id to send
#: as `X-Session-ID`) -> extra fields for the reward functions (e.g. the final answer)
Episode = Callable[[Any, Any, str], Awaitable[dict[str, Any]]]
#: the adapter name PEFT models are served under
ADAPTER = "trl"


class WeightSyncFailed(RLFabricError):
    """A step's weights did not reach the quorum: training stops rather than sample from
    weights the trainer no longer holds. `report` names who acked and who did not."""

    def __init__(self, message: str, report: Any = None) -> None:
        super().__init__(message)
        self.report = report


class TrajectoryMissing(RLFabricError):
    """An agent episode left no trajectory on the bus under its session id."""


class TrlFabric:
    """A connection to an rlfabric job for one TRL run (use it as a context manager)."""

    def __init__(self, nats: str, *, prefix: str = "rl", transport: str = "shm",
                 policy: QuorumPolicy | None = None, timeout: float = 600.0,
                 **connect: Any) -> None:
        self.nats = nats
        self.prefix = prefix
        self.transport = transport
        self.policy = policy
        self.timeout = timeout
        self._connect = connect
        #: the version the workers serve (the last one pushed); requests ask for it
        self.version = -1
        #: each push's FanoutReport, by version
        self.reports: dict[int, Any] = {}
        self.sync = _Sync(self)
        self._stack = contextlib.ExitStack()
        self._portal: BlockingPortal | None = None
        self.fabric: FabricClient | None = None
        self._run = uuid.uuid4().hex[:8]

    def __enter__(self) -> TrlFabric:
        self._portal = self._stack.enter_context(start_blocking_portal())
        self.fabric = self._stack.enter_context(self._portal.wrap_async_context_manager(
            FabricClient.connect(self.nats, prefix=self.prefix, **self._connect)))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._portal = self.fabric = None

    def call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run `fn(*args)` on the bus client's loop, from TRL's thread."""
        if self._portal is None:
            raise RuntimeError("TrlFabric is not open: use it as `with TrlFabric(...) as f:`")
        return self._portal.call(fn, *args)

    @property
    def client(self) -> FabricClient:
        if self.fabric is None:
            raise RuntimeError("TrlFabric is not open: use it as `with TrlFabric(...) as f:`")
        return self.fabric

    # ---- weights ----
    def push(self, model: Any, version: int) -> None:
        """`model`'s weights (a PEFT model: its adapter) to every worker as `version`."""
        adapter, state = _weights(model)
        try:
            rep = self.call(self._push, state, adapter, version)
        except RLFabricError as exc:
            raise WeightSyncFailed(f"the weights of step {version} did not reach the fleet: "
                                   f"{exc}; training stops (the workers still serve "
                                   f"v{self.version})", getattr(exc, "report", None)) from exc
        self.reports[version] = rep
        self.version = version

    async def _push(self, state: dict[str, Any], adapter: Adapter | None, version: int) -> Any:
        return await self.client.update_weights(version, state_dict=state, adapter=adapter,
                                                transport=self.transport, policy=self.policy)

    # ---- single-turn rollouts ----
    def rollout_func(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """TRL's `rollout_func`: one completion per prompt received."""
        ids = tokenize(prompts, trainer)
        step = trainer.state.global_step
        sampling = sampling_of(trainer)
        seed = getattr(trainer.args, "seed", 0)
        reqs = [RolloutRequest(
            request_id=f"trl-{self._run}-s{step}-{i}", prompt_token_ids=PackedI32(p),
            min_weight_version=max(self.version, 0), adapter=self._adapter_name(trainer),
            sampling=SamplingParams(**sampling, seed=(seed * 1_000_003 + step) * 4096 + i))
            for i, p in enumerate(ids)]
        got = self.call(self._collect, reqs)
        out: dict[str, list[Any]] = {"prompt_ids": ids, "completion_ids": [], "logprobs": [],
                                     "worker_id": [], "weight_version": []}
        for r in reqs:
            res = got[r.request_id]
            out["completion_ids"].append(res.completion_token_ids.tolist())
            out["logprobs"].append(res.logprobs.tolist())
            out["worker_id"].append(res.worker_id)
            spans = {s.version for s in res.version_spans}
            out["weight_version"].append(spans.pop() if len(spans) == 1 else -2)
        return out

    def _adapter_name(self, trainer: Any) -> str:
        return ADAPTER if hasattr(trainer.model, "peft_config") else ""

    async def _collect(self, reqs: list[RolloutRequest]) -> dict[str, RolloutResult]:
        got: dict[str, RolloutResult] = {}
        async for r in self.client.generate(reqs, timeout=self.timeout):
            if isinstance(r, RolloutError):
                where = r.worker_id or "no worker"
                raise RolloutFailed(f"rollout {r.request_id} failed on {where}: {r.code}: "
                                    f"{r.message}", error=r)
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
            sids = [f"trl-{self._run}-s{trainer.state.global_step}-{i}"
                    for i in range(len(prompts))]
            extras = self.call(self._episodes, base_url, api_key, episode, prompts, sids,
                               concurrency)
            out: dict[str, list[Any]] = {k: [] for k in (
                "prompt_ids", "completion_ids", "logprobs", "env_mask", "weight_version",
                "segments", "session_id")}
            for sid in sids:
                for k, v in self.call(self._trajectory, sid).items():
                    out[k].append(v)
            for extra in extras:
                for k, v in extra.items():
                    out.setdefault(k, []).append(v)
            return out

        return rollout

    async def _episodes(self, base_url: str, api_key: str, episode: Episode,
                        prompts: list[Any], sids: list[str], concurrency: int
                        ) -> list[dict[str, Any]]:
        import anyio
        import openai

        out: list[dict[str, Any]] = [{} for _ in prompts]
        limit = anyio.Semaphore(concurrency)
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key,
                                      max_retries=0, timeout=self.timeout) as client:
            async def one(i: int) -> None:
                async with limit:
                    out[i] = await episode(client, prompts[i], sids[i])

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
        return out

    async def _trajectory(self, sid: str) -> dict[str, Any]:
        traj = await read_trajectory(self.client.bus, sid)
        if traj is None or not traj.segments:
            raise TrajectoryMissing(f"session {sid}: no trajectory was recorded (did the "
                                    "episode send its turns with this X-Session-ID?)")
        # branched sessions have several segments: TRL takes one sequence, the longest
        seg = max(traj.segments, key=lambda s: len(s.token_ids))
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
        self.owner.push(kw["model"], state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.owner.push(kw["model"], state.global_step)


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
            "top_k": int(trainer.top_k or 0)}


def _weights(model: Any) -> tuple[Adapter | None, dict[str, Any]]:
    if hasattr(model, "peft_config"):  # a PEFT model: its adapter, in PEFT's own layout
        from peft import get_peft_model_state_dict

        cfg = model.peft_config["default"]
        adapter = Adapter(name=ADAPTER, rank=cfg.r, alpha=float(cfg.lora_alpha),
                          target_modules=tuple(sorted(cfg.target_modules)))
        return adapter, {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}
    return None, {k: v.detach() for k, v in model.state_dict().items()}
