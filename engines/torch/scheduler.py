"""Which sequences run next: admitted ones wait in `pending`, a `keep` pause parks new ones in
`held` until resume, an `abort` pause ends them at once. Batches of up to `max_batch` go to the
model runner in admission order."""

from __future__ import annotations

import anyio

from rlfabric.concurrency import Signal
from rlfabric.engines.torch.sequence import Sequence
from rlfabric.schemas import PauseMode


class Scheduler:
    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.pending: list[Sequence] = []
        self.held: list[Sequence] = []
        self.running: list[Sequence] = []
        self.paused: PauseMode | None = None
        self.wakeup = Signal()  # new sequences, or a resume
        self.progress = Signal()  # a batch ended

    def admit(self, seqs: list[Sequence]) -> None:
        if self.paused == "abort":  # like vLLM: an abort pause ends what arrives, too
            for seq in seqs:
                seq.finish = "abort"
                deliver(seq)
        elif self.paused == "keep":  # held, starts after resume
            self.held.extend(seqs)
        else:  # running, or draining for a wait pause: admitted now
            self.pending.extend(seqs)
            self.wakeup.fire()

    def next_batch(self) -> list[Sequence] | None:
        """The next batch to run, or None while there is nothing to run."""
        self.pending = [s for s in self.pending if not s.cancelled]
        if not self.pending or self.paused in ("keep", "abort"):
            return None
        batch, self.pending = self.pending[:self.max_batch], self.pending[self.max_batch:]
        self.running = batch
        return batch

    def finished(self, batch: list[Sequence]) -> None:
        self.running = []
        for seq in batch:
            deliver(seq)
        self.progress.fire()

    def abort_pending(self) -> None:
        for seq in self.pending:
            seq.finish = "abort"
            deliver(seq)
        self.pending.clear()

    def release_held(self) -> None:
        self.pending.extend(self.held)
        self.held.clear()
        self.wakeup.fire()

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.running)


def deliver(seq: Sequence) -> None:
    """Hand a finished sequence's result to whoever awaits it (if anyone still does)."""
    if seq.cancelled:
        return
    try:
        seq.sink.send_nowait(seq.result())
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass
