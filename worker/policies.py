"""The policies a worker serves (`rlfabric.schemas.policy`): the base weights it holds and each
adapter version, by run, and the names its results' version spans are stamped with.

An engine knows versions only (numbers within a run); the worker knows which run and payload
each version came from, so it stamps spans here, after the engine. A span of a version this
worker no longer remembers (an engine that reports one it never loaded) gets no name: a
trainer refuses it as it refuses any policy it did not push.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from rlfabric.schemas import (
    DesiredState,
    RolloutRequest,
    RolloutResult,
    VersionSpan,
    adapter_policy,
    base_policy,
    checkpoint_policy,
)

#: base versions remembered for stamping (a keep-paused sequence may span a few updates)
BASE_KEPT = 8


@dataclass(frozen=True, slots=True)
class AdapterHeld:
    run: str
    digest: str


class Policies:
    def __init__(self) -> None:
        #: the base policy served now ("" before any weights)
        self.base = ""
        self.base_version = -1
        self._bases: OrderedDict[int, str] = OrderedDict()
        #: adapter name -> version -> the run and tensors it came from
        self._adapters: dict[str, dict[int, AdapterHeld]] = {}

    # ---- what is loaded ----
    def set_base(self, version: int, run: str, digest: str) -> str:
        return self._set_base(version, base_policy(run, version, digest))

    def set_checkpoint(self, checksum: str, version: int = 0) -> str:
        return self._set_base(version, checkpoint_policy(checksum, version))

    def _set_base(self, version: int, name: str) -> str:
        self.base, self.base_version = name, version
        self._bases[version] = name
        self._bases.move_to_end(version)
        while len(self._bases) > BASE_KEPT:
            self._bases.popitem(last=False)
        return name

    def adapter_run(self, name: str) -> str | None:
        """The run whose versions of adapter `name` are held (None: none held)."""
        held = self._adapters.get(name)
        return next(iter(held.values())).run if held else None

    def set_adapter(self, name: str, version: int, run: str, digest: str) -> None:
        held = self._adapters.setdefault(name, {})
        for v in [v for v in held if held[v].run != run or v > version]:
            del held[v]  # another run's, or newer ones taken back by this load
        held[version] = AdapterHeld(run, digest)

    def keep_adapters(self, versions: dict[str, tuple[int, ...]]) -> None:
        """Forget adapter versions the engine no longer holds (evicted, unloaded)."""
        for name in list(self._adapters):
            keep = set(versions.get(name, ()))
            held = {v: h for v, h in self._adapters[name].items() if v in keep}
            if held:
                self._adapters[name] = held
            else:
                del self._adapters[name]

    def adapter_name(self, name: str, version: int) -> str:
        held = self._adapters.get(name, {}).get(version)
        if held is None:
            return ""
        return adapter_policy(held.run, name, version, held.digest, self.base)

    # ---- results ----
    def stamp(self, req: RolloutRequest, res: RolloutResult) -> tuple[VersionSpan, ...]:
        """`res`'s version spans, each named by its policy and its worker."""
        return tuple(msgspec.structs.replace(s, policy=self.name(req, s.version),
                                             worker=res.worker_id) for s in res.version_spans)

    def name(self, req: RolloutRequest, version: int) -> str:
        """The policy `req`'s tokens of `version` come from ("": not one this worker names)."""
        return (self.adapter_name(req.adapter, version) if req.adapter
                else self._bases.get(version, ""))


def desired_policy(state: DesiredState) -> str:
    """The base policy `state` asks for ("": none; a state written before policies had names
    gives its locator's)."""
    if state.policy or state.locator is None:
        return state.policy
    cmd = state.locator
    return base_policy(cmd.run, cmd.version, cmd.digest)
