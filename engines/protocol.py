"""The `Engine` protocol: what the worker runtime needs from an inference engine.

The interface is documented here, once; implementations (`TorchEngine`, `NullEngine`) carry
no docstrings of their own for these methods.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Protocol, runtime_checkable

import anyio
from anyio.abc import TaskStatus

from rlfabric.engines.errors import EngineDied, RequestRejected, Unsupported, WeightLoadError
from rlfabric.engines.payload import PackedWeights
from rlfabric.schemas import (
    Adapter,
    ErrorCode,
    InitTransport,
    PauseMode,
    RolloutRequest,
    RolloutResult,
    TokenDelta,
    UpdateWeights,
)
from rlfabric.schemas.validation import InvalidRequest, check_request

#: where an engine hands the tokens of a streamed request (`RolloutRequest.stream`) as it
#: samples them; called on the event loop
TokenSink = Callable[[TokenDelta], None]
#: where an engine can, the tokens of a request that is not streamed go to `on_tokens` too, in
#: deltas of about this many: what another worker continues the sample from should this one die
PROGRESS_TOKENS = 32


def checked(request: RolloutRequest) -> None:
    """The engine-independent checks (`rlfabric.schemas.validation`), as `RequestRejected`:
    every `Engine.check` starts with it."""
    try:
        check_request(request)
    except InvalidRequest as exc:
        raise RequestRejected(exc.code, str(exc)) from None


def adapter_held(request: RolloutRequest, held: dict[str, tuple[int, ...]]) -> None:
    """`RequestRejected` unless the engine holds the adapter version `request` asks for."""
    versions = held.get(request.adapter)
    if not versions:
        raise RequestRejected(ErrorCode.ADAPTER_UNKNOWN,
                              f"adapter {request.adapter!r} is not loaded on this worker "
                              f"(loaded: {', '.join(held) or 'none'}); push it with "
                              "FabricClient.update_weights(adapter=...)")
    want = request.adapter_version
    if want >= 0 and want not in versions:
        raise RequestRejected(ErrorCode.VERSION_UNAVAILABLE,
                              f"adapter {request.adapter!r} v{want} is not loaded here (held: "
                              f"{', '.join(f'v{v}' for v in versions)}); a worker keeps the last "
                              "--adapter-versions versions of each adapter")
    if max(versions) < request.min_weight_version:
        raise RequestRejected(ErrorCode.VERSION_UNAVAILABLE,
                              f"adapter {request.adapter!r}: newest v{max(versions)} is older "
                              f"than min_weight_version {request.min_weight_version}")


@runtime_checkable
class Engine(Protocol):
    """One inference engine replica, driven by the worker runtime."""

    #: short engine name shown in membership (its `rlfabric.engines.registry` name)
    name: str
    #: the model it serves, as given on the command line
    model: str

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the engine's background work (its scheduler) until cancelled; started once it
        takes requests (`await tg.start(engine.run)`). On cancellation what is still in
        flight ends with `finish_reason="abort"`."""
        ...

    @property
    def version(self) -> int:
        """The weight version served now (-1 before any update or `serve_checkpoint_as`)."""
        ...

    async def serve_checkpoint_as(self, version: int) -> None:
        """Serve the weights the engine started with (its checkpoint) as `version`, loading
        nothing: a fleet no trainer pushed weights to serves its checkpoint as version 0.
        `weights_checksum()` then tells whether two workers started from the same one."""
        ...

    def check(self, request: RolloutRequest) -> None:
        """Raise `RequestRejected` if `request` can never be served: what `checked` refuses
        for every engine (ids, sizes, non-finite or out-of-range sampling), a token id outside
        the vocabulary, a prompt that does not fit the context. Cheap; the worker calls it
        before `generate`, so a bad request never joins a batch."""
        ...

    def generate(self, request: RolloutRequest, *, worker_id: str,
                 on_tokens: TokenSink | None = None) -> AsyncIterator[RolloutResult]:
        """Yield one `RolloutResult` per sample (`request.sampling.n` in all) as each finishes.
        Each result carries the sampled tokens, the logprob of every one of them under the raw
        model distribution (before temperature / top-k / top-p, like vLLM's `raw_logprobs`),
        top-k alternatives when `sampling.logprobs > 0`, and `version_spans` saying which
        weight version produced which tokens. A paused engine holds new requests until
        `resume()`; an abort pause ends them early with `finish_reason="abort"`. If
        `request.stream` is set and `on_tokens` given, each sample's tokens also go to
        `on_tokens` as `TokenDelta`s while they are sampled (in order; together they are the
        result's tokens). Where `request.stream` is not set, an engine may hand them over in
        deltas of about `PROGRESS_TOKENS` (the last few may never go: the result has them)."""
        ...

    async def pause(self, mode: PauseMode) -> None:
        """Stop generating. `abort`: in-flight sequences end now with what they have
        (`finish_reason="abort"`). `wait`: return once everything already admitted has
        finished. `keep`: freeze in-flight sequences between two decode steps and return at once;
        they continue after `resume()`, under whatever weights are loaded by then."""
        ...

    async def resume(self) -> None:
        """Undo `pause`: frozen sequences continue, held requests start."""
        ...

    async def load_weights(self, weights: PackedWeights, version: int) -> None:
        """Replace the weights with the verified payload `weights` (all of the model's names:
        `weights.state()` views them as tensors in this process, `weights.file()` is a file
        with the same bytes for an engine that loads in another process) and serve them as
        `version`. Nothing may keep a view of the payload after the call. All-or-nothing:
        names, shapes and dtypes are checked before anything is copied; on failure
        `WeightLoadError` is raised and the old version keeps serving (an engine that cannot
        check first restores a sound state before it raises). It takes effect between two
        decode steps and never aborts a sequence by itself."""
        ...

    @property
    def weights_device(self) -> str:
        """Where the engine's weights live, as torch names devices: on "cuda..." the worker
        brings a host payload (shm, filesystem, nats) to that GPU itself, through pinned
        memory and digested on the way, so `load_weights` copies device to device; "cpu" for
        engines that load from host memory or a file."""
        ...

    def weights_checksum(self) -> str:
        """A digest of every parameter (name, dtype, shape, bytes): equal weights, equal
        checksums, on any worker."""
        ...

    async def load_adapter(self, weights: PackedWeights, adapter: Adapter, version: int) -> str:
        """Load `version` of LoRA `adapter` from `weights` (its tensors in PEFT's layout) beside
        the versions already held, as its newest (held versions at or after it are dropped: a
        push taken back); return the checksum of its tensors. The newest `--adapter-versions`
        versions of each adapter stay loaded; a request running under an older one finishes
        on it. `WeightLoadError` if the tensors do not fit the model,
        `EngineError` (`adapter_limit`) past `--max-adapters` names, `Unsupported` for an
        engine without LoRA; the adapters held before stay as they were."""
        ...

    async def unload_adapter(self, name: str) -> bool:
        """Drop every version of adapter `name` (False if none was held); requests running
        under it finish."""
        ...

    def adapter_versions(self) -> dict[str, tuple[int, ...]]:
        """The adapters held: name -> versions, oldest first. A request naming an adapter is
        served under `adapter_version` if given, else the newest (`adapter_held` checks)."""
        ...

    @property
    def max_adapters(self) -> int:
        """Adapter names held at once (`--max-adapters`; 0: no limit, or no LoRA). The worker
        keeps within it: it evicts the least recently used for a new one and loads an
        evicted one again when a request names it (`rlfabric.worker.residency`)."""
        ...

    async def sleep(self, level: int) -> None:
        """Abort what runs and release memory: 1 = caches dropped and weights moved to host
        memory (wake brings them back), 2 = caches and weights dropped (the next load brings
        them; until then a woken engine holds its requests)."""
        ...

    async def wake(self, tags: tuple[str, ...] = ()) -> None:
        """Undo `sleep` for `tags` ("weights", "kv_cache"; all if empty)."""
        ...

    async def reset_prefix_cache(self) -> None:
        """Drop cached prefixes (their KV was computed with older weights)."""
        ...

    def describe(self) -> dict[str, str]:
        """Facts for operators: model, version, device, dtype, counts."""
        ...


@runtime_checkable
class JoinsGroups(Protocol):
    """An engine that takes collective weight updates through its own machinery (vLLM's
    weight transfer: tensors streamed into its own loader). The worker then hands it
    `init_transport` and collective updates; an engine without these calls loads every
    version from a payload (`load_weights`), and the worker joins the group and receives the
    broadcast for it. Optional: `TorchEngine` and `NullEngine` have no such calls."""

    async def init_transport(self, cmd: InitTransport, rank_offset: int) -> None:
        """Join the weight-broadcast group `cmd` describes as ranks `rank_offset...` (this
        worker's offset from rlfabric's handshake) of `cmd.world_size`; raise `Unsupported` at
        once where the engine cannot, never hang."""
        ...

    async def receive_collective(self, cmd: UpdateWeights) -> None:
        """Receive the broadcast of `cmd.version` over the group joined by `init_transport`
        and serve it."""
        ...


@runtime_checkable
class ServesMany(Protocol):
    """An engine that can take a delivered message's requests in one call. The worker then
    serves such a message with one task, not a task per request (with tracing off: a traced
    request keeps its own span on a lane). Optional: `VllmEngine` has no such call."""

    def generate_many(self, requests: list[RolloutRequest], *, worker_id: str,
                      on_tokens: TokenSink | None = None
                      ) -> AsyncGenerator[list[RolloutResult], None]:
        """`generate` for several requests at once, each of which passed `check` and has its
        own `request_id`: yield every sample's result once, as it finishes, the samples that
        finished together in one list (a decode batch's: the worker sends them as one
        message), in any order across requests (`request_id` and `sample_index` say whose).
        Pausing, aborting, `version_spans` and `on_tokens` work as in `generate`."""
        ...


__all__ = ["PROGRESS_TOKENS", "Engine", "EngineDied", "JoinsGroups", "PauseMode",
           "RequestRejected", "ServesMany", "TokenSink", "Unsupported", "WeightLoadError",
           "adapter_held"]
