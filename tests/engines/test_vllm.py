"""The vLLM engine for real: `rlfabric worker --engine vllm` processes (vLLM's CPU build here)
on a real nats-server, the tiny64 checkpoint, the trainer's recompute as the reference.

Skipped, with the reason, where vLLM is not installed (the default dev venv); CI runs them in
the venv the README's vLLM command builds.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import anyio
import helpers
import msgspec
import pytest
import torch
from helpers import generate_moving, streamed_as_answered, worst_gap

from rlfabric.bus import Limits, QuorumNotReached, QuorumPolicy
from rlfabric.schemas import Adapter, RolloutResult
from rlfabric.tensors import lora
from rlfabric.tensors.checksums import checksum
from rlfabric.tensors.models import build_model
from rlfabric.trainer import FabricClient

pytestmark = [
    pytest.mark.nats, pytest.mark.vllm, pytest.mark.anyio,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed here (README, 'vLLM': its CPU build)"),
    pytest.mark.timeout(600),
]

MODEL = "tiny64"
perturbed = functools.partial(helpers.perturbed, model_name=MODEL)
req = functools.partial(helpers.req, min_version=0)
EOS = 257


class Fleet:
    """vLLM worker processes of one job; `stop()` ends every one."""

    def __init__(self, url: str, prefix: str) -> None:
        self.url, self.prefix = url, prefix
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, wid: str, *extra: str, engine: str = "vllm",
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        path = f"{os.environ.get('TMPDIR', '/tmp')}/rlf-{self.prefix}-{wid}.log"
        with open(path, "wb") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [sys.executable, "-m", "rlfabric", "worker", "--nats", self.url, "--prefix",
                 self.prefix, "--worker-id", wid, "--engine", engine, "--model", MODEL, *extra],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.procs[wid] = proc
        return proc

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


@contextlib.contextmanager
def fleet(url: str) -> Iterator[Fleet]:
    f = Fleet(url, "v" + uuid.uuid4().hex[:10])
    try:
        yield f
    finally:
        f.stop()


@pytest.fixture(scope="module")
def two_vllm(nats_url: str) -> Iterator[Fleet]:
    """Two vLLM workers shared by the tests of this module that leave them serving."""
    with fleet(nats_url) as f:
        f.start("vl0")
        f.start("vl1")
        yield f


def client(f: Fleet, **limits) -> contextlib.AbstractAsyncContextManager[FabricClient]:
    return FabricClient.connect(f.url, prefix=f.prefix, limits=Limits(**limits),
                                policy=QuorumPolicy(timeout=120))


async def test_parity_32_samples_match_the_trainers_recompute(two_vllm: Fleet) -> None:
    async with client(two_vllm) as fabric:
        await fabric.wait_for_workers(2, timeout=240)
        v0 = build_model(MODEL)
        await fabric.update_weights(0, module=v0)
        reqs = [req(f"p{i}", [256, 10 + i, 20 + i], max_tokens=24, temperature=1.0, seed=i,
                    n=2, logprobs=3) for i in range(16)]
        out = [r async for r in fabric.generate(reqs, timeout=120)]
    assert len(out) == 32 and all(isinstance(r, RolloutResult) for r in out)
    assert {r.worker_id for r in out} == {"vl0", "vl1"}
    assert worst_gap(v0, reqs, out) <= 1e-4
    for r in out:
        assert [(s.version, s.start, s.end) for s in r.version_spans] == [
            (0, 0, len(r.completion_token_ids))]
        top = r.top_logprobs
        assert top is not None and top.k == 3 and len(top.ids) == 3 * len(r.logprobs)
        assert r.finish_reason in ("stop", "length")


@pytest.mark.parametrize("transport", ["shm", "filesystem", "nats"])
async def test_update_reaches_both_and_no_stale_prefix_cache(two_vllm: Fleet,
                                                             transport: str) -> None:
    prefix = [256, *range(1, 200)]  # a long shared prompt: cached by vLLM's prefix cache
    async with client(two_vllm) as fabric:
        await fabric.wait_for_workers(2, timeout=240)
        v0, v1 = build_model(MODEL), perturbed(7)
        await fabric.update_weights(0, module=v0, transport=transport)
        # NOTE: ids unique per transport: these tests share one job, and a reused request id
        # within the results' dedupe window loses its result (a known issue of the bus)
        before = [req(f"b{transport}{i}", [*prefix, i], max_tokens=8, seed=i) for i in range(8)]
        got0 = [r async for r in fabric.generate(before, timeout=120)]
        rep = await fabric.update_weights(1, module=v1, transport=transport)
        assert rep.ok == ("vl0", "vl1") and rep.failed == ()
        assert {a.weights_checksum for a in rep.acks.values()} == {checksum(v1.state_dict())}
        after = [req(f"a{transport}{i}", [*prefix, i], min_version=1, max_tokens=8, seed=i)
                 for i in range(8)]
        got1 = [r async for r in fabric.generate(after, timeout=120)]
    assert worst_gap(v0, before, got0) <= 1e-4
    assert all([s.version for s in r.version_spans] == [1] for r in got1)
    assert worst_gap(v1, after, got1) <= 1e-4  # not v0's cached prefix
    assert worst_gap(v0, after, got1) > 1e-3


async def test_a_kept_prefix_cache_never_serves_blocks_of_other_weights(two_vllm: Fleet
                                                                        ) -> None:
    """`reset_prefix_cache=False`: the cache is kept, but a 300-token prefix the worker cached
    under v0 (two blocks) is not served to v1 (requests are salted per load): v1's requests
    match v1."""
    prefix = [256, *(1 + i % 250 for i in range(300))]
    async with client(two_vllm) as fabric:
        await fabric.wait_for_workers(2, timeout=240)
        v0, v1 = build_model(MODEL), perturbed(11)
        await fabric.update_weights(0, module=v0)
        # one session: both calls go to the worker that cached the prefix (affinity)
        before = [req(f"kb{i}", [*prefix, i], max_tokens=8, seed=i) for i in range(16)]
        got0 = [r async for r in fabric.generate(before, timeout=120, session="kept")]
        await fabric.update_weights(1, module=v1, reset_prefix_cache=False)
        after = [req(f"ka{i}", [*prefix, i], min_version=1, max_tokens=8, seed=i)
                 for i in range(16)]
        got1 = [r async for r in fabric.generate(after, timeout=120, session="kept")]
    assert len({r.worker_id for r in got0 + got1}) == 1
    assert worst_gap(v0, before, got0) <= 1e-4
    assert all([s.version for s in r.version_spans] == [1] for r in got1)
    assert worst_gap(v1, after, got1) <= 1e-4  # not v0's cached prefix
    assert worst_gap(v0, after, got1) > 1e-3


# NOTE: the pause-mode tests (wait, abort + continue, keep + update + resume) are the torch
# engine's, parametrized over both engines: tests/trainer/test_control.py


async def test_corrupted_payload_is_refused_and_the_old_weights_keep_serving(
        two_vllm: Fleet) -> None:
    from multiprocessing import shared_memory

    v0 = build_model(MODEL)
    async with client(two_vllm) as fabric:
        await fabric.wait_for_workers(2, timeout=240)
        await fabric.update_weights(0, module=v0)
        staged = await fabric.stage_weights(1, perturbed(3), "shm")
        seg = shared_memory.SharedMemory(name=staged.transport.name)
        seg.buf[100] ^= 0xFF
        seg.close()
        with pytest.raises(QuorumNotReached, match=r"vl0 \(digest_mismatch.*vl1 \(digest_mismatch"):
            await fabric.push_weights(staged, policy=QuorumPolicy(timeout=60))
        bad = dict(v0.state_dict())
        bad["lm_head.weight"] = torch.zeros(3, 3)
        with pytest.raises(QuorumNotReached, match=r"vl0 \(load_failed.*lm_head.weight"):
            await fabric.update_weights(2, state_dict=bad, policy=QuorumPolicy(timeout=60))
        reqs = [req(f"c{i}", [256, i], max_tokens=10, seed=i) for i in range(6)]
        out = [r async for r in fabric.generate(reqs, timeout=120)]
    assert all([s.version for s in r.version_spans] == [0] for r in out)
    assert worst_gap(v0, reqs, out) <= 1e-4


async def test_load_failing_inside_vllm_restarts_the_engine_on_the_previous_weights(
        nats_url: str) -> None:
    """A load vLLM's loader gives up on halfway (injected by a worker extension of this folder's)
    leaves a half-written model: the worker acks the error only once a restarted engine serves
    the previous version again; requests in flight across it complete, and a later update
    lands."""
    v1, v2, v3 = perturbed(21), perturbed(22), perturbed(23)
    here = os.path.dirname(os.path.abspath(__file__))
    with fleet(nats_url) as f:
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
        proc = f.start("fl0", "--worker-extension", "failing_vllm_load.FailingLoad",
                       env={"PYTHONPATH": path})
        async with client(f) as fabric:
            await fabric.wait_for_workers(1, timeout=240)
            await fabric.update_weights(1, module=v1)
            reqs = [req(f"f{i}", [256, 90 + i], max_tokens=200, seed=i) for i in range(6)]
            out: list = []
            async with anyio.create_task_group() as tg:
                async def consume() -> None:
                    out.extend([r async for r in fabric.generate(reqs, timeout=240)])

                tg.start_soon(consume)
                await fabric.watcher.wait_until(
                    lambda s: sum(m.in_flight for m in s.members) >= 1, timeout=60)
                with pytest.raises(QuorumNotReached,
                                   match=r"fl0 \(load_failed: .*injected.*restarted and serves v1"):
                    await fabric.update_weights(2, module=v2, policy=QuorumPolicy(timeout=180))
            after = [req(f"g{i}", [256, 95 + i], max_tokens=16, seed=i) for i in range(4)]
            got1 = [r async for r in fabric.generate(after, timeout=120)]
            rep = await fabric.update_weights(3, module=v3)
            later = [req(f"h{i}", [256, 95 + i], min_version=3, max_tokens=16, seed=i)
                     for i in range(4)]
            got3 = [r async for r in fabric.generate(later, timeout=120)]
        assert proc.poll() is None  # the worker lived through it
    assert len(out) == 6 and all(isinstance(r, RolloutResult) for r in out)
    assert all(isinstance(r, RolloutResult) for r in got1 + got3)
    assert all([s.version for s in r.version_spans] == [1] for r in got1)
    assert worst_gap(v1, after, got1) <= 1e-4  # the previous weights, whole
    assert rep.ok == ("fl0",) and worst_gap(v3, later, got3) <= 1e-4


# importing vLLM's AsyncLLM in this process imports torch modules that warn of deprecations
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_stop_it_asked_for_is_not_logged_as_the_engine_dying(caplog) -> None:
    """vLLM's shutdown may end its output handler with `EngineDeadError`, which vLLM logs as an
    error: while the engine stops vLLM (`stopping_quietly`) that record is dropped on vLLM's
    own logger; any other record passes, and outside a stop a dead engine is still logged."""
    from vllm.v1.engine import async_llm
    from vllm.v1.engine.exceptions import EngineDeadError

    from rlfabric.engines.vllm.engine import stopping_quietly

    def fail(exc: Exception) -> None:
        try:
            raise exc
        except Exception:
            async_llm.logger.exception("AsyncLLM output_handler failed.")

    caplog.set_level(logging.WARNING)
    with stopping_quietly():
        fail(EngineDeadError())
        fail(RuntimeError("a real fault"))
    fail(EngineDeadError())
    assert [(r.exc_info[0].__name__, r.levelname) for r in caplog.records
            if r.name == async_llm.logger.name] == [("RuntimeError", "ERROR"),
                                                     ("EngineDeadError", "ERROR")]


async def test_sleep_and_collective_are_refused_at_once_on_cpu(two_vllm: Fleet) -> None:
    async with client(two_vllm) as fabric:
        await fabric.wait_for_workers(2, timeout=240)
        t0 = time.monotonic()
        with pytest.raises(QuorumNotReached, match=r"vl0 \(unsupported: sleep.*frees no"):
            await fabric.sleep(1, policy=QuorumPolicy(timeout=30))
        # the call stops at the first refusal, which may be either worker's
        with pytest.raises(QuorumNotReached,
                           match=r"refused by vl[01] \(unsupported: this group speaks rlfabric's"):
            await fabric.init_transport("gloo", timeout=20)
        assert time.monotonic() - t0 < 30
        rep = await fabric.describe()  # still serving, not asleep
        assert {a.detail["paused"] for a in rep.acks.values()} == {"False"}


async def test_a_kv_cache_larger_than_the_machine_exits_at_start_naming_the_flag(
        two_vllm: Fleet) -> None:
    """Beside the two serving workers: it exits (3) before it loads anything, they go on."""
    async with client(two_vllm) as fabric:
        await fabric.wait_for_workers(2, timeout=240)
        epoch = fabric.watcher.snapshot().epoch
        t0 = time.monotonic()
        proc = two_vllm.start("huge", "--kv-cache-gib", "100000")
        rc = await anyio.to_thread.run_sync(lambda: proc.wait(timeout=120))
        exit_s = time.monotonic() - t0
        rep = await fabric.pause()
        await fabric.resume()
        out = [r async for r in fabric.generate([req(f"k{i}") for i in range(8)],
                                                timeout=120)]
        snap = fabric.watcher.snapshot()
    with open(f"{os.environ.get('TMPDIR', '/tmp')}/rlf-{two_vllm.prefix}-huge.log") as f:
        log = f.read()
    print(f"\nKV cache too large: the worker exited {rc} after {exit_s:.1f} s")
    assert rc == 3 and exit_s < 60, (rc, exit_s, log[-2000:])
    assert "100000 GiB of KV cache" in log and "--kv-cache-gib" in log, log[-2000:]
    assert "GiB of memory available" in log
    assert sorted(rep.ok) == ["vl0", "vl1"] and snap.epoch == epoch
    assert sorted(r.request_id for r in out) == [f"k{i}" for i in range(8)]


async def test_the_ipc_weight_transfer_on_the_cpu_build_exits_at_start_naming_the_flag(
        two_vllm: Fleet) -> None:
    t0 = time.monotonic()
    proc = two_vllm.start("ipc", "--weight-transfer", "ipc")
    rc = await anyio.to_thread.run_sync(lambda: proc.wait(timeout=120))
    with open(f"{os.environ.get('TMPDIR', '/tmp')}/rlf-{two_vllm.prefix}-ipc.log") as f:
        log = f.read()
    assert rc == 3 and time.monotonic() - t0 < 60, (rc, log[-2000:])
    assert "--weight-transfer ipc" in log and "CPU build" in log, log[-2000:]


def test_an_ipc_chunk_is_what_vllms_ipc_backend_parses() -> None:
    """The chunk as vLLM's msgpack RPC delivers it to the worker extension, turned into the
    update info of vLLM's own ipc backend (its dataclass validates it)."""
    import msgspec
    from vllm.distributed.weight_transfer.ipc_engine import (
        IPCWeightTransferInitInfo,
        IPCWeightTransferUpdateInfo,
    )

    from rlfabric.engines.vllm.ipc import INIT_INFO, update_info
    from rlfabric.tensors.ipc import plain_handle

    shared = (torch.Tensor, (32,), (1,), 0, torch.storage.TypedStorage, torch.uint8, 0,
              b"handle", 512, 0, False, b"/torch_1_2", 3, None, False)
    chunk = {"names": ["a.weight", "b.bias"], "dtype_names": ["float32", "bfloat16"],
             "shapes": [[2, 3], [4]], "tensor_sizes": [24, 8], "gpu_uuid": "GPU-1",
             "handle": plain_handle(shared)}
    info = IPCWeightTransferUpdateInfo(
        **update_info(msgspec.msgpack.decode(msgspec.msgpack.encode(chunk))))
    assert IPCWeightTransferInitInfo(**INIT_INFO).packed
    assert info.names == ["a.weight", "b.bias"] and info.tensor_sizes == [24, 8]
    assert isinstance(info.ipc_handles, dict)
    assert info.ipc_handles["GPU-1"] == shared


async def test_vllm_nccl_bridge_commands_reach_every_worker_and_cpu_refuses_at_once(
        two_vllm: Fleet) -> None:
    """vLLM's trainer engine calls its client's four methods from its own threads; through
    `BusWeightSyncClient` each is a quorum-acked command. Here (vLLM's CPU build) the workers
    refuse the NCCL group at once, naming why, and a collective update without a group."""
    from rlfabric.integrations.vllm_sync import BusWeightSyncClient, VllmNcclSync
    from rlfabric.trainer import TransportInitFailed

    async with client(two_vllm) as fabric:
        await fabric.wait_for_workers(2, timeout=240)
        bus_client = BusWeightSyncClient(fabric, rank_offsets={"vl0": 1, "vl1": 2}, world_size=3,
                                         group_epoch=41, policy=QuorumPolicy(timeout=30))
        payload = {"master_address": "127.0.0.1", "master_port": 29511, "rank_offset": 1,
                   "world_size": 3, "packed": True, "packed_buffer_size_bytes": 1 << 20,
                   "packed_num_buffers": 2}  # what vLLM's trainer_init hands its client
        t0 = time.monotonic()
        with pytest.raises(QuorumNotReached, match=r"vl0 \(unsupported: .*needs CUDA.*CPU build"):
            await anyio.to_thread.run_sync(bus_client.init_weight_transfer_engine, payload)
        bus_client.version = 5
        info = {"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[258, 64]]}
        with pytest.raises(QuorumNotReached, match=r"vl1 \(unsupported: .*needs CUDA"):
            await anyio.to_thread.run_sync(bus_client.update_weights, info)
        assert time.monotonic() - t0 < 30 and bus_client.failed.is_set()
        # the convenience wrapper refuses before any rendezvous on a trainer without CUDA
        with pytest.raises(TransportInitFailed, match="needs a CUDA device"):
            await VllmNcclSync(fabric, build_model(MODEL)).init()
        assert (await fabric.describe()).ok == ("vl0", "vl1")  # both alive and answering


async def test_mixed_fleet_torch_and_vllm_verify_against_the_sender(nats_url: str) -> None:
    with fleet(nats_url) as f:
        f.start("mt", engine="torch")
        f.start("mv")
        v1 = perturbed(5)
        async with client(f) as fabric:
            await fabric.wait_for_workers(2, timeout=240)
            await fabric.update_weights(0, module=build_model(MODEL), transport="nats")
            rep = await fabric.update_weights(1, module=v1, transport="nats", verify="sender")
            assert rep.ok == ("mt", "mv")
            assert {a.weights_checksum for a in rep.acks.values()} == {checksum(v1.state_dict())}
            reqs = [req(f"m{i}", [256, i, 7], min_version=1, max_tokens=12, seed=i)
                    for i in range(12)]
            out = [r async for r in fabric.generate(reqs, timeout=120)]
            # vLLM's NCCL protocol reaches vLLM workers only: refused before any rendezvous
            from rlfabric.integrations.vllm_sync import BusWeightSyncClient, VllmNcclSync
            from rlfabric.trainer import TransportInitFailed

            with pytest.raises(TransportInitFailed, match=r"vLLM workers only; not: mt \(torch\)"):
                await VllmNcclSync(fabric, v1).init()
            bus_client = BusWeightSyncClient(fabric, rank_offsets={"mt": 1, "mv": 2},
                                             world_size=3, group_epoch=7,
                                             policy=QuorumPolicy(timeout=30))
            with pytest.raises(QuorumNotReached,
                               match=r"mt \(unsupported: group epoch 7 streams tensors into an "
                                     r"engine's own loader"):
                await anyio.to_thread.run_sync(bus_client.init_weight_transfer_engine, {
                    "master_address": "127.0.0.1", "master_port": 29512, "world_size": 3})
    assert {r.worker_id for r in out} == {"mt", "mv"}
    assert worst_gap(v1, reqs, out) <= 1e-4


async def test_engine_process_killed_worker_leaves_and_its_requests_complete_elsewhere(
        nats_url: str) -> None:
    import psutil  # a dependency of vLLM

    from rlfabric.schemas import ErrorEvent, codec_for

    with fleet(nats_url) as f:
        victim = f.start("kv0")
        f.start("kv1")
        async with client(f, rollout_ack_wait=10.0) as fabric:
            await fabric.wait_for_workers(2, timeout=240)
            await fabric.update_weights(0, module=build_model(MODEL))
            events: list[ErrorEvent] = []

            async def on_event(msg) -> None:
                events.append(codec_for(ErrorEvent).decode(msg.data, msg.headers))

            sub = await fabric.bus.nc.subscribe(fabric.bus.subjects.events("error", "kv0"),
                                                cb=on_event)
            reqs = [req(f"s{i}", [256, i % 200, 3], max_tokens=200, seed=i) for i in range(24)]
            out: list = []
            async with anyio.create_task_group() as tg:
                async def consume() -> None:
                    out.extend([r async for r in fabric.generate(reqs, timeout=240)])

                tg.start_soon(consume)
                await fabric.watcher.wait_until(
                    lambda s: any(m.worker_id == "kv0" and m.in_flight > 0 for m in s.members),
                    timeout=60)
                core = [c for c in psutil.Process(victim.pid).children(recursive=True)
                        if "python" in c.name().lower() or "VLLM" in c.name()]
                assert core, "no engine process under the worker"
                t_kill = time.monotonic()
                for c in core:
                    c.send_signal(signal.SIGKILL)
                await fabric.watcher.wait_until(lambda s: "kv0" not in s.worker_ids,
                                                timeout=10)
                left_s = time.monotonic() - t_kill
            await sub.unsubscribe()
        rc = victim.wait(timeout=30)
    assert left_s < 2.0, left_s
    assert rc == 3
    died = [e for e in events if e.code == "engine_died"]
    assert died and "died" in died[0].message
    assert not [e for e in events if e.code == "engine_error"]  # handed back, not failed
    keys = [(r.request_id, r.sample_index) for r in out]
    assert len(keys) == 24 and len(set(keys)) == 24
    assert all(isinstance(r, RolloutResult) for r in out)
    assert all(r.worker_id == "kv1" for r in out if r.attempt > 1)


async def test_a_killed_workers_samples_go_on_elsewhere_from_the_tokens_it_sampled(
        nats_url: str) -> None:
    """As the torch engine's (tests/trainer/test_lost_worker.py): the worker process SIGKILLed
    with its engine mid-generation, each sample goes on on the other worker from the tokens its
    deltas brought (a non-streamed one's every `PROGRESS_TOKENS`)."""
    import psutil  # a dependency of vLLM

    # half streamed, half not; most go to kc0
    # long enough that kc0 is still sampling when it is killed (48 tokens in), however slow
    reqs = [msgspec.structs.replace(req(f"c{i}", [256, 3 + i], max_tokens=320,
                                        temperature=0.0), stream=i % 2 == 0)
            for i in range(8)]
    with fleet(nats_url) as f:
        victim = f.start("kc0")
        f.start("kc1", "--capacity", "2")
        async with client(f) as fabric:
            await fabric.wait_for_workers(2, timeout=240)
            v0 = build_model(MODEL)
            await fabric.update_weights(0, module=v0)
            held: dict[str, str] = {}

            async def kill() -> None:
                held.update((await fabric.describe()).acks["kc0"].detail)
                tree = [victim, *psutil.Process(victim.pid).children(recursive=True)]
                for p in tree:
                    with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                        p.send_signal(signal.SIGKILL)

            seen, results = await generate_moving(
                fabric, reqs, lambda s: len(s) == len(reqs) // 2 and all(
                    sum(len(d.token_ids) for d in ds) >= 48 for ds in s.values()), kill,
                wait=240)
    assert int(held["in_flight"]) > 0, held
    assert {rid: len(rs) for rid, rs in results.items()} == {r.request_id: 1 for r in reqs}
    out = [rs[0] for rs in results.values()]
    assert all(isinstance(r, RolloutResult) for r in out), out
    moved = {"streamed": 0, "not": 0}
    for r in reqs:
        res = results[r.request_id][0]
        who = [s.worker for s in res.version_spans]
        assert who in (["kc0"], ["kc1"], ["kc0", "kc1"]), res.version_spans
        if who == ["kc0", "kc1"]:  # kc0's part kept, not sampled again
            moved["streamed" if r.stream else "not"] += 1
            assert res.version_spans[0].end >= 32 and res.version_spans[1].start == \
                res.version_spans[0].end, res.version_spans
        if r.stream:
            assert streamed_as_answered(res, seen[r.request_id]) == list(
                range(len(res.completion_token_ids)))
    assert moved["streamed"] and moved["not"], moved
    assert worst_gap(v0, reqs, out) <= 1e-4


QV = Adapter(name="qv", rank=8, alpha=16.0, target_modules=("q_proj", "v_proj", "down_proj"))
HEAD = Adapter(name="head", rank=4, alpha=4.0, target_modules=("o_proj", "lm_head"))


async def test_adapters_match_the_merged_model_and_a_new_version_never_reuses_old_cache(
        nats_url: str) -> None:
    """Base rows and two adapters in one batch each match their merged references; v2 of an
    adapter serves requests whose 200-token prefix vLLM cached under v1 with v2's weights."""
    base = build_model(MODEL)
    v1, v2 = (lora.random_adapter(base, QV, seed=s, std=0.2) for s in (1, 2))
    head = lora.random_adapter(base, HEAD, seed=3, std=0.2)
    prefix = [256, *range(1, 200)]
    with fleet(nats_url) as f:
        for wid in ("ad0", "ad1"):
            f.start(wid, "--max-adapters", "2", "--max-lora-rank", "8")
        async with client(f) as fabric:
            await fabric.wait_for_workers(2, timeout=240)
            await fabric.update_weights(0, module=base)
            rep = await fabric.update_weights(1, state_dict=v1, adapter=QV)
            assert {a.weights_checksum for a in rep.acks.values()} == {checksum(v1)}
            await fabric.update_weights(1, state_dict=head, adapter=HEAD, transport="nats")
            mixed = [req(f"m{k}{i}", [*prefix, i], max_tokens=12, seed=i, adapter=k)
                     for k in ("", "qv", "head") for i in range(6)]
            got1 = [r async for r in fabric.generate(mixed, timeout=120)]
            await fabric.update_weights(2, state_dict=v2, adapter=QV, transport="filesystem")
            again = [req(f"n{i}", [*prefix, i], min_version=2, max_tokens=12, seed=i,
                         adapter="qv") for i in range(6)]
            got2 = [r async for r in fabric.generate(again, timeout=120)]
            members = await fabric.bus.fleet.members()
    refs = {"": base, "qv": lora.merged(base, v1, QV), "head": lora.merged(base, head, HEAD)}
    for k, model in refs.items():
        reqs = [r for r in mixed if r.adapter == k]
        out = [r for r in got1 if r.request_id[1:-1] == k]
        assert len(out) == 6 and worst_gap(model, reqs, out) <= 1e-4
    assert all([s.version for s in r.version_spans] == [2] for r in got2)
    assert worst_gap(lora.merged(base, v2, QV), again, got2) <= 1e-4
    assert worst_gap(refs["qv"], again, got2) > 1e-3  # not v1's cached blocks
    assert {m.adapters["qv"] for m in members.values()} == {(1, 2)}


async def test_up_trains_a_lora_adapter_on_vllm(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "rlfabric", "up", "--engine", "vllm",
                          "--workers", "2", "--steps", "12", "--threshold", "0.3", "--lora", "8",
                          "--no-live", "--json", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["reward_final"] >= 0.3 > summary["reward_first"]
    assert summary["mismatch_mean"] is not None and summary["mismatch_mean"] <= 1e-4
    assert set(summary["workers_on_final"].values()) == {12}
    assert 0 < summary["update_bytes"] < summary["full_model_bytes"] / 4


async def test_agent_sessions_with_affinity_hit_vllms_prefix_cache() -> None:
    """`rlfabric bench agent`, small: seeded turns whose prompts pass 800 tokens (longer than a
    step's budget together: prefills that vLLM would otherwise split), 4 sessions at once, on
    two vLLM workers. With affinity every later turn lands on its session's worker and vLLM's
    own counters find most tokens in its cache; without, turns move. (How much faster that is
    at scale: `rlfabric bench agent`, docs/benchmarks.md.)"""
    import argparse

    from rlfabric.bench.agent import add_arguments, run

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--sessions", "4", "--turns", "4", "--system-tokens", "768",
                         "--first-tokens", "32", "--user-tokens", "16", "--max-tokens", "4"])
    on, off = (await run(args))["rows"]
    print(f"\nagent sessions on vLLM: prefix hit {on['hit_rate']:.1%} with affinity, "
          f"{off['hit_rate']:.1%} without")
    assert on["turns"] == off["turns"] == 16
    assert on["same_worker"] == 1.0 and on["hit_rate"] >= 0.8
    assert off["same_worker"] < 1.0


async def test_up_trains_the_tools_task_on_vllm(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "rlfabric", "up", "--task", "tools", "--engine",
                          "vllm", "--workers", "2", "--no-live", "--json", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["reward_final"] >= summary["threshold"] > summary["reward_first"]
    assert summary["mismatch_max"] is not None and summary["mismatch_max"] <= 1e-4
    assert summary["tool_calls_per_episode"] > 0 and 1.0 <= summary["segments_per_episode"] < 1.1
