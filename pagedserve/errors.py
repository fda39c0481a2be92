"""Exceptions that cross component boundaries and become gRPC status codes (docs/architecture.md).

Torch-free: the router imports this. One interceptor per server maps them:

| exception           | gRPC code            | `google.rpc.Status` detail        |
|---------------------|----------------------|-----------------------------------|
| `InvalidArgument`   | `INVALID_ARGUMENT`   | `BadRequest.FieldViolation`       |
| `ResourceExhausted` | `RESOURCE_EXHAUSTED` | `RetryInfo` when `retry_after_s`  |
| `Unavailable`       | `UNAVAILABLE`        | none                              |
| `AlreadyExists`     | `ALREADY_EXISTS`     | none                              |

Anything else that escapes a servicer is a bug (`INTERNAL`); a caller's mistake must never be one.
"""

from __future__ import annotations


class InvalidArgument(ValueError):
    """A caller's mistake in one named field; maps to `INVALID_ARGUMENT`.

    `field` is the path of the offending field as the caller spelled it (e.g. `"temperature"`;
    the router prefixes the enclosing message, see `with_prefix`). It becomes
    `BadRequest.FieldViolation.field`, and `description` (which names the bad value) becomes
    `FieldViolation.description`. A `ValueError`, so code that only knows style.md's rule
    ("a caller's mistake raises ValueError") still catches it.
    """

    def __init__(self, field: str, description: str) -> None:
        super().__init__(field, description)
        self.field = field
        self.description = description

    def __str__(self) -> str:
        return f"{self.field}: {self.description}"

    def with_prefix(self, prefix: str) -> InvalidArgument:
        """The same violation with `field` nested under `prefix` (`"sampling_params.top_p"`)."""
        return InvalidArgument(f"{prefix}.{self.field}", self.description)


class ResourceExhausted(Exception):
    """An overload the caller may retry; maps to `RESOURCE_EXHAUSTED`.

    `retry_after_s`, when set, becomes `RetryInfo.retry_delay`.
    """

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message, retry_after_s)
        self.message = message
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return self.message


class Unavailable(Exception):
    """A worker was lost, is draining or not yet ready; maps to `UNAVAILABLE` (retryable)."""


class AlreadyExists(Exception):
    """The caller's own request of that id is still running; maps to `ALREADY_EXISTS`."""
