"""The real model through real processes (redis-server, router, prefill and decode workers started
by `pagedserve up`'s code), against transformers `generate()` on the same directory.

Requests are chat conversations (sharing a system prompt, so the prefix cache is exercised too)
sent as `messages`: the router renders them with the model's own chat template; transformers gets
`apply_chat_template`'s ids.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
import torch
from support.clusters import up_args
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedserve.client import Client
from pagedserve.launcher import start_cluster
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
NEAR_TIE = 0.25
"""bf16: a difference is accepted only where transformers' own top-2 logits are this close."""

SYSTEM = "You are a concise assistant for a bakery. Answer in one short sentence."
QUESTIONS = (
    "How long do croissants bake?", "What makes bread crust crisp?", "Why does dough rise?",
    "What flour is best for pizza?", "How do I store sourdough starter?", "What is a baguette?",
    "Can I freeze cookie dough?", "Why did my cake sink?", "What is proofing?",
    "How hot should the oven be for bread?", "What is laminated dough?", "Is rye bread healthy?",
    "How do I make brioche soft?", "What does butter do in pastry?", "Why rest pie dough?",
    "What is a levain?", "How much salt goes in bread?", "What is focaccia?",
)  # fmt: skip


CONVERSATIONS = [
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    for question in QUESTIONS
]


@pytest.fixture(scope="module")
def prompts(smollm2_dir) -> list[list[int]]:
    """What transformers makes of each conversation (the oracle's input); the cluster gets the
    messages themselves and renders them in the router."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    rendered = []
    for messages in CONVERSATIONS:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        rendered.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return rendered


@pytest.fixture(scope="module", autouse=True)
def two_torch_threads() -> Iterator[None]:
    """NOTE: the oracle runs once the cluster has stopped (`serve_concurrently`), so it has
    both cores: ~0.85 s a prompt against ~1.3 s on one thread (18 prompts, two tests). Were a
    cluster running beside it, OpenMP threads waiting for each other on the busy cores would
    slow transformers down tens of times."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def hf_greedy(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """(new token ids, per-step logits [steps, vocab] float32) of transformers, one prompt."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()


def all_at_once(run, n: int, timeout_s: float) -> None:
    """`run(i)` for i in range(n), each on its own thread, all started before any is joined."""
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)


def serve_concurrently(
    model_dir, dtype: str, tmp_path, http: dict | None = None
) -> dict[int, list]:
    """Start a cluster, send every conversation at once as a chat request (`messages`), return
    each stream's messages; stop it. With `http`, also ask `HTTP_QUESTIONS` through the
    OpenAI-compatible gateway (the `openai` client), streamed and not, into `http`."""
    args = up_args(
        model_dir, dtype=dtype, kv_cache_memory="48MiB", start_timeout=180.0,
        http_port=0 if http is not None else None,
    )  # fmt: skip
    cluster = start_cluster(args, tmp_path)
    results: dict[int, list] = {}
    try:

        def run(i: int) -> None:
            with Client(cluster.router_address) as client:
                results[i] = list(client.chat(CONVERSATIONS[i], GREEDY, timeout=300))

        all_at_once(run, len(CONVERSATIONS), timeout_s=330)
        if http is not None:
            http.update(ask_openai(cluster.http_url, Path(model_dir).name))
        with Client(cluster.router_address) as client:
            status = client.status()
    finally:
        cluster.stop()
    assert len(results) == len(CONVERSATIONS), "every stream must finish"
    assert sum(w.load.kv_blocks_total - w.load.kv_blocks_free - w.load.kv_blocks_cached
               for w in status.workers) == 0, "finished streams must hold no blocks"  # fmt: skip
    return results


HTTP_QUESTIONS = (0, 7, 12)


def ask_openai(url: str, model: str) -> dict[tuple[int, bool], tuple[str, int]]:
    """(text, completion tokens) of each of HTTP_QUESTIONS, not streamed and streamed."""
    answers = {}
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120) as c:
        for i in HTTP_QUESTIONS:
            kwargs = dict(model=model, messages=CONVERSATIONS[i], temperature=0,
                          max_tokens=NEW_TOKENS)  # fmt: skip
            whole = c.chat.completions.create(**kwargs)
            answers[i, False] = (whole.choices[0].message.content, whole.usage.completion_tokens)
            chunks = list(
                c.chat.completions.create(
                    **kwargs, stream=True, stream_options={"include_usage": True}
                )
            )
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            answers[i, True] = (text, chunks[-1].usage.completion_tokens)
    return answers


def tokens_of(parts) -> list[int]:
    return [t for p in parts for t in p.token_ids]


def test_fp32_concurrent_chat_requests_equal_transformers(smollm2_dir, prompts, tmp_path):
    http: dict = {}
    results = serve_concurrently(smollm2_dir, "float32", tmp_path, http=http)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    cached = 0
    for i, prompt in enumerate(prompts):
        want, _ = hf_greedy(model, prompt)
        parts = results[i]
        assert tokens_of(parts) == want, f"prompt {i}: {QUESTIONS[i]!r}"
        if i in HTTP_QUESTIONS:  # NOTE: the OpenAI API's answer is transformers' too
            text = tokenizer.decode(want, skip_special_tokens=True)
            assert http[i, False] == http[i, True] == (text, len(want)), QUESTIONS[i]
        last = parts[-1]
        # NOTE: the router's rendering of the messages is transformers' prompt, token for token
        assert last.usage.prompt_tokens == len(prompt)
        assert last.finish_reason in (
            common_pb2.FINISH_REASON_LENGTH,
            common_pb2.FINISH_REASON_STOP,
        )
        cached += last.usage.cached_prompt_tokens
    assert any(len(tokens_of(results[i])) == NEW_TOKENS for i in results)
    # NOTE: whether a request hits the shared system prompt depends on arrival order; that some
    # do is what a real chat workload shows.
    assert cached > 0, "the shared system prompt must be served from the prefix cache"


def test_bf16_first_tokens_equal_transformers_or_differ_at_a_near_tie(
    smollm2_dir, prompts, tmp_path
):
    results = serve_concurrently(smollm2_dir, "bfloat16", tmp_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).eval()
    margins = []
    for i, prompt in enumerate(prompts):
        want, logits = hf_greedy(model, prompt)
        got = tokens_of(results[i])
        step = next((s for s, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        if step is None:
            assert got == want[: len(got)] and len(got) == len(want), f"prompt {i}"
            continue
        top2 = logits[step].topk(2).values
        margin = float(top2[0] - logits[step][got[step]])
        margins.append((i, step, margin))
        assert margin <= NEAR_TIE, f"prompt {i} differs at step {step}: margin {margin:.3f}"
    print(
        f"bf16: {len(margins)} of {len(prompts)} prompts differ; (prompt, step, margin): {margins}"
    )


def test_48_requests_at_once_on_busy_workers_all_finish(smollm2_dir, tmp_path, monkeypatch):
    """The S1 shape (48 random prompts of 32-256 tokens, all at once) on the real model, with
    every worker answering its load polls later than the router's poll timeout (a busy host):
    slow is not dead, so no request fails, and each equals its undisturbed output."""
    from pagedserve.bench.workloads import make_workload
    from pagedserve.worker_load import TEST_LOAD_DELAY_ENV

    requests = make_workload("random", 48, 49_152, seed=480)
    params = [SamplingParams(temperature=0.0, max_tokens=min(r.output_len, 24), ignore_eos=True)
              for r in requests]  # fmt: skip
    monkeypatch.setenv(TEST_LOAD_DELAY_ENV, "0.8")  # NOTE: the poll timeout is 0.5 s
    args = up_args(smollm2_dir, dtype="float32", kv_cache_memory="96MiB", start_timeout=180.0)
    cluster = start_cluster(args, tmp_path)
    results: dict[int, list[int] | str] = {}
    try:

        def run(i: int) -> None:
            with Client(cluster.router_address) as client:
                try:
                    parts = client.generate(requests[i].prompt, params[i], timeout=600)
                    results[i] = tokens_of(parts)
                except grpc.RpcError as err:
                    results[i] = f"{err.code().name}: {err.details()}"

        all_at_once(run, len(requests), timeout_s=660)
        with Client(cluster.router_address) as client:
            alone = [tokens_of(client.generate(requests[i].prompt, params[i], timeout=300))
                     for i in (0, 17, 47)]  # fmt: skip
    finally:
        cluster.stop()
    failed = {i: r for i, r in results.items() if isinstance(r, str)}
    assert len(results) == 48 and not failed, failed
    assert all(len(results[i]) == params[i].max_tokens for i in range(48))
    assert [results[i] for i in (0, 17, 47)] == alone
