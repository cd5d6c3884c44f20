"""Errors answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with
the HTTP status that says whose fault it is."""

from __future__ import annotations

import msgspec

from rlfabric.schemas import ErrorCode, RLFabricError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          409: "conflict_error", 413: "invalid_request_error", 422: "invalid_request_error"}


class APIError(RLFabricError):
    """Raised inside the gateway for anything answered with an error status; `param` names the
    request field at fault (`messages[2].role`), `code` is stable."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")

    def body(self) -> bytes:
        return msgspec.json.encode({"error": {"message": self.message, "type": self.type,
                                              "param": self.param, "code": self.code}})


def bad_request(message: str, param: str | None = None,
                code: ErrorCode = ErrorCode.INVALID_VALUE) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, why: str) -> APIError:
    return APIError(400, f"{param} is not supported by the rlfabric gateway: {why}",
                    param=param, code=ErrorCode.UNSUPPORTED_PARAMETER)


#: a worker's `RolloutError.code` as the status and error code the agent gets
WORKER_ERRORS: dict[str, tuple[int, ErrorCode]] = {
    ErrorCode.BAD_REQUEST: (400, ErrorCode.INVALID_VALUE),
    ErrorCode.MALFORMED: (400, ErrorCode.INVALID_VALUE),
    ErrorCode.PROMPT_TOO_LONG: (413, ErrorCode.CONTEXT_LENGTH_EXCEEDED),
    ErrorCode.REQUEST_TOO_LARGE: (400, ErrorCode.REQUEST_TOO_LARGE),  # the worker's own budget
    ErrorCode.VERSION_UNAVAILABLE: (503, ErrorCode.NO_WEIGHTS),
    ErrorCode.DEADLINE_EXCEEDED: (503, ErrorCode.TIMEOUT),
    ErrorCode.ENGINE_ERROR: (502, ErrorCode.ENGINE_ERROR),
    ErrorCode.NO_WORKERS: (503, ErrorCode.NO_WORKERS),
}
