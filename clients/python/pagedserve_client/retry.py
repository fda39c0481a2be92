"""Retries: UNAVAILABLE through gRPC's own retry policy (a service config on the channel), and
RESOURCE_EXHAUSTED after the delay the router asks for in its google.rpc.RetryInfo detail."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from pagedserve_client.rpc import status_pb2

SERVICE = "pagedserve.v1.Generation"
RETRY_INFO = "google.rpc.RetryInfo"
STATUS_DETAILS_KEY = "grpc-status-details-bin"


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """When a call is tried again.

    UNAVAILABLE (a router not up yet, restarting, or with no ready worker): gRPC retries, up to
    `max_attempts` tries in all (gRPC allows 2 to 5; 1 turns this off), waiting a random time
    below `initial_backoff_s`, then `backoff_multiplier` times more per try, at most
    `max_backoff_s`. A Generate stream is retried only until its first response arrives (gRPC's
    rule: after that the call is committed and the error reaches the caller).

    RESOURCE_EXHAUSTED with a RetryInfo detail (the router's queue is full): the client waits the
    delay the router names and tries again, up to `overload_attempts` tries in all, unless the
    delay is over `max_overload_delay_s` or would pass the call's timeout. RESOURCE_EXHAUSTED
    without RetryInfo (e.g. a message over gRPC's size limit) is not retried."""

    max_attempts: int = 5
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    backoff_multiplier: float = 2.0
    overload_attempts: int = 5
    max_overload_delay_s: float = 30.0

    def __post_init__(self) -> None:
        if not 1 <= self.max_attempts <= 5:
            raise ValueError(f"max_attempts={self.max_attempts}: gRPC allows 1 to 5")
        if min(self.initial_backoff_s, self.max_backoff_s, self.backoff_multiplier) <= 0:
            raise ValueError("initial_backoff_s, max_backoff_s, backoff_multiplier must be > 0")
        if self.overload_attempts < 1 or self.max_overload_delay_s < 0:
            raise ValueError("overload_attempts must be >= 1 and max_overload_delay_s >= 0")


def _duration(seconds: float) -> str:
    return f"{seconds:.3f}s"


def service_config(policy: RetryPolicy) -> str:
    """The gRPC service config (JSON) with `policy`'s retryPolicy for every method of the
    Generation service."""
    method: dict[str, Any] = {"name": [{"service": SERVICE}]}
    if policy.max_attempts > 1:
        method["retryPolicy"] = {
            "maxAttempts": policy.max_attempts,
            "initialBackoff": _duration(policy.initial_backoff_s),
            "maxBackoff": _duration(policy.max_backoff_s),
            "backoffMultiplier": policy.backoff_multiplier,
            "retryableStatusCodes": ["UNAVAILABLE"],
        }
    return json.dumps({"methodConfig": [method]})


def status_details(error: grpc.RpcError) -> status_pb2.Status | None:
    """The google.rpc.Status of a failed call (the `grpc-status-details-bin` trailer), None when
    there is none, it does not parse, or its code is not the call's."""
    trailers: Any = error.trailing_metadata() or ()
    for key, value in trailers:
        if key != STATUS_DETAILS_KEY:
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except DecodeError:
            return None
        return status if status.code == error.code().value[0] else None
    return None


def retry_delay(error: grpc.RpcError) -> float | None:
    """Seconds the server asks the caller to wait (google.rpc.RetryInfo), None without one."""
    status = status_details(error)
    for detail in status.details if status is not None else ():
        if detail.type_url.rsplit("/", 1)[-1] == RETRY_INFO:
            delay = status_pb2.RetryInfo.FromString(detail.value).retry_delay
            return delay.seconds + delay.nanos / 1e9
    return None


def overload_wait(
    policy: RetryPolicy | None, error: grpc.RpcError, attempt: int, deadline: float | None
) -> float | None:
    """Seconds to wait before trying again after try number `attempt` failed with `error`, or
    None: give up and raise it. `deadline`: the call's end on time.monotonic()'s clock."""
    if policy is None or attempt >= policy.overload_attempts:
        return None
    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    delay = retry_delay(error)
    if delay is None or delay > policy.max_overload_delay_s:
        return None
    if deadline is not None and time.monotonic() + delay >= deadline:
        return None
    return delay


def remaining(deadline: float | None) -> float | None:
    """The timeout left until `deadline` (None: no deadline)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def deadline_of(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout
