"""Weight-update throughput per transport, beside the machine's own floors, in one run.

For each size, a state dict of 16 MiB fp32 tensors goes to one worker (the null engine: it
verifies the digest and takes the tensors, so the transport is what is measured) through
`FabricClient.update_weights(..., verify="off")`: pack + digest on the sender, the transport,
digest on the worker, ack. Floors in the same run: a torch memcpy of the same bytes, a
/dev/shm file write + read, and `nats-py floor`: the same bytes in the same 4 MiB chunks
published to a file stream with nats-py (`publish_async`, the same window) and read by another
process through an ordered consumer into one buffer (what the `nats` transport does, without
rlfabric's packing, digests and command).

LoRA adapter rows (`--adapter-ranks`): the A and B matrices of a Llama-7B-shaped model's
q, k, v and o projections (32 layers, hidden 4096) at each rank, pushed as an adapter
(`update_weights(adapter=...)`) over `--adapter-transports`, beside the full-weight rows.

    rlfabric bench weights [--sizes 256,1024] [--transports shm,filesystem,nats,collective]
                           [--adapter-ranks 8,64] [--adapter-transports shm,nats]
    rlfabric bench weights --device cuda [--model qwen05b] [--workers 2]
                           [--transports cuda_ipc,shm,filesystem,nats]   (see weights_cuda)
    rlfabric bench weights --delta [--lrs 1e-6,1e-5] [--delta-transports nats,shm,filesystem]
                           (see weights_delta)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence

import anyio
import torch

from rlfabric.bench._util import children, table
from rlfabric.bus import EmbeddedNats, Limits, QuorumPolicy
from rlfabric.errors import LaunchError
from rlfabric.schemas import Adapter
from rlfabric.tensors import lora
from rlfabric.trainer import FabricClient

MIB = 1024 * 1024
CPU_TRANSPORTS = "shm,filesystem,nats,nats-memory,collective"
CUDA_TRANSPORTS = "cuda_ipc,shm,filesystem,nats"


def state_dict(mib: int) -> dict[str, torch.Tensor]:
    n = max(1, mib // 16)
    return {f"layer{i}.weight": torch.randn(4 * MIB) for i in range(n)}  # 16 MiB each


#: the model an adapter row's matrices are shaped for: Llama-7B's attention projections
ADAPTER_LAYERS, ADAPTER_HIDDEN = 32, 4096
ADAPTER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def adapter(rank: int) -> tuple[Adapter, dict[str, torch.Tensor]]:
    a = Adapter(name=f"r{rank}", rank=rank, alpha=2.0 * rank, target_modules=ADAPTER_TARGETS)
    state = {}
    for layer in range(ADAPTER_LAYERS):
        for t in ADAPTER_TARGETS:
            module = f"model.layers.{layer}.self_attn.{t}"
            state[lora.key(module, "lora_A")] = torch.randn(rank, ADAPTER_HIDDEN)
            state[lora.key(module, "lora_B")] = torch.randn(ADAPTER_HIDDEN, rank)
    return a, state


def floors(sd: dict[str, torch.Tensor], nbytes: int, rounds: int) -> list[dict]:
    """Best of `rounds`, buffers allocated and touched first (page faults are not copies)."""
    dst = {k: torch.zeros_like(v) for k, v in sd.items()}
    best = float("inf")
    for _ in range(rounds + 1):
        t0 = time.perf_counter()
        for k, v in sd.items():
            dst[k].copy_(v)
        best = min(best, time.perf_counter() - t0)
    out = [{"path": "memcpy (torch copy_)", "seconds": best}]
    del dst
    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(shm_dir, f"rlfabric-bench-{os.getpid()}")
    buf = bytearray(nbytes)
    best = float("inf")
    try:
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                for v in sd.values():
                    f.write(v.numpy().data)
            with open(path, "rb") as f:
                f.readinto(buf)
            best = min(best, time.perf_counter() - t0)
            os.unlink(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    out.append({"path": f"{shm_dir} write+read", "seconds": best})
    return out


async def nats_floor(url: str, sd: dict[str, torch.Tensor], nbytes: int, rounds: int
                     ) -> dict:
    import json as _json

    import nats
    from nats.js.api import StorageType, StreamConfig

    from rlfabric.bench.floor import READ_WAIT_S
    from rlfabric.transports.nats import NATS_CHUNK, NATS_WINDOW

    buf = bytearray(nbytes)
    off = 0
    for v in sd.values():  # the bytes to send, packed once (not timed: rlfabric's is)
        b = v.numpy().tobytes()
        buf[off:off + len(b)] = b
        off += len(b)
    view = memoryview(buf)
    nc = await nats.connect(url, name="rlfabric-floor-weights")
    js = nc.jetstream(publish_async_max_pending=NATS_WINDOW * 2)
    stream, subject = "FLOORW", "floorw.v"
    await js.add_stream(StreamConfig(name=stream, subjects=["floorw.v.>"],
                                     storage=StorageType.FILE))
    best = float("inf")
    try:
        async with children([["rlfabric.bench.floor", "weights", "--nats", url,
                              "--subject", "floorw.go"]], ready="floor: weights ready"):
            for _ in range(rounds):
                await js.purge_stream(stream)
                t0 = time.perf_counter()
                pending = []
                chunks = 0
                for o in range(0, nbytes, NATS_CHUNK):
                    pending.append(await js.publish_async(f"{subject}.{chunks}",
                                                          view[o:o + NATS_CHUNK]))  # type: ignore[arg-type]  # any buffer goes, as in the transport
                    chunks += 1
                    if len(pending) >= NATS_WINDOW:
                        await pending.pop(0)
                for fut in pending:
                    await fut
                job = {"stream": stream, "subject": subject, "chunks": chunks,
                       "chunk_bytes": NATS_CHUNK, "size": nbytes}
                reply = await nc.request("floorw.go", _json.dumps(job).encode(),
                                         timeout=READ_WAIT_S + 10)
                if reply.data != b"done":
                    raise RuntimeError(f"nats-py floor: the reader {reply.data.decode()}")
                best = min(best, time.perf_counter() - t0)
        await js.delete_stream(stream)
    finally:
        await nc.close()
    return {"path": "nats-py floor (publish+read)", "seconds": best}


async def bench(sizes: list[int], transports: list[str], rounds: int,
                ranks: Sequence[int] = (), adapter_transports: Sequence[str] = ()) -> list[dict]:
    rows = []
    async with EmbeddedNats() as nats:
        for mib in sizes:
            sd = state_dict(mib)
            nbytes = sum(v.numel() * v.element_size() for v in sd.values())
            for row in floors(sd, nbytes, rounds):
                rows.append({"size_mib": mib, **row})
            if any(t.startswith("nats") for t in transports):
                rows.append({"size_mib": mib, **await nats_floor(nats.url, sd, nbytes, rounds)})
            for tr in transports:
                best = await _pushes(nats.url, f"wb{mib}{tr.replace('-', '')}", tr, sd, rounds)
                rows.append({"size_mib": mib, "path": f"rlfabric {tr}", "seconds": best})
            del sd
        for rank in ranks:
            a, sd = adapter(rank)
            size = sum(v.numel() * v.element_size() for v in sd.values()) / MIB
            for tr in adapter_transports:
                best = await _pushes(nats.url, f"wa{rank}{tr}", tr, sd, rounds, adapter=a)
                rows.append({"size_mib": round(size, 1), "seconds": best,
                             "path": f"rlfabric {tr}, LoRA rank {rank} (7B q,k,v,o)"})
    for r in rows:
        r["mb_s"] = r["size_mib"] * MIB / 1e6 / r["seconds"]
    return rows


async def _pushes(url: str, prefix: str, tr: str, sd: dict[str, torch.Tensor], rounds: int,
                  adapter: Adapter | None = None) -> float:
    """The best of `rounds` updates of `sd` over transport `tr` to one null worker."""
    storage = "memory" if tr == "nats-memory" else "file"
    # the client provisions first, so the weights stream gets this storage
    async with FabricClient.connect(url, prefix=prefix, policy=QuorumPolicy(timeout=600),
                                    limits=Limits(weights_storage=storage)) as fab:
        cmds = [["rlfabric", "worker", "--nats", url, "--prefix", prefix, "--engine", "null",
                 "--worker-id", "sink"]]
        async with children(cmds, ready="ready"):
            await fab.wait_for_workers(1, timeout=120)
            if tr == "collective":
                await fab.init_transport("gloo", timeout=120)
            best = float("inf")
            for version in range(rounds):
                t0 = time.perf_counter()
                await fab.update_weights(version, state_dict=sd, adapter=adapter,
                                         transport=tr.split("-")[0], verify="off")
                best = min(best, time.perf_counter() - t0)
    return best


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="256,1024", help="MiB per update (default %(default)s)")
    p.add_argument("--transports", default=None,
                   help="nats-memory: the nats transport with an in-memory weights stream "
                        f"(default {CPU_TRANSPORTS}; with --device cuda {CUDA_TRANSPORTS})")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the trainer's state dict on its GPU, pushed to torch workers on "
                        "that GPU, beside host->device and device->device floors "
                        "(rlfabric.bench.weights_cuda); cpu: the rows above")
    p.add_argument("--model", default="qwen05b",
                   help="--device cuda: the model pushed (default %(default)s: Qwen2.5-0.5B's "
                        "shape, 2,404 MiB in fp32)")
    p.add_argument("--workers", type=int, default=2,
                   help="--device cuda: torch workers on the GPU (default %(default)s)")
    p.add_argument("--adapter-ranks", default="8,64",
                   help="LoRA adapter rows: these ranks (empty: none; default %(default)s)")
    p.add_argument("--adapter-transports", default="shm,nats",
                   help="the transports of the adapter rows (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="best of N per transport")
    p.add_argument("--json", action="store_true")
    p.add_argument("--delta", action="store_true",
                   help="updates sent as deltas against full pushes after a real AdamW step "
                        "(rlfabric.bench.weights_delta; its options below)")
    from rlfabric.bench import weights_delta

    weights_delta.add_arguments(p)


def main(args: argparse.Namespace) -> int:
    if args.delta:
        from rlfabric.bench import weights_delta

        return weights_delta.main(args)
    if args.device == "cuda":
        return _main_cuda(args)
    rows = anyio.run(bench, [int(x) for x in args.sizes.split(",") if x],
                     [t for t in (args.transports or CPU_TRANSPORTS).split(",") if t],
                     args.rounds,
                     [int(x) for x in args.adapter_ranks.split(",") if x],
                     [t for t in args.adapter_transports.split(",") if t])
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(table(rows, [("size_mib", "MiB", ""), ("path", "path", ""),
                       ("seconds", "seconds", ".3f"), ("mb_s", "MB/s", ".0f")]))
    return 0


def _main_cuda(args: argparse.Namespace) -> int:
    from rlfabric.bench import weights_cuda

    try:
        rows = anyio.run(weights_cuda.bench, args.model,
                         [t for t in (args.transports or CUDA_TRANSPORTS).split(",") if t],
                         args.workers, args.rounds)
    except LaunchError as exc:
        print(f"rlfabric bench weights: {exc}", file=sys.stderr)
        return 2
    d2d = next(r["seconds"] for r in rows if r["path"].startswith("device->device"))
    pinned = next(r["seconds"] for r in rows if r["path"].startswith("host->device, pinned"))
    for r in rows:
        r["x_d2d"] = r["seconds"] / d2d
        r["x_pinned"] = r["seconds"] / pinned
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(table(rows, [("size_mib", "MiB", ""), ("path", "path", ""),
                       ("seconds", "seconds", ".4f"), ("mb_s", "MB/s", ".0f"),
                       ("x_d2d", "x device->device", ".1f"),
                       ("x_pinned", "x pinned h->d", ".2f")]))
    return 0
