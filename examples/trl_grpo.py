"""TRL's GRPOTrainer generating through rlfabric workers: the two arguments that change are
marked. Runs alone:

    TRL_EXPERIMENTAL_SILENCE=1 python examples/trl_grpo.py

starts an embedded NATS server and two workers serving the built-in `tinychat` checkpoint
(written once under ~/.cache/rlfabric), trains, prints a summary and exits non-zero if the
reward did not rise past --threshold. With --nats URL it uses a fleet that already runs
(workers serving the checkpoint --model names: the same weights on both sides). The run's
files (TRL's output, the workers' logs) go under ~/.cache/rlfabric/runs, or --out.

The toy task: answer "say a #i:" with the byte `a` (reward: the fraction of the 8 completion
tokens that are `a`); the reward climbs from about 0.01 to 1 within the default 30 steps
(`rlfabric bench trl --seeds 0,1,2` shows it).

Two runs on one pool at once, as two jobs, each training a LoRA adapter named `policy` for its
own letter (the pool's workers serve both; neither sees the other's adapter or pause), each run
a process of its own; exits non-zero unless both learned:

    python examples/trl_grpo.py --jobs exp-a:a,exp-b:b

An adapter learns on `tinylora` (the default with --lora or --jobs), not on `tinychat`: a
random-init head keeps every logit within a few nats of the others, and an adapter on the blocks
cannot change the head (TRL refuses one on it).
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed
from trl import GRPOConfig, GRPOTrainer

from rlfabric.engines import checkpoint_dir
from rlfabric.integrations.trl import TrlFabric
from rlfabric.launch.local import LocalFleet
from rlfabric.text.builtin import runs_dir

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def reward_of(letter: str) -> Any:
    """The reward of a completion: the fraction of its 8 tokens that are byte `letter`."""
    def reward(completion_ids: list[list[int]], **_: object) -> list[float]:
        return [sum(1 for t in ids if t == ord(letter)) / 8 for ids in completion_ids]
    reward.__name__ = f"reward_{letter}"
    return reward


class Rewards(TrainerCallback):
    """Each step's mean reward, as TRL logs it."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
        if logs and "reward" in logs:
            self.seen.append(float(logs["reward"]))


def options() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nats", default=None, metavar="URL",
                   help="a running fleet's NATS server (default: start a server and two "
                   "workers here)")
    p.add_argument("--prefix", default="rl", help="its job prefix (default %(default)s)")
    p.add_argument("--model", default=None,
                   help="the checkpoint the trainer (and the workers it starts) load: a "
                   "directory, or a built-in name (default tinychat; tinylora with --lora or "
                   "--jobs)")
    p.add_argument("--steps", type=int, default=30, help="training steps (default %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="TRL's seed, and the adapter's init's (default %(default)s)")
    p.add_argument("--batch", type=int, default=None,
                   help="completions per step, 8 per prompt (default 16; 32 with --lora or "
                   "--jobs: an adapter's random init starts some seeds with no reward for many "
                   "steps at 16)")
    p.add_argument("--lr", type=float, default=1e-2,
                   help="learning rate, decayed linearly to 0 over --steps (default %(default)s)")
    p.add_argument("--threshold", type=float, default=0.8,
                   help="exit 1 unless the mean reward of the last 3 steps is above it "
                   "(default %(default)s)")
    p.add_argument("--job", default="",
                   help="the job this run is on a shared pool (default: the pool's own run; "
                   "a job trains a LoRA adapter: use it with --lora)")
    p.add_argument("--lora", action="store_true",
                   help="train a LoRA adapter (PEFT, rank 8 on every linear module of the "
                   "blocks), served as adapter `policy`, instead of the full weights")
    p.add_argument("--lora-alpha", type=float, default=16.0,
                   help="the adapter's alpha (its update is scaled by alpha / 8; default "
                   "%(default)s)")
    p.add_argument("--letter", default="a",
                   help="the byte the prompts ask for and the reward counts (default a)")
    p.add_argument("--jobs", default=None, metavar="JOB:LETTER,...",
                   help="one LoRA run per job at once on one pool (its own process, its own "
                   "letter; the same --steps, --batch, --seed, --lr); exits 0 only if each "
                   "learned")
    p.add_argument("--out", default=None, metavar="DIR",
                   help=f"the run's folder (default: a new one under {runs_dir()})")
    args = p.parse_args()
    args.model = args.model or ("tinylora" if args.lora or args.jobs else "tinychat")
    args.batch = args.batch or (32 if args.lora or args.jobs else 16)
    return args


def train(args: argparse.Namespace, url: str, model: str, out: Path
          ) -> tuple[list[float], dict[int, Any]]:
    data = Dataset.from_dict({"prompt": [[{"role": "user",
                                           "content": f"say {args.letter} #{i}:"}]
                                         for i in range(512)]})
    config = GRPOConfig(output_dir=str(out / "trl"), use_cpu=True, report_to=[],
                        save_strategy="no", per_device_train_batch_size=args.batch,
                        num_generations=8, max_completion_length=8, learning_rate=args.lr,
                        max_steps=args.steps, logging_steps=1, seed=args.seed)
    rewards = Rewards()
    set_seed(args.seed)  # the adapter's random init too: a run repeats with its seed
    policy = AutoModelForCausalLM.from_pretrained(model)
    if args.lora:
        import peft

        # every linear module of the blocks (TRL refuses one on the head)
        policy = peft.get_peft_model(policy, peft.LoraConfig(
            r=8, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules=LORA_TARGETS))
    with TrlFabric(url, prefix=args.prefix, job=args.job, adapter="policy") as fabric:
        fabric.call(fabric.client.wait_for_workers, 1, 300)
        trainer = GRPOTrainer(model=policy,
                              reward_funcs=reward_of(args.letter), args=config,
                              train_dataset=data,
                              processing_class=AutoTokenizer.from_pretrained(model),
                              rollout_func=fabric.rollout_func,  # 1: workers generate
                              callbacks=[fabric.sync, rewards])  # 2: each step's weights
        trainer.train()
    return rewards.seen, dict(fabric.reports)


def summarize(args: argparse.Namespace, seen: list[float], reports: dict[int, Any],
              seconds: float, out: Path) -> bool:
    final = sum(seen[-3:]) / max(1, len(seen[-3:]))
    passed = len(seen) == args.steps and final > args.threshold
    print(f"trl_grpo: {'job ' + args.job + ', ' if args.job else ''}seed {args.seed}, "
          f"{len(seen)} steps in {seconds:.0f}s: "
          f"reward {seen[0] if seen else float('nan'):.3f} -> {final:.3f} (the last 3 steps' "
          f"mean; threshold {args.threshold}); {'PASS' if passed else 'FAIL'}; files in {out}")
    print(f"trl_grpo: reward by step {' '.join(f'{r:.2f}' for r in seen)}")
    acked = sorted({w for rep in reports.values() for w in rep.ok})
    print(f"trl_grpo: {len(reports)} pushes, each acked by "
          f"{min((len(r.ok) for r in reports.values()), default=0)} of the workers "
          f"({', '.join(acked)})")
    return passed


def run_jobs(args: argparse.Namespace, out: Path) -> int:
    """Each job's run as a process of its own, all at once on one pool; 0 if each passed."""
    jobs = [j.split(":") for j in args.jobs.split(",")]
    if any(len(j) != 2 or not j[0] or len(j[1]) != 1 for j in jobs):
        sys.exit(f"trl_grpo: --jobs {args.jobs!r}: want JOB:LETTER,... (e.g. exp-a:a,exp-b:b)")
    with contextlib.ExitStack() as stack:
        url, model = args.nats, checkpoint_dir(args.model)
        if not url:
            fleet = stack.enter_context(LocalFleet(args.model, workers=2, logs=out,
                                                   prefix=args.prefix))
            url = fleet.url
            print(f"trl_grpo: NATS at {url}, 2 workers serving {model}; jobs "
                  f"{', '.join(j for j, _ in jobs)} (logs in {out})", flush=True)
        runs = []
        for job, letter in jobs:
            cmd = [sys.executable, __file__, "--nats", url, "--prefix", args.prefix, "--model",
                   model, "--job", job, "--lora", "--letter", letter, "--steps",
                   str(args.steps), "--batch", str(args.batch), "--seed", str(args.seed),
                   "--lr", str(args.lr),
                   "--lora-alpha", str(args.lora_alpha), "--threshold", str(args.threshold),
                   "--out", str(out / job)]
            log = stack.enter_context(open(out / f"{job}.log", "w"))
            runs.append((job, stack.enter_context(subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT))))
        try:
            codes = [proc.wait() for _, proc in runs]
        finally:
            for _, proc in runs:  # Ctrl-C: no run outlives this one
                proc.terminate()
    for job, _ in runs:
        lines = (out / f"{job}.log").read_text().splitlines()
        print("\n".join(f"[{job}] {line}" for line in lines if line.startswith("trl_grpo:")))
    print(f"trl_grpo: {sum(c == 0 for c in codes)} of {len(runs)} jobs passed; "
          f"{'PASS' if not any(codes) else 'FAIL'}")
    return 0 if not any(codes) else 1


def main() -> int:
    args = options()
    out = Path(args.out) if args.out else Path(runs_dir()) / time.strftime(
        "trl-%Y%m%d-%H%M%S")
    if args.jobs:
        out.mkdir(parents=True, exist_ok=True)
        return run_jobs(args, out)
    t0 = time.monotonic()
    if args.nats:
        seen, reports = train(args, args.nats, checkpoint_dir(args.model), out)
    else:
        with LocalFleet(args.model, workers=2, logs=out, prefix=args.prefix) as fleet:
            print(f"trl_grpo: NATS at {fleet.url}, 2 workers serving {fleet.path} (logs in "
                  f"{out})", flush=True)
            seen, reports = train(args, fleet.url, fleet.path, out)
    return 0 if summarize(args, seen, reports, time.monotonic() - t0, out) else 1


if __name__ == "__main__":
    sys.exit(main())
