"""Engines by name: what `--engine` takes in `rlfabric worker` and `rlfabric up`, the Ray
launcher and the benches. An engine kind is its factory, its own command-line options and what
it can do; adding an engine is its module plus one `register(EngineKind(...))`.

    register(EngineKind(name="echo", help="echoes prompts", factory=make_echo))
    engine = make_engine("echo", "tiny")                  # what `--engine echo` builds
    kind("vllm").trains, kind("vllm").default_model      # what `up` asks of it

The built-in kinds are declared in `rlfabric.engines.kinds`; nothing here imports an engine
(torch or vLLM) until one is built.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlfabric.engines.protocol import Engine

#: sequences an engine decodes together, unless told (`rlfabric worker --max-batch`)
MAX_BATCH = 64
#: LoRA adapters (by name) an engine holds at once, and versions of each kept loaded so that
#: running requests finish on theirs (`--max-adapters`, `--adapter-versions`)
MAX_ADAPTERS = 4
ADAPTER_VERSIONS = 2


@dataclass(frozen=True, kw_only=True)
class EngineKind:
    name: str
    #: one line for `--engine`'s help
    help: str
    #: `factory(model, **options)`: the engine (imports what it needs when called)
    factory: Callable[..., Engine]
    #: adds the engine's own flags to `rlfabric worker` (a group of its own)
    add_options: Callable[[argparse.ArgumentParser], None] | None = None
    #: the constructor options from those flags (and the worker's shared `--max-batch`)
    options: Callable[[argparse.Namespace], dict[str, Any]] | None = None
    #: the built-in model it serves when none is named (`up`, the benches)
    default_model: str = "tiny"
    #: it learns: `rlfabric up` may train on it (an echo engine does not)
    trains: bool = True
    #: it computes with torch on the CPU threads `--threads` sets
    torch_threads: bool = False
    #: flags `rlfabric up` gives each of its workers of this kind
    up_worker_args: tuple[str, ...] = ()
    #: readies the process before the engine's libraries load (what they read once, as they
    #: load: environment defaults); run by `prepare_process`
    prepare: Callable[[], None] | None = None


_KINDS: dict[str, EngineKind] = {}


def register(k: EngineKind) -> EngineKind:
    """Make `k` an `--engine` choice (a name registered again is replaced)."""
    _KINDS[k.name] = k
    return k


def unregister(name: str) -> None:
    _KINDS.pop(name, None)


def names(*, trains: bool | None = None) -> tuple[str, ...]:
    """The registered names, in registration order (`trains`: only those that do, or not)."""
    return tuple(n for n, k in _KINDS.items() if trains is None or k.trains == trains)


def kind(name: str) -> EngineKind:
    try:
        return _KINDS[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}: use one of {', '.join(_KINDS)}") from None


def make_engine(name: str, model: str, **options: Any) -> Engine:
    """An engine by name; `options` go to its factory."""
    return kind(name).factory(model, **options)


def prepare_process(name: str, threads: int = 0) -> None:
    """Ready this process for engine `name`, before anything in it imports torch: the kind's
    `prepare`, then `threads` torch CPU threads if it computes on them (0: torch's choice).
    Every process that runs an engine calls it (the worker, the Ray actor, the benches'
    servers), so each runs its engine alike."""
    k = kind(name)
    if k.prepare is not None:
        k.prepare()
    if threads and k.torch_threads:
        import torch

        torch.set_num_threads(threads)


def options_from(args: argparse.Namespace) -> dict[str, Any]:
    """The options of `args.engine`'s kind from parsed `rlfabric worker` flags."""
    k = kind(args.engine)
    return k.options(args) if k.options is not None else {}


def add_worker_options(p: argparse.ArgumentParser) -> None:
    """Every registered kind's own flags."""
    for k in _KINDS.values():
        if k.add_options is not None:
            k.add_options(p)


def engine_help() -> str:
    return "; ".join(f"{k.name}: {k.help}" for k in _KINDS.values())
