"""A new engine is one registration: registered from this test (no other module touched), it is
an `--engine` choice with its own flags in `rlfabric worker --help`, those flags reach its
factory, and a worker serving it answers requests on the bus. A process is readied for its
engine before the engine's libraries load."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import anyio
import pytest

from rlfabric.bus import Bus
from rlfabric.cli import build_parser, main
from rlfabric.engines import registry
from rlfabric.engines.kinds import OPENMP_SPIN
from rlfabric.engines.null import NullEngine
from rlfabric.engines.registry import EngineKind
from rlfabric.schemas import RolloutRequest, RolloutResult, SamplingParams
from rlfabric.worker import Worker

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


class EchoEngine(NullEngine):
    name = "echo"


def _add_options(p) -> None:
    p.add_argument_group("echo engine").add_argument(
        "--echo-vocab", type=int, default=512, help="the echo engine's vocabulary size")


@pytest.fixture
def echo_kind():
    k = registry.register(EngineKind(
        name="echo", help="this test's throwaway engine",
        factory=lambda model, **o: EchoEngine(model, **o), add_options=_add_options,
        options=lambda a: {"vocab_size": a.echo_vocab}, trains=False))
    yield k
    registry.unregister("echo")


def _help(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*argv, "--help"])
    return out.getvalue()


def test_a_registered_engine_is_listed_with_its_flags(echo_kind) -> None:
    text = _help("worker")
    assert "{torch,vllm,null,echo}" in text and "this test's throwaway engine" in text
    assert "--echo-vocab" in text and "--max-model-len" in text  # vLLM's own flags stay
    # `up` trains: an engine that does not learn is not offered there
    assert "{torch,vllm}" in _help("up")


async def test_a_registered_engine_serves_requests_on_the_bus(echo_kind, nats_url, prefix,
                                                              client) -> None:
    args = build_parser().parse_args(["worker", "--engine", "echo", "--echo-vocab", "300",
                                      "--nats", nats_url, "--prefix", prefix])
    engine = registry.make_engine(args.engine, "tiny", **registry.options_from(args))
    assert isinstance(engine, EchoEngine) and engine.vocab_size == 300
    async with Bus.connect(nats_url, prefix=prefix) as bus, anyio.create_task_group() as tg:
        worker = Worker(bus, engine, "echo-0", capacity=4)
        await tg.start(worker.run)
        async with client() as fabric:
            await fabric.wait_for_workers(1, timeout=30)
            assert [m.engine for m in fabric.watcher.members.values()] == ["echo"]
            req = RolloutRequest(request_id="e1", prompt_token_ids=[7, 8, 9],
                                 min_weight_version=-1, sampling=SamplingParams(max_tokens=2))
            [res] = [r async for r in fabric.generate([req], timeout=30)]
        assert isinstance(res, RolloutResult) and res.completion_token_ids.tolist() == [7, 8]
        tg.cancel_scope.cancel()


def test_an_unknown_engine_names_the_registered_ones() -> None:
    with pytest.raises(ValueError, match="unknown engine 'nope': use one of torch, vllm, null"):
        registry.make_engine("nope", "tiny")


def test_a_torch_process_is_readied_before_torch_loads() -> None:
    """`prepare_process` gives a fresh process the torch kind's OpenMP spin before anything
    imports torch (libgomp reads it once, as it loads), then its threads. The modules of its
    callers (`rlfabric worker`, the Ray actor's) do not load torch before it runs."""
    code = ("import os, sys\n"
            "import rlfabric.cli.worker_cmd, rlfabric.launch.ray\n"
            "from rlfabric.engines import registry\n"
            "assert 'torch' not in sys.modules\n"
            "registry.prepare_process('torch', 1)\n"
            "import torch\n"
            "print(os.environ.get('GOMP_SPINCOUNT'), torch.get_num_threads())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == [OPENMP_SPIN, "1"]


@pytest.mark.parametrize("user", [{"GOMP_SPINCOUNT": "7"}, {"OMP_WAIT_POLICY": "ACTIVE"}])
def test_an_openmp_wait_setting_of_the_users_wins(monkeypatch, user) -> None:
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in user.items():
        monkeypatch.setenv(name, value)
    registry.prepare_process("torch")
    assert os.environ.get("GOMP_SPINCOUNT") == user.get("GOMP_SPINCOUNT")
    assert os.environ.get("OMP_WAIT_POLICY") == user.get("OMP_WAIT_POLICY")
