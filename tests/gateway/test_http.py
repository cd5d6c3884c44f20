"""The gateway's HTTP surface: bad input gets the right status in OpenAI's error shape and
never disturbs the next request; completions from text or token ids; bearer keys."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.nats, pytest.mark.slow]
MODEL = "tinyqwen"
OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _post(base: str, path: str, body: Any = None, *, raw: bytes | None = None,
          **kw: Any) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{base}{path}", content=content, timeout=60,
                      headers={"content-type": "application/json", **kw.pop("headers", {})},
                      **kw)


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _with(**changes: Any) -> dict[str, Any]:
    return {**OK, **changes}


BAD = [
    pytest.param(dict(raw=b'{"model": "tinyqwen", "messages": [}'), 400, None, id="malformed-json"),
    pytest.param(dict(body=_with(model="gpt-9")), 404, "model", id="unknown-model"),
    pytest.param(dict(body=_with(messages=[{"role": "wizard", "content": "x"}])), 400,
                 "messages[0].role", id="unknown-role"),
    pytest.param(dict(body=_with(messages=[{"role": "user", "content": "x"},
                                           {"role": "tool", "tool_call_id": "c1",
                                            "content": "5"}])), 400, "messages[1]",
                 id="tool-result-without-call"),
    pytest.param(dict(body=_with(max_tokens=0)), 400, "max_tokens", id="max-tokens-0"),
    pytest.param(dict(body=_with(n=0)), 400, "n", id="n-0"),
    pytest.param(dict(body=_with(messages="hi")), 400, "messages", id="wrong-type"),
    pytest.param(dict(raw=b"x" * 10_000_000), 413, None, id="10MB-body"),
    pytest.param(dict(body=_with(messages=[{"role": "user", "content": "word " * 5000}])), 413,
                 "messages", id="prompt-over-context"),
]


@pytest.mark.parametrize(("request_", "status", "param"), BAD)
def test_bad_input_gets_its_status_and_the_next_request_is_served(fleet, request_, status,
                                                                  param):
    base = next(iter(fleet.gateways))
    err = _error(_post(base, "/chat/completions", **request_), status)
    assert err["param"] == param
    ok = _post(base, "/chat/completions", OK)
    assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"], ok.text


def test_unknown_session_and_route_are_404(fleet):
    base = next(iter(fleet.gateways))
    assert _error(httpx.get(f"{base}/sessions/nobody-{fleet.prefix}/trajectory"),
                  404)["code"] == "session_not_found"
    assert _error(_post(base, "/sessions/nobody/finish", {}), 404)["param"] == "session_id"
    _error(httpx.get(f"{base}/nothing-here"), 404)


def test_a_finished_session_takes_no_more_turns(fleet):
    base = next(iter(fleet.gateways))
    sid = f"done-{fleet.prefix}"
    path = f"/../sessions/{sid}/v1/chat/completions"
    assert _post(base, path, OK).status_code == 200
    fin = _post(base, f"/sessions/{sid}/finish", {})
    assert fin.status_code == 200 and fin.json()["ended"] == "finished"
    assert _error(_post(base, path, OK), 409)["code"] == "session_ended"
    traj = httpx.get(f"{base}/sessions/{sid}/trajectory").json()
    assert traj["ended"] == "finished" and traj["turns"] == 1


def test_completions_from_text_or_token_ids(fleet, chat_format):
    base = next(iter(fleet.gateways))
    ids = chat_format().encode("Once upon a time")
    by_text = _post(base, "/completions", {"model": MODEL, "prompt": "Once upon a time",
                                           "max_tokens": 5, "seed": 4, "logprobs": 2})
    by_ids = _post(base, "/completions", {"model": MODEL, "prompt": ids, "max_tokens": 5,
                                          "seed": 4})
    assert by_text.status_code == by_ids.status_code == 200, by_text.text + by_ids.text
    a, b = by_text.json(), by_ids.json()
    assert a["prompt_token_ids"] == b["prompt_token_ids"] == ids
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert len(a["choices"][0]["logprobs"]["top_logprobs"][0]) == 2


def test_models_and_health(fleet):
    base = next(iter(fleet.gateways))
    models = httpx.get(f"{base}/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["object"] == "list"
    health = httpx.get(base.removesuffix("/v1") + "/health").json()
    assert health["status"] == "ok" and health["workers"] == 2


def test_an_api_key_is_required_when_set(fleet, client, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# tenant key\nteam-a sk-a\nsk-b\n")
    base = fleet.gateway("--api-key-file", str(keys))
    err = _error(_post(base, "/chat/completions", OK), 401)
    assert err["code"] == "invalid_api_key"
    _error(_post(base, "/chat/completions", OK, headers={"authorization": "Bearer nope"}), 401)
    r = client(base, api_key="sk-a").chat.completions.create(**OK)
    assert r.choices[0].finish_reason == "length"
    assert client(base, api_key="sk-b").models.list().data[0].id == MODEL


@pytest.mark.anyio
async def test_a_lora_adapter_is_a_model_the_gateway_lists_and_serves(new_fleet, chat_format):
    """Pushed to the fleet, an adapter is a `model`: listed by /v1/models, its completions
    are the merged model's tokens, and once unloaded it is a 404 again."""
    import anyio
    from helpers import taken_logprobs

    from rlfabric.schemas import Adapter
    from rlfabric.tensors import lora
    from rlfabric.tensors.models import build_model
    from rlfabric.trainer import FabricClient

    f = new_fleet()
    f.workers(["lw0"])
    base = f.gateway()
    qv = Adapter(name="qv", rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    model = build_model(MODEL)
    state = lora.random_adapter(model, qv, seed=5, std=0.2)
    ids = chat_format().encode("Once upon a time")
    body = {"model": "qv", "prompt": ids, "max_tokens": 6, "seed": 2, "logprobs": 0}
    async with FabricClient.connect(f.nats, prefix=f.prefix) as fabric:
        await fabric.wait_for_workers(1, timeout=60)
        await fabric.update_weights(1, state_dict=state, adapter=qv)
        # the gateway learns of it from the membership: another process, no event to await
        with anyio.fail_after(30):
            while "qv" not in [m["id"] for m in httpx.get(f"{base}/models").json()["data"]]:  # noqa: ASYNC110
                await anyio.sleep(0.1)
        got = await anyio.to_thread.run_sync(lambda: _post(base, "/completions", body))
        await fabric.unload_adapter("qv")
        with anyio.fail_after(30):
            while "qv" in [m["id"] for m in httpx.get(f"{base}/models").json()["data"]]:  # noqa: ASYNC110
                await anyio.sleep(0.1)
    gone = _post(base, "/completions", body)
    assert got.status_code == 200, got.text
    choice = got.json()["choices"][0]
    want = taken_logprobs(lora.merged(model, state, qv), ids, choice["token_ids"])
    assert abs(want - choice["logprobs"]["token_logprobs"]).max() <= 1e-4
    assert [v["version"] for v in choice["weight_versions"]] == [1]
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


@pytest.mark.anyio
async def test_each_jobs_key_is_served_its_own_adapter_and_sessions(new_fleet, chat_format,
                                                                    tmp_path):
    """`--tenants-are-jobs`: two jobs both push an adapter named `qv`; each job's key lists
    and is served its own job's `qv`, and a session one job's key opened is not there for the
    other job's key (same session id: two sessions)."""
    import anyio
    from helpers import taken_logprobs

    from rlfabric.schemas import Adapter
    from rlfabric.tensors import lora
    from rlfabric.tensors.models import build_model
    from rlfabric.trainer import FabricClient

    f = new_fleet()
    f.workers(["jw0"])
    keys = tmp_path / "keys"
    keys.write_text("exp-a sk-a\nexp-b sk-b\n")
    base = f.gateway("--api-key-file", str(keys), "--tenants-are-jobs")
    qv = Adapter(name="qv", rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    model = build_model(MODEL)
    states = {j: lora.random_adapter(model, qv, seed=s, std=0.2)
              for j, s in (("exp-a", 1), ("exp-b", 2))}
    ids = chat_format().encode("Once upon a time")
    body = {"model": "qv", "prompt": ids, "max_tokens": 6, "seed": 2, "logprobs": 0}

    def auth(j: str) -> dict[str, str]:
        return {"authorization": f"Bearer sk-{j[-1]}"}

    for j, state in states.items():
        async with FabricClient.connect(f.nats, prefix=f.prefix, job=j) as fabric:
            await fabric.wait_for_workers(1, timeout=60)
            await fabric.update_weights(1, state_dict=state, adapter=qv)
    with anyio.fail_after(30):  # the gateway learns of them from the membership
        while any("qv" not in [m["id"] for m in httpx.get(  # noqa: ASYNC110
                f"{base}/models", headers=auth(j)).json()["data"]] for j in states):
            await anyio.sleep(0.1)
    for j, state in states.items():
        got = await anyio.to_thread.run_sync(
            lambda j=j: _post(base, "/completions", body, headers=auth(j)))
        assert got.status_code == 200, got.text
        choice = got.json()["choices"][0]
        want = taken_logprobs(lora.merged(model, state, qv), ids, choice["token_ids"])
        assert abs(want - choice["logprobs"]["token_logprobs"]).max() <= 1e-4, j
    chat = {**OK, "model": "qv"}
    r = await anyio.to_thread.run_sync(lambda: _post(
        base, "/chat/completions", chat, headers={**auth("exp-a"), "x-session-id": "s1"}))
    assert r.status_code == 200, r.text
    mine = httpx.get(f"{base}/sessions/s1/trajectory", headers=auth("exp-a"))
    theirs = httpx.get(f"{base}/sessions/s1/trajectory", headers=auth("exp-b"))
    assert mine.status_code == 200 and mine.json()["turns"] == 1
    assert _error(theirs, 404)["code"] == "session_not_found"
