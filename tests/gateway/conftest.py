"""What the gateway tests share: a fleet started by hand as a user would (`rlfabric worker`
processes, then `rlfabric gateway`), the official `openai` client pointed at it, and the
chat format the gateway renders with."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the gateway extra is not installed")
openai = pytest.importorskip("openai", reason="the tests drive the gateway with openai")


@dataclass
class Fleet:
    nats: str
    prefix: str
    spawn: Callable[..., Any]
    gateways: dict[str, Any] = field(default_factory=dict)  # base url -> process

    def workers(self, ids: list[str], *extra: str, engine: str = "torch",
                model: str = "tinyqwen", timeout: float = 120.0) -> list[Any]:
        procs = [self.spawn("worker", "--nats", self.nats, "--prefix", self.prefix,
                            "--worker-id", wid, "--engine", engine, "--model", model,
                            "--capacity", "64", *extra, module="rlfabric") for wid in ids]
        for p in procs:
            p.wait_for(r"ready \(", timeout=timeout)
        return procs

    def gateway(self, *extra: str, model: str = "tinyqwen") -> str:
        """Start `rlfabric gateway` on a free port; its base URL (`.../v1`)."""
        proc = self.spawn("gateway", "--nats", self.nats, "--prefix", self.prefix,
                          "--model", model, "--port", "0", *extra, module="rlfabric")
        base = proc.wait_for(r"serving \S+ at (http://\S+/v1)", timeout=60).group(1)
        self.gateways[base] = proc
        return base


@functools.cache
def _chat_format(template: str | None = None) -> Any:
    from rlfabric.text import load_chat_format

    return load_chat_format("tinyqwen", template=template)


@pytest.fixture
def client() -> Callable[..., Any]:
    """`client(base_url)`: the official OpenAI client, as an agent harness holds it (no
    retries: a test sees every answer)."""
    def make(base_url: str, **kw: Any) -> Any:
        return openai.OpenAI(base_url=base_url, api_key=kw.pop("api_key", "-"), max_retries=0,
                             timeout=kw.pop("timeout", 120.0), **kw)
    return make


@pytest.fixture
def chat_format() -> Callable[..., Any]:
    """`chat_format(template=None)`: tinyqwen's tokenizer and chat template (the gateway's)."""
    return _chat_format


@pytest.fixture
def new_fleet(nats_url: str, prefix: str,
              spawn: Callable[..., Any]) -> Callable[..., Fleet]:
    """`new_fleet(url=None)`: an empty fleet of this test's own on the test server (or `url`);
    its processes stop with the test."""
    return lambda url=None: Fleet(url or nats_url, prefix, spawn)


@pytest.fixture(scope="package")
def fleet(nats_url: str, package_prefix: str,
          spawn_package: Callable[..., Any]) -> Iterator[Fleet]:
    """Two torch workers serving tinyqwen and one gateway, started in that order, shared by
    the gateway tests; nobody pushes weights: the workers serve their checkpoint as version
    0."""
    f = Fleet(nats_url, package_prefix, spawn_package)
    f.workers(["w0", "w1"])
    f.gateway()
    yield f


@pytest.fixture
def extra() -> Callable[[Any, str], Any]:
    """`extra(obj, name)`: an rlfabric field of an openai response object (`prompt_token_ids`,
    `token_ids`, `weight_versions`, `session_id`)."""
    return lambda obj, name: (obj.model_extra or {})[name]
