"""What `rlfabric gateway` is told: the service's settings and the HTTP server's (no Starlette
or tokenizer here: the CLI reads its defaults from these)."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any


@dataclass(kw_only=True)
class GatewayConfig:
    """What `rlfabric gateway` is told; each field is a flag of it."""

    model: str  # --model: a built-in name or a checkpoint directory
    served_name: str = ""  # --served-model-name (default: --model)
    tool_parser: str = "qwen"  # --tool-call-parser
    request_timeout: float = 600.0  # --request-timeout
    max_model_len: int = 0  # --max-model-len (0: the model's own)
    affinity: bool = True  # --no-affinity: every turn to the shared queue
    default_max_tokens: int = 1024  # --default-max-tokens: a request without max_tokens
    max_request_tokens: int = 16384  # --max-request-tokens: n x max_tokens at most
    max_n: int = 16  # --max-n
    gateway_id: str = ""
    #: --tenants-are-jobs: an API key's tenant is the job (`rlfabric.schemas.jobs`) its
    #: requests, sessions and adapters belong to (the tenant `default`: the default job)
    tenant_jobs: bool = False

    def job_of(self, tenant: str) -> str:
        return tenant if self.tenant_jobs and tenant != "default" else ""

    @property
    def name(self) -> str:
        return self.served_name or self.model


@dataclass(kw_only=True)
class ServeOptions:
    """Where and how the HTTP server listens; each field is a flag of `rlfabric gateway`."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant
    max_body_bytes: int = 8 << 20
    session_idle_timeout: float = 3600.0
    max_cached_sessions: int = 10_000
    max_session_bytes: int = 1 << 30
    chat_template: str | None = None


def defaults(kind: type[Any]) -> dict[str, Any]:
    """Each field's default, by name (fields without one are left out)."""
    return {f.name: f.default for f in fields(kind) if f.default is not MISSING}
