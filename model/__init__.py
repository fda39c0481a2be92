"""Llama-family models over a paged KV cache, weight loading, model runner and sampler."""
