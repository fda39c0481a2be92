"""The internal gRPC APIs of pagedserve (routers <-> prefill and decode workers); not public."""
