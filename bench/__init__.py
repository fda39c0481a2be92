"""Benchmarks: `pagedserve bench` (built in the benchmark issue)."""
