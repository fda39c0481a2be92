"""Decode worker: `pagedserve.v1.DecodeWorker` (built in the decode-worker issue)."""
