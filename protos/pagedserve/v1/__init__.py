"""gRPC contracts of pagedserve: the *.proto files here and the code generated from them.

The generated modules (`*_pb2.py`, `*_pb2_grpc.py`, `*_pb2.pyi`) are committed; regenerate them
with `make protos` (scripts/gen_protos.py). tests/test_protos.py fails when they are stale.
"""
