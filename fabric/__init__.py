"""rlfabric: a NATS message-bus rollout fabric for LLM RL post-training.

Subpackages: `rlfabric.schemas` (wire messages), `rlfabric.bus` (NATS, membership, quorum),
`rlfabric.engines` (inference engines and the worker runtime), `rlfabric.trainer` (the
trainer-side SDK). Nothing is imported eagerly here.
"""

__version__ = "0.1.0"
