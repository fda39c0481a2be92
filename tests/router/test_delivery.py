"""`router/delivery.py` against a gRPC server that has no `DecodeWorker.Deliver` (a decode
worker older than the router): the router asks once, then its Decode calls stream their own
responses until `RETRY_UNSUPPORTED_S` has passed. The delivery itself is tested end to end
(tests/router/test_cluster_e2e.py, tests/decode_worker/test_deliver.py, tests/faults)."""

from __future__ import annotations

import asyncio

import grpc

from pagedserve.router import delivery
from pagedserve.router.delivery import DeliverStream


class Calls(grpc.aio.ServerInterceptor):
    """The methods the server was called with."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    async def intercept_service(self, continuation, handler_call_details):
        self.methods.append(handler_call_details.method)
        return await continuation(handler_call_details)


def test_a_worker_without_deliver_is_asked_once_then_again_after_a_while(monkeypatch):
    async def scenario() -> list[str | None]:
        calls = Calls()
        server = grpc.aio.server(interceptors=[calls])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stream = DeliverStream(channel, "old-worker")
        try:
            ids = [await stream.delivery_id(), await stream.delivery_id()]
            assert calls.methods == ["/pagedserve.internal.v1.DecodeWorker/Deliver"]
            monkeypatch.setattr(delivery, "RETRY_UNSUPPORTED_S", 0.0)
            ids += [await stream.delivery_id(), await stream.delivery_id()]
            assert len(calls.methods) == 3  # NOTE: asked again each time the wait is over
            return ids
        finally:
            await stream.close()
            await channel.close()
            await server.stop(None)

    assert asyncio.run(scenario()) == [None, None, None, None]
