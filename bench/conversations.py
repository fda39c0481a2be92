"""S16's conversations: seeded synthetic chats of a system prompt and user messages of given
token lengths (by the served model's own tokenizer).

Every conversation starts with the same system prompt (as a chat product's do) and a first user
message of `first_tokens` ± `first_stdev` tokens, then follow-ups of `followup_tokens` ±
`followup_stdev`. The messages are plain sentences drawn, seeded, from grounded.py's bank, each
first message opening with its conversation's number, so that no two conversations share more
than the system prompt. The same spec and seed give the same messages, whatever the server: the
answers (the servers' own, carried into the next turn by the driver) are what differ.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.bench.grounded import SENTENCES

SYSTEM_PROMPT = (
    "You are a helpful assistant for a small town's newsroom. Answer the reader's questions "
    "about the local news briefly and plainly, and keep to the facts you are given."
)
QUESTIONS = (
    "What does this mean for the people who live here?",
    "Can you say more about that?",
    "Which of these matters most, and why?",
    "Summarise that in a few words.",
    "Is there anything else I should know?",
)

Encode = Callable[[str], list[int]]  # text -> token ids, without special tokens


@dataclass(frozen=True, slots=True)
class ConversationSpec:
    """The shape of S16's conversations; ValueError (naming the flag) where it cannot be
    built."""

    conversations: int
    turns: int
    first_tokens: int
    first_stdev: int
    followup_tokens: int
    followup_stdev: int
    output_tokens: int  # per turn, exactly (`ignore_eos`)
    seed: int = 0

    def __post_init__(self) -> None:
        for flag, value in (("--conversations", self.conversations), ("--turns", self.turns),
                            ("--first-message-tokens", self.first_tokens),
                            ("--followup-tokens", self.followup_tokens),
                            ("--output-tokens", self.output_tokens)):  # fmt: skip
            if value < 1:
                raise ValueError(f"{flag}: must be >= 1, got {value}")
        if min(self.first_stdev, self.followup_stdev) < 0:
            raise ValueError("--first-message-stdev, --followup-stdev: must be >= 0")

    def length(self, rng: random.Random, turn: int) -> int:
        """A user message's length in tokens for `turn` (0-based), within mean ± 2 stdev."""
        mean, stdev = (
            (self.first_tokens, self.first_stdev)
            if turn == 0
            else (self.followup_tokens, self.followup_stdev)
        )
        return min(mean + 2 * stdev, max(1, mean - 2 * stdev, round(rng.gauss(mean, stdev))))


def user_messages(spec: ConversationSpec, encode: Encode) -> list[list[str]]:
    """Per conversation, its `spec.turns` user messages, each `encode`-d to its drawn length
    (the message is cut on a token boundary and decoded back by the caller's tokenizer)."""
    out = []
    for conv in range(spec.conversations):
        rng = random.Random(spec.seed * 1_000_003 + conv)
        turns = []
        for turn in range(spec.turns):
            n = spec.length(rng, turn)
            head = f"Conversation {conv}. " if turn == 0 else f"{rng.choice(QUESTIONS)} "
            turns.append(_sized(head, n, rng, encode))
        out.append(turns)
    return out


def _sized(head: str, tokens: int, rng: random.Random, encode: Encode) -> str:
    """`head` and seeded sentences, as many words as keep the text at most `tokens` tokens long
    and within a word of it."""
    words = head.split()
    while len(encode(" ".join(words))) < tokens:
        words += rng.choice(SENTENCES).split()
    while len(words) > 1 and len(encode(" ".join(words))) > tokens:
        words.pop()
    return " ".join(words)
