"""Weight updates as deltas against full pushes (`rlfabric bench weights --delta`), in one run.

The trainer holds `--model` (default `qwen05b`: Qwen2.5-0.5B's shape, random weights) in
bfloat16 and takes one real AdamW step on seeded tokens at each learning rate. For each
transport, two workers (the null engine: each applies the delta to the version it kept and
verifies the full version's digest, so the transport and the delta are what is measured) get
v0 (full, kept) and v1 = v0 after the step as a delta (`update_weights(..., delta=True)`; each
side's first delta makes the buffers it reuses); timed: v2, the step back, as a delta, and v3,
the step again, as a full push (`delta=False`). Columns: bytes the push staged
(what crosses the wire once per push), the update's time from staging to every worker's ack,
and the delta's ratios. `encode` is the trainer's own part of a delta push (pack, XOR, zstd).
A second table writes the same deltas each way rlfabric could (docs/decisions.md).

`--joiners N`: two workers get v1 whole and v2..v5 as deltas over nats (the step, back and
forth), then N workers join at once; each takes v5 from the workers keeping it
(`rlfabric.worker.peers`) and verifies its digest. The row: the bytes the trainer staged for all
five versions against one copy of the model, the chunks the keepers served, the seconds from
the joiners' start until every one serves v5, and v6's push, which reaches all of them as a
delta.
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

import anyio
import torch

from rlfabric.bench._util import children, table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lrs", default="1e-6,1e-5", help="learning rates (default %(default)s)")
    p.add_argument("--delta-transports", default="nats,shm,filesystem",
                   help="transports (default %(default)s)")
    p.add_argument("--delta-model", default="qwen05b",
                   help="the model stepped and pushed (default %(default)s)")
    p.add_argument("--joiners", type=int, default=0,
                   help="instead of the tables: N workers join at once after v5 went as deltas "
                        "over nats at the first --lrs (0: the tables)")


class _Steps:
    """The model's state, and its state after one AdamW step from it at a learning rate, on
    the same seeded tokens (one step's memory at a time: the model, before, after)."""

    def __init__(self, name: str) -> None:
        from rlfabric.tensors.models import build_model

        self.model = build_model(name, dtype=torch.bfloat16)
        self.before = {k: v.clone() for k, v in self.model.state_dict().items()}
        vocab = self.model.get_input_embeddings().weight.shape[0]
        self.x = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(0))

    def after(self, lr: float) -> dict[str, torch.Tensor]:
        model = self.model
        model.load_state_dict(self.before)
        model.train()
        model(self.x, labels=self.x).loss.backward()
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        opt.step()
        del opt
        model.zero_grad(set_to_none=True)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


async def _fleet_rows(url: str, tr: str, before: dict, after: dict) -> list[dict[str, Any]]:
    from rlfabric.bus import QuorumPolicy
    from rlfabric.trainer import FabricClient

    prefix = f"wd{uuid.uuid4().hex[:8]}"
    cmds = [["rlfabric", "worker", "--nats", url, "--prefix", prefix, "--engine", "null",
             "--worker-id", f"n{i}"] for i in range(2)]
    rows = []
    async with FabricClient.connect(url, prefix=prefix, policy=QuorumPolicy(timeout=600)) as fab, \
            children(cmds, ready="ready"):
        await fab.wait_for_workers(2, timeout=120)
        # v0 whole, kept; v1 the step as a delta (each side's first delta makes its buffers);
        # timed: v2 the step back as a delta, v3 the step again whole
        await fab.update_weights(0, state_dict=before, transport=tr, verify="off", delta=True)
        await fab.update_weights(1, state_dict=after, transport=tr, verify="off", delta=True)
        for version, state, delta in ((2, before, True), (3, after, False)):
            t0 = time.perf_counter()
            rep = await fab.update_weights(version, state_dict=state, transport=tr,
                                           verify="off", delta=delta)
            took = time.perf_counter() - t0
            assert len(rep.ok) == 2, rep
            sent = fab.last_push_bytes if delta else sum(v.nbytes for v in after.values())
            rows.append({"push": "delta" if delta else "full", "bytes": sent, "seconds": took})
    return rows


def _encode_s(before: dict, after: dict) -> tuple[float, float]:
    """Seconds the trainer spends making the delta, and the share of elements that changed."""
    from rlfabric.tensors import digest, pack_into, plan
    from rlfabric.tensors.delta import encode
    from rlfabric.trainer.deltas import ENCODE_THREADS

    metas, size = plan(before)
    a, b = bytearray(size), bytearray(size)
    pack_into(before, metas, a)
    t0 = time.perf_counter()
    pack_into(after, metas, b)
    encode(a, b, metas, base_digest=digest(a), threads=ENCODE_THREADS)
    took = time.perf_counter() - t0
    changed = sum(int((before[k].view(torch.int16) != after[k].view(torch.int16)).sum())
                  for k in before)
    return took, changed / sum(v.numel() for v in before.values())


def encodings(lr: float, before: dict, after: dict) -> list[dict[str, Any]]:
    """The delta's size and encoding time, per tensor, for each way of writing it: the XOR of
    the bit patterns, or the changed elements' indices (as gaps) and new values; compressed
    with zstd at levels 1 and 3, or lz4 where it is installed."""
    import numpy as np
    import zstandard

    codecs: dict[str, Any] = {f"zstd {lv}": zstandard.ZstdCompressor(level=lv).compress
                              for lv in (1, 3)}
    try:
        import lz4.frame

        codecs["lz4"] = lz4.frame.compress
    except ImportError:
        pass
    full = sum(v.nbytes for v in before.values())
    rows = []
    for way in ("xor", "changed + indices"):
        for name, compress in codecs.items():
            size, t0 = 0, time.perf_counter()
            for k, a in before.items():
                ua, ub = a.view(torch.int16).numpy().ravel(), after[k].view(torch.int16).numpy(
                ).ravel()
                if way == "xor":
                    raw = np.bitwise_xor(ua, ub).tobytes()
                else:
                    idx = np.flatnonzero(ua != ub)
                    raw = np.diff(idx, prepend=0).astype(np.uint32).tobytes() + ub[idx].tobytes()
                size += len(compress(raw))
            rows.append({"lr": lr, "way": way, "codec": name, "mb": size / 1e6,
                         "x": full / size, "seconds": time.perf_counter() - t0})
    return rows


async def bench(lrs: list[float], transports: list[str], model: str
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from rlfabric.bus import EmbeddedNats

    out, ways = [], []
    steps = _Steps(model)
    before = steps.before
    async with EmbeddedNats() as nats:
        for lr in lrs:
            after = steps.after(lr)
            enc, changed = _encode_s(before, after)
            ways += encodings(lr, before, after)
            for tr in transports:
                rows = await _fleet_rows(nats.url, tr, before, after)
                d, f = rows
                out.append({"lr": lr, "transport": tr, "changed": changed, "encode": enc,
                            "full_mb": f["bytes"] / 1e6, "delta_mb": d["bytes"] / 1e6,
                            "x_bytes": f["bytes"] / d["bytes"], "full_s": f["seconds"],
                            "delta_s": d["seconds"], "x_time": f["seconds"] / d["seconds"]})
            del after
    return out, ways


async def joiners(n: int, lr: float, model: str) -> dict[str, Any]:
    from rlfabric.bus import EmbeddedNats, QuorumPolicy
    from rlfabric.trainer import FabricClient

    steps = _Steps(model)
    states = [steps.before, steps.after(lr)]
    del steps.model
    full = sum(v.nbytes for v in states[0].values())
    prefix = f"wj{uuid.uuid4().hex[:8]}"

    def cmd(wid: str) -> list[str]:
        return ["rlfabric", "worker", "--nats", url, "--prefix", prefix, "--engine", "null",
                "--worker-id", wid]

    async with EmbeddedNats() as nats:
        url = nats.url
        async with FabricClient.connect(url, prefix=prefix, policy=QuorumPolicy(timeout=600)
                                        ) as fab, children([cmd(f"k{i}") for i in range(2)],
                                                           ready="ready"):
            await fab.wait_for_workers(2, timeout=120)
            sent = 0
            for v in range(1, 6):
                await fab.update_weights(v, state_dict=states[(v - 1) % 2], transport="nats",
                                         verify="off", delta=True)
                sent += fab.last_push_bytes
            policy = (await fab.bus.state.read()).policy
            states[0] = {}  # v5's; v6 is the step again: the room goes to the joiners
            fab.updates.stager.close()  # the nats transport's packing buffer, made again
            ids = [f"j{i}" for i in range(n)]
            t0 = time.perf_counter()
            async with children([cmd(j) for j in ids], ready="ready"):
                await fab.watcher.wait_until(
                    lambda s: sum(m.worker_id in ids and m.policy == policy and len(m.kept) == 1
                                  for m in s.members) == n, timeout=600)
                took = time.perf_counter() - t0
                rep = await fab.update_weights(6, state_dict=states[1], transport="nats",
                                               verify="off", delta=True)
                assert len(rep.ok) == n + 2, rep
                v6 = fab.last_push_bytes
    return {"joiners": n, "full_mb": full / 1e6, "sent_mb": sent / 1e6, "x_copy": sent / full,
            "seconds": took, "v6_mb": v6 / 1e6}


def main(args: argparse.Namespace) -> int:
    if args.joiners:
        lr = float(args.lrs.split(",")[0])
        row = anyio.run(joiners, args.joiners, lr, args.delta_model)
        print(f"{args.delta_model} in bfloat16, lr {lr:g}, v1 whole and v2..v5 as deltas over "
              f"nats to 2 workers (null engine), then {args.joiners} join at once")
        print(table([row], [("joiners", "joiners", "d"), ("full_mb", "model MB", ".1f"),
                            ("sent_mb", "trainer sent MB, v1..v5", ".1f"),
                            ("x_copy", "x one copy", ".3f"),
                            ("seconds", "s until all serve v5", ".2f"),
                            ("v6_mb", "v6 to all, MB", ".1f")]))
        return 0
    rows, ways = anyio.run(bench, [float(x) for x in args.lrs.split(",") if x],
                           [t for t in args.delta_transports.split(",") if t], args.delta_model)
    print(f"{args.delta_model} in bfloat16, one AdamW step a version, 2 workers (null engine)")
    print(table(rows, [("lr", "lr", "g"), ("transport", "transport", ""),
                       ("changed", "elements changed", ".1%"),
                       ("full_mb", "full MB", ".1f"), ("delta_mb", "delta MB", ".1f"),
                       ("x_bytes", "x fewer bytes", ".1f"), ("full_s", "full s", ".2f"),
                       ("delta_s", "delta s", ".2f"), ("x_time", "x faster", ".2f"),
                       ("encode", "encode s", ".2f")]))
    print("\nthe same steps' deltas written each way (one thread, every tensor)")
    print(table(ways, [("lr", "lr", "g"), ("way", "delta as", ""), ("codec", "codec", ""),
                       ("mb", "MB", ".1f"), ("x", "x fewer bytes", ".1f"),
                       ("seconds", "encode s", ".2f")]))
    return 0
