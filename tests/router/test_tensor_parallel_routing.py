"""`RoutingPolicy` pairs a prefill worker with a decode worker of the same
`--tensor-parallel-size` (each worker's `LoadReport.tensor_parallel_size`): KV moves only between
equal counts (docs/tensor_parallel.md). Without such a prefill worker the decode worker computes
the prompt itself rather than recompute it after a wasted prefill. The counts themselves come
from real workers: test_tp_cluster_e2e.py."""

from __future__ import annotations

import asyncio

from pagedserve.router.routing import RoutingPolicy, WorkerSet
from pagedserve.worker_load import WorkerLoad

BLOCK = 16


def route(
    prefill_sizes: list[int],
    decode_size: int,
    num_tokens: int | None = 100,
    *,
    queued: list[int] | None = None,
) -> tuple[str | None, RoutingPolicy]:
    """The prefill worker chosen (None: the decode worker computes the prompt) among workers of
    `prefill_sizes` ranks (0: a worker that did not say) for one decode worker of
    `decode_size`; the router's conditional disaggregation stays off."""

    async def scenario() -> tuple[str | None, RoutingPolicy]:
        addresses = [f"127.0.0.1:{10 + i}" for i in range(len(prefill_sizes))]
        workers = WorkerSet(addresses, ["127.0.0.1:2"], None, max_message_bytes=1 << 20)
        try:
            for worker, size, waiting in zip(
                workers.workers()[:-1], prefill_sizes, queued or [0] * len(prefill_sizes),
                strict=True,
            ):  # fmt: skip
                worker.load = WorkerLoad(tensor_parallel_size=size, queued_prefill_tokens=waiting)
            decode = workers.workers()[-1]
            decode.load = WorkerLoad(accepts_prefill_here=True, tensor_parallel_size=decode_size)
            policy = RoutingPolicy(workers, None, block_size=BLOCK)
            decision = policy.choose([], num_tokens=num_tokens)
            return (None if decision.prefill_here else decision.prefill.address), policy
        finally:
            await workers.close()

    return asyncio.run(scenario())


def test_the_prefill_worker_of_the_decode_workers_count_even_when_it_is_busier() -> None:
    chosen, policy = route([1, 2], 2, queued=[0, 4096])
    assert chosen == "127.0.0.1:11"
    assert (policy.stats.prefill_worker, policy.stats.tensor_parallel_mismatch) == (1, 0)


def test_no_prefill_worker_of_its_count_the_decode_worker_computes_the_prompt() -> None:
    chosen, policy = route([1, 1], 2, num_tokens=5000)  # NOTE: even a long prompt
    assert chosen is None
    assert (policy.stats.prefill_here, policy.stats.tensor_parallel_mismatch) == (1, 1)


def test_a_request_the_decode_worker_cannot_prefill_still_goes_to_a_prefill_worker() -> None:
    chosen, policy = route([1], 2, num_tokens=None)  # several samples or beams
    assert chosen == "127.0.0.1:10"  # the decode worker refuses its KV and recomputes
    assert policy.stats.tensor_parallel_mismatch == 0


def test_a_worker_that_did_not_report_its_count_is_paired_as_before() -> None:
    assert route([0], 2)[0] == "127.0.0.1:10"
    assert route([2], 0)[0] == "127.0.0.1:10"
    assert route([1, 0], 2, queued=[0, 4096])[0] == "127.0.0.1:11"
