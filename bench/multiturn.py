"""S16's load: multi-turn chats over one server's `/v1/chat/completions`, streamed, each turn
carrying the previous turns' real answers, reduced to one `ServerRun`.

One asyncio task per conversation (every conversation at once, so `conversations` streams); a
conversation's turns run one after another: turn n's request is the system prompt, every earlier
user message and the answer the server streamed back for it, then turn n's user message, so a
server that kept turn n-1's KV can reuse all of it. Every turn asks for exactly `output_tokens`
tokens (`max_tokens` with `ignore_eos`, which vLLM, llama.cpp and our gateway all take), greedy.
A conversation whose turn fails stops there: its later turns are counted as not sent.

The client is httpx's (an HTTP/1.1 client speaking the OpenAI streaming protocol: SSE lines of
`data: {chunk}` and a last usage chunk, `stream_options.include_usage`). guidellm 0.8.1 can
replay a conversation's real answers too (its synthetic data's `turns`), but its report keeps
neither the turn of a request nor every request, and S16's result is TTFT by turn.

Per turn: TTFT is the first chunk with content after the send; ITL is (last content chunk - first)
/ (completion tokens - 1); the server's usage gives prompt tokens (its chat template's included)
and, where it reports them (ours; vLLM with `--enable-prompt-tokens-details`), cached prompt
tokens. Output tok/s is every output token of the run over its wall time (first send to last
answer): a fixed workload, not a time-boxed level.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from pagedserve.bench.conversations import SYSTEM_PROMPT, ConversationSpec
from pagedserve.bench.online_load import quantile

CHAT = "/v1/chat/completions"


@dataclasses.dataclass(frozen=True, slots=True)
class TurnRecord:
    """One request: times in seconds (`sent_s`, `ended_s` from the run's start; `ttft_s`,
    `itl_s` from its send); token counts as the server reported them (None where it did not)."""

    conversation: int
    turn: int  # 1-based
    sent_s: float
    ended_s: float
    ttft_s: float | None
    itl_s: float | None
    completion_tokens: int
    prompt_tokens: int | None
    cached_tokens: int | None
    status: str  # "ok", or what failed
    carried_answers: int  # earlier answers in the request's messages
    answer: str


@dataclasses.dataclass(frozen=True, slots=True)
class ServerRun:
    """One server's S16 run. Latencies in ms, None where no turn of the kind completed; "later"
    is every turn after the first. `failure`: why nothing ran (counts are 0 then)."""

    server: str
    conversations: int
    turns: int
    wall_s: float
    output_tok_s: float
    completed: int
    errored: int
    not_sent: int  # turns of conversations that stopped at an error
    ttft_first_p50_ms: float | None
    ttft_first_p99_ms: float | None
    ttft_later_p50_ms: float | None
    ttft_later_p99_ms: float | None
    later_over_first: float | None  # TTFT p50 of turns >= 2 / of turn 1
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    ttft_p50_by_turn_ms: tuple[float | None, ...]
    prompt_tokens_by_turn: tuple[float | None, ...]  # mean, as the server counted them
    cached_share_later: float | None  # cached / prompt tokens of turns >= 2, where reported
    final_context_tokens: int  # every conversation's last prompt + answer, summed
    errors: tuple[str, ...] = ()
    failure: str = ""
    cpu_s: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not self.failure and self.errored == 0 and self.completed > 0


Progress = Callable[[str], None]


def drive(base_url: str, model: str, spec: ConversationSpec, users: Sequence[Sequence[str]],
          progress: Progress = print, timeout_s: float = 600.0) -> list[TurnRecord]:  # fmt: skip
    """Every conversation of `users` (its user messages, turn by turn) against `base_url` at
    once; a progress line each time every conversation is past a turn. Returns every sent
    turn's record."""
    return asyncio.run(_drive(base_url, model, spec, users, progress, timeout_s))


async def _drive(base_url: str, model: str, spec: ConversationSpec,
                 users: Sequence[Sequence[str]], progress: Progress,
                 timeout_s: float) -> list[TurnRecord]:  # fmt: skip
    import httpx  # NOTE: installed with the dev extras (openai's); only S16 needs it

    records: list[TurnRecord] = []
    past = Counter[int]()  # turn -> conversations past it (answered, failed or stopped)
    limits = httpx.Limits(max_connections=len(users), max_keepalive_connections=len(users))
    start = time.perf_counter()

    def turn_done(turn: int) -> None:
        past[turn] += 1
        if past[turn] == len(users):
            progress(_progress_line(turn, spec.turns, records))

    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        run = _Run(client, model, spec.output_tokens, start, records, turn_done)
        await asyncio.gather(*(_conversation(run, conv, msgs) for conv, msgs in enumerate(users)))
    return records


@dataclasses.dataclass(frozen=True, slots=True)
class _Run:
    """What every conversation of one run shares."""

    client: Any  # httpx.AsyncClient
    model: str
    max_tokens: int
    start: float  # perf_counter() at the run's start
    records: list[TurnRecord]
    turn_done: Callable[[int], None]


def _progress_line(turn: int, turns: int, records: list[TurnRecord]) -> str:
    done = [r for r in records if r.turn == turn]
    ok = [1e3 * r.ttft_s for r in done if r.status == "ok" and r.ttft_s is not None]
    p50 = quantile(ok, 0.5)
    ttft = f"TTFT p50 {p50:.0f} ms" if p50 is not None else "no TTFT"
    return (f"turn {turn}/{turns}: {len(ok)} answered, "
            f"{sum(r.status != 'ok' for r in done)} errored, {ttft}")  # fmt: skip


async def _conversation(run: _Run, conv: int, users: Sequence[str]) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    for turn, user in enumerate(users, 1):
        messages.append({"role": "user", "content": user})
        record = await _turn(run, messages, conv, turn)
        run.records.append(record)
        run.turn_done(turn)
        if record.status != "ok":
            for later in range(turn + 1, len(users) + 1):
                run.turn_done(later)
            return
        messages.append({"role": "assistant", "content": record.answer})


async def _turn(run: _Run, messages: list[dict[str, str]], conv: int, turn: int) -> TurnRecord:
    """One streamed chat completion; any failure (status, transport, no content) is its
    `status`, never an exception."""
    body = {"model": run.model, "messages": messages, "max_tokens": run.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    sent = time.perf_counter()
    times: list[float] = []
    parts: list[str] = []
    usage: dict[str, Any] = {}
    status = "ok"
    try:
        async with run.client.stream("POST", CHAT, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                status = f"HTTP {resp.status_code}: {text[:300]}"
            else:
                async for line in resp.aiter_lines():
                    _on_line(line, time.perf_counter() - sent, times, parts, usage)
    except Exception as err:  # NOTE: httpx's errors, a bad JSON line: the turn failed
        status = f"{type(err).__name__}: {err}"[:300]
    if status == "ok" and not times:
        status = "no content streamed"
    tokens = int(usage.get("completion_tokens") or len(times))
    details = usage.get("prompt_tokens_details") or {}
    itl = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 and times else None
    return TurnRecord(conv, turn, sent - run.start, time.perf_counter() - run.start,
                      times[0] if times else None, itl, tokens, usage.get("prompt_tokens"),
                      details.get("cached_tokens"), status, (len(messages) - 2) // 2,
                      "".join(parts))  # fmt: skip


def _on_line(line: str, now: float, times: list[float], parts: list[str],
             usage: dict[str, Any]) -> None:  # fmt: skip
    """One SSE line: content chunks' arrival times and text, and the usage. RuntimeError for
    an error event (a server that fails after its 200 says so in the stream)."""
    if not line.startswith("data: {"):
        return  # NOTE: blank separators, `data: [DONE]`
    chunk = json.loads(line[6:])
    if chunk.get("error"):
        raise RuntimeError(f"error event: {chunk['error']}"[:300])
    usage.update(chunk.get("usage") or {})
    for choice in chunk.get("choices") or ():
        content = (choice.get("delta") or {}).get("content")
        if content:
            times.append(now)
            parts.append(content)


def summarise(server: str, spec: ConversationSpec, records: Sequence[TurnRecord]) -> ServerRun:
    """The `ServerRun` of one server's records."""
    ok = [r for r in records if r.status == "ok"]

    def ttft(rs: Sequence[TurnRecord]) -> list[float]:
        return [1e3 * r.ttft_s for r in rs if r.ttft_s is not None]

    first, later = ttft([r for r in ok if r.turn == 1]), ttft([r for r in ok if r.turn > 1])
    itl = [1e3 * r.itl_s for r in ok if r.itl_s is not None]
    wall = max((r.ended_s for r in records), default=0.0) - min(
        (r.sent_s for r in records), default=0.0
    )
    f50, l50 = quantile(first, 0.5), quantile(later, 0.5)
    by_turn = range(1, spec.turns + 1)
    return ServerRun(
        server, spec.conversations, spec.turns, wall,
        sum(r.completion_tokens for r in ok) / wall if wall > 0 else 0.0,
        len(ok), len(records) - len(ok), spec.conversations * spec.turns - len(records),
        f50, quantile(first, 0.99), l50, quantile(later, 0.99),
        l50 / f50 if l50 is not None and f50 else None, quantile(itl, 0.5), quantile(itl, 0.99),
        tuple(quantile(ttft([r for r in ok if r.turn == t]), 0.5) for t in by_turn),
        tuple(_mean([r.prompt_tokens for r in ok if r.turn == t]) for t in by_turn),
        _cached_share([r for r in ok if r.turn > 1]), _final_context(ok),
        tuple(sorted({r.status for r in records} - {"ok"})[:5]),
    )  # fmt: skip


def _mean(values: Sequence[int | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _cached_share(rs: Sequence[TurnRecord]) -> float | None:
    """Cached ÷ prompt tokens over `rs`, None where the server reported no cached tokens."""
    reported = [r for r in rs if r.cached_tokens is not None and r.prompt_tokens]
    if not reported:
        return None
    return sum(r.cached_tokens or 0 for r in reported) / sum(r.prompt_tokens or 0 for r in reported)


def _final_context(ok: Sequence[TurnRecord]) -> int:
    """Every conversation's longest context: its last answered turn's prompt + answer."""
    last: dict[int, TurnRecord] = {}
    for r in ok:
        if r.conversation not in last or r.turn > last[r.conversation].turn:
            last[r.conversation] = r
    return sum((r.prompt_tokens or 0) + r.completion_tokens for r in last.values())


def failed(server: str, spec: ConversationSpec, why: str) -> ServerRun:
    """The `ServerRun` of a server that could not be driven (it did not start, say)."""
    n = spec.turns
    return ServerRun(server, spec.conversations, n, 0.0, 0.0, 0, 0, 0, None, None, None, None,
                     None, None, None, (None,) * n, (None,) * n, None, 0,
                     failure=why[:500])  # fmt: skip
