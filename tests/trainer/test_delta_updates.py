"""`update_weights(..., delta=True)` on real torch workers: after a real AdamW step only what
changed goes, over filesystem and nats (over shm whole); every worker verifies the full
version's checksum against the sender's and, after 20 such updates, serves exactly the
trainer's logprobs; a worker that joins, or restarts, takes the version from the workers
keeping it, and the next delta reaches it too; a delta against a base no worker keeps is
refused and the full weights go at once; a damaged delta is refused by
name and the old weights serve; a LoRA adapter goes the same way."""

from __future__ import annotations

import os
import signal

import anyio
import numpy as np
import pytest
import torch
from helpers import req, taken_logprobs

from rlfabric.bus import MembershipChanged, QuorumNotReached, QuorumPolicy
from rlfabric.schemas import Adapter
from rlfabric.tensors import lora
from rlfabric.tensors.checksums import checksum
from rlfabric.tensors.models import build_model
from rlfabric.transports.filesystem import WEIGHTS_FILE

pytestmark = [pytest.mark.nats, pytest.mark.anyio]

BF16 = ("--threads", "1", "--dtype", "bfloat16")


def _step(model: torch.nn.Module, seed: int, lr: float = 1e-5) -> None:
    """One AdamW step on seeded tokens (a fresh optimizer: the first step's size is lr)."""
    model.train()
    x = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(x, labels=x).loss.backward()
    torch.optim.AdamW(model.parameters(), lr=lr).step()
    model.zero_grad()
    model.eval()


def _full_bytes(model: torch.nn.Module) -> int:
    from rlfabric.tensors import plan

    return plan(model.state_dict())[1]


async def _served_as(fabric, model: torch.nn.Module, version: int) -> None:
    """Greedy rollouts on every worker: tagged `version`, logprobs the trainer's own."""
    reqs = [req(f"p{version}.{i}", [256, 5 + i], max_tokens=12, temperature=0.0)
            for i in range(6)]
    out = [r async for r in fabric.generate(reqs, timeout=60)]
    for r in out:
        assert [s.version for s in r.version_spans] == [version], r.version_spans
        ref = taken_logprobs(model, [256, 5 + int(r.request_id.split(".")[1])],
                             r.completion_token_ids.tolist())
        gap = float(np.abs(ref - r.logprobs.numpy()).max())
        assert gap <= 1e-5


async def test_deltas_over_every_transport_joiners_and_a_lost_base(client, workers) -> None:
    # bfloat16, as models are trained: a step keeps most elements' bit patterns (in float32
    # it moves every one's low bytes, and the delta would not pay)
    (d0, _) = workers(["d0", "d1"], *BF16)
    model = build_model("tiny", dtype=torch.bfloat16)
    full = _full_bytes(model)
    async with client() as fabric:
        await fabric.wait_for_workers(2, timeout=60)
        # no base yet: whole
        rep = await fabric.update_weights(1, module=model, transport="nats", delta=True)
        assert fabric.last_push_bytes == full and set(rep.ok) == {"d0", "d1"}
        sizes = {}
        for v, transport in enumerate(["filesystem", "nats", "shm", "nats"], start=2):
            _step(model, v)
            rep = await fabric.update_weights(v, module=model, transport=transport, delta=True)
            assert set(rep.ok) == {"d0", "d1"}  # checksums verified against the sender's
            sizes[v] = fabric.last_push_bytes
        # shm goes whole and nothing is kept, so the next goes whole too
        assert [n < full / 4 for n in sizes.values()] == [True, True, False, False], sizes
        for v in range(6, 21):  # 20 updates in all, deltas on the last again
            _step(model, v)
            await fabric.update_weights(v, module=model, transport="nats", delta=True)
            assert fabric.last_push_bytes < full / 4
        await _served_as(fabric, model, 20)

        # joins: it holds no base, and takes v20 from the workers keeping it, not the trainer
        workers(["d2"], *BF16)
        await fabric.wait_for_workers(3, timeout=60)
        await fabric.watcher.wait_until(lambda s: _keeps(fabric, "d2", 20), timeout=60)
        _step(model, 21)
        rep = await fabric.update_weights(21, module=model, transport="filesystem",
                                          delta=True)
        assert set(rep.ok) == {"d0", "d1", "d2"}
        assert fabric.last_push_bytes < full / 4  # d2 keeps v20 too

        # d0 restarts under its own id: it takes v21 from d1 and d2
        d0.send_signal(signal.SIGKILL)
        await fabric.watcher.wait_until(lambda s: "d0" not in s.worker_ids, timeout=30)
        workers(["d0"], *BF16)
        await fabric.wait_for_workers(3, timeout=60)
        await fabric.watcher.wait_until(lambda s: _keeps(fabric, "d0", 21), timeout=60)
        _step(model, 22)
        rep = await fabric.update_weights(22, module=model, transport="nats", delta=True)
        assert set(rep.ok) == {"d0", "d1", "d2"} and fabric.last_push_bytes < full / 4

        # the trainer's base is one no worker keeps: each refuses by name, the full weights go
        other = build_model("tiny", dtype=torch.bfloat16)
        lost = await fabric.updates.bases.pack("", 22, other.state_dict())
        fabric.updates.bases.keep("", lost, {"d0", "d1", "d2"})
        _step(model, 23)
        rep = await fabric.update_weights(23, module=model, transport="filesystem",
                                          delta=True)
        assert set(rep.ok) == {"d0", "d1", "d2"}
        assert fabric.last_push_bytes > full  # the delta, refused, then the full
        await _served_as(fabric, model, 23)


def _keeps(fabric, worker: str, version: int) -> bool:
    """Whether `worker` serves `version` and keeps it for the next delta."""
    info = fabric.watcher.members.get(worker)
    return info is not None and info.weight_version == version and len(info.kept) == 1 \
        and not info.behind


async def test_joiners_take_the_version_from_the_workers_keeping_it(client, workers) -> None:
    # null workers (they checksum names and shapes only: verify="off"): each checks the digest
    # of the copy it loads; the torch test above checks served logprobs
    workers(["k0", "k1"], engine="null")
    model = build_model("tiny", dtype=torch.bfloat16)
    full = _full_bytes(model)
    joiners = [f"j{i}" for i in range(8)]
    async with client() as fabric:
        await fabric.wait_for_workers(2, timeout=60)
        sent = 0
        for v in range(1, 6):
            if v > 1:
                _step(model, v, lr=1e-6)
            await fabric.update_weights(v, module=model, transport="nats", delta=True,
                                        verify="off")
            sent += fabric.last_push_bytes
        workers(joiners, engine="null")
        await fabric.watcher.wait_until(lambda s: all(_keeps(fabric, j, 5) for j in joiners),
                                        timeout=120)
        want = (await fabric.bus.state.read()).policy  # names v5's digest
        assert {fabric.watcher.members[j].policy for j in joiners} == {want}
        assert sent <= 1.2 * full, (sent, full)  # the trainer sent v5 once, as deltas
        _step(model, 6, lr=1e-6)
        rep = await fabric.update_weights(6, module=model, transport="nats", delta=True,
                                          verify="off")
        assert len(rep.ok) == 10 and fabric.last_push_bytes < full / 4


async def test_a_worker_killed_mid_delta_comes_back_on_the_fleets_version(client,
                                                                         workers) -> None:
    small = ("--model", "small64", *BF16)  # a load long enough to be killed inside
    (x0,) = workers(["x0"], *small)
    workers(["x1"], *small)
    model = build_model("small64", dtype=torch.bfloat16)
    full = _full_bytes(model)
    states = {}
    async with client() as fabric:
        await fabric.wait_for_workers(2, timeout=60)
        for v in (1, 2, 3):
            if v > 1:
                _step(model, v)
            states[v] = {k: t.clone() for k, t in model.state_dict().items()}
        await fabric.update_weights(1, state_dict=states[1], transport="nats", delta=True)
        await fabric.update_weights(2, state_dict=states[2], transport="nats", delta=True)

        def updating(s) -> bool:
            return any(m.worker_id == "x0" and m.state == "updating" for m in s.members)

        async with anyio.create_task_group() as tg:
            async def kill() -> None:
                await fabric.watcher.wait_until(updating, timeout=60)
                x0.send_signal(signal.SIGKILL)

            tg.start_soon(kill)
            try:  # x0 dies while it applies v3's delta: v3 fails and is taken back
                await fabric.update_weights(3, state_dict=states[3], transport="nats",
                                            delta=True, policy=QuorumPolicy(timeout=30))
            except (QuorumNotReached, MembershipChanged) as exc:
                assert "taken back to v2: the fleet serves it again (x1 v2)" in str(exc), exc
                served = 2
            else:  # x0 acked before the kill landed
                served = 3
        assert (await fabric.bus.state.read()).weight_version == served
        workers(["x0"], *small)  # back, with no base: it takes v{served} from x1
        await fabric.watcher.wait_until(
            lambda s: all(_keeps(fabric, w, served) for w in ("x0", "x1")), timeout=90)
        model.load_state_dict(states[served])
        await _served_as(fabric, model, served)  # never a half-made model
        _step(model, 4)
        rep = await fabric.update_weights(4, module=model, transport="nats", delta=True)
        assert set(rep.ok) == {"x0", "x1"} and fabric.last_push_bytes < full / 4
        await _served_as(fabric, model, 4)


async def test_a_damaged_delta_is_refused_and_the_old_weights_serve(client, workers) -> None:
    workers(["e0", "e1"], *BF16)
    model = build_model("tiny", dtype=torch.bfloat16)
    async with client() as fabric:
        await fabric.wait_for_workers(2, timeout=60)
        await fabric.update_weights(1, module=model, transport="nats", delta=True)
        served = build_model("tiny", dtype=torch.bfloat16)
        served.load_state_dict(model.state_dict())
        _step(model, 2)
        staged, _ = await fabric.updates.stage_delta(2, model, "filesystem", key="",
                                                     with_checksum=True)
        assert staged.delta is not None
        (body,) = staged.transport.tensors
        with open(os.path.join(staged.transport.path, WEIGHTS_FILE), "r+b") as f:
            f.seek(body.offset + body.nbytes - 50)  # inside the last piece, after staging
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0xFF]))
        with pytest.raises(QuorumNotReached, match=r"e0 \(digest_mismatch.*e1 \(digest_mismatch"):
            await fabric.push_weights(staged, policy=QuorumPolicy(timeout=20))
        assert (await fabric.bus.state.read()).weight_version == 1
        await _served_as(fabric, served, 1)
        # each worker's kept v1 is whole again: the next delta on it applies
        rep = await fabric.update_weights(2, module=model, transport="filesystem", delta=True)
        assert len(rep.ok) == 2 and fabric.last_push_bytes < _full_bytes(model) / 4
        await _served_as(fabric, model, 2)

        # an adapter goes as a delta too, verified against the sender's checksum
        qv = Adapter(name="qv", rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
        adapter = {k: v.to(torch.bfloat16)
                   for k, v in lora.random_adapter(served, qv, seed=2, std=0.2).items()}
        full = sum(t.nbytes for t in adapter.values())
        await fabric.update_weights(1, state_dict=adapter, adapter=qv, transport="nats",
                                    delta=True)
        assert fabric.last_push_bytes >= full  # no base yet
        with torch.no_grad():
            next(iter(adapter.values()))[0, :3] += 0.5  # a few elements move
        rep = await fabric.update_weights(3, state_dict=adapter, adapter=qv, transport="nats",
                                          delta=True)
        assert fabric.last_push_bytes < full / 4
        assert {a.weights_checksum for a in rep.acks.values()} == {checksum(adapter)}
        areqs = [req(f"q{i}", [256, i], max_tokens=8, temperature=0.0, adapter="qv")
                 for i in range(4)]
        aout = [r async for r in fabric.generate(areqs, timeout=60)]
    assert len(aout) == 4 and all([s.version for s in r.version_spans] == [3] for r in aout)
