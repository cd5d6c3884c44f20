"""What every `RolloutRequest` must satisfy before anyone serves it, whatever the engine.

The client checks it before publishing (`InvalidRequest`, at once); every worker checks it
again before a request reaches its engine (a `RolloutError` with code `bad_request`), because
anyone who can publish on the request subject can send anything. Engines add what depends on
the model (vocabulary, context length) in their own `check`.
"""

from __future__ import annotations

import math

from rlfabric.schemas.codes import ErrorCode
from rlfabric.schemas.errors import RLFabricError
from rlfabric.schemas.jobs import SEPARATOR, is_job
from rlfabric.schemas.rollout import RolloutRequest

#: longest request id: it travels in NATS headers and message ids
MAX_REQUEST_ID = 256
MAX_SAMPLES = 1024  # n
MAX_NEW_TOKENS = 1 << 20
MAX_PROMPT_TOKENS = 1 << 20
MAX_STOP_IDS = 1024
MAX_LOGPROBS = 20  # top-k alternatives per token (vLLM's own default limit)
MAX_METADATA_BYTES = 64 * 1024
SEED_RANGE = (0, (1 << 63) - 1)
TOKEN_RANGE = (0, (1 << 31) - 1)


class InvalidRequest(RLFabricError, ValueError):
    """A request that can never be served as written; the message names the field, the value
    and what is allowed. `code` is the `RolloutError.code` a worker answers it with."""

    code = ErrorCode.BAD_REQUEST


def check_request(req: RolloutRequest) -> None:
    """Raise `InvalidRequest` naming the first field out of range."""
    if _plainly_valid(req):
        return
    _first_invalid(req)


def _plainly_valid(req: RolloutRequest) -> bool:
    """Every check of `_first_invalid` at once, on plain ints and floats (what a decoded
    request holds). False sends the request through the field-by-field checks, which name the
    failing field, or pass what this pass leaves to them (stop ids, an adapter, metadata, a
    numpy int)."""
    rid, sp, seed = req.request_id, req.sampling, req.sampling.seed
    packed = req.prompt_token_ids.tobytes()  # 4 bytes a token
    return bool(
        0 < len(rid) <= MAX_REQUEST_ID and rid.isprintable()
        and 0 < len(packed) <= 4 * MAX_PROMPT_TOKENS and packed[3::4].isascii()
        and type(sp.n) is int and 1 <= sp.n <= MAX_SAMPLES
        and type(sp.max_tokens) is int and 1 <= sp.max_tokens <= MAX_NEW_TOKENS
        and type(sp.top_k) is int and 0 <= sp.top_k <= _TOKEN_MAX
        and type(sp.logprobs) is int and 0 <= sp.logprobs <= MAX_LOGPROBS
        and (seed is None or (type(seed) is int and 0 <= seed <= _SEED_MAX))
        and 0.0 <= sp.temperature < _INF and 0.0 < sp.top_p <= 1.0
        and not sp.stop_token_ids
        and type(req.min_weight_version) is int and -1 <= req.min_weight_version <= _SEED_MAX
        and 0.0 <= req.deadline < _INF
        and not req.adapter and req.adapter_version == -1
        and not req.metadata and (not req.job or is_job(req.job)))


# module constants as plain names: read per request, on the hot path
_TOKEN_MAX, _SEED_MAX, _INF = TOKEN_RANGE[1], SEED_RANGE[1], math.inf


def _first_invalid(req: RolloutRequest) -> None:
    rid = req.request_id
    if not rid or len(rid) > MAX_REQUEST_ID or not rid.isprintable():
        raise InvalidRequest(f"request_id {_short(rid)}: needs 1 to {MAX_REQUEST_ID} printable "
                             "characters")
    where = f"request {rid}"
    n_prompt = len(req.prompt_token_ids)
    if not 0 < n_prompt <= MAX_PROMPT_TOKENS:
        raise InvalidRequest(f"{where}: prompt_token_ids has {n_prompt} tokens; needs 1 to "
                             f"{MAX_PROMPT_TOKENS}")
    # packed little-endian: a negative id is one whose last byte has its top bit set (a
    # bytes check, cheaper than numpy's min)
    if not req.prompt_token_ids.tobytes()[3::4].isascii():
        low = int(req.prompt_token_ids.numpy().min())
        raise InvalidRequest(f"{where}: prompt token id {low} is negative")
    sp = req.sampling
    _int_in(where, "sampling.n", sp.n, 1, MAX_SAMPLES)
    _int_in(where, "sampling.max_tokens", sp.max_tokens, 1, MAX_NEW_TOKENS)
    _int_in(where, "sampling.top_k", sp.top_k, 0, TOKEN_RANGE[1])
    _int_in(where, "sampling.logprobs", sp.logprobs, 0, MAX_LOGPROBS)
    if sp.seed is not None:
        _int_in(where, "sampling.seed", sp.seed, *SEED_RANGE)
    if not (math.isfinite(sp.temperature) and sp.temperature >= 0.0):
        raise InvalidRequest(f"{where}: sampling.temperature={sp.temperature}: needs a finite "
                             "value >= 0 (0 = greedy)")
    if not (math.isfinite(sp.top_p) and 0.0 < sp.top_p <= 1.0):
        raise InvalidRequest(f"{where}: sampling.top_p={sp.top_p}: needs 0 < top_p <= 1")
    if len(sp.stop_token_ids) > MAX_STOP_IDS:
        raise InvalidRequest(f"{where}: {len(sp.stop_token_ids)} stop_token_ids; at most "
                             f"{MAX_STOP_IDS}")
    for t in sp.stop_token_ids:
        _int_in(where, "a stop token id", t, *TOKEN_RANGE)
    _int_in(where, "min_weight_version", req.min_weight_version, -1, SEED_RANGE[1])
    if not (math.isfinite(req.deadline) and req.deadline >= 0.0):
        raise InvalidRequest(f"{where}: deadline={req.deadline}: needs unix seconds, or 0 for "
                             "none")
    if len(req.adapter) > MAX_REQUEST_ID or not req.adapter.isprintable():
        raise InvalidRequest(f"{where}: adapter {_short(req.adapter)}: needs at most "
                             f"{MAX_REQUEST_ID} printable characters (empty: the base model)")
    if SEPARATOR in req.adapter and not req.adapter.startswith(f"{req.job}{SEPARATOR}"):
        raise InvalidRequest(f"{where}: adapter {_short(req.adapter)}: an adapter name may not "
                             f"hold {SEPARATOR!r} (it separates a job from its adapters' names; "
                             "set the request's job instead)")
    if req.job and not is_job(req.job):
        raise InvalidRequest(f"{where}: job {_short(req.job)}: needs 1-64 characters from "
                             "A-Z a-z 0-9 _ - (empty: the default job)")
    # a version of an adapter: only with one named (-1: the newest)
    _int_in(where, "adapter_version", req.adapter_version, -1,
            SEED_RANGE[1] if req.adapter else -1)
    size = sum(len(k) + len(v) for k, v in req.metadata.items())
    if size > MAX_METADATA_BYTES:
        raise InvalidRequest(f"{where}: metadata holds {size} characters; at most "
                             f"{MAX_METADATA_BYTES}")


def _int_in(where: str, field: str, value: int, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not lo <= value <= hi:
        raise InvalidRequest(f"{where}: {field}={value}: needs an integer in [{lo}, {hi}]")


def _short(s: str) -> str:
    return repr(s) if len(s) <= 40 else f"{s[:40]!r}... ({len(s)} characters)"
