"""The errors engines raise: one tree under `EngineError`, each with the `ErrorCode` the worker
runtime answers with (a RolloutError for a request, an error Ack for a command)."""

from __future__ import annotations

from rlfabric.schemas import ErrorCode, RLFabricError


class EngineError(RLFabricError):
    """An engine could not do what it was asked; `code` says what kind of failure it was."""

    default_code: str = ErrorCode.HANDLER_ERROR

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code or self.default_code


class RequestRejected(EngineError):
    """Raised by `Engine.check` for a request the engine cannot serve. `code` is the stable
    `RolloutError.code` (`bad_request`, `prompt_too_long`, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message, code=code)


class EngineDied(EngineError):
    """Raised out of `Engine.run` when the engine is gone (its process killed or crashed);
    the message names the cause (vLLM: with the tail of its log). The worker reports it as an
    `ErrorEvent` (code `engine_died`), leaves membership and exits with status 3."""

    default_code = ErrorCode.ENGINE_DIED


class WeightLoadError(EngineError):
    """Raised by `Engine.load_weights` when the new weights cannot be applied; the engine
    keeps serving the previous version."""

    default_code = ErrorCode.LOAD_FAILED


class Unsupported(EngineError):
    """The engine cannot do this at all (here, or with these options): refused at once."""

    default_code = ErrorCode.UNSUPPORTED
