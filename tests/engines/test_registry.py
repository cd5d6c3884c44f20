"""A new engine is one registration: registered from this test (no other module touched), it is
an `--engine` choice with its own flags in `rlfabric worker --help`, those flags reach its
factory, and a worker serving it answers requests on the bus."""

from __future__ import annotations

import contextlib
import io

import anyio
import pytest

from rlfabric.bus import Bus
from rlfabric.cli import build_parser, main
from rlfabric.engines import registry
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
