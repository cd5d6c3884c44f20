"""The reference GRPO loop: generate groups through the fabric, score, group-normalise, step,
publish the new weights.

Per step (sync): n samples for each prompt at the current version -> rewards -> advantages
`(r - mean(group)) / (std(group) + eps)` -> the clipped policy-gradient loss with the rollout
logprobs as the behaviour policy -> one optimizer step -> `pause(wait)` ->
`update_weights(v + 1)` -> `resume()`.

`async_mode`: generation of step k+1 runs while step k trains (one step off-policy). The
update then uses a `keep` pause, so requests in flight continue under the new weights and
their `version_spans` show the switch; `RolloutBuffer(max_staleness=1)` bounds how old a
sample may be.

A sample that fails (a `RolloutError`) is left out of the loss and of its group's baseline,
counted in the step's `failed`; more than `max_failed` of a step's samples failing stops the run
with `RolloutFailed` naming the causes (`trainer.failures`).

Per step it also measures the trainer/rollout logprob mismatch: mean |trainer - rollout| over
the samples produced entirely by the version the trainer holds, which is the weight-sync check
(1e-6-ish on CPU in fp32 when the weights really are the same).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import anyio
import msgspec
import torch

from rlfabric.concurrency import beside
from rlfabric.schemas import (
    Adapter,
    PackedI32,
    PauseMode,
    RolloutRequest,
    RolloutResult,
    SamplingParams,
)
from rlfabric.telemetry import spans
from rlfabric.tensors.lora import LoraModel
from rlfabric.trainer.buffer import RolloutBuffer, sample_version
from rlfabric.trainer.client import FabricClient
from rlfabric.trainer.config import LORA_NAME, LORA_TARGETS, GRPOConfig
from rlfabric.trainer.failures import StepFailures
from rlfabric.trainer.task import LetterTask
from rlfabric.trainer.tools import AgentRollouts, Episode, Sample


@dataclass(slots=True)
class _Rollouts:
    """A step's rollouts: results (the letter task), or episodes and their samples (tools)."""

    results: list[RolloutResult]
    gen_s: float
    episodes: list[Episode] | None = None
    samples: list[Sample] | None = None
    #: samples that came back as errors: left out of the loss and of their group's baseline
    failed: int = 0

    @property
    def moved(self) -> int:
        """Results sampled by more than one worker: each went on from the tokens a worker
        that drained or died had sampled."""
        return sum(len({s.worker for s in r.version_spans}) > 1 for r in self.results)


@dataclass(kw_only=True, slots=True)
class StepStats:
    step: int
    version: int
    reward: float
    reward_std: float
    mismatch: float | None
    samples: int
    tokens: int
    stale_dropped: int
    two_version_samples: int
    #: samples that failed (left out of the loss; the run stops past --max-failed)
    failed: int
    gen_s: float
    train_s: float
    pause_ms: float
    update_ms: float
    resume_ms: float
    wall_s: float
    tokens_per_s: float
    #: bytes the update after this step pushed (the adapter's alone with --lora)
    update_bytes: int = 0
    #: colocated: the workers' sleep before training and wake before the update (ms)
    sleep_ms: float = 0.0
    wake_ms: float = 0.0
    #: samples that went on from a worker that drained or died (sampled by two workers)
    moved: int = 0
    #: the tools task's episodes: turns, tool calls and trajectory segments, on average
    turns_per_episode: float = 0.0
    tool_calls_per_episode: float = 0.0
    segments_per_episode: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class GRPOTrainer:
    def __init__(self, fabric: FabricClient, model: torch.nn.Module, cfg: GRPOConfig, *,
                 task: LetterTask | None = None, agent: AgentRollouts | None = None,
                 on_step: Callable[[StepStats], None] | None = None) -> None:
        self.fabric = fabric
        self.cfg = cfg
        #: the tools task: episodes through the gateway instead of the letter task's requests
        self.agent = agent
        self.config: Any = model.config
        self.task = task or LetterTask(max_tokens=cfg.max_tokens)
        self.on_step = on_step
        self.device = torch.device(cfg.device)
        model = model.to(self.device)
        base = dict(model.state_dict())
        self.full_bytes = sum(t.numel() * t.element_size() for t in base.values())
        #: with --lora, what version 0 pushes beside the adapter: the base weights, by their
        #: names before wrapping (frozen: no copy needed)
        self.base_state: dict[str, torch.Tensor] = {}
        self.adapter: Adapter | None = None
        if cfg.lora_rank:
            self.base_state = base
            self.adapter = Adapter(name=LORA_NAME, rank=cfg.lora_rank,
                                   alpha=2.0 * cfg.lora_rank, target_modules=LORA_TARGETS)
            lora_model = LoraModel(model, self.adapter)
            lora_model.to(self.device)  # its A and B matrices are made on the CPU
            self.model: torch.nn.Module = lora_model
            params = list(lora_model.lora_parameters())
        else:
            self.model = model
            params = list(model.parameters())
        self.opt = torch.optim.Adam(params, lr=cfg.lr)
        self.update_bytes = 0
        self.version = 0
        self.buffer = RolloutBuffer(max_staleness=cfg.max_staleness if cfg.async_mode else 0)
        self.history: list[StepStats] = []
        self._prompt_ids: dict[str, list[int]] = {}
        self._published: dict[int, dict[str, torch.Tensor]] = {}

    # ---- rollouts ----
    def _requests(self, step: int) -> list[RolloutRequest]:
        cfg = self.cfg
        reqs = []
        for i in range(cfg.prompts_per_step):
            rid = f"s{step}p{i}"
            prompt = self.task.prompt(step * cfg.prompts_per_step + i)
            self._prompt_ids[rid] = prompt
            reqs.append(RolloutRequest(
                request_id=rid, group_id=f"s{step}", prompt_token_ids=PackedI32(prompt),
                min_weight_version=self.version,
                adapter=self.adapter.name if self.adapter else "",
                sampling=SamplingParams(max_tokens=cfg.max_tokens, n=cfg.group_size,
                                        temperature=cfg.temperature,
                                        seed=(step * 7919 + i) * 64)))
        return reqs

    async def _generate(self, step: int) -> _Rollouts:
        t0 = time.perf_counter()
        if self.agent is not None:
            episodes, samples = await self.agent.step(step, self.cfg.prompts_per_step,
                                                      self.cfg.group_size)
            return _Rollouts([], time.perf_counter() - t0, episodes, samples)
        out: list[RolloutResult] = []
        failures = StepFailures(step)
        async for group in self.fabric.generate_groups(self._requests(step),
                                                       timeout=self.cfg.request_timeout):
            out.extend(r for r in group if not failures.add(r) and isinstance(r, RolloutResult))
        failures.check(self.cfg.max_failed, "--max-failed")
        return _Rollouts(out, time.perf_counter() - t0, failed=failures.failed)

    def _batch(self, out: _Rollouts) -> tuple[list[Sample], int, int]:
        """What this step learns from (the letter task: through the staleness buffer), the
        tokens sampled, and the samples more than one version made."""
        if out.samples is not None:
            return (out.samples, sum(sum(s.mask) for s in out.samples),
                    sum(1 for s in out.samples if s.version == -2))
        self.buffer.add(out.results)
        return (self._samples(self.buffer.take(self.version)),
                sum(len(r.completion_token_ids) for r in out.results),
                sum(1 for r in out.results if len(r.version_spans) > 1))

    def _samples(self, results: list[RolloutResult]) -> list[Sample]:
        out = []
        for r in results:
            prompt, comp = self._prompt_ids[r.request_id], r.completion_token_ids.tolist()
            out.append(Sample(ids=prompt + comp, mask=[0] * len(prompt) + [1] * len(comp),
                              old=[0.0] * len(prompt) + r.logprobs.tolist(),
                              version=sample_version(r) if len(r.version_spans) == 1 else -2,
                              group=r.request_id, reward=self.task.reward(comp)))
        return out

    # ---- learning ----
    def _train(self, batch: list[Sample]) -> tuple[float, float, float | None]:
        """One optimizer step on `batch` (runs in a worker thread): the clipped policy
        gradient over the sampled tokens only, advantages normalised within each group.
        Returns reward mean, std and the mismatch over samples produced by the version the
        trainer holds."""
        cfg = self.cfg
        rw = torch.tensor([s.reward for s in batch])
        reward = (rw.mean().item(), rw.std(unbiased=False).item()) if batch else (
            math.nan, math.nan)
        advs = torch.zeros(len(batch))
        groups: dict[str, list[int]] = {}
        for k, s in enumerate(batch):
            groups.setdefault(s.group, []).append(k)
        for idx in groups.values():
            rs = rw[idx]
            advs[idx] = (rs - rs.mean()) / (rs.std(unbiased=False) + 1e-4)
        keep = [k for k, s in enumerate(batch) if any(s.mask[1:])]
        if not keep:  # every sample stale or empty: nothing to learn from, no step
            return (*reward, None)
        seqs = [batch[k] for k in keep]
        width = max(len(s.ids) for s in seqs)
        pad = self.config.pad_token_id
        dev = self.device
        ids = torch.tensor([s.ids + [pad] * (width - len(s.ids)) for s in seqs], device=dev)
        mask = torch.tensor([[1] * len(s.ids) + [0] * (width - len(s.ids)) for s in seqs],
                            device=dev)
        logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        versions = [s.version for s in seqs]
        earlier = self._earlier_logp(ids, mask, versions)
        loss_terms, mismatch = [], []
        for row, s in enumerate(seqs):
            pos = torch.tensor([t for t in range(1, len(s.ids)) if s.mask[t]], device=dev)
            tok = ids[row, pos, None]
            new = logp[row, pos - 1].gather(1, tok)[:, 0]
            old = torch.tensor([s.old[t] for t in pos.tolist()], device=dev)
            if s.version == self.version:
                mismatch.append((new.detach() - old).abs().mean().item())
            elif row in earlier:  # a stale sample, checked against the weights that made it
                ref = earlier[row][pos - 1].gather(1, tok)[:, 0]
                mismatch.append((ref - old).abs().mean().item())
            ratio = torch.exp(new - old)
            a = advs[keep[row]].item()
            clipped = torch.clamp(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps)
            loss_terms.append(-torch.minimum(ratio * a, clipped * a).mean())
        loss = torch.stack(loss_terms).mean()
        self.opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        self.opt.step()
        return (*reward, sum(mismatch) / len(mismatch) if mismatch else None)

    def _earlier_logp(self, ids: torch.Tensor, mask: torch.Tensor,
                      versions: list[int]) -> dict[int, torch.Tensor]:
        """Log-probs of samples made by an earlier published version, under those weights
        (async mode keeps the last `max_staleness` versions for this check)."""
        out: dict[int, torch.Tensor] = {}
        for v, state in self._published.items():
            rows = [k for k, sv in enumerate(versions) if sv == v and v != self.version]
            if not rows:
                continue
            with torch.no_grad():
                logits = torch.func.functional_call(
                    self.model, state, (), {"input_ids": ids[rows], "attention_mask": mask[rows]}
                ).logits.float()
            for k, row in zip(rows, torch.log_softmax(logits, dim=-1), strict=True):
                out[k] = row
        return out

    def _remember(self) -> None:
        if not self.cfg.async_mode:
            return
        self._published[self.version] = {k: v.detach().clone()
                                         for k, v in self.model.state_dict().items()}
        for v in [v for v in self._published if v < self.version - self.cfg.max_staleness]:
            del self._published[v]

    async def _sleep(self) -> float:
        """Colocated: the workers give the device back for training (ms; 0 when not)."""
        if not self.cfg.sleep_level:
            return 0.0
        t0 = time.perf_counter()
        await self.fabric.sleep(level=self.cfg.sleep_level)
        return (time.perf_counter() - t0) * 1e3

    async def _publish(self) -> dict[str, float]:
        """pause -> (colocated: wake) -> update_weights(v + 1) -> resume, each timed (ms)."""
        mode: PauseMode = "keep" if self.cfg.async_mode else "wait"
        ms: dict[str, float] = {}
        t0 = time.perf_counter()
        await self.fabric.pause(mode=mode)
        ms["pause"], t0 = _since(t0)
        if self.cfg.sleep_level:  # held by the pause until the update is in
            await self.fabric.wake()
            ms["wake"], t0 = _since(t0)
        await self._push(self.version + 1)
        ms["update"], t0 = _since(t0)
        await self.fabric.resume()
        ms["resume"], _ = _since(t0)
        self.version += 1
        self._remember()
        return ms

    async def _push(self, version: int) -> None:
        """The trained weights as `version`: the whole model, or with --lora the adapter."""
        if isinstance(self.model, LoraModel):
            state = self.model.adapter_state()
            await self.fabric.update_weights(version, state_dict=state, adapter=self.adapter,
                                             transport=self.cfg.transport, delta=self.cfg.delta)
        else:
            state = self.model.state_dict()
            await self.fabric.update_weights(version, state_dict=state,
                                             transport=self.cfg.transport, delta=self.cfg.delta)
        self.update_bytes = self.fabric.last_push_bytes if self.cfg.delta else \
            sum(t.numel() * t.element_size() for t in state.values())

    # ---- the loop ----
    async def push_initial(self) -> None:
        """Version 0: the trainer's own weights, so workers never need to share its seed
        (with --lora, the base weights and the adapter's version 0 beside them)."""
        self.model.eval()
        if self.adapter is not None:
            await self.fabric.update_weights(0, state_dict=self.base_state,
                                             transport=self.cfg.transport)
            # its versions run on that base only: a worker on another refuses them
            self.adapter = msgspec.structs.replace(self.adapter,
                                                   base=self.fabric.pushed.names("")[-1])
        await self._push(0)
        self._remember()
        self.model.train()

    def _stats(self, step: int, out: _Rollouts, samples: int, tokens: int, two: int,
               trained: tuple[float, float, float | None], train_s: float,
               timed: dict[str, float], wall: float) -> StepStats:
        reward, reward_std, mismatch = trained
        eps = out.episodes or []
        if eps:  # the tools task: an episode's reward, whatever its segments
            rw = torch.tensor([e.reward for e in eps])
            reward, reward_std = rw.mean().item(), rw.std(unbiased=False).item()
        n = max(1, len(eps))
        return StepStats(
            step=step, version=self.version, reward=reward, reward_std=reward_std,
            mismatch=mismatch, samples=samples, tokens=tokens,
            stale_dropped=self.buffer.dropped, two_version_samples=two, failed=out.failed,
            moved=out.moved, gen_s=out.gen_s,
            train_s=train_s, pause_ms=timed["pause"], update_ms=timed["update"],
            resume_ms=timed["resume"], sleep_ms=timed.get("sleep", 0.0),
            wake_ms=timed.get("wake", 0.0),
            wall_s=wall, tokens_per_s=tokens / out.gen_s if out.gen_s > 0 else math.nan,
            update_bytes=self.update_bytes,
            turns_per_episode=sum(e.turns for e in eps) / n,
            tool_calls_per_episode=sum(e.calls for e in eps) / n,
            segments_per_episode=sum(e.segments for e in eps) / n)

    async def run(self) -> list[StepStats]:
        await self.push_initial()
        pending: dict[int, Any] = {}
        async with beside() as tg:  # a failed step raises as itself (`RolloutFailed`)
            async def gen_into(step: int, box: dict[str, Any]) -> None:
                with spans.within(box["span"]):
                    box["out"] = await self._generate(step)
                box["done"].set()

            def start(step: int) -> None:
                # one trace per step: its generation (begun during the previous step in
                # async mode), training, pause, update and resume
                span = spans.start("step", attributes={spans.STEP: step})
                box = {"done": anyio.Event(), "span": span}
                pending[step] = box
                tg.start_soon(gen_into, step, box)

            start(0)
            for step in range(self.cfg.steps):
                t_step = time.perf_counter()
                box = pending.pop(step)
                await box["done"].wait()
                out: _Rollouts = box["out"]
                if self.cfg.async_mode and step + 1 < self.cfg.steps:
                    start(step + 1)  # overlaps this step's training and update
                batch, tokens, two = self._batch(out)
                try:
                    with spans.within(box["span"]):
                        slept = await self._sleep()
                        t0 = time.perf_counter()
                        with spans.span("train", attributes={"rlfabric.samples": len(batch)}):
                            trained = await anyio.to_thread.run_sync(self._train, batch)
                        train_s = time.perf_counter() - t0
                        timed = {**await self._publish(), "sleep": slept}
                finally:
                    box["span"].end()
                if not self.cfg.async_mode and step + 1 < self.cfg.steps:
                    start(step + 1)
                stats = self._stats(step, out, len(batch), tokens, two, trained, train_s,
                                    timed, time.perf_counter() - t_step)
                self.history.append(stats)
                if self.on_step is not None:
                    self.on_step(stats)
        return self.history


def _since(t0: float) -> tuple[float, float]:
    """Milliseconds since `t0`, and now."""
    now = time.perf_counter()
    return (now - t0) * 1e3, now
