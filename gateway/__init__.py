"""The gateway: an OpenAI-compatible HTTP server over the bus (`rlfabric gateway`). It owns the
tokenizer and chat template; workers stay token-in/token-out. Agent sessions get prompts built
from the exact tokens sampled before (`splice`), recorded on the bus turn by turn, so a trainer
reads trajectories with loss masks, logprobs and weight versions straight off it.

Needs the `gateway` extra (Starlette, uvicorn): `pip install 'rlfabric[gateway]'`.
"""

from typing import Any

from rlfabric.gateway.config import GatewayConfig, ServeOptions


def __getattr__(name: str) -> Any:
    # the service loads the tokenizer library: only when asked for (`rlfabric --help` not)
    if name == "Gateway":
        from rlfabric.gateway.service import Gateway

        return Gateway
    raise AttributeError(f"module 'rlfabric.gateway' has no attribute {name!r}")


__all__ = ["Gateway", "GatewayConfig", "ServeOptions"]
