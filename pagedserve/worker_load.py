"""What every process knows about a worker besides its address: its `Role` and its `WorkerLoad`.

Torch-free and Redis-free: both workers build a `WorkerLoad`, the registry stores it as JSON in
``worker:{id}``, `GetLoad` sends it as a `LoadReport` (`pagedserve.protoconv`), and the router's
load view holds it.
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import asdict, dataclass, fields

TEST_LOAD_DELAY_ENV = "PAGEDSERVE_TEST_LOAD_DELAY_S"


def test_load_delay_s() -> float:
    """Seconds a worker holds back each `GetLoad` answer: 0 unless the fault tests set
    $PAGEDSERVE_TEST_LOAD_DELAY_S (a busy worker, made on purpose: slow is not dead)."""
    return float(os.environ.get(TEST_LOAD_DELAY_ENV, "0") or 0)


class Role(enum.Enum):
    """Role of a registered process (mirrors ``pagedserve.v1.WorkerRole``)."""

    ROUTER = "router"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's load at one instant: the fields of a ``LoadReport`` but the worker's identity.

    Fields a role does not have stay 0 (``num_requests_swapped`` on prefill,
    ``queued_prefill_tokens`` on decode).
    """

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_requests_swapped: int = 0
    queued_prefill_tokens: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    draining: bool = False
    reported_at_unix_ms: int = 0
    accepts_prefill_here: bool = False  # decode: takes requests no prefill worker ran
    tensor_parallel_size: int = 0  # the worker's ranks; 0: it did not say (older workers)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerLoad:
        """Parse ``to_json`` output; unknown keys (from a newer writer) are ignored."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"load: expected a JSON object, got {text!r}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
