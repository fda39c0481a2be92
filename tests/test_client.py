"""`pagedserve.client.Client`'s channel to a router that went away (`pagedserve up` restarts a
router at its port; a Kubernetes Service keeps its address across a pod's restart): it tries
again at least once a second, so a router that is back is used within a second. gRPC's default
back-off waits 1 s, then 1.6x longer per failed attempt, up to 120 s."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest

from pagedserve.client import Client
from pagedserve.v1 import generation_pb2

WINDOW_S = 4.0
GRPC_DEFAULT_BACKOFF = [
    ("grpc.initial_reconnect_backoff_ms", 1000),
    ("grpc.min_reconnect_backoff_ms", 1000),
    ("grpc.max_reconnect_backoff_ms", 120_000),
]


class HangUp:
    """A TCP port that accepts each connection and closes it at once, timing each: every
    attempt of a gRPC channel there fails, as against a router that is restarting."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)  # NOTE: a close does not wake a blocked accept
        self.stopped = False
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.attempts: list[float] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.attempts.append(time.monotonic())
            conn.close()

    def close(self) -> None:
        self.stopped = True
        self.thread.join(5)
        self.sock.close()


def attempts_while_waiting(channel_options) -> list[float]:
    """Connection attempts of a Client's channel during one call that waits WINDOW_S for it."""
    port = HangUp()
    try:
        with Client(port.address, channel_options=channel_options) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.stub.GetModelInfo(
                    generation_pb2.GetModelInfoRequest(), timeout=WINDOW_S, wait_for_ready=True
                )
            assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        port.close()
    return port.attempts


def test_a_client_tries_a_router_that_went_away_again_at_least_once_a_second():
    attempts = attempts_while_waiting(())
    gaps = [b - a for a, b in zip(attempts, attempts[1:], strict=False)]
    # NOTE: 100 ms doubling to 1 s (+-20 % jitter): 8 attempts in 4 s
    assert len(attempts) >= 6, gaps
    assert max(gaps) < 2.0, gaps


def test_channel_options_apply_over_the_clients_own():
    # NOTE: gRPC's own default back-off (1 s, x1.6): 3 attempts in 4 s; this shows the test
    # above would fail on a channel with it
    attempts = attempts_while_waiting(GRPC_DEFAULT_BACKOFF)
    assert 1 <= len(attempts) <= 4, attempts
