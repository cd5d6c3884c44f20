"""The gateway: an OpenAI-compatible HTTP server over the bus (`rlfabric gateway`). It owns the
tokenizer and chat template; workers stay token-in/token-out. Agent sessions get prompts built
from the exact tokens sampled before (`splice`), recorded on the bus turn by turn, so a trainer
reads trajectories with loss masks, logprobs and weight versions straight off it.

Needs the `gateway` extra (Starlette, uvicorn): `pip install 'rlfabric[gateway]'`.
"""

from rlfabric.gateway.service import Gateway, GatewayConfig

__all__ = ["Gateway", "GatewayConfig"]
