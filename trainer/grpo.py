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
import torch

from rlfabric.schemas import (
    Adapter,
    PackedI32,
    PauseMode,
    RolloutError,
    RolloutRequest,
    RolloutResult,
    SamplingParams,
)
from rlfabric.telemetry import spans
from rlfabric.tensors.lora import LoraModel
from rlfabric.trainer.buffer import RolloutBuffer, sample_version
from rlfabric.trainer.client import FabricClient
from rlfabric.trainer.config import LORA_NAME, LORA_TARGETS, GRPOConfig
from rlfabric.trainer.errors import RolloutFailed
from rlfabric.trainer.task import LetterTask


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
    gen_s: float
    train_s: float
    pause_ms: float
    update_ms: float
    resume_ms: float
    wall_s: float
    tokens_per_s: float
    #: bytes the update after this step pushed (the adapter's alone with --lora)
    update_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class GRPOTrainer:
    def __init__(self, fabric: FabricClient, model: torch.nn.Module, cfg: GRPOConfig, *,
                 task: LetterTask | None = None,
                 on_step: Callable[[StepStats], None] | None = None) -> None:
        self.fabric = fabric
        self.cfg = cfg
        self.config: Any = model.config
        self.task = task or LetterTask(max_tokens=cfg.max_tokens)
        self.on_step = on_step
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

    async def _generate(self, step: int) -> tuple[list[RolloutResult], float]:
        t0 = time.perf_counter()
        out: list[RolloutResult] = []
        async for group in self.fabric.generate_groups(self._requests(step),
                                                       timeout=self.cfg.request_timeout):
            errors = [r for r in group if isinstance(r, RolloutError)]
            if errors:
                e = errors[0]
                raise RolloutFailed(f"rollout {e.request_id} failed on "
                                    f"{e.worker_id or 'no worker'}: {e.code}: {e.message}",
                                    error=e)
            out.extend(r for r in group if isinstance(r, RolloutResult))
        return out, time.perf_counter() - t0

    # ---- learning ----
    def _train(self, batch: list[RolloutResult]) -> tuple[float, float, float | None]:
        """One optimizer step on `batch` (runs in a worker thread). Returns reward mean, std
        and the mismatch over samples produced by the version the trainer holds."""
        cfg = self.cfg
        groups: dict[str, list[RolloutResult]] = {}
        for r in batch:
            groups.setdefault(r.request_id, []).append(r)
        rewards_all: list[float] = []
        seqs, advs, olds, plens, versions = [], [], [], [], []
        for rid, g in groups.items():
            rs = torch.tensor([self.task.reward(r.completion_token_ids.tolist()) for r in g])
            rewards_all.extend(rs.tolist())
            adv = (rs - rs.mean()) / (rs.std(unbiased=False) + 1e-4)
            for r, a in zip(g, adv.tolist(), strict=True):
                comp = r.completion_token_ids.tolist()
                if not comp:
                    continue
                seqs.append(self._prompt_ids[rid] + comp)
                plens.append(len(self._prompt_ids[rid]))
                advs.append(a)
                olds.append(torch.from_numpy(r.logprobs.numpy().copy()))
                versions.append(sample_version(r) if len(r.version_spans) == 1 else -2)
        rw = torch.tensor(rewards_all)
        reward = (rw.mean().item(), rw.std(unbiased=False).item()) if rewards_all else (
            math.nan, math.nan)
        if not seqs:  # every sample stale or empty: nothing to learn from, no step
            return (*reward, None)
        width = max(len(s) for s in seqs)
        pad = self.config.pad_token_id
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        earlier = self._earlier_logp(ids, mask, versions)
        loss_terms, mismatch = [], []
        for k, s in enumerate(seqs):
            p, n = plens[k], len(s) - plens[k]
            new = logp[k, p - 1:p - 1 + n].gather(1, ids[k, p:p + n, None])[:, 0]
            old = olds[k][:n]
            if versions[k] == self.version:
                mismatch.append((new.detach() - old).abs().mean().item())
            elif k in earlier:  # a stale sample, checked against the weights that made it
                ref = earlier[k][p - 1:p - 1 + n].gather(1, ids[k, p:p + n, None])[:, 0]
                mismatch.append((ref - old).abs().mean().item())
            ratio = torch.exp(new - old)
            a = advs[k]
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

    async def _publish(self) -> tuple[float, float, float]:
        """pause -> update_weights(v + 1) -> resume, each timed (ms)."""
        mode: PauseMode = "keep" if self.cfg.async_mode else "wait"
        t0 = time.perf_counter()
        await self.fabric.pause(mode=mode)
        t1 = time.perf_counter()
        await self._push(self.version + 1)
        t2 = time.perf_counter()
        await self.fabric.resume()
        t3 = time.perf_counter()
        self.version += 1
        self._remember()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3

    async def _push(self, version: int) -> None:
        """The trained weights as `version`: the whole model, or with --lora the adapter."""
        if isinstance(self.model, LoraModel):
            state = self.model.adapter_state()
            await self.fabric.update_weights(version, state_dict=state, adapter=self.adapter,
                                             transport=self.cfg.transport)
        else:
            state = self.model.state_dict()
            await self.fabric.update_weights(version, state_dict=state,
                                             transport=self.cfg.transport)
        self.update_bytes = sum(t.numel() * t.element_size() for t in state.values())

    # ---- the loop ----
    async def push_initial(self) -> None:
        """Version 0: the trainer's own weights, so workers never need to share its seed
        (with --lora, the base weights and the adapter's version 0 beside them)."""
        self.model.eval()
        if self.adapter is not None:
            await self.fabric.update_weights(0, state_dict=self.base_state,
                                             transport=self.cfg.transport)
        await self._push(0)
        self._remember()
        self.model.train()

    async def run(self) -> list[StepStats]:
        await self.push_initial()
        pending: dict[int, Any] = {}
        async with anyio.create_task_group() as tg:
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
                results, gen_s = box["out"]
                if self.cfg.async_mode and step + 1 < self.cfg.steps:
                    start(step + 1)  # overlaps this step's training and update
                self.buffer.add(results)
                batch = self.buffer.take(self.version)
                try:
                    with spans.within(box["span"]):
                        t0 = time.perf_counter()
                        with spans.span("train", attributes={"rlfabric.samples": len(batch)}):
                            reward, reward_std, mismatch = await anyio.to_thread.run_sync(
                                self._train, batch)
                        train_s = time.perf_counter() - t0
                        pause_ms, update_ms, resume_ms = await self._publish()
                finally:
                    box["span"].end()
                if not self.cfg.async_mode and step + 1 < self.cfg.steps:
                    start(step + 1)
                tokens = sum(len(r.completion_token_ids) for r in results)
                wall = time.perf_counter() - t_step
                stats = StepStats(
                    step=step, version=self.version, reward=reward, reward_std=reward_std,
                    mismatch=mismatch, samples=len(batch), tokens=tokens,
                    stale_dropped=self.buffer.dropped,
                    two_version_samples=sum(1 for r in results if len(r.version_spans) > 1),
                    gen_s=gen_s, train_s=train_s, pause_ms=pause_ms, update_ms=update_ms,
                    resume_ms=resume_ms, wall_s=wall,
                    tokens_per_s=tokens / gen_s if gen_s > 0 else math.nan,
                    update_bytes=self.update_bytes)
                self.history.append(stats)
                if self.on_step is not None:
                    self.on_step(stats)
        return self.history
