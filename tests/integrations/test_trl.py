"""TRL's GRPOTrainer (the real package, unpatched) trains through two `rlfabric worker`
processes with two arguments changed (`rollout_func`, `callbacks`): every completion comes from
a worker, both workers ack each step's weights as version = global step, the workers' logprobs
are those of TRL's model at the version that sampled them, and a worker killed during a step
loses no completion."""

from __future__ import annotations

import copy
import os
import threading
import time
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


def config(out: Path, steps: int, batch: int = 8) -> Any:
    return trl.GRPOConfig(output_dir=str(out), use_cpu=True, report_to=[], save_strategy="no",
                          per_device_train_batch_size=batch, num_generations=4, max_steps=steps,
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
    took: list[float] = []  # seconds each step's rollouts took
    stop = threading.Event()
    killed: list[str] = []
    # the job's default redelivery wait (15 s): the killed worker's requests go to the other
    # as soon as membership declares it gone, not at that wait
    with TrlFabric(nats_url, prefix=prefix,
                   policy=QuorumPolicy(timeout=60, on_membership_change="shrink")) as fabric:
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
            t0 = time.monotonic()
            try:
                out = fabric.rollout_func(prompts, trainer)
            finally:
                if killer is not None:
                    stop.set()
                    killer.join(timeout=30)
            took.append(time.monotonic() - t0)
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
    # the step that lost a worker: at most twice an undisturbed one, plus the time membership
    # takes to declare a killed worker gone
    liveness = Limits().member_ttl + 1.0
    print(f"\nrollouts per step {[round(t, 2) for t in took]} s ({engine}; step 3 lost {dead})")
    assert took[2] <= 2 * max(took[:2]) + liveness, took


CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "adds the numbers", "parameters": {
        "type": "object", "properties": {}}}}


def test_a_two_turn_tool_episode_reaches_trl_with_tool_and_template_tokens_masked(
        tmp_path: Path, workers, spawn, nats_url: str, prefix: str) -> None:
    pytest.importorskip("starlette", reason="the gateway extra is not installed")
    ckpt = write_checkpoint("tinychat", str(tmp_path / "tinychat"))
    seen: dict[str, tuple[list[int], list[int], list[int], list[int]]] = {}

    async def episode(client: Any, prompt: Any, sid: str) -> dict[str, Any]:
        if sid.endswith("-0"):  # an environment that fails: never a reward
            raise RuntimeError("the calculator is down")
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
    with TrlFabric(nats_url, prefix=prefix, max_failed=0.2) as fabric:
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
    assert len(out["env_mask"]) == 8 and len(seen) == 7
    (bad,) = [i for i, sid in enumerate(out["session_id"]) if sid not in seen]
    assert out["rollout_failed"][bad] == "RuntimeError: the calculator is down"
    assert out["env_mask"][bad] == [0] and out["answer"][bad] is None
    assert fabric.failed == {0: 1}
    rows = sorted((i for i in range(8) if i != bad), key=lambda i: out["session_id"][i])
    for sid, ids, comp, mask, lps in zip(sorted(seen), *(
            [out[k][i] for i in rows]
            for k in ("prompt_ids", "completion_ids", "env_mask", "logprobs")), strict=True):
        p1, c1, p2, c2 = seen[sid]
        assert p2[:len(p1) + len(c1)] == p1 + c1  # exact tokens: turn 2 extends turn 1
        assert ids == p1 and comp == p2[len(p1):] + c2
        between = len(p2) - len(p1) - len(c1)  # the tool result and the template around it
        assert between > 0 and mask == [1] * len(c1) + [0] * between + [1] * len(c2)
        assert all(lp == 0.0 for lp, m in zip(lps, mask, strict=True) if not m)
    assert {out["weight_version"][i] for i in rows} == {0}


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
    assert "now m0 v0 (load_failed)" in str(stopped.value)  # where the worker is
    assert trainer.state.global_step == 0 and fabric.version == -1  # nothing was sampled


def short_config(out: Path, steps: int) -> Any:
    """`config` with short completions: the seams below need steps, not long samples."""
    cfg = config(out, steps)
    cfg.max_completion_length = 32
    return cfg


def lora_flags(engine: str) -> tuple[str, ...]:
    return (*engine_flags(engine), "--max-adapters", "2") if engine == "vllm" else ()


@pytest.mark.parametrize("engine", ENGINES)
def test_lora_runs_after_a_full_weight_run_each_sample_their_own_policy(
        engine: str, tmp_path: Path, workers, nats_url: str, prefix: str) -> None:
    """On the same two workers: a full-weight run, then two LoRA runs (PEFT) from the same
    checkpoint, each pushing its adapter as `trl` from version 0. Every completion of every
    LoRA step is sampled by that run's own adapter on that run's own base: logprobs equal
    the trainer's model's (the first LoRA run's base is the checkpoint, not the full-weight
    run's trained weights; the second's adapter is its own, not the first's newer-numbered
    one)."""
    peft = pytest.importorskip("peft", reason="PEFT is not installed: pip install "
                                              "'rlfabric[trl]'")
    ckpt = write_checkpoint("tinychat", str(tmp_path / "tinychat"))
    workers(["p0", "p1"], "--model", ckpt, *lora_flags(engine), engine=engine)
    gaps: dict[str, list[float]] = {}
    runs: dict[str, str] = {}

    def run(name: str, lora: bool) -> None:
        with TrlFabric(nats_url, prefix=prefix, policy=QuorumPolicy(timeout=120)) as fabric:
            fabric.call(fabric.client.wait_for_workers, 2, 240)
            model = AutoModelForCausalLM.from_pretrained(ckpt)
            if lora:
                model = peft.get_peft_model(model, peft.LoraConfig(
                    r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
            seen = gaps.setdefault(name, [])

            def rollout(prompts: list[Any], trainer: Any) -> dict[str, Any]:
                out = fabric.rollout_func(prompts, trainer)
                # the trainer's weights now (a PEFT model's merged), in a plain fp32 model:
                # TRL's own forward runs under accelerate's autocast
                merged = copy.deepcopy(trainer.model)
                if lora:
                    merged = merged.merge_and_unload()
                ref = build_model(ckpt)
                ref.load_state_dict(merged.state_dict())
                seen.append(max(float(np.abs(taken_logprobs(ref, p, c) - np.array(lp)).max())
                                for p, c, lp in zip(out["prompt_ids"], out["completion_ids"],
                                                    out["logprobs"], strict=True) if c))
                return out

            trl.GRPOTrainer(
                model=model, reward_funcs=shorter, args=short_config(tmp_path / name, 2),
                train_dataset=dataset(), processing_class=AutoTokenizer.from_pretrained(ckpt),
                rollout_func=rollout, callbacks=[fabric.sync]).train()
            runs[name] = fabric.run

    run("full", lora=False)
    run("lora1", lora=True)
    run("lora2", lora=True)
    print(f"\nworst logprob gap per step ({engine}): {gaps}")
    assert len(set(runs.values())) == 3
    for name in ("lora1", "lora2"):
        assert len(gaps[name]) == 2 and max(gaps[name]) <= 1e-4, (name, gaps[name])


@pytest.mark.parametrize("engine", ENGINES)
def test_completions_stop_at_the_trainers_end_tokens(engine: str, tmp_path: Path, workers,
                                                     nats_url: str, prefix: str) -> None:
    """A checkpoint that names an end token in each of its files (as Llama 3 Instruct's
    does), and a trainer whose generation config adds one more: no completion runs past any
    end token TRL's own generation stops at."""
    from helpers import LLAMA3_ENDS, llama3_like

    ckpt = llama3_like(str(tmp_path / "llama3-like"))
    workers(["e0"], "--model", ckpt, *engine_flags(engine), engine=engine)
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    model.generation_config.eos_token_id = [257, 260, 42]  # the trainer's own, not the workers'
    ends = LLAMA3_ENDS | {42}
    with TrlFabric(nats_url, prefix=prefix) as fabric:
        fabric.call(fabric.client.wait_for_workers, 1, 240)
        trainer = trl.GRPOTrainer(
            model=model, reward_funcs=shorter, args=config(tmp_path / "out", 1),
            train_dataset=dataset(), processing_class=AutoTokenizer.from_pretrained(ckpt))
        prompts = [[{"role": "user", "content": f"say {i}"}] for i in range(48)]
        out = fabric.rollout_func(prompts, trainer)
    comps = out["completion_ids"]
    past = [i for i, c in enumerate(comps) if any(t in ends for t in c[:-1])]
    assert past == []
    assert {c[-1] for c in comps if c and c[-1] in ends} >= {42, 260}  # stopped at both


def test_failed_rollouts_are_left_out_of_the_loss_and_past_max_failed_stop_the_run(
        tmp_path: Path, workers, nats_url: str, prefix: str) -> None:
    """A third of a step's prompts are past the workers' context (a real refusal,
    `prompt_too_long`): each comes back as a placeholder with `env_mask` 0 and
    `rollout_failed` set, the reward function answers None for it (TRL leaves it out of its
    group's baseline), the step trains and `failed` counts them; with `max_failed` below a
    third, the step stops naming the cause."""
    from rlfabric.trainer import RolloutFailed

    ckpt = write_checkpoint("tinychat", str(tmp_path / "tinychat"))
    workers(["x0"], "--model", ckpt)
    too_long = "say " + "x" * 1100  # tinychat's context: 1,024 tokens
    prompts = [[{"role": "user", "content": c}] for c in ("say hi", "say no", too_long)]
    args = config(tmp_path / "out", 1, batch=12)  # the 3 prompts, 4 completions each
    outs: list[dict[str, Any]] = []
    with TrlFabric(nats_url, prefix=prefix, max_failed=0.5) as fabric:
        fabric.call(fabric.client.wait_for_workers, 1, 120)

        def rollout(ps: list[Any], trainer: Any) -> dict[str, Any]:
            outs.append(fabric.rollout_func(ps, trainer))
            return outs[-1]

        trainer = trl.GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(ckpt), reward_funcs=shorter, args=args,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=AutoTokenizer.from_pretrained(ckpt), rollout_func=rollout,
            callbacks=[fabric.sync])
        trainer.train()
        fabric.max_failed = 0.25
        with pytest.raises(RolloutFailed) as stopped:
            fabric.rollout_func(prompts * 4, trainer)
    (out,) = outs
    failed = [i for i, f in enumerate(out["rollout_failed"]) if f]
    assert len(failed) == 4 and fabric.failed[0] == 4, out["rollout_failed"]
    assert all(out["rollout_failed"][i].startswith("prompt_too_long: ") for i in failed)
    assert all(out["env_mask"][i] == [0] and out["weight_version"][i] == -1 for i in failed)
    served = [i for i in range(12) if i not in failed]
    assert all(out["env_mask"][i] == [1] * len(out["completion_ids"][i]) for i in served)
    assert all(out["weight_version"][i] == 0 for i in served)
    # what TRL scores each row with: None (no reward, no advantage) for the failed ones
    texts = [[{"content": str(i)}] for i in range(12)]
    rewards = trainer.reward_funcs[0](prompts=[], completions=texts, completion_ids=[],
                                      rollout_failed=out["rollout_failed"])
    assert [i for i, r in enumerate(rewards) if r is None] == failed
    assert all(isinstance(rewards[i], float) for i in served)
    assert "4 of 12 samples failed, more than the 25%" in str(stopped.value)
    assert "4 x prompt_too_long on x0" in str(stopped.value), stopped.value


def test_ctrl_c_ends_a_waiting_rollout_and_a_dead_port_ends_the_process(
        nats_url: str, prefix: str) -> None:
    """A TRL process waiting on rollouts that will not come (no worker serves the version it
    asks for) ends within 2 s of SIGINT; one pointed at a port nobody listens on exits
    within 10 s, saying so."""
    import signal
    import subprocess
    import sys

    from rlfabric.bus.nats.cluster import free_ports

    waiting = (
        "import sys\n"
        "from rlfabric.integrations.trl import TrlFabric\n"
        "from rlfabric.schemas import RolloutRequest\n"
        f"with TrlFabric({nats_url!r}, prefix={prefix!r}) as f:\n"
        "    print('waiting', flush=True)\n"
        "    f.call(f._collect, [RolloutRequest(request_id='x', prompt_token_ids=[1, 2],\n"
        "                                       min_weight_version=99, deadline=0)])\n")
    with subprocess.Popen([sys.executable, "-c", waiting], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "waiting"
            time.sleep(1.0)  # the call is out, waiting on the bus client's loop
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=10)
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
        err = proc.stderr.read() if proc.stderr else ""
    assert took <= 2.0, took
    assert "KeyboardInterrupt" in err
    (port,) = free_ports(1)
    dead = ("from rlfabric.integrations.trl import TrlFabric\n"
            "print('connecting', flush=True)\n"
            f"TrlFabric('nats://127.0.0.1:{port}').__enter__()")
    with subprocess.Popen([sys.executable, "-c", dead], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "connecting"
            t0 = time.monotonic()  # TRL's own import (seconds) is not the connect's
            code = proc.wait(timeout=60)
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
        err = proc.stderr.read() if proc.stderr else ""
    assert code != 0 and took <= 10.0, (took, err[-2000:])
    assert "NatsUnavailable" in err and str(port) in err


def test_the_example_runs_alone_and_writes_nothing_where_it_runs(tmp_path: Path) -> None:
    """examples/trl_grpo.py with no flags but a short run: its own server and workers, a
    summary line, exit 0; nothing written into the working directory."""
    import subprocess
    import sys

    cwd, cache = tmp_path / "work", tmp_path / "cache"
    cwd.mkdir()
    example = Path(__file__).parents[2] / "examples" / "trl_grpo.py"
    done = subprocess.run([sys.executable, str(example), "--steps", "2", "--threshold", "-1"],
                          cwd=cwd, env={**os.environ, "XDG_CACHE_HOME": str(cache)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "trl_grpo: seed 0, 2 steps" in done.stdout and "PASS" in done.stdout
    assert list(cwd.iterdir()) == []
    assert (cache / "rlfabric" / "checkpoints" / "tinychat" / "config.json").exists()
