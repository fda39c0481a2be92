"""A small threaded TCP fault proxy on 127.0.0.1 for Redis and gRPC links.

    client ──► FaultProxy(127.0.0.1:port) ──► upstream

Modes (switchable while connections are open; a switch applies to every byte from then on):
  pass        forward both ways
  delay N     hold every chunk N ms before forwarding it (both ways, or one: `direction`
              "up" is client -> upstream, "down" is upstream -> client)
  drop        accept, then black-hole: read and discard, never answer
  reset       close new and open connections with RST (SO_LINGER 0)

Bounded: every socket has a timeout, every thread is a daemon, and the proxy stops by itself
after `max_life_s` even if a test forgets `close()`.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Mode:
    name: str  # "pass" | "delay" | "drop" | "reset"
    delay_ms: int = 0
    direction: str = "both"  # delay only: "both" | "up" (to upstream) | "down" (to client)


PASS = Mode("pass")
DROP = Mode("drop")
RESET = Mode("reset")


def delay(ms: int, direction: str = "both") -> Mode:
    assert direction in ("both", "up", "down"), direction
    return Mode("delay", ms, direction)


class FaultProxy:
    def __init__(self, upstream: tuple[str, int], *, max_life_s: float = 120.0) -> None:
        self.upstream = upstream
        self.mode = PASS
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = threading.Event()
        self._deadline = time.monotonic() + max_life_s
        self.connections = 0
        threading.Thread(target=self._accept, name="fault-proxy", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_mode(self, mode: Mode) -> None:
        self.mode = mode
        if mode.name == "reset":
            with self._lock:
                sockets, self._sockets = self._sockets, []
            for sock in sockets:
                _reset(sock)

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _alive(self) -> bool:
        if time.monotonic() > self._deadline:
            self._closed.set()
        return not self._closed.is_set()

    def _accept(self) -> None:
        while self._alive():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            self.connections += 1
            if self.mode.name == "reset":
                _reset(client)
                continue
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()
        self.close()

    def _connect(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.upstream, timeout=2.0)
        except OSError:
            _reset(client)
            return
        with self._lock:
            self._sockets += [client, server]
        for src, dst, direction in ((client, server, "up"), (server, client, "down")):
            threading.Thread(target=self._pump, args=(src, dst, direction), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        src.settimeout(0.2)
        while self._alive():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            mode = self.mode
            if mode.name == "drop":
                continue  # NOTE: black hole: the peer sees silence, not an error
            if mode.name == "delay" and mode.direction in ("both", direction):
                time.sleep(mode.delay_ms / 1000)
            try:
                dst.sendall(data)
            except OSError:
                break
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def _reset(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
