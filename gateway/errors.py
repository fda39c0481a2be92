"""OpenAI's error object, and how the router's gRPC statuses become one.

| router status        | HTTP | `error.type`             | notes                                  |
|----------------------|------|--------------------------|----------------------------------------|
| INVALID_ARGUMENT     | 400  | `invalid_request_error`  | `param`: the OpenAI name of the field  |
| UNAUTHENTICATED      | 401  | `authentication_error`   | `code`: `invalid_api_key`              |
| PERMISSION_DENIED    | 403  | `permission_error`       |                                        |
| NOT_FOUND            | 404  | `invalid_request_error`  |                                        |
| ALREADY_EXISTS       | 409  | `invalid_request_error`  |                                        |
| RESOURCE_EXHAUSTED   | 429  | `rate_limit_error`       | `Retry-After` from `RetryInfo`         |
| UNAVAILABLE          | 503  | `service_unavailable`    | the router or its workers are down     |
| DEADLINE_EXCEEDED    | 504  | `timeout`                |                                        |
| anything else        | 500  | `internal_error`         |                                        |
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

_DETAILS_KEY = "grpc-status-details-bin"

_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


class GatewayError(Exception):
    """One failed request, as OpenAI reports it: an HTTP status and an error object."""

    def __init__(  # noqa: PLR0913 (the error object's four fields and two HTTP ones)
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 (OpenAI's field name)
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


def invalid(param: str | None, message: str) -> GatewayError:
    """A 400 naming the request's parameter."""
    return GatewayError(400, message, param=param)


def from_rpc_error(
    err: grpc.aio.AioRpcError, param_of: Callable[[str], str | None]
) -> GatewayError:
    """The router's status as an OpenAI error. `param_of` maps the router's field path
    (`sampling.top_p`, `messages`) to the request's parameter name."""
    code = err.code()
    status, kind = _HTTP.get(code, (500, "internal_error"))
    message = err.details() or code.name
    error = GatewayError(status, message, type=kind)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        error.code = "invalid_api_key"
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        error.code = "rate_limit_exceeded"
    for detail in _details(err):
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            if bad.field_violations:
                violation = bad.field_violations[0]
                error.param = param_of(violation.field)
                error.message = f"{error.param or violation.field}: {violation.description}"
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            error.retry_after_s = info.retry_delay.ToTimedelta().total_seconds()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and error.retry_after_s is None:
        error.retry_after_s = 1.0
    return error


def _details(err: grpc.aio.AioRpcError) -> list[Any]:
    """The `google.rpc.Status` details of the trailers (grpc_status reads only sync calls)."""
    for key, value in err.trailing_metadata() or ():
        if key == _DETAILS_KEY and isinstance(value, bytes):
            status = status_pb2.Status.FromString(value)
            if status.code == err.code().value[0]:
                return list(status.details)
    return []
