"""`pagedserve chat --router ADDR`: an interactive conversation with a running router.

The history is kept here and sent whole with every turn (`GenerateRequest.messages`; the router
renders the model's chat template). Answers stream as they are generated. Ctrl-C while an answer
streams cancels that request (the workers free its blocks at once) and drops the unanswered turn;
the conversation goes on. Ctrl-C at the prompt discards the line; Ctrl-D (end of input) or
`/exit` ends the session; `/reset` forgets the history (the system prompt stays).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TextIO

import grpc

from pagedserve.client import Client
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2, generation_pb2

PROMPT = "> "


@dataclass
class Conversation:
    """The turns so far; `system` (if any) always comes first."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self, question: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.turns, {"role": "user", "content": question}]

    def keep(self, question: str, answer: str) -> None:
        self.turns += [{"role": "user", "content": question}]
        self.turns += [{"role": "assistant", "content": answer}]


def take_ctrl_c() -> None:
    """Make Ctrl-C raise KeyboardInterrupt here whatever this process inherited: a parent that
    ignores or blocks SIGINT (a script's `trap '' INT`, nohup, a test runner) passes that on
    across exec, and Python then leaves SIGINT ignored. Call from the main thread."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)


def stream_answer(
    responses: Iterator[generation_pb2.GenerateResponse], out: TextIO
) -> tuple[str, generation_pb2.GenerateResponse | None]:
    """Print the text deltas as they come; the whole text and the last response."""
    text, last = [], None
    for last in responses:
        out.write(last.text)
        out.flush()
        text.append(last.text)
    return "".join(text), last


def run(
    client: Client,
    params: SamplingParams,
    *,
    system: str | None,
    read: Callable[[str], str] = input,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
) -> int:
    """The read-answer loop; returns the exit status (0 at end of input or /exit)."""
    conversation = Conversation(system)
    while True:
        try:
            question = read(PROMPT)
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write("\n")
            continue
        if question.strip() in ("/exit", "/quit"):
            return 0
        if question.strip() == "/reset":
            conversation.turns.clear()
            out.write("[history cleared]\n")
            continue
        if not question.strip():
            continue
        answer = _one_turn(client, params, conversation.messages(question), out, err)
        if answer is not None:
            conversation.keep(question, answer)


def _one_turn(client, params, messages, out: TextIO, err: TextIO) -> str | None:
    """Stream one answer; None when it was aborted or failed (the turn is not kept)."""
    call = client.chat(messages, params)
    try:
        answer, last = stream_answer(call, out)
    except KeyboardInterrupt:
        call.cancel()  # type: ignore[attr-defined]
        out.write("\n[aborted: this turn is not kept]\n")
        out.flush()
        return None
    except grpc.RpcError as exc:
        details = " ".join(str(exc.details() or "").split())  # type: ignore[attr-defined]
        out.write("\n")
        err.write(f"[{exc.code().name}: {details}; this turn is not kept]\n")  # type: ignore[attr-defined]
        err.flush()
        return None
    out.write("\n")
    if last is not None and last.finish_reason == common_pb2.FINISH_REASON_LENGTH:
        out.write("[cut at max_tokens]\n")
    out.flush()
    return answer
