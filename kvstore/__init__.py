"""Paged KV-cache bookkeeping: block pool, block tables, block hashing, KV page tensors."""
