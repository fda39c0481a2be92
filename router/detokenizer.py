"""Incremental detokenization that never emits broken UTF-8, with stop-string matching.

Each new token is decoded within a small window of the tokens before it, not the whole output:

    tokens: | ... | prefix_offset ... read_offset | new tokens |
                    '--- prefix_text ---'
                    '-------------- new_text -----------------'
    delta = new_text[len(prefix_text):]   (held back while it ends in U+FFFD: an incomplete
                                           multi-byte character waits for its next byte)

Stop strings: the text of the last `max(len(stop)) - 1` characters is held back until more
text arrives, so a stop string spanning tokens is never half-emitted; on a match the output is
cut right before the stop string (which is reported as `matched_stop`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.router.tokenizer import RouterTokenizer

_REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class Detokenizer:
    """Turns one request's generated token ids into text deltas. Not thread-safe."""

    tokenizer: RouterTokenizer
    skip_special_tokens: bool = True
    stop: Sequence[str] = ()
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # all decoded text so far, including the held-back tail
    emitted: int = 0  # characters of `text` already returned to the caller
    matched_stop: str | None = None
    _prefix_offset: int = 0
    _read_offset: int = 0
    _holdback: int = field(init=False)  # characters a stop string may still need

    def __post_init__(self) -> None:
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the text that is now safe to show (maybe empty).

        After a stop string matched, further tokens are ignored and "" is returned.
        """
        if self.matched_stop is not None:
            return ""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self._decode_step()
            if self._find_stop():
                break
        return self._take(final=self.matched_stop is not None)

    def flush(self) -> str:
        """At the end of the request: whatever is still held back (broken bytes included)."""
        if self.matched_stop is None and self._read_offset < len(self.token_ids):
            full = self._decode(self.token_ids[self._prefix_offset :])
            prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
            self.text += full[len(prefix) :]
            self._read_offset = len(self.token_ids)
            self._find_stop()
        return self._take(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_step(self) -> None:
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)

    def _find_stop(self) -> bool:
        if not self.stop:
            return False
        start = max(0, self.emitted - self._holdback)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        self.text = self.text[:index]
        self.matched_stop = stop
        return True

    def _take(self, *, final: bool) -> str:
        end = len(self.text) if final else max(self.emitted, len(self.text) - self._holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
