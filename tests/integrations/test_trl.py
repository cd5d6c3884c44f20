"""TRL's GRPOTrainer (the real package, unpatched) trains through two `rlfabric worker`
processes with two arguments changed (`rollout_func`, `callbacks`): every completion comes from
a worker, both workers ack each step's weights as version = global step, the workers' logprobs
are those of TRL's model at the version that sampled them, and a worker killed during a step
loses no completion."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import taken_logprobs

trl = pytest.importorskip("trl", reason="TRL is not installed: pip install 'rlfabric[trl]'")

from datasets import Dataset  # noqa: E402  (TRL's own dependency)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from rlfabric.bus import Limits, QuorumPolicy  # noqa: E402
from rlfabric.integrations.trl import TrlFabric  # noqa: E402
from rlfabric.tensors.models import build_model, write_checkpoint  # noqa: E402

# TRL and transformers warn of their own deprecations, and TRL of a vLLM newer than it lists
# (it never drives vLLM here: the workers do); the suite turns warnings into errors
pytestmark = [pytest.mark.nats, pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning",
                                         "ignore:TRL currently supports vLLM:UserWarning")]
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
ENGINES = ["torch", pytest.param("vllm", marks=pytest.mark.vllm)]


def engine_flags(engine: str) -> tuple[str, ...]:
    if engine == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed (README, 'vLLM')")
        return ("--max-model-len", "512")
    return ()


def shorter(completions: list[Any], **_: Any) -> list[float]:
    """A toy reward: short answers."""
    return [-float(len(c[0]["content"])) for c in completions]


def config(out: Path, steps: int) -> Any:
    return trl.GRPOConfig(output_dir=str(out), use_cpu=True, report_to=[], save_strategy="no",
                          per_device_train_batch_size=8, num_generations=4, max_steps=steps,
                          max_completion_length=128, learning_rate=1e-3, logging_steps=1,
                          seed=0, temperature=1.0)


def dataset() -> Any:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"say {w}"}]
                                         for w in ("hi", "yes", "no", "ok", "go", "up")]})


def kill_when_busy(fabric: TrlFabric, procs: dict[str, Any], killed: list[str],
                   done: threading.Event) -> None:
    """SIGKILL the first worker seen with a request in flight (and the engine processes it
    started: vLLM's); its id goes to `killed`. (A `generate` call's requests travel in one
    message: one worker holds them all.)"""
    import psutil  # accelerate's dependency, and vLLM's

    while not done.is_set():
        rep = fabric.call(fabric.client.describe)
        busy = [w for w, a in sorted(rep.acks.items()) if a.detail.get("in_flight", "0") != "0"]
        if busy:
            proc = procs[busy[0]]
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            killed.append(busy[0])
            return


@pytest.mark.parametrize("engine", ENGINES)
def test_grpo_trainer_trains_through_two_workers(engine: str, tmp_path: Path, workers,
                                                nats_url: str, prefix: str) -> None:
    ckpt = write_checkpoint("tinychat", str(tmp_path / "tinychat"))
    calls: list[tuple[int, dict[str, torch.Tensor], dict[str, Any]]] = []
    stop = threading.Event()
    killed: list[str] = []
    # a short redelivery wait: the killed worker's requests go to the other in seconds
    with TrlFabric(nats_url, prefix=prefix,
                   policy=QuorumPolicy(timeout=60, on_membership_change="shrink"),
                   limits=Limits(rollout_ack_wait=3.0)) as fabric:
        procs = dict(zip(["g0", "g1"], workers(["g0", "g1"], "--model", ckpt,
                                               *engine_flags(engine), engine=engine),
                         strict=True))
        fabric.call(fabric.client.wait_for_workers, 2, 240)

        def rollout(prompts: list[Any], trainer: Any) -> dict[str, Any]:
            snap = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
            killer = None
            if len(calls) == 2:  # the third step: a worker dies while it generates
                killer = threading.Thread(target=kill_when_busy,
                                          args=(fabric, procs, killed, stop))
                killer.start()
            try:
                out = fabric.rollout_func(prompts, trainer)
            finally:
                if killer is not None:
                    stop.set()
                    killer.join(timeout=30)
            calls.append((trainer.state.global_step, snap, out))
            return out

        trainer = trl.GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(ckpt), reward_funcs=shorter,
            args=config(tmp_path / "out", 3), train_dataset=dataset(),
            processing_class=AutoTokenizer.from_pretrained(ckpt),
            rollout_func=rollout, callbacks=[fabric.sync])
        trainer.train()
        reports = dict(fabric.reports)
    assert len(killed) == 1, "no worker was killed during the third step"
    (dead,) = killed
    (alive,) = {"g0", "g1"} - {dead}
    assert procs[dead].poll() is not None
    assert [c[0] for c in calls] == [0, 1, 2]
    for version in (0, 1, 2):  # both workers serve each step's weights
        assert sorted(reports[version].ok) == ["g0", "g1"], reports[version]
        assert {a.weight_version for a in reports[version].acks.values()} == {version}
    assert reports[3].ok == (alive,)  # the other died in the third step
    ref = build_model(ckpt)
    for step, snap, out in calls:
        assert len(out["completion_ids"]) == 8  # one per prompt TRL handed over: none lost
        assert set(out["worker_id"]) <= {"g0", "g1"} and out["worker_id"]
        assert out["weight_version"] == [step] * 8
        ref.load_state_dict(snap)
        gaps = [float(np.abs(taken_logprobs(ref, p, c) - np.array(lp)).max())
                for p, c, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"],
                                    strict=True) if c]
        assert max(gaps) <= 1e-4, (step, max(gaps))
    assert set(calls[2][2]["worker_id"]) == {alive}  # it served what the dead one held


CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "adds the numbers", "parameters": {
        "type": "object", "properties": {}}}}


def test_a_two_turn_tool_episode_reaches_trl_with_tool_and_template_tokens_masked(
        tmp_path: Path, workers, spawn, nats_url: str, prefix: str) -> None:
    pytest.importorskip("starlette", reason="the gateway extra is not installed")
    ckpt = write_checkpoint("tinychat", str(tmp_path / "tinychat"))
    seen: dict[str, tuple[list[int], list[int], list[int], list[int]]] = {}

    async def episode(client: Any, prompt: Any, sid: str) -> dict[str, Any]:
        msgs = list(prompt)
        turns = []
        for choice, n in (("required", 6), ("none", 3)):  # a forced call, then the answer
            r = await client.chat.completions.create(
                model="tinychat", messages=msgs, tools=[CALCULATOR], tool_choice=choice,
                max_tokens=n, extra_headers={"X-Session-ID": sid})
            m = r.choices[0].message
            turns.append((r.model_extra["prompt_token_ids"],
                          r.choices[0].model_extra["token_ids"]))
            msgs.append(m.model_dump(exclude_none=True))
            msgs += [{"role": "tool", "tool_call_id": c.id, "content": "5"}
                     for c in m.tool_calls or ()]
        (p1, c1), (p2, c2) = turns
        seen[sid] = (p1, c1, p2, c2)
        return {"answer": m.content or ""}

    outs: list[dict[str, Any]] = []
    with TrlFabric(nats_url, prefix=prefix) as fabric:
        workers(["a0", "a1"], "--model", "tinychat")
        gw = spawn("gateway", "--nats", nats_url, "--prefix", prefix, "--model", "tinychat",
                   "--tool-call-parser", "tinychat", "--port", "0", module="rlfabric")
        base = gw.wait_for(r"serving \S+ at (http://\S+/v1)", timeout=60).group(1)
        fabric.call(fabric.client.wait_for_workers, 2, 120)
        agents = fabric.agent_rollout_func(base, episode)

        def rollout(prompts: list[Any], trainer: Any) -> dict[str, Any]:
            outs.append(agents(prompts, trainer))
            return outs[-1]

        trl.GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(ckpt), reward_funcs=shorter,
            args=config(tmp_path / "out", 1), train_dataset=dataset(),
            processing_class=AutoTokenizer.from_pretrained(ckpt),
            rollout_func=rollout, callbacks=[fabric.sync]).train()
    (out,) = outs
    assert len(out["env_mask"]) == 8 and len(seen) == 8
    for sid, ids, comp, mask, lps in zip(sorted(seen), *(
            [out[k][i] for i in sorted(range(8), key=lambda i: out["session_id"][i])]
            for k in ("prompt_ids", "completion_ids", "env_mask", "logprobs")), strict=True):
        p1, c1, p2, c2 = seen[sid]
        assert p2[:len(p1) + len(c1)] == p1 + c1  # exact tokens: turn 2 extends turn 1
        assert ids == p1 and comp == p2[len(p1):] + c2
        between = len(p2) - len(p1) - len(c1)  # the tool result and the template around it
        assert between > 0 and mask == [1] * len(c1) + [0] * between + [1] * len(c2)
        assert all(lp == 0.0 for lp, m in zip(lps, mask, strict=True) if not m)
    assert set(out["weight_version"]) == {0}


def test_a_step_whose_weights_no_worker_took_stops_training_naming_the_worker(
        tmp_path: Path, workers, nats_url: str, prefix: str) -> None:
    from rlfabric.integrations.trl import WeightSyncFailed

    ckpt = write_checkpoint("tinychat", str(tmp_path / "tinychat"))
    with TrlFabric(nats_url, prefix=prefix, policy=QuorumPolicy(timeout=60)) as fabric:
        workers(["m0"], "--model", "tiny")  # another model: it cannot load TRL's weights
        fabric.call(fabric.client.wait_for_workers, 1, 120)
        trainer = trl.GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(ckpt), reward_funcs=shorter,
            args=config(tmp_path / "out", 2), train_dataset=dataset(),
            processing_class=AutoTokenizer.from_pretrained(ckpt),
            rollout_func=fabric.rollout_func, callbacks=[fabric.sync])
        with pytest.raises(WeightSyncFailed) as stopped:
            trainer.train()
    assert "m0" in str(stopped.value) and "load_failed" in str(stopped.value)
    assert trainer.state.global_step == 0 and fabric.version == -1  # nothing was sampled
