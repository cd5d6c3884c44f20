"""What a client pushed, by policy name (`rlfabric.schemas.policy`), and the check that every
result it trains on came from one of those: versions alone cannot tell two runs' version 3
apart, a policy name can.

A request for the base weights is checked once this client pushed base weights, a request
naming an adapter once it pushed that adapter: a client that pushes an adapter and samples the
base beside it (a reference policy) is not refused for the base's results.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from rlfabric.schemas import (
    Adapter,
    RLFabricError,
    RolloutRequest,
    RolloutResult,
    VersionSpan,
    adapter_key,
    adapter_policy,
    base_policy,
)

#: names of one target kept for the error message
SHOWN = 3


class PolicyMismatch(RLFabricError):
    """Raised when a result holds tokens produced by a policy this client did not push (another
    run's weights, a version this run never pushed, or a worker off the fleet's desired state).
    `worker_id`, `request_id`, `policy` (what produced them) and `pushed` (the names this
    client pushed for that target, newest last) say which."""

    def __init__(self, message: str, *, worker_id: str, request_id: str, policy: str,
                 pushed: tuple[str, ...]) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.request_id = request_id
        self.policy = policy
        self.pushed = pushed


class PushedPolicies:
    def __init__(self, run: str, job: str = "") -> None:
        self.run = run
        #: the job this client's requests and adapters belong to (`rlfabric.schemas.jobs`):
        #: its adapters' policy names hold their keys
        self.job = job
        #: target ("" the base weights, else the adapter's name) -> names pushed, in order
        self._by_target: dict[str, dict[str, None]] = {}
        #: adapters pushed without a base named: their base part is not compared
        self._any_base: set[str] = set()

    def add(self, version: int, digest: str, adapter: Adapter | None = None) -> str:
        """Record a push acked by the fleet; returns its policy name."""
        if adapter is None:
            name = base_policy(self.run, version, digest)
            self._by_target.setdefault("", {})[name] = None
            return name
        key = adapter_key(self.job, adapter.name)
        name = adapter_policy(self.run, key, version, digest, adapter.base)
        if not adapter.base:
            self._any_base.add(key)
        self._by_target.setdefault(key, {})[_unbased(name) if not adapter.base
                                            else name] = None
        return name

    def pushed(self, adapter: str = "") -> bool:
        """Whether this client pushed the base weights ("") or adapter `adapter`."""
        return adapter_key(self.job, adapter) in self._by_target

    def names(self, adapter: str = "") -> tuple[str, ...]:
        return tuple(self._by_target.get(adapter_key(self.job, adapter), ()))

    def own(self, req: RolloutRequest) -> RolloutRequest:
        """`req` in this client's job, asking for this run's weights where this client
        pushed them (and the request names no run itself)."""
        if self.job and not req.job:
            req = msgspec.structs.replace(req, job=self.job)
        if req.run or adapter_key(req.job, req.adapter) not in self._by_target:
            return req
        return msgspec.structs.replace(req, run=self.run)

    def check(self, res: RolloutResult, adapter: str) -> None:
        """`PolicyMismatch` unless every span of `res` (a result of a request for `adapter`,
        "" for the base) was produced by a policy this client pushed for it."""
        adapter = adapter_key(self.job, adapter)
        names = self._by_target.get(adapter)
        if names is None:
            return
        loose = adapter in self._any_base
        for s in res.version_spans:
            got = _unbased(s.policy) if loose else s.policy
            if got not in names:
                self._refuse(res, adapter, s.policy, s.start, s.end)

    def check_spans(self, spans: Iterable[VersionSpan], where: str) -> None:
        """`PolicyMismatch` unless every span names a policy this client pushed, for the
        targets it pushed (read from each name: a trajectory mixes no request ids)."""
        for s in spans:
            adapter = target_of(s.policy)
            names = self._by_target.get(adapter)
            if names is None:
                continue
            got = _unbased(s.policy) if adapter in self._any_base else s.policy
            if got not in names:
                self._refuse_in(where, "", "", adapter, s.policy, s.start, s.end)

    def _refuse(self, res: RolloutResult, adapter: str, policy: str, start: int,
                end: int) -> None:
        self._refuse_in(f"result of request {res.request_id} (sample {res.sample_index}) from "
                        f"worker {res.worker_id}", res.worker_id, res.request_id, adapter,
                        policy, start, end)

    def _refuse_in(self, where: str, worker_id: str, request_id: str, adapter: str,
                   policy: str, start: int, end: int) -> None:
        pushed = tuple(self._by_target.get(adapter, ()))  # `adapter`: its key
        what = f"adapter {adapter!r}" if adapter else "base weights"
        shown = ", ".join(pushed[-SHOWN:])
        raise PolicyMismatch(
            f"{where}: tokens [{start}, {end}) were produced by policy "
            f"{policy or '(unnamed)'}, which this client (run {self.run}) did not push as its "
            f"{what} (it pushed {len(pushed)}, the last: {shown}). Refused: training on it "
            "would learn from another policy's samples. The worker serves another run's "
            "weights or missed a push: check `rlfabric status`", worker_id=worker_id,
            request_id=request_id, policy=policy, pushed=pushed)


def _unbased(name: str) -> str:
    return name.split("@", 1)[0]


def target_of(policy: str) -> str:
    """The adapter a policy name is of ("" for base weights, and for an empty name)."""
    parts = _unbased(policy).split("/")
    return "/".join(parts[1:-2]) if len(parts) > 3 else ""


def adapters_of(requests: Iterable[RolloutRequest]) -> dict[str, str]:
    """Request id -> the adapter it names ("" for the base)."""
    return {r.request_id: r.adapter for r in requests}
