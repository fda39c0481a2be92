"""`pagedserve.v1.DecodeWorker`: a thin servicer over `DecodeWorker` (DESIGN §3.2).

Errors are raised, not aborted: the server's interceptor maps them (pagedserve/errors.py). When
the call ends however it ends (client cancel, deadline, disconnect), the request is aborted and
its blocks are freed at once (a no-op if it already finished).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from pagedserve.decode_worker import convert
from pagedserve.decode_worker.worker import DecodeWorker
from pagedserve.model.sequence import FinishReason
from pagedserve.protoconv import load_to_proto
from pagedserve.telemetry import context_from
from pagedserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from pagedserve.worker_load import Role

POLL_S = 0.2  # how often a quiet stream checks that its client is still there


class DecodeServicer(decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker

    def Decode(self, request, context) -> Iterator[decode_pb2.DecodeResponse]:  # noqa: N802
        call = convert.decode_call(request)
        stream = self.worker.submit(call, context_from(context.invocation_metadata()))
        context.add_callback(lambda: self.worker.abort(call.request_id, stream))
        while True:
            delta = stream.get(POLL_S)
            if delta is None:
                if not context.is_active():
                    return
                continue
            yield convert.decode_response(call.request_id, delta)
            if delta.finish_reason is FinishReason.ERROR:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, delta.error or "decode failed")
            if delta.finish_reason is not None:
                return

    def Abort(self, request, context) -> common_pb2.AbortResponse:  # noqa: N802
        return common_pb2.AbortResponse(found=self.worker.abort(request.request_id))

    def GetLoad(self, request, context) -> common_pb2.LoadReport:  # noqa: N802
        return load_to_proto(self.worker.load(), self.worker.worker_id, Role.DECODE)
