"""A small Python client of the public API (what `pagedserve generate --router` and
`pagedserve status` use; any gRPC language can do the same from the protos)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from pagedserve.protoconv import sampling_to_proto
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc


class Client:
    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        request_id: str = "",
        priority: int = 0,
        cache_salt: str = "",
        timeout: float | None = None,
    ) -> Iterator[generation_pb2.GenerateResponse]:
        """Stream the response messages (the iterator's `cancel()` aborts the request)."""
        request = generation_pb2.GenerateRequest(
            request_id=request_id,
            sampling=sampling_to_proto(params),
            priority=priority,
            cache_salt=cache_salt,
            stream=True,
        )
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        return self.stub.Generate(request, timeout=timeout)

    def status(self, timeout: float = 5.0) -> generation_pb2.ClusterStatus:
        return self.stub.GetClusterStatus(generation_pb2.GetClusterStatusRequest(), timeout=timeout)

    def model_info(self, timeout: float = 5.0) -> generation_pb2.ModelInfo:
        return self.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=timeout)

    def abort(self, request_id: str, timeout: float = 5.0) -> bool:
        request = common_pb2.AbortRequest(request_id=request_id)
        return self.stub.Abort(request, timeout=timeout).found


def format_status(status: generation_pb2.ClusterStatus) -> str:
    lines = [
        f"prefix cache hit rate {status.prefix_cache_hit_rate:.2f}"
        + ("   (index degraded: routing by load only)" if status.index_degraded else ""),
        f"{'worker':<24} {'role':<8} {'alive':<6} {'run':>4} {'wait':>5} {'kv used':>8} "
        f"{'free':>6} {'cached':>7}",
    ]
    for w in status.workers:
        role = common_pb2.WorkerRole.Name(w.role).removeprefix("WORKER_ROLE_").lower()
        load = w.load
        lines.append(
            f"{w.worker_id:<24} {role:<8} {str(w.alive).lower():<6} "
            f"{load.num_requests_running:>4} {load.num_requests_waiting:>5} "
            f"{load.kv_cache_usage:>8.1%} {load.kv_blocks_free:>6} {load.kv_blocks_cached:>7}"
        )
    return "\n".join(lines)
