"""A real router (servicer, worker set, gRPC server on an ephemeral port) inside the test process,
so a test can reach into its servicer while clients call it over real gRPC."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from pagedserve.grpcutil import ServerHandle, build_server
from pagedserve.router.routing import WorkerSet
from pagedserve.router.server import build_servicer
from pagedserve.router.servicer import GenerationServicer
from pagedserve.v1 import generation_pb2_grpc


@dataclass
class InProcessRouter:
    servicer: GenerationServicer
    worker_set: WorkerSet
    handle: ServerHandle
    channel: grpc.Channel

    @property
    def stub(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(self.channel)


@contextmanager
def serve_router(args: argparse.Namespace, **server_options) -> Iterator[InProcessRouter]:
    """Build the router of `args` (as `pagedserve router` would), poll its workers once, serve
    it; stop everything on exit. `server_options` go to `build_server`."""
    servicer, worker_set = build_servicer(args)
    worker_set.refresh()
    handle = build_server(
        [lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, s)],
        ["pagedserve.v1.Generation"],
        **server_options,
    )
    handle.server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    try:
        yield InProcessRouter(servicer, worker_set, handle, channel)
    finally:
        channel.close()
        handle.server.stop(None).wait(5)
        worker_set.close()
