"""A real router (servicer, worker set, asyncio gRPC server on an ephemeral port, load poller)
inside the test process, on an event loop thread of its own, so a test can reach into its
servicer while clients call it over real gRPC."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from pagedserve.grpcutil import LoopThread, ServerHandle
from pagedserve.router.cli_args import add_arguments
from pagedserve.router.routing import WorkerSet
from pagedserve.router.server import RouterOptions, RunningRouter, start_router
from pagedserve.router.servicer import GenerationServicer
from pagedserve.v1 import generation_pb2_grpc


@dataclass
class InProcessRouter:
    running: RunningRouter
    loop: LoopThread
    channel: grpc.Channel

    @property
    def servicer(self) -> GenerationServicer:
        return self.running.servicer

    @property
    def worker_set(self) -> WorkerSet:
        return self.running.workers

    @property
    def handle(self) -> ServerHandle:
        return self.running.handle

    @property
    def stub(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(self.channel)

    def workers(self):
        return self.running.workers.workers()

    def refresh(self) -> None:
        """One load-poll round now (the poller also runs every `--load-poll-interval`)."""
        self.loop.run(self.running.refresh())


@contextmanager
def serve_router(args: argparse.Namespace, **server_options) -> Iterator[InProcessRouter]:
    """Start the router of `args` as `pagedserve router` would (on 127.0.0.1, an ephemeral port
    unless `args.port` says otherwise); stop everything on exit. `server_options`: `keys`,
    `tls` of `start_router`, or `max_message_bytes` overriding the flag."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args(["--model", args.model, "--port", "0"]))
    args = argparse.Namespace(**{**defaults, **vars(args), "host": "127.0.0.1"})
    if "max_message_bytes" in server_options:
        args.max_message_bytes = server_options.pop("max_message_bytes")
    loop = LoopThread("router-loop")
    running = loop.run(start_router(RouterOptions.from_args(args), **server_options))
    channel = grpc.insecure_channel(f"127.0.0.1:{running.handle.port}")
    try:
        yield InProcessRouter(running, loop, channel)
    finally:
        channel.close()
        loop.run(running.stop(None))
        loop.close()
