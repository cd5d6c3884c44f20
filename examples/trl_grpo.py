"""TRL's GRPOTrainer generating through rlfabric workers: the two arguments that change are
marked. Start a server and workers first, on a checkpoint both sides load:

    python -c "from rlfabric.tensors.models import write_checkpoint as w; w('tinychat', 'ckpt')"
    rlfabric nats &                                          # nats://127.0.0.1:4222
    rlfabric worker --nats nats://127.0.0.1:4222 --model ckpt --worker-id w0 &
    rlfabric worker --nats nats://127.0.0.1:4222 --model ckpt --worker-id w1 &
    TRL_EXPERIMENTAL_SILENCE=1 python examples/trl_grpo.py --model ckpt

The toy task: answer "say a #i:" with the byte `a` (reward: the fraction of the 8 completion
tokens that are `a`); the reward climbs from about 0.004 towards 1 within 20-30 steps.
"""

from __future__ import annotations

import argparse

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from rlfabric.integrations.trl import TrlFabric


def reward_a(completion_ids: list[list[int]], **_: object) -> list[float]:
    return [sum(1 for t in ids if t == ord("a")) / 8 for ids in completion_ids]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="ckpt", help="a checkpoint directory the workers serve")
    p.add_argument("--nats", default="nats://127.0.0.1:4222")
    p.add_argument("--prefix", default="rl")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"say a #{i}:"}]
                                         for i in range(512)]})
    config = GRPOConfig(output_dir="trl-grpo-out", use_cpu=True, report_to=[],
                        save_strategy="no", per_device_train_batch_size=16, num_generations=8,
                        max_completion_length=8, learning_rate=1e-2, max_steps=args.steps,
                        logging_steps=1, seed=0)
    with TrlFabric(args.nats, prefix=args.prefix) as fabric:
        trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(args.model),
                              reward_funcs=reward_a, args=config, train_dataset=data,
                              processing_class=AutoTokenizer.from_pretrained(args.model),
                              rollout_func=fabric.rollout_func,  # 1: workers generate
                              callbacks=[fabric.sync])  # 2: each step's weights to them
        trainer.train()


if __name__ == "__main__":
    main()
