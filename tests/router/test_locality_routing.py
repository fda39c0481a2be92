"""`RoutingPolicy` and the decode workers' prefix-index entries: the decode cost counts the
prompt's leading blocks a decode worker already holds (`CostWeights.decode_overlap`), and a
decode worker holding more of the prompt than the prefill worker computes it itself
(conditional disaggregation by locality, `LocalPrefill.max_suffix_tokens`). The index is a real
`LocalPrefixIndex`; with Redis and a real decode worker: tests/decode_worker/test_decode_index.py,
end to end: tests/router/test_locality_e2e.py."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.kvstore.block_pool import BlockEvent, BlockEventKind, Tier
from pagedserve.kvstore.hashing import hash_blocks
from pagedserve.kvstore.prefix_index import LocalPrefixIndex, StaticLiveness
from pagedserve.router.routing import Decision, LocalPrefill, RoutingPolicy, WorkerSet
from pagedserve.worker_load import WorkerLoad

BLOCK = 16
PREFILL, BUSY, IDLE = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"  # ids of static workers
PROMPT = list(range(1, 8 * BLOCK + 10))  # 8 full blocks, then 9 tokens
HASHES = hash_blocks(PROMPT, BLOCK, model_fingerprint=b"f" * 16)


def route(
    held: dict[str, int],
    num_tokens: int | None = len(PROMPT),
    *,
    busy_usage: float = 0.1,
    local: LocalPrefill | None = None,
    accepts: bool = True,
    tiers: tuple[Tier, ...] = (Tier.DEV,),
) -> tuple[Decision, RoutingPolicy]:
    """Route PROMPT with `held[worker]` leading blocks of it published for each worker, block
    i in tier `tiers[i]` (the last one for the rest); the decode worker `BUSY` has
    `busy_usage` of its KV in use and 4 requests, `IDLE` none."""
    index = LocalPrefixIndex(liveness=StaticLiveness({w: "inc" for w in held}))
    for worker_id, n in held.items():
        stored = [
            BlockEvent(BlockEventKind.STORED, h, tiers[min(i, len(tiers) - 1)])
            for i, h in enumerate(HASHES[:n])
        ]
        index.publish(worker_id, stored, incarnation="inc")

    async def scenario() -> tuple[Decision, RoutingPolicy]:
        workers = WorkerSet([PREFILL], [BUSY, IDLE], None, max_message_bytes=1 << 20)
        try:
            by_id = {w.worker_id: w for w in workers.workers()}
            by_id[PREFILL].load = WorkerLoad()
            by_id[BUSY].load = WorkerLoad(
                num_requests_running=4, kv_cache_usage=busy_usage, accepts_prefill_here=accepts
            )
            by_id[IDLE].load = WorkerLoad(accepts_prefill_here=accepts)
            policy = RoutingPolicy(workers, index, block_size=BLOCK, local_prefill=local)
            return policy.choose(HASHES, num_tokens=num_tokens), policy
        finally:
            await workers.close()

    return asyncio.run(scenario())


def test_without_entries_the_less_loaded_decode_worker_wins() -> None:
    decision, _ = route({})
    assert decision.decode.worker_id == IDLE
    assert decision.terms["decode_cached_blocks"] == 0.0
    assert decision.terms["decode_overlap"] == 0.0


def test_a_decode_worker_holding_the_conversation_wins_over_a_less_loaded_one() -> None:
    decision, _ = route({BUSY: 8})
    assert decision.decode.worker_id == BUSY
    assert decision.terms["decode_cached_blocks"] == 8.0
    assert decision.terms["decode_overlap"] == pytest.approx(1.0)  # the whole prompt, weight 1
    assert decision.terms["decode_cost"] == pytest.approx(4 * 0.1 + 4 / 64 - 1.0)


def test_blocks_in_a_host_or_disk_tier_count_like_device_blocks() -> None:
    """A decode worker that moved the conversation's tail to its host and disk tiers still
    holds it for the router: the same decode overlap, and it computes the prompt itself."""
    on_device, _ = route({PREFILL: 2, BUSY: 8})
    tiered, _ = route({PREFILL: 2, BUSY: 8}, tiers=(Tier.DEV, Tier.DEV, Tier.HOST, Tier.DISK))
    assert tiered.decode.worker_id == on_device.decode.worker_id == BUSY
    assert tiered.terms["decode_cached_blocks"] == on_device.terms["decode_cached_blocks"] == 8.0
    assert tiered.prefill_here and on_device.prefill_here


def test_a_much_busier_decode_worker_loses_its_prefix() -> None:
    decision, _ = route({BUSY: 8}, busy_usage=0.9)  # 80 points more KV in use
    assert decision.decode.worker_id == IDLE


@pytest.mark.parametrize(
    ("held", "want"),
    [
        ({BUSY: 8, PREFILL: 2}, True),  # turn n+1: the decode worker has turn n's prompt+answer
        ({BUSY: 8}, True),  # the prefill worker holds nothing
        ({BUSY: 3, PREFILL: 3}, False),  # equal: a prefill worker is as good
        ({BUSY: 2, PREFILL: 3}, False),  # the prefill worker holds more
        ({}, False),
    ],
)
def test_locality_sends_the_prompt_to_the_decode_worker_that_holds_more(held, want) -> None:
    decision, policy = route(held)
    assert decision.prefill_here is want
    assert decision.terms["prefill_here_locality"] is want
    assert decision.terms["prefill_here"] is want
    assert policy.stats.prefill_here_locality == policy.stats.prefill_here == int(want)
    assert policy.stats.prefill_worker == int(not want)


def test_the_uncached_suffix_is_bounded() -> None:
    suffix = len(PROMPT) - 8 * BLOCK  # 9 tokens not cached at the decode worker
    assert route({BUSY: 8}, local=LocalPrefill(max_suffix_tokens=suffix))[0].prefill_here
    decision, policy = route({BUSY: 8}, local=LocalPrefill(max_suffix_tokens=suffix - 1))
    assert not decision.prefill_here and policy.stats.prefill_here_locality == 0
    assert not route({BUSY: 8}, local=LocalPrefill(max_suffix_tokens=0))[0].prefill_here


def test_never_for_several_samples_beams_or_a_decode_worker_that_does_not_accept_it() -> None:
    # NOTE: num_tokens None is what the router passes for n > 1, best_of and beam search
    decision, policy = route({BUSY: 8}, num_tokens=None)
    assert not decision.prefill_here and policy.stats.prefill_worker == 1
    assert decision.decode.worker_id == BUSY  # it still holds the blocks the import reuses
    assert not route({BUSY: 8}, accepts=False)[0].prefill_here


def test_the_short_prompt_rule_comes_first_and_is_not_counted_as_locality() -> None:
    decision, policy = route({BUSY: 8}, local=LocalPrefill(max_tokens=1024, queue_tokens=0))
    assert decision.prefill_here and not decision.terms["prefill_here_locality"]
    assert (policy.stats.prefill_here, policy.stats.prefill_here_locality) == (1, 0)


def test_the_suffix_bound_is_on_by_default_and_reaches_the_router_from_up() -> None:
    from pagedserve import launcher
    from pagedserve.cli import build_parser

    def router_bound(*argv: str) -> int:
        args = build_parser().parse_args(["up", "--model", "m", *argv])
        routed = build_parser().parse_args(
            ["router", "--model", "m", *launcher._router_flags(args, [])]
        )
        return routed.max_local_suffix_tokens

    assert router_bound() == LocalPrefill().max_suffix_tokens == 1024
    assert router_bound("--max-local-suffix-tokens", "0") == 0
    alone = build_parser().parse_args(["router", "--model", "m", "--prefill", "a:1"])
    assert alone.max_local_suffix_tokens == 1024
