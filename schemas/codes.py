"""Every stable error code rlfabric puts on the wire or answers with, in one enum.

A code travels as its string (`Ack.error_code`, `RolloutError.code`, `ErrorEvent.code`, the
gateway's `error.code`); `ErrorCode` is a `StrEnum`, so a member equals its string and code
that compares with strings keeps working. Add a code here before raising it anywhere.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    # ---- a rollout request (RolloutError.code) ----
    BAD_REQUEST = "bad_request"  # a field out of range; the request only is refused
    MALFORMED = "malformed"  # bytes that are not the message they claim to be
    PROMPT_TOO_LONG = "prompt_too_long"  # the prompt leaves the engine no room
    VERSION_UNAVAILABLE = "version_unavailable"  # min_weight_version nobody serves
    DEADLINE_EXCEEDED = "deadline_exceeded"  # a request's or command's deadline passed
    ENGINE_ERROR = "engine_error"  # the engine failed this request
    PAYLOAD_TOO_LARGE = "payload_too_large"  # a request or result over the server's max_payload
    ADAPTER_UNKNOWN = "adapter_unknown"  # a LoRA adapter no update loaded (or one unloaded)
    NO_WORKERS = "no_workers"  # no worker is a member of the job: nothing would serve it
    NOT_MOVED = "not_moved"  # a sample a leaving worker handed back could not be sent on

    # ---- a command (Ack.error_code) ----
    UNKNOWN_SCHEMA_VERSION = "unknown_schema_version"  # a major version this build cannot read
    HANDLER_ERROR = "handler_error"  # a command handler raised something unexpected
    UNSUPPORTED = "unsupported"  # this engine cannot do it (at once, not at a timeout)
    FETCH_FAILED = "fetch_failed"  # the weights could not be fetched over their transport
    DIGEST_MISMATCH = "digest_mismatch"  # the fetched payload is not what was sent
    LOAD_FAILED = "load_failed"  # the engine refused the weights; the old ones serve
    NOT_IN_GROUP = "not_in_group"  # init_transport gave this worker no rank
    GROUP_JOIN_FAILED = "group_join_failed"  # the collective group could not be joined
    NO_GROUP = "no_group"  # a collective update before (or after another) init_transport
    BROADCAST_FAILED = "broadcast_failed"  # the collective broadcast failed midway
    DRAIN_TIMEOUT = "drain_timeout"  # requests still in flight at a pause's deadline
    ADAPTER_LIMIT = "adapter_limit"  # more adapters than the engine holds (--max-adapters)
    STORAGE_FULL = "storage_full"  # the transport's storage has no room for the push
    MEMORY_UNAVAILABLE = "memory_unavailable"  # the engine cannot get the memory it was given
    BASE_MISMATCH = "base_mismatch"  # an adapter trained on other base weights than served
    JOB_DELETED = "job_deleted"  # the request's job was ended (rlfabric job delete)
    POOL_ONLY = "pool_only"  # a job asked for what only the pool's operator does (base weights)
    STALE_PREFIX_CACHE = "stale_prefix_cache"  # a kept prefix cache would serve other weights
    DELTA_BASE_MISSING = "delta_base_missing"  # a weight delta against a version not held

    # ---- a worker's own events (ErrorEvent.code) ----
    WEIGHTS_UNAVAILABLE = "weights_unavailable"  # joined without the fleet's version
    CHECKPOINT_MISMATCH = "checkpoint_mismatch"  # not the checkpoint the fleet serves as v0
    ENGINE_DIED = "engine_died"  # the engine process is gone; the worker exits
    BEHIND = "behind"  # the worker is not on the desired policy and takes no requests
    # ---- a trainer's own check of what it receives ----
    POLICY_MISMATCH = "policy_mismatch"  # a result from weights this trainer did not push

    # ---- the gateway (its `error.code`) ----
    INVALID_JSON = "invalid_json"
    INVALID_VALUE = "invalid_value"
    INVALID_CONVERSATION = "invalid_conversation"
    UNSUPPORTED_PARAMETER = "unsupported_parameter"
    TOOL_RESULT_WITHOUT_CALL = "tool_result_without_call"
    INVALID_API_KEY = "invalid_api_key"
    MODEL_NOT_FOUND = "model_not_found"
    SESSION_NOT_FOUND = "session_not_found"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    SESSION_ENDED = "session_ended"
    SESSION_CONFLICT = "session_conflict"
    SESSION_WRITE_FAILED = "session_write_failed"
    SESSION_LIMIT = "session_limit"  # the gateway holds as many sessions as it is allowed
    REQUEST_TOO_LARGE = "request_too_large"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    NO_WEIGHTS = "no_weights"
    TIMEOUT = "timeout"
    BUS_UNAVAILABLE = "bus_unavailable"
    INTERNAL_ERROR = "internal_error"
