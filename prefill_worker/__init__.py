"""Prefill worker: `pagedserve.v1.PrefillWorker` (built in the prefill-worker issue)."""
