"""pagedserve: disaggregated LLM serving over gRPC with a paged KV cache."""

__version__ = "0.1.0"
