"""rlfabric inside trainers other than its own: `rlfabric.integrations.trl` (TRL's
GRPOTrainer). Each module imports its trainer's package; this one imports nothing."""
