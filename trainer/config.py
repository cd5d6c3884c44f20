"""The reference GRPO loop's knobs (no torch here: `rlfabric up --help` reads its defaults)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from rlfabric import transports

#: `steps` when `async_mode` is on and none was given: one-step-stale samples learn slower
ASYNC_STEPS = 30
#: `rlfabric up --task tools`: its steps when none are given, and its reward threshold: the
#: policy calls the calculator in most episodes (0.4 each; answering with a digit, 0.2, and the
#: right one, 0.4, come later and when varies from run to run: `rlfabric.trainer.tools`)
TOOLS_STEPS = 30
TOOLS_THRESHOLD = 0.35
#: `rlfabric up` judges the mean reward of its last this many steps against the threshold: one
#: step's reward is too noisy to judge a run on
FINAL_STEPS = 3


@dataclass(kw_only=True, slots=True)
class GRPOConfig:
    """Knobs of the reference loop; each error names the `rlfabric up` flag to change."""

    steps: int = 20
    prompts_per_step: int = 16
    group_size: int = 8
    max_tokens: int = 8
    lr: float = 1e-2
    temperature: float = 1.0
    clip_eps: float = 0.2
    transport: str = "shm"
    #: send each update as a delta against the last where every worker holds it
    #: (`update_weights(..., delta=True)`: nats, filesystem; over shm whole)
    delta: bool = False
    async_mode: bool = False
    max_staleness: int = 1
    reward_threshold: float = 0.8
    request_timeout: float = 120.0
    #: the share of a step's samples that may fail (each left out of the loss); past it the
    #: run stops naming the causes
    max_failed: float = 0.1
    #: > 0: train a LoRA adapter of this rank (alpha = 2 x rank, on every linear module of the
    #: attention and MLP blocks and the LM head) instead of every weight, and push only it
    lora_rank: int = 0
    #: where the trainer's model lives ("cpu", "cuda", "cuda:1", ...)
    device: str = "cpu"
    #: trainer and workers share the device: each step the workers sleep while the trainer
    #: trains (at this level: 1 keeps their weights in host memory, 2 drops them) and wake
    #: before the update; 0: no colocation
    sleep_level: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.steps >= 1, f"--steps {self.steps}: need at least 1 step"),
            (self.group_size >= 2, f"--group-size {self.group_size}: GRPO needs >= 2 samples "
                                   "per prompt to normalise within a group"),
            (self.prompts_per_step >= 1, f"--prompts {self.prompts_per_step}: need >= 1"),
            (self.max_tokens >= 1, f"--max-tokens {self.max_tokens}: need >= 1"),
            (self.lr > 0, f"--lr {self.lr}: must be > 0"),
            (0.0 <= self.max_failed <= 1.0,
             f"--max-failed {self.max_failed}: a share of a step's samples, 0 to 1"),
            (self.lora_rank >= 0, f"--lora {self.lora_rank}: a rank >= 1, or 0 for none"),
            (self.transport in transports.names(),
             f"--transport {self.transport}: use one of {', '.join(transports.names())}"),
            (not self.delta or self.transport in ("shm", "filesystem", "nats"),
             f"--delta goes over shm, filesystem or nats, not --transport {self.transport}"),
            (self.sleep_level in (0, 1, 2), f"--sleep-level {self.sleep_level}: 1 or 2"),
            (not (self.sleep_level and self.async_mode),
             "--colocate trains while the workers sleep, so it runs in sync mode: drop --async"),
            (self.transport != "cuda_ipc" or self.device.startswith("cuda"),
             "--transport cuda_ipc sends the trainer's GPU buffers: add --device cuda"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


#: the modules `--lora` trains (the LM head too: the tiny models' random head leaves too
#: little room to move a token's probability through the blocks alone)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "lm_head")
#: the adapter's name on the fleet
LORA_NAME = "grpo"


def defaults() -> dict[str, Any]:
    """Each field's default, by name (what the CLI's flags default to)."""
    return {f.name: f.default for f in fields(GRPOConfig)}
