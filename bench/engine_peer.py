"""The pagedserve in-process peer: one `DecodeEngine` driven step by step (no gRPC).

Requests join when their `arrival` is due (all at once for offline runs). After every step it
records, for each live sequence, when new tokens appeared (TTFT/TPOT/ITL as a client would see
them), and the KV accounting the scenarios need::

    used slots      = sum over running sequences of num_computed_tokens   (KV actually held)
    allocated slots = device blocks in use x block_size
    time-weighted utilisation = sum(used x dt) / sum(allocated x dt) over steps
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field

from pagedserve.bench.metrics import RequestResult, peer_report, request_result
from pagedserve.bench.workloads import BenchRequest
from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.decode_worker.plan import KVPolicy, PreemptionMode, SchedulingPolicy
from pagedserve.kvstore.eviction import EvictionPolicy
from pagedserve.model.requests.sequence import Sequence
from pagedserve.sampling_params import SamplingParams


@dataclass(slots=True)
class KVTrack:
    used_dt: float = 0.0
    alloc_dt: float = 0.0
    used_steps: int = 0
    alloc_steps: int = 0
    peak_blocks: int = 0
    max_running: int = 0
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, used, allocated)

    def observe(self, t: float, dt: float, used: int, allocated: int, running: int) -> None:
        self.used_dt += used * dt
        self.alloc_dt += allocated * dt
        self.used_steps += used
        self.alloc_steps += allocated
        self.max_running = max(self.max_running, running)
        self.timeline.append((round(t, 4), used, allocated))

    def to_json(self) -> dict:
        return {
            "time_weighted_util": self.used_dt / max(self.alloc_dt, 1e-12),
            "step_weighted_util": self.used_steps / max(self.alloc_steps, 1),
            "peak_blocks": self.peak_blocks,
            "max_running": self.max_running,
            "timeline": self.timeline[:: max(1, len(self.timeline) // 400)],
        }


class EnginePeer:
    """Engine variants (a run's `engine` option overrides the flags) share this process: they
    are configurations of one peer, built once each and kept for later repetitions."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.engines: dict[str, DecodeEngine] = {}
        self.engine = self._engine({})

    def _engine(self, overrides: dict) -> DecodeEngine:
        key = json.dumps(overrides, sort_keys=True)
        if key not in self.engines:
            a = {**vars(self.args), **overrides}
            config = DecodeEngineConfig(
                block_size=a["block_size"],
                num_blocks=a["num_blocks"],
                max_num_batched_tokens=a["max_num_batched_tokens"],
                max_num_seqs=a["max_num_seqs"],
                enable_prefix_caching=a["prefix_caching"],
                eviction_policy=EvictionPolicy(a["eviction_policy"]),
                dtype=a["dtype"],
                num_swap_blocks=a["num_swap_blocks"],
                preemption_mode=PreemptionMode(a["preemption_mode"]),
                scheduling_policy=SchedulingPolicy(a["policy"]),
                kv_policy=KVPolicy(a["kv_policy"]),
            )
            self.engines[key] = DecodeEngine.from_model_dir(a["model"], config)
        return self.engines[key]

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()

    def _add(self, req: BenchRequest, now: float) -> Sequence:
        params = SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True)
        return self.engine.add_request(
            req.prompt, params, request_id=req.request_id, priority=req.priority
        )

    def run(self, requests: list[BenchRequest], options: dict) -> dict:
        self.engine = self._engine(options.get("engine", {}))
        self.engine.pool.reset_prefix_cache()
        self.done: list[Sequence] = []
        stats0 = _stats(self.engine)
        pending = sorted(requests, key=lambda r: r.arrival)
        results = {r.request_id: request_result(r) for r in requests}
        live: dict[str, Sequence] = {}
        track, steps = KVTrack(), list[tuple[float, int, int]]()
        start = time.perf_counter()
        if options.get("warm_first"):  # NOTE: S5: the first request's prefix is cached first
            first = pending.pop(0)
            live[first.request_id] = self._add(first, 0.0)
            results[first.request_id].sent = 0.0
            while not live[first.request_id].num_output_tokens:
                self._step(live, results, track, steps, start)
        while pending or self.engine.has_unfinished:
            now = time.perf_counter() - start
            while pending and pending[0].arrival <= now:
                req = pending.pop(0)
                live[req.request_id] = self._add(req, now)
                results[req.request_id].sent = now
            if not self.engine.has_unfinished:
                time.sleep(max(0.0, pending[0].arrival - now))
                continue
            self._step(live, results, track, steps, start)
        duration = time.perf_counter() - start
        prompt = sum(len(r.prompt) for r in requests)
        cached = sum(s.num_cached_prompt_tokens for s in self.done)
        return peer_report(
            list(results.values()),
            duration,
            kv=track.to_json(),
            steps=steps,
            prefix={"prompt_tokens": prompt, "cached_prompt_tokens": cached},
            sched=_delta(_stats(self.engine), stats0),
            errors=dict(self.engine.errors),
        )

    def _step(self, live, results, track: KVTrack, steps: list, start: float) -> None:
        t0 = time.perf_counter()
        out = self.engine.step()
        t1 = time.perf_counter()
        now = t1 - start
        for rid, seq in list(live.items()):
            res: RequestResult = results[rid]
            if seq.num_output_tokens > len(res.tokens):
                res.tokens = list(seq.output_token_ids)
                res.token_times.append(now)
            if seq.is_finished:
                self.done.append(live.pop(rid))  # NOTE: kept for the prefix-cache counters
        running = self.engine.scheduler.running
        used = sum(e.seq.num_computed_tokens for e in running)
        pool = self.engine.pool
        track.peak_blocks = max(track.peak_blocks, pool.num_used)
        track.observe(now, t1 - t0, used, pool.num_used * pool.block_size, len(running))
        plan = out.plan
        steps.append((round(t1 - t0, 6), plan.num_batched_tokens, len(plan.scheduled)))


def _stats(engine: DecodeEngine) -> dict:
    s = engine.stats
    out = {
        "preemptions_swap": s.num_preemptions_swap,
        "preemptions_recompute": s.num_preemptions_recompute,
        "swap_bytes": s.num_swap_in_bytes + s.num_swap_out_bytes,
        "swap_busy_s": 0.0,
    }
    if engine.swapper is not None:
        out["swap_busy_s"] = engine.swapper.stats.busy_seconds
    return out


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}
