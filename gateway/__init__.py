"""The OpenAI-compatible HTTP API (`pagedserve gateway`): FastAPI on asyncio, a client of the
public `pagedserve.v1.Generation` API of a router over `grpc.aio` (gateway.md: torch-free, never
a client of the workers)."""
