"""S14 samples (issue 19): one request with n = 8 against 8 separate requests of its prompt.

Each prompt (500 tokens, sampled at temperature 1, seeded, `ignore_eos`) is asked three ways:

    n=8             one request, SamplingParams(n=8, seed=s): the prompt computed once, its
                    blocks shared by the 8 samples (copy-on-write of the partial last block)
    separate        8 requests, seeds sample_seed(s, 0..7), prefix cache off: what a client
                    without `n` costs
    separate+cache  the same 8 requests, prefix cache on; the first of each prompt is prefilled
                    before the other 7 arrive (as in S5), so they hit its full blocks

The gate: sample i of the n = 8 request equals the single request seeded sample_seed(s, i),
token for token, in every mode and repetition (docs/samples.md, "Seeds"), and the 8 samples of a
prompt differ. `EnginePeer.run` adds greedy single-sample requests and reads sample 0 only, so
this scenario's peer (`SamplesPeer`, below) is the engine peer with its own `run`, in its own
process: `python -m pagedserve.bench.scenarios_samples samples --model DIR`.
"""

from __future__ import annotations

if __name__ == "__main__":
    # NOTE: as the engine peer: glibc's malloc settings pay only when applied before torch
    from pagedserve.host_memory import reuse_freed_memory

    reuse_freed_memory()

import dataclasses
import random
import sys
import time
from dataclasses import dataclass
from functools import partial

from pagedserve.bench.driver import Context, PeerProcess, Ratio
from pagedserve.bench.driver import ScenarioResult as Result
from pagedserve.bench.engine_peer import EnginePeer
from pagedserve.bench.scenarios import BLOCK, _blocks, _interleave, _ratio, _tok_s
from pagedserve.bench.workloads import FIRST_ID, BenchRequest
from pagedserve.decode_worker.engine import DecodeEngine
from pagedserve.decode_worker.plan import DecodePlan
from pagedserve.model.requests.sequence import Sequence
from pagedserve.sampling_params import SamplingParams, sample_seed

N = 8
PROMPT_LEN = 500  # NOTE: not a multiple of the block size: the partial last block is shared too
# NOTE: the peer starts with the prefix cache off (`--no-prefix-caching`); `engine` overrides it
MODES: dict[str, dict] = {
    "n=8": {"split": False},
    "separate": {"split": True},
    "separate+cache": {"split": True, "warm_first": True, "engine": {"prefix_caching": True}},
}


# -- the peer (its own process) -----------------------------------------------------------------


@dataclass(slots=True)
class StepMeter:
    """Peak device blocks and prompt tokens computed, read after every step."""

    peak_blocks: int = 0
    computed_prompt_tokens: int = 0
    steps: int = 0

    def observe(self, engine: DecodeEngine, plan: DecodePlan) -> None:
        self.steps += 1
        self.peak_blocks = max(self.peak_blocks, engine.pool.num_used)
        for item in plan.scheduled:
            # NOTE: after the step: `update` has advanced num_computed_tokens by the chunk
            #   | computed before | chunk (num_new_tokens) |
            #   0               start                  num_computed_tokens
            start = item.seq.num_computed_tokens - item.num_new_tokens
            end = min(item.seq.num_computed_tokens, item.seq.num_prompt_tokens)
            self.computed_prompt_tokens += max(0, end - start)


class SamplesPeer(EnginePeer):
    """The engine peer asked for `n` samples per prompt: once with `n`, or `n` times (`split`),
    request k seeded `seed + k`. Returns every sample's tokens keyed `"<request id>:<index>"`."""

    def run(self, requests: list[BenchRequest], options: dict) -> dict:
        engine = self._engine(options.get("engine", {}))
        engine.pool.reset_prefix_cache()
        preempted0 = engine.stats.num_preemptions
        n, split, meter = options["n"], options["split"], StepMeter()
        waves = _waves(requests, n, options["seed"], split)
        start = time.perf_counter()
        roots = [(key, engine.add_request(p, sp, request_id=key)) for key, p, sp in waves[0]]
        if options.get("warm_first"):
            while not all(seq.num_output_tokens for _, seq in roots):
                meter.observe(engine, engine.step().plan)
        roots += [(key, engine.add_request(p, sp, request_id=key)) for key, p, sp in waves[1]]
        while engine.has_unfinished:
            meter.observe(engine, engine.step().plan)
        duration = time.perf_counter() - start
        if engine.errors:
            raise RuntimeError(f"samples: requests failed: {dict(engine.errors)}")
        tokens = _tokens(roots, split)
        useful = sum(len(t) for t in tokens.values())
        return {
            "duration_s": duration, "useful_tokens": useful, "useful_tok_s": useful / duration,
            "peak_blocks": meter.peak_blocks, "steps": meter.steps,
            "prompt_tokens": sum(len(p) for _, p, _ in waves[0] + waves[1]),
            "computed_prompt_tokens": meter.computed_prompt_tokens,
            "preemptions": engine.stats.num_preemptions - preempted0, "tokens": tokens,
        }  # fmt: skip


Wave = list[tuple[str, list[int], SamplingParams]]


def _waves(requests: list[BenchRequest], n: int, seed: int, split: bool) -> tuple[Wave, Wave]:
    """(request id, prompt, params) of the engine requests: sample 0 of every prompt first (the
    one request of each when not `split`), then samples 1 .. n-1."""
    first: Wave = []
    rest: Wave = []
    for k, r in enumerate(requests):
        params = SamplingParams(
            temperature=1.0, seed=seed + k, max_tokens=r.output_len, ignore_eos=True
        )
        if not split:
            first.append((r.request_id, r.prompt, dataclasses.replace(params, n=n)))
            continue
        for i in range(n):
            sample = dataclasses.replace(params, seed=sample_seed(seed + k, i))
            (rest if i else first).append((f"{r.request_id}/{i}", r.prompt, sample))
    return first, rest


def _tokens(roots: list[tuple[str, Sequence]], split: bool) -> dict[str, list[int]]:
    out = {}
    for key, seq in roots:
        if split:
            rid, index = key.rsplit("/", 1)
            out[f"{rid}:{index}"] = list(seq.output_token_ids)
            continue
        if seq.group is None:
            raise RuntimeError(f"samples: {key} was not forked into samples")
        for member in seq.group.members:
            out[f"{key}:{member.sample_index}"] = list(member.output_token_ids)
    return out


# -- the scenario (the driver) ------------------------------------------------------------------


def samples(ctx: Context) -> Result:
    res = Result("S14 samples")
    count, new = ctx.n(2, 4), ctx.n(16, 64)
    sets = [_prompts(ctx, count, new, 1400 + rep) for rep in range(ctx.reps)]
    # NOTE: room for every separate request at once: a preemption would measure something else
    blocks = count * N * _blocks(PROMPT_LEN + new) + 64
    argv = [sys.executable, "-m", "pagedserve.bench.scenarios_samples", "samples",
            "--model", ctx.model, "--num-blocks", str(blocks), "--no-prefix-caching"]  # fmt: skip
    peer = PeerProcess("samples", argv, ctx.work)
    try:
        warm = [dataclasses.replace(sets[0][0], output_len=4)]
        for mode in ("n=8", "separate+cache"):  # NOTE: both engine variants, before timing
            peer.run(warm, n=N, seed=1, **MODES[mode])
        outs = _interleave(ctx, res, {
            mode: partial(_run, peer, sets, options) for mode, options in MODES.items()
        })  # fmt: skip
    finally:
        peer.close()
    res.gate = _gate(outs, new)
    _ratios(res, outs, count, new)
    res.notes += _notes(outs, count, new)
    return res


def _prompts(ctx: Context, count: int, new: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(FIRST_ID, ctx.vocab) for _ in range(PROMPT_LEN)] for _ in range(count)
    ]
    return [BenchRequest(f"n{seed}-{k}", p, new) for k, p in enumerate(prompts)]


def _run(peer: PeerProcess, sets: list[list[BenchRequest]], options: dict, rep: int) -> dict:
    return peer.run(sets[rep], n=N, seed=7000 + 100 * rep, **options)


def _gate(outs: dict[str, list[dict]], new: int) -> dict:
    """Every mode's tokens equal the n = 8 request's, sample by sample; the samples differ."""
    mismatches, same, checked = [], [], 0
    for rep, reference in enumerate(o["tokens"] for o in outs["n=8"]):
        for mode in ("separate", "separate+cache"):
            other = outs[mode][rep]["tokens"]
            mismatches += [
                f"rep {rep} {mode} {k}" for k in reference if other.get(k) != reference[k]
            ]
            checked += len(reference)
        mismatches += [f"rep {rep} n=8 {k}: {len(t)} tokens" for k, t in reference.items()
                       if len(t) != new]  # fmt: skip
        prompts = {k.rsplit(":", 1)[0] for k in reference}
        same += [p for p in prompts if len({tuple(reference[f"{p}:{i}"]) for i in range(N)}) < N]
    passed = not mismatches and not same and checked > 0
    return {"passed": passed, "checked": checked, "mismatches": mismatches[:20],
            "samples_not_distinct": same}  # fmt: skip


def _ratios(res: Result, outs: dict[str, list[dict]], count: int, new: int) -> None:
    expected = count * _n8_blocks(new)

    def peak(o: dict) -> float:
        return o["peak_blocks"]

    def computed(o: dict) -> float:
        return o["computed_prompt_tokens"]

    formula = (PROMPT_LEN + N * new) / (N * (PROMPT_LEN + new))
    res.ratios += [
        Ratio("S14", "peak KV blocks: n=8 / 8 separate", _ratio(outs, "n=8", "separate", peak),
              f"~ (P + 8 O) / (8 (P + O)) = {formula:.2f}", higher_is_better=False),
        Ratio("S14", "peak KV blocks n=8: measured / (prompt once + 8 x own)",
              [peak(o) / expected for o in outs["n=8"]], "<= 1.0", 1.0, higher_is_better=False),
        Ratio("S14", "useful tok/s: n=8 / 8 separate", _ratio(outs, "n=8", "separate", _tok_s),
              ">= 1.0", 1.0),
        Ratio("S14", "computed prompt tokens: n=8 / 8 separate",
              _ratio(outs, "n=8", "separate", computed), "1/8", 1 / N, higher_is_better=False),
        Ratio("S14", "peak KV blocks: n=8 / 8 separate + prefix cache",
              _ratio(outs, "n=8", "separate+cache", peak), higher_is_better=False),
        Ratio("S14", "useful tok/s: n=8 / 8 separate + prefix cache",
              _ratio(outs, "n=8", "separate+cache", _tok_s)),
        Ratio("S14", "computed prompt tokens: n=8 / 8 separate + prefix cache",
              _ratio(outs, "n=8", "separate+cache", computed), higher_is_better=False),
    ]  # fmt: skip


def _n8_blocks(new: int) -> int:
    """One prompt's peak with n = 8: its full blocks once, and per sample the blocks of the
    tokens it writes from the partial last block on (the last token is sampled, not written)."""
    full = PROMPT_LEN // BLOCK
    return full + N * (_blocks(PROMPT_LEN + new - 1) - full)


def _notes(outs: dict[str, list[dict]], count: int, new: int) -> list[str]:
    notes = [
        f"{count} prompts x {PROMPT_LEN} tokens, {N} samples x {new} tokens each, temperature "
        f"1, seeded, ignore_eos, block {BLOCK}; all at t = 0 except separate+cache, whose first "
        "request per prompt is prefilled before the other 7 arrive"
    ]
    for mode, runs in outs.items():
        notes.append(
            f"{mode}: peak blocks {[o['peak_blocks'] for o in runs]}, computed prompt tokens "
            f"{[o['computed_prompt_tokens'] for o in runs]} of {runs[0]['prompt_tokens']}, "
            f"tok/s {[round(o['useful_tok_s'], 1) for o in runs]}"
        )
        if any(o["preemptions"] for o in runs):
            notes.append(f"{mode}: preempted {[o['preemptions'] for o in runs]} times")
    return notes


if __name__ == "__main__":
    from pagedserve.bench import peers

    peers.PEERS["samples"] = SamplesPeer  # NOTE: peers.main speaks the driver's protocol
    raise SystemExit(peers.main())
