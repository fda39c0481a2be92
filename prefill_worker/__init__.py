"""Prefill worker: `pagedserve.internal.v1.PrefillWorker` (built in the prefill-worker issue)."""
