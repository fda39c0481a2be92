"""`RoutingPolicy`'s conditional disaggregation rule: a prompt goes to the decode worker only
when it is short, the chosen prefill worker has a queue, and the decode worker says it accepts
such requests (an older one would take token 0 as the first). End to end:
test_prefill_here_e2e.py."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.router.routing import LocalPrefill, RoutingPolicy, WorkerSet
from pagedserve.worker_load import WorkerLoad

BLOCK = 16
ON = LocalPrefill(max_tokens=512, queue_tokens=2048)


def decide(
    num_tokens: int | None,
    *,
    queued: int = 0,
    in_flight_tokens: int = 0,
    accepts: bool = True,
    local: LocalPrefill = ON,
) -> tuple[bool, RoutingPolicy]:
    async def scenario() -> tuple[bool, RoutingPolicy]:
        workers = WorkerSet(["127.0.0.1:1"], ["127.0.0.1:2"], None, max_message_bytes=1 << 20)
        try:
            prefill, decode = workers.workers()
            prefill.load = WorkerLoad(queued_prefill_tokens=queued)
            prefill.in_flight_tokens = in_flight_tokens
            decode.load = WorkerLoad(accepts_prefill_here=accepts)
            policy = RoutingPolicy(workers, None, block_size=BLOCK, local_prefill=local)
            decision = policy.choose([], num_tokens=num_tokens)
            assert decision.terms["prefill_here"] is decision.prefill_here
            return decision.prefill_here, policy
        finally:
            await workers.close()

    return asyncio.run(scenario())


@pytest.mark.parametrize(
    ("num_tokens", "queued", "in_flight", "accepts", "want"),
    [
        (512, 2048, 0, True, True),  # short, and the prefill worker has a queue
        (513, 2048, 0, True, False),  # too long: always a prefill worker
        (512, 2047, 0, True, False),  # the prefill worker is nearly idle
        (100, 0, 2048, True, True),  # a burst this router sent before the next load poll
        (100, 4096, 0, False, False),  # a decode worker that does not accept it
        (None, 4096, 0, True, False),  # several samples or beams: never
    ],
)
def test_the_rule(num_tokens, queued, in_flight, accepts, want) -> None:
    here, policy = decide(num_tokens, queued=queued, in_flight_tokens=in_flight, accepts=accepts)
    assert here is want
    assert (policy.stats.prefill_here, policy.stats.prefill_worker) == (want, not want)


def test_off_by_default_and_always() -> None:
    assert not decide(1, queued=10**6, local=LocalPrefill())[0]
    assert not decide(1, queued=10**6, local=LocalPrefill(max_tokens=0))[0]
    assert decide(1, queued=0, local=LocalPrefill(max_tokens=8, queue_tokens=0))[0]


def test_pagedserve_up_prefills_short_prompts_on_the_decode_worker_by_default():
    """On one host `up` turns the length rule on (the router's own default stays off); the
    flags reach the router's command line, and `--max-local-prefill-tokens 0` turns it off."""
    from pagedserve import launcher
    from pagedserve.cli import build_parser

    def router_rule(*argv: str) -> tuple[int, int]:
        args = build_parser().parse_args(["up", "--model", "m", *argv])
        flags = launcher._router_flags(args, [])
        routed = build_parser().parse_args(["router", "--model", "m", *flags])
        return routed.max_local_prefill_tokens, routed.local_prefill_queue_tokens

    assert router_rule() == (launcher.ONE_HOST_LOCAL_PREFILL_TOKENS, 0)
    assert router_rule("--max-local-prefill-tokens", "0") == (0, 0)
    assert router_rule("--local-prefill-queue-tokens", "2048") == (512, 2048)
    router_default = build_parser().parse_args(["router", "--model", "m", "--prefill", "a:1"])
    assert router_default.max_local_prefill_tokens == 0
