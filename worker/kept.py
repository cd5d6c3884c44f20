"""The versions a worker keeps for a weight delta to apply to (`UpdateWeights.keep`): the
packed bytes of the last version of each target loaded with `keep`, and their digest. A delta
(`UpdateWeights.delta`) against one of them makes the full version here
(`rlfabric.tensors.delta`); against anything else it is refused (`delta_base_missing`), and
the trainer pushes the full weights."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio

from rlfabric.bus import CommandFailed
from rlfabric.schemas import Adapter, ErrorCode, UpdateWeights
from rlfabric.telemetry import spans
from rlfabric.tensors.errors import DeltaRefused


def _delta() -> Any:
    from rlfabric.tensors import delta  # torch: loaded with the first delta

    return delta


def target_key(cmd: UpdateWeights) -> str:
    """"" for the base weights, else the adapter's key in the engine."""
    return cmd.target.name if isinstance(cmd.target, Adapter) else ""


class KeptVersions:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        #: by target: the digest of a version's packed bytes, and the bytes
        self.held: dict[str, tuple[str, bytearray]] = {}
        self._scratch = bytearray()  # a delta's pieces are decompressed here, one at a time
        #: called when what is kept changed (`rlfabric.worker.peers` gives it to others)
        self.on_change: Callable[[], None] = lambda: None

    @contextlib.asynccontextmanager
    async def making(self, cmd: UpdateWeights, received: Any, size: int
                     ) -> AsyncIterator[bytearray | None]:
        """Within it: the full version `cmd`'s delta (the first `size` bytes of `received`)
        makes, in the kept bytes of its base, changed in place (no second copy); None if `cmd`
        is no delta. Left by an error (a digest or a load that failed), the kept bytes go back
        to the base. `CommandFailed` (`delta_base_missing`, `digest_mismatch`) if it cannot be
        made."""
        if cmd.delta is None:
            yield None
            return
        made = await self._undelta(cmd, received, size)
        try:
            yield made
        except BaseException:
            box = [memoryview(received)[:size]]  # see `_undelta`
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(
                    lambda: _delta().revert(made, box.pop(), scratch=self._scratch))
            self.held[target_key(cmd)] = (cmd.delta.base, made)  # the base again
            raise

    async def _undelta(self, cmd: UpdateWeights, received: Any, size: int) -> bytearray:
        assert cmd.delta is not None
        held = self.held.get(target_key(cmd))
        if held is None or held[0] != cmd.delta.base:
            raise CommandFailed(ErrorCode.DELTA_BASE_MISSING, (
                f"{self.worker_id}: v{cmd.version} came as a delta against the packed version "
                f"with digest {cmd.delta.base}, and this worker holds "
                f"{'digest ' + held[0] if held else 'none'}; push the full weights"))
        # NOTE: an idle anyio worker thread keeps the arguments of its last call alive: the
        # view goes in a box it is taken out of
        box = [memoryview(received)[:size]]
        digest, base = held
        delta = _delta()
        # changing: named by no digest until it is the base again or the new version loaded,
        # so a delta never applies to bytes left half-way (a cancelled load, say)
        self.held[target_key(cmd)] = ("", base)

        def run() -> bytearray:
            view = box.pop()
            head, _ = delta.header(view)
            largest = max((p.nbytes for p in head.pieces), default=0)
            if len(self._scratch) < largest:
                self._scratch = bytearray(largest)
            made: bytearray = delta.apply(base, view, base_digest=digest, in_place=True,
                                          scratch=self._scratch)
            return made

        try:
            with spans.span("apply delta"):
                return await anyio.to_thread.run_sync(run)
        except DeltaRefused as exc:
            code, why = exc.code, str(exc)
        self.held[target_key(cmd)] = held  # refused whole: the base as it was
        # NOTE: raised outside the except block: the refused frames hold views of the buffer
        raise CommandFailed(code, f"{self.worker_id}: v{cmd.version} not loaded: {why}")

    def loaded(self, cmd: UpdateWeights, made: bytearray | None) -> None:
        """`cmd` was loaded: keep its bytes (`made`) if it asks to, else keep nothing of its
        target (a later delta against an older version must not apply)."""
        if cmd.keep and made is not None:
            self.held[target_key(cmd)] = (cmd.digest, made)
        else:
            self.held.pop(target_key(cmd), None)
        self.on_change()

    def lacks_base(self, cmd: UpdateWeights) -> bool:
        """Whether `cmd` is a delta against a version this worker does not keep."""
        held = self.held.get(target_key(cmd))
        return cmd.delta is not None and (held is None or held[0] != cmd.delta.base)
