"""Control-plane messages: `Command`s the trainer broadcasts, `Ack`s each worker returns.

Commands go to the `RL_CONTROL` stream on `<prefix>.control.<op>`; every worker receives every
command and answers on `<prefix>.ack.<cmd_id>` (core NATS). A command naming a `job` acts on
that job's requests and adapters only (`rlfabric.schemas.jobs`).
"""

from __future__ import annotations

import functools
from typing import Literal, get_args

import msgspec

from rlfabric.schemas._base import Message

# ---- update targets and weight transports -------------------------------------------------


class Base(Message, tag_field="kind", tag="base", frozen=True, kw_only=True):
    """Update the base model's weights."""


class Adapter(Message, tag_field="kind", tag="lora", frozen=True, kw_only=True):
    """A LoRA adapter: the update's tensors are its A and B matrices in PEFT's layout
    (`base_model.model.<module>.lora_A.weight` [rank, in], `...lora_B.weight` [out, rank]) for
    each of `target_modules` (module names' last part, e.g. `q_proj`); a module's output gains
    `B @ A @ x * alpha / rank`. Requests name it (`RolloutRequest.adapter`); its versions are
    the updates' `version`s."""

    name: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    #: the base policy (`rlfabric.schemas.policy`) the adapter was trained on: a worker whose
    #: base weights are another policy refuses it (`base_mismatch`); "" = not checked
    base: str = ""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


Target = Base | Adapter


class TensorMeta(Message, frozen=True, kw_only=True):
    """Where one tensor lies in a staged buffer (offset/nbytes) or a collective broadcast."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0
    nbytes: int = 0


class DeltaPiece(Message, frozen=True, kw_only=True):
    """One changed span of a packed buffer in a `WeightDelta`: `nbytes` bytes at `offset`,
    their XOR with the base's compressed to `length` bytes of the delta's body."""

    offset: int
    nbytes: int
    length: int


class WeightDelta(Message, frozen=True, kw_only=True):
    """The header of a weight delta (`rlfabric.tensors.delta`): the digest of the packed base
    it applies to, the size of the buffer it makes, and its changed spans in body order."""

    base: str
    size: int
    pieces: tuple[DeltaPiece, ...] = ()


class DeltaOf(Message, frozen=True, kw_only=True):
    """What an `UpdateWeights` that carries a delta applies to and makes: the digest of the
    packed base version, and the layout of the buffer it makes (the transport's locator
    describes the delta's own bytes)."""

    base: str
    tensors: tuple[TensorMeta, ...] = ()


class SharedMemory(Message, tag_field="kind", tag="shm", frozen=True, kw_only=True):
    """Tensors staged in a POSIX shared-memory segment on the same host."""

    name: str
    tensors: tuple[TensorMeta, ...] = ()


class Filesystem(Message, tag_field="kind", tag="filesystem", frozen=True, kw_only=True):
    """Tensors written under `path`; with `require_marker` a STABLE file marks them complete."""

    path: str
    require_marker: bool = True
    tensors: tuple[TensorMeta, ...] = ()


class Nats(Message, tag_field="kind", tag="nats", frozen=True, kw_only=True):
    """Tensors chunked over a JetStream stream; any host can pull them. Chunk `i` is the
    message on `<subject>.<i>` and holds bytes `[i * chunk_bytes, (i + 1) * chunk_bytes)`."""

    stream: str
    subject: str
    chunks: int = 0
    chunk_bytes: int = 4 * 1024 * 1024
    tensors: tuple[TensorMeta, ...] = ()


class PeerAsk(Message, frozen=True, kw_only=True):
    """Core NATS request on `<prefix>.peers.weights.<digest>`: a worker that joined or fell
    behind asks for chunk `index` (bytes `[index * chunk_bytes, (index + 1) * chunk_bytes)`)
    of the packed version with that digest from the workers keeping it (one of them answers:
    a queue group), not from the trainer (`rlfabric.worker.peers`)."""

    worker_id: str
    digest: str
    index: int = 0
    chunk_bytes: int = 0


class Collective(Message, tag_field="kind", tag="collective", frozen=True, kw_only=True):
    """Tensors broadcast by the trainer (rank 0) over an initialised group (NCCL or gloo)."""

    group_epoch: int
    tensors: tuple[TensorMeta, ...] = ()


class CudaIpcBucket(Message, frozen=True, kw_only=True):
    """One CUDA buffer of a `cuda_ipc` push: bytes `[offset, offset + nbytes)` of the packed
    layout, and what another process on the same host needs to map it (torch's CUDA IPC
    sharing of the buffer's storage)."""

    offset: int
    nbytes: int
    device_uuid: str
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes = b""
    event_sync: bool = False


class CudaIpc(Message, tag_field="kind", tag="cuda_ipc", frozen=True, kw_only=True):
    """Tensors packed into CUDA buffers by a trainer on the same host as the workers (its
    `boot_id`), mapped by each worker through CUDA IPC; freed once the update is decided."""

    host: str
    boot_id: str
    buckets: tuple[CudaIpcBucket, ...] = ()
    tensors: tuple[TensorMeta, ...] = ()


class External(Message, tag_field="kind", tag="external", frozen=True, kw_only=True):
    """Tensors moved by a transport registered outside rlfabric (`rlfabric.transports`):
    the name it was registered under and its own parameters."""

    transport: str
    params: dict[str, str] = msgspec.field(default_factory=dict)
    tensors: tuple[TensorMeta, ...] = ()


Transport = SharedMemory | Filesystem | Nats | Collective | CudaIpc | External
#: every locator's `kind` tag, in declaration order (the transports that can be staged are
#: those registered in `rlfabric.transports`)
TRANSPORT_KINDS: tuple[str, ...] = tuple(t.__struct_config__.tag for t in get_args(Transport))

# ---- commands -------------------------------------------------------------------------------


class _Command(Message, tag_field="op", frozen=True, kw_only=True):
    """Fields every command carries: `cmd_id` (idempotency key), `seq` (its sequence in the
    control stream, assigned at publish), the membership `epoch` the sender saw, and a
    `deadline` (unix seconds; 0 = none) after which a worker refuses to start it."""

    cmd_id: str
    seq: int = 0
    epoch: int = 0
    deadline: float = 0.0


PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)


class Pause(_Command, tag="pause", frozen=True, kw_only=True):
    """Pause the pool (`job` ""), or only job `job`'s requests (`rlfabric.schemas.jobs`)."""

    mode: PauseMode = "wait"
    job: str = ""


class Resume(_Command, tag="resume", frozen=True, kw_only=True):
    """Resume the pool (`job` ""), or job `job`'s requests."""

    job: str = ""


class UpdateWeights(_Command, tag="update_weights", frozen=True, kw_only=True):
    """Serve `version` of `run`'s weights (payload `digest`). The run, version and digest name
    the policy (`rlfabric.schemas.policy`); a worker already serving that policy loads
    nothing, and one serving a newer version of the same run goes back to it (a failed push
    taken back). `reset_prefix_cache=False` keeps cached prefixes only where no prefix
    computed under other weights can be served (an engine that cannot tell refuses it)."""

    version: int
    transport: Transport
    digest: str
    target: Target = Base()
    reset_prefix_cache: bool = True
    run: str = ""
    #: the job an adapter belongs to ("": the default job); base weights are the pool's
    job: str = ""
    #: set: the transport carries a delta against the packed version whose digest it names
    #: (`rlfabric.tensors.delta`), which makes the buffer `digest` names
    delta: DeltaOf | None = None
    #: keep this version's packed bytes: the next push of this target may be a delta on them
    keep: bool = False


CollectiveBackend = Literal["gloo", "nccl"]
COLLECTIVE_BACKENDS: tuple[str, ...] = get_args(CollectiveBackend)


class TensorStream(Message, frozen=True, kw_only=True):
    """How a group streams the tensors of an update into an engine's own loader, tensor by
    tensor, packed into `packed_num_buffers` buffers of `packed_buffer_size_bytes` (vLLM's
    NCCL weight transfer speaks it): the trainer's choice, shipped to every worker so both
    sides cut the stream the same way."""

    packed: bool = True
    packed_buffer_size_bytes: int = 1 << 30
    packed_num_buffers: int = 2


class InitTransport(_Command, tag="init_transport", frozen=True, kw_only=True):
    """Form collective group `group_epoch`: rank 0 is the trainer, each worker's first rank is
    `rank_offsets[worker_id]`. `stream` set: the tensors are streamed into the engine's own
    loader (`TensorStream`; `rlfabric.integrations.vllm_sync`), which only engines that join
    groups themselves take (`rlfabric.engines.protocol.JoinsGroups`); unset: rlfabric's
    packed-buffer broadcast, which the worker receives for its engine."""

    backend: CollectiveBackend
    group_epoch: int
    master_addr: str
    master_port: int
    world_size: int
    rank_offsets: dict[str, int]
    stream: TensorStream | None = None


class Sleep(_Command, tag="sleep", frozen=True, kw_only=True):
    level: int = 1


class Wake(_Command, tag="wake", frozen=True, kw_only=True):
    tags: tuple[str, ...] = ()


class ResetPrefixCache(_Command, tag="reset_prefix_cache", frozen=True, kw_only=True):
    pass


class Describe(_Command, tag="describe", frozen=True, kw_only=True):
    pass


class UnloadAdapter(_Command, tag="unload_adapter", frozen=True, kw_only=True):
    """Drop every loaded version of job `job`'s adapter `name`; its requests then fail
    `adapter_unknown`."""

    name: str
    job: str = ""


class Shutdown(_Command, tag="shutdown", frozen=True, kw_only=True):
    """Drain and leave; or, naming a `job` (the pool's operator only), end that job: its
    requests, queued or running, are answered `job_deleted`, its adapters dropped. `worker`:
    only that worker leaves (the others ack and serve on). `move`: the worker does not finish
    its unfinished samples but hands them back at once, each with the tokens sampled so far
    (`RolloutResult.moved`), for their clients to continue elsewhere."""

    job: str = ""
    worker: str = ""
    move: bool = False


Command = (
    Pause
    | Resume
    | UpdateWeights
    | InitTransport
    | Sleep
    | Wake
    | ResetPrefixCache
    | Describe
    | UnloadAdapter
    | Shutdown
)
COMMAND_TYPES: tuple[type[_Command], ...] = get_args(Command)
#: what a job may send for itself, on its own subjects (`rlfabric.schemas.jobs`)
JOB_COMMANDS = Pause | Resume | UpdateWeights | UnloadAdapter


def op_of(cmd: _Command) -> str:
    """The command's tag, e.g. `"pause"`: the last token of its subject."""
    return _tag_of(type(cmd))


@functools.cache
def _tag_of(kind: type[_Command]) -> str:
    # NOTE: cached: msgspec builds a new `__struct_config__` object at every access,
    # and the control path asks once per command and per ack
    tag = kind.__struct_config__.tag
    assert isinstance(tag, str)  # every command class declares a str tag
    return tag


# ---- acknowledgements -----------------------------------------------------------------------


class Ack(Message, frozen=True, kw_only=True, gc=False):
    """A worker's answer to one command. Two-phase commands (collective updates, transport
    init) send `phase="ready"` once posted, then `phase="done"`. `weight_version` and
    `weights_checksum` are what the worker serves after applying the command; `detail` carries
    op-specific results (e.g. `describe`). Not tracked by the garbage collector (it holds no
    reference back to anything): a sender keeps one per worker until its quorum is in."""

    cmd_id: str
    worker_id: str
    phase: Literal["ready", "done"] = "done"
    status: Literal["ok", "error"] = "ok"
    error_code: str = ""
    error_message: str = ""
    weight_version: int = -1
    weights_checksum: str = ""
    elapsed_s: float = 0.0
    detail: dict[str, str] = {}
