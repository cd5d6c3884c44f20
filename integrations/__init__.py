"""rlfabric inside trainers and engines other than its own: `rlfabric.integrations.trl` (TRL's
GRPOTrainer), `rlfabric.integrations.vllm_sync` (vLLM's own NCCL weight transfer, driven over
the bus). Each module imports its trainer's package; this one imports nothing."""
