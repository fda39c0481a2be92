"""The conversation every example client is asked: its command line, and the same request as
the Python client's messages (the tests compare the two answers)."""

from __future__ import annotations

CHAT_ARGS = ("Name a colour.", "--system", "You are brief.", "--max-tokens", "8")
CHAT_MESSAGES = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Name a colour."},
]
CHAT_MAX_TOKENS = 8
