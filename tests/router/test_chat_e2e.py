"""Chat requests through real processes (redis-server, router, prefill and decode workers, as
`pagedserve up` starts them): the same tokens as the equivalent token_ids / text requests and as
transformers; bad conversations never reach a worker; the `pagedserve chat` client."""

from __future__ import annotations

import argparse
import contextlib
import queue
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from support.in_process_router import serve_router
from support.oracle import hf_greedy
from support.waits import wait_until
from transformers import AutoTokenizer

from pagedserve.client import Client
from pagedserve.router.tokenizer import RouterTokenizer
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2, generation_pb2

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
CONVERSATION = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
]


@pytest.fixture(scope="module")
def cluster(tiny_chat_model, clusters):
    """The shared cluster of the tiny model with a chat template (tests/examples use it too)."""
    return clusters.get(tiny_chat_model, http_port=0), tiny_chat_model


def router_args(model_dir, redis_url) -> argparse.Namespace:
    return argparse.Namespace(
        model=str(model_dir), served_model_name=None, revision="", dtype=None, block_size=16,
        redis_url=redis_url, prefill=[], decode=[], max_queued_requests=64,
        max_message_bytes=16 << 20,
    )  # fmt: skip


@pytest.fixture(scope="module")
def routers(cluster, tiny_llama):
    """Real routers in this process (to count their calls to workers), for the model with a
    template and for the same model without one."""
    started, model_dir = cluster
    with ExitStack() as stack:
        built = [
            stack.enter_context(serve_router(router_args(d, started.redis_url)))
            for d in (model_dir, tiny_llama)
        ]
        yield [(router.servicer, router.stub) for router in built]


def tokens_of(stream) -> tuple[list[int], list]:
    parts = list(stream)
    return [t for p in parts for t in p.token_ids], parts


def test_chat_gives_the_tokens_of_the_equivalent_token_ids_and_text_requests(cluster):
    started, model_dir = cluster
    hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    prompt_ids = list(hf.apply_chat_template(CONVERSATION, add_generation_prompt=True)["input_ids"])
    prompt_text = hf.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    with Client(started.router_address) as client:
        chat, parts = tokens_of(client.chat(CONVERSATION, GREEDY, timeout=60))
        by_ids, _ = tokens_of(client.generate(prompt_ids, GREEDY, timeout=60))
        request = generation_pb2.GenerateRequest(text=prompt_text, add_special_tokens=False)
        request.sampling.temperature, request.sampling.max_tokens = 0.0, GREEDY.max_tokens
        by_text, _ = tokens_of(client.stub.Generate(request, timeout=60))
        info = client.model_info()
    want, _ = hf_greedy(model_dir, torch.float32, tuple(prompt_ids))
    assert chat == by_ids == by_text == want[: len(chat)]
    assert (
        len(chat) == GREEDY.max_tokens or parts[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    )
    assert parts[-1].usage.prompt_tokens == len(prompt_ids)
    assert info.has_chat_template


def test_a_conversation_without_the_generation_prompt_is_prefilled_as_rendered(cluster):
    started, model_dir = cluster
    hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    prompt_ids = list(hf.apply_chat_template(CONVERSATION[:3])["input_ids"])
    with Client(started.router_address) as client:
        chat, parts = tokens_of(
            client.chat(CONVERSATION[:3], GREEDY, add_generation_prompt=False, timeout=60)
        )
        by_ids, _ = tokens_of(client.generate(prompt_ids, GREEDY, timeout=60))
    assert chat == by_ids
    assert parts[-1].usage.prompt_tokens == len(prompt_ids)


def field_of(err: grpc.RpcError) -> str:
    bad_request = error_details_pb2.BadRequest()
    rpc_status.from_call(err).details[0].Unpack(bad_request)
    return bad_request.field_violations[0].field


def chat_request(messages: list[tuple[str, str]]) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest()
    request.messages.SetInParent()
    for role, content in messages:
        request.messages.messages.add(role=role, content=content)
    return request


BAD = {
    "empty": (0, chat_request([]), "messages.messages"),
    "unknown role": (
        0,
        chat_request([("user", "hi"), ("wizard", "x")]),
        "messages.messages[1].role",
    ),
    "no template": (1, chat_request([("user", "hi")]), "messages"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_chat_input_is_invalid_argument_and_reaches_no_worker(routers, case):
    which, request, field = BAD[case]
    servicer, stub = routers[which]
    before = servicer.requests_to_workers
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(info.value) == field
    assert servicer.requests_to_workers == before
    good = chat_request([("user", "hi")])
    good.sampling.max_tokens = 2
    if which == 0:  # the cluster still serves chat
        assert list(stub.Generate(good, timeout=60))[-1].finish_reason
        assert servicer.requests_to_workers == before + 2


def test_model_info_says_whether_chat_works(routers):
    infos = [
        stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10) for _, stub in routers
    ]
    assert [i.has_chat_template for i in infos] == [True, False]


def test_generate_chat_does_one_turn(cluster):
    started, model_dir = cluster
    out = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "generate", "--router", started.router_address,
         "--chat", "Name a colour.", "--system", "You are brief.", "--max-tokens", "6"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    prompt = hf.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True)["input_ids"]
    with Client(started.router_address) as client:
        want, _ = tokens_of(client.generate(list(prompt), SamplingParams(0.0, max_tokens=6)))
    text = RouterTokenizer.from_model_dir(model_dir).decode(want)
    assert out.stdout.startswith(text)
    assert f"{len(prompt)} prompt tokens" in out.stdout


class Chat:
    """A `pagedserve chat` process with its stdout read on a thread."""

    def __init__(self, address: str, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.cli", "chat", "--router", address, *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            bufsize=1,
        )  # fmt: skip
        self.chunks: queue.Queue[str] = queue.Queue()
        self.seen = ""
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        while chunk := self.proc.stdout.read(1):
            self.chunks.put(chunk)

    def signals(self) -> str:
        """The chat process's ignored / blocked / caught signal masks (for a failure)."""
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text().splitlines()
        except OSError:
            return f"chat exited with {self.proc.poll()}"
        return " ".join(line for line in status if line.startswith(("SigIgn", "SigBlk", "SigCgt")))

    def say(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_for(self, predicate, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while not predicate(self.seen):
            assert time.monotonic() < deadline, f"{self.signals()}; output so far: {self.seen!r}"
            with contextlib.suppress(queue.Empty):
                self.seen += self.chunks.get(timeout=0.1)
        return self.seen


def blocks_in_use(client: Client) -> set[int]:
    return {w.load.kv_blocks_total - w.load.kv_blocks_free - w.load.kv_blocks_cached
            for w in client.status().workers}  # fmt: skip


def test_chat_keeps_history_and_ctrl_c_aborts_only_the_answer(cluster):
    started, _ = cluster
    # NOTE: the longest answer the tiny model's 2,048 positions allow, interrupted at its first
    # characters: a decode step of the tiny model is ~1 ms, so a shorter answer (or a later
    # interrupt) can end before the signal lands on a loaded machine
    chat = Chat(started.router_address, "--max-tokens", "1900", "--ignore-eos")
    try:
        chat.wait_for(lambda s: s.endswith("> "))
        chat.say("Tell me a long story.")
        chat.wait_for(lambda s: len(s) > 4)  # the answer streams
        chat.proc.send_signal(signal.SIGINT)
        chat.wait_for(lambda s: "[aborted: this turn is not kept]\n> " in s)
        with Client(started.router_address) as client:
            assert wait_until(lambda: blocks_in_use(client) == {0}, timeout_s=10)
        chat.say("/reset")
        chat.wait_for(lambda s: s.endswith("[history cleared]\n> "))
        chat.proc.stdin.close()
        assert chat.proc.wait(timeout=30) == 0
    finally:
        if chat.proc.poll() is None:
            chat.proc.kill()


def expected_turn(model_dir, address, messages, max_tokens) -> tuple[str, str]:
    """(answer text, what `pagedserve chat` prints for it), via a token_ids request."""
    hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    prompt = list(hf.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    with Client(address) as client:
        _, parts = tokens_of(client.generate(prompt, SamplingParams(0.0, max_tokens=max_tokens)))
    text = "".join(p.text for p in parts)
    cut = parts[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    return text, text + "\n" + ("[cut at max_tokens]\n" if cut else "")


def test_chat_sends_the_whole_history_each_turn(cluster):
    started, model_dir = cluster
    chat = Chat(started.router_address, "--max-tokens", "3", "--system", "You are brief.")
    try:
        chat.wait_for(lambda s: s.endswith("> "))
        chat.say("Name a colour.")
        chat.wait_for(lambda s: s.count("\n> ") == 1)
        chat.say("Another one?")
        chat.wait_for(lambda s: s.count("\n> ") == 2)
        chat.proc.stdin.close()
        assert chat.proc.wait(timeout=30) == 0
    finally:
        if chat.proc.poll() is None:
            chat.proc.kill()
    first, first_printed = expected_turn(model_dir, started.router_address, CONVERSATION[:2], 3)
    history = [*CONVERSATION[:2], {"role": "assistant", "content": first}, CONVERSATION[3]]
    _, second_printed = expected_turn(model_dir, started.router_address, history, 3)
    chat.wait_for(lambda s: s.endswith("\n"), timeout_s=5)  # the newline printed at exit
    assert chat.seen == "> " + first_printed + "> " + second_printed + "> \n"
