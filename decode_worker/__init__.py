"""Decode worker: `pagedserve.internal.v1.DecodeWorker` (built in the decode-worker issue)."""
