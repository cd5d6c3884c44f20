"""rlfabric on a CUDA device (`pytest -m gpu`; skipped where there is none, as on CI's
machines): digests equal on CPU and GPU; a host payload staged to the GPU intact; sleep gives
the card back, wake restores it, and sampling after wake is what it was before sleep; a
`cuda_ipc` push reaches two worker processes on the GPU, which then sample with the trainer's
logprobs, and leaves nothing allocated on the trainer's side; with vLLM's CUDA build, the same
push enters a vLLM worker through vLLM's own ipc backend."""

from __future__ import annotations

import importlib.util
import os
import subprocess

import numpy as np
import pytest
import torch
from helpers import collect, packed, perturbed, req, taken_logprobs

from rlfabric.engines import make_engine, running
from rlfabric.schemas import RolloutResult
from rlfabric.tensors import packing
from rlfabric.tensors.checksums import checksum, device_digest

pytestmark = [
    pytest.mark.gpu, pytest.mark.anyio, pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device here: run `pytest -m gpu` on a GPU machine "
                              "(../shared/gpu/README.md)"),
]


async def sample(engine, rid: str) -> list[int]:
    (res,) = [r async for r in engine.generate(req(rid, [256, 5, 6], max_tokens=32, seed=3))]
    assert isinstance(res, RolloutResult)
    return res.completion_token_ids.tolist()


def device_used_mib() -> str:
    """The device's used memory as the driver counts it (what nvidia-smi shows), and this
    process's line of nvidia-smi where it lists one."""
    free, total = torch.cuda.mem_get_info()
    try:
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        apps = ""
    mine = [line.split(",")[1].strip() for line in apps.splitlines()
            if line.split(",")[0].strip() == str(os.getpid())]
    return f"{(total - free) >> 20} MiB used (nvidia-smi, this process: {mine or 'not listed'})"


async def test_sleep_level_1_frees_the_cards_memory_and_wake_restores_it() -> None:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()  # what earlier tests in this process left
    async with running(make_engine("torch", "small64", device="cuda")) as engine:
        weights = sum(t.numel() * t.element_size() for t in engine.runner.params.values())
        before = await sample(engine, "before")
        torch.cuda.synchronize()
        reserved, smi = torch.cuda.memory_reserved(), [device_used_mib()]
        await engine.sleep(1)
        asleep, smi = torch.cuda.memory_reserved(), [*smi, device_used_mib()]
        left = torch.cuda.memory_allocated()
        await engine.wake()
        after = await sample(engine, "after")
        woken, smi = torch.cuda.memory_reserved(), [*smi, device_used_mib()]
    print(f"\nsleep level 1, torch reserved: {reserved >> 20} MiB -> {asleep >> 20} asleep -> "
          f"{woken >> 20} woken; allocated {base >> 20} MiB before the engine, {left >> 20} "
          f"asleep; device: " + " -> ".join(smi))
    assert reserved - asleep >= 0.9 * weights, (reserved, asleep, weights)
    assert left <= base + (1 << 20), (base, left)
    assert woken >= 0.9 * reserved, (reserved, woken)
    assert after == before


def test_digests_and_checksums_are_equal_on_the_cpu_and_the_gpu() -> None:
    x = torch.randint(0, 256, ((1 << 20) * 9 + 13,), dtype=torch.uint8,
                      generator=torch.Generator().manual_seed(0))
    assert device_digest([(0, x)]) == device_digest([(0, x.cuda())])
    state = dict(perturbed(1).state_dict())
    assert checksum(state) == checksum({k: v.cuda() for k, v in state.items()})


def test_a_host_payload_reaches_the_gpu_intact_with_its_digest() -> None:
    from rlfabric.tensors.staging import to_device

    x = torch.randint(0, 256, ((1 << 20) * 70 + 5,), dtype=torch.uint8,
                      generator=torch.Generator().manual_seed(1))
    buf = bytearray(x.numpy().tobytes())
    flat, dg = to_device(memoryview(buf), "cuda", chunk=16 << 20)
    assert dg == packing.digest(buf)
    assert torch.equal(flat.cpu(), x)


async def test_cuda_ipc_reaches_two_workers_which_sample_with_the_trainers_logprobs(
        workers, client) -> None:
    model = perturbed(3).cuda()
    workers(["g0", "g1"], "--model", "tiny", "--device", "cuda")
    async with client() as fabric:
        await fabric.wait_for_workers(2, timeout=240)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        rep = await fabric.update_weights(1, module=model, transport="cuda_ipc")
        assert set(rep.ok) == {"g0", "g1"}
        assert {a.weights_checksum for a in rep.acks.values()} == {
            checksum(dict(model.state_dict()))}
        torch.cuda.synchronize()
        after = [torch.cuda.memory_allocated()]
        for v in (2, 3):
            await fabric.update_weights(v, module=model, transport="cuda_ipc")
            torch.cuda.synchronize()
            after.append(torch.cuda.memory_allocated())
        torch.cuda.ipc_collect()
        print(f"\ncuda_ipc: allocated {before} before the pushes, {after} after each, "
              f"{torch.cuda.memory_allocated()} after ipc_collect; {live_cuda_tensors()}")
        assert max(after) <= before, (before, after)  # each push's buckets are freed
        reqs = [req(f"r{i}", [256, 5 + i, 6], min_version=3, max_tokens=24, seed=i)
                for i in range(8)]
        out = await collect(fabric, reqs, timeout=120)
    assert {r.worker_id for r in out} == {"g0", "g1"}
    assert gap(model, reqs, out) <= 1e-5


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM's CUDA build is not installed (docs/vllm.md)")
async def test_cuda_ipc_enters_vllm_through_its_own_ipc_backend(workers, client) -> None:
    model = perturbed(4, model_name="tiny64").cuda()
    workers(["v0"], "--model", "tiny64", "--weight-transfer", "ipc", engine="vllm")
    async with client() as fabric:
        await fabric.wait_for_workers(1, timeout=280)
        rep = await fabric.update_weights(1, module=model, transport="cuda_ipc")
        assert set(rep.ok) == {"v0"}
        assert rep.acks["v0"].weights_checksum == checksum(dict(model.state_dict()))
        reqs = [req(f"r{i}", [256, 5 + i, 6], min_version=1, max_tokens=24, seed=i)
                for i in range(4)]
        out = await collect(fabric, reqs, timeout=120)
    assert gap(model, reqs, out) <= 1e-5


def live_cuda_tensors() -> str:
    """The CUDA tensors the garbage collector finds, largest first, with who holds them."""
    import gc

    found = []
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.is_cuda:
            held = sorted({type(r).__name__ for r in gc.get_referrers(obj)} - {"list"})
            found.append((obj.untyped_storage().nbytes(), tuple(obj.shape), held))
    found.sort(key=lambda f: -f[0])
    return f"{len(found)} live CUDA tensors: {found[:6]}"


def gap(model: torch.nn.Module, reqs: list, out: list) -> float:
    """The largest |worker logprob - the model's forward pass| over every sampled token."""
    cpu = model.cpu()
    prompts = {r.request_id: r.prompt_token_ids.tolist() for r in reqs}
    return max(float(np.abs(taken_logprobs(cpu, prompts[r.request_id],
                                           r.completion_token_ids.tolist())
                            - r.logprobs.numpy()).max())
               for r in out if len(r.completion_token_ids))


async def test_sleep_level_2_drops_the_weights_on_the_gpu_and_a_load_brings_them() -> None:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()  # what earlier tests in this process left
    async with running(make_engine("torch", "small64", device="cuda")) as engine:
        await engine.serve_checkpoint_as(0)
        state = {k: v.cpu().clone() for k, v in engine.runner.params.items()}
        before = await sample(engine, "before")
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        await engine.sleep(2)
        dropped = torch.cuda.memory_allocated()
        await engine.wake()
        with packed(state) as weights:
            await engine.load_weights(weights, 1)
        after = await sample(engine, "after")
    assert allocated > base and dropped <= base + (1 << 20), (base, allocated, dropped)
    assert after == before
