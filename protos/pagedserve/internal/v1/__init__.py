"""Internal gRPC contracts of pagedserve: the worker APIs (prefill.proto, decode.proto) and the
messages only they use (worker.proto), in proto package `pagedserve.internal.v1`. They import the
public `pagedserve/v1/common.proto`. Not a public API: they change with pagedserve, and every
process of a cluster must run the same version (docs/protos.md).

The generated modules (`*_pb2.py`, `*_pb2_grpc.py`, `*_pb2.pyi`) are committed; regenerate them
with `make protos` (scripts/gen_protos.py). tests/test_protos.py fails when they are stale.
"""
