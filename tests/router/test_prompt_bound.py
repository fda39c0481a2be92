"""Bounded router work per request: a prompt that cannot fit max_model_len is refused from its
byte length, before tokenization; no prompt that fits is refused (the bound is a lower bound)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pagedserve.errors import InvalidArgument
from pagedserve.router import convert
from pagedserve.router.tokenizer import RouterTokenizer, max_token_bytes, read_model_card
from pagedserve.v1 import generation_pb2

SMOLLM2 = Path(__file__).resolve().parents[2] / ".cache" / "smollm2-135m-instruct"


class CountingTokenizer(RouterTokenizer):
    """The real tokenizer; records the length of every text it encodes."""

    encoded: list[int]

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.encoded.append(len(text))
        return super().encode(text, add_special_tokens=add_special_tokens)


def counting(model_dir: Path) -> CountingTokenizer:
    tok = CountingTokenizer(Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    tok.encoded = []
    return tok


def longest_token(tok: RouterTokenizer) -> str:
    """A text of one token that covers `max_token_bytes` bytes."""
    raw = tok._tok
    for token, _ in sorted(
        raw.get_vocab(with_added_tokens=False).items(), key=lambda t: -len(t[0])
    ):
        text = raw.decode([raw.token_to_id(token)])
        if (
            len(text.encode()) == tok.max_token_bytes
            and len(tok.encode(text, add_special_tokens=False)) == 1
        ):
            return text
    pytest.fail("no single-token text of the longest length: the bound cannot be shown tight")


def text_request(text: str) -> generation_pb2.GenerateRequest:
    msg = generation_pb2.GenerateRequest(text=text, add_special_tokens=False)
    msg.sampling.max_tokens = 1
    return msg


def test_an_oversized_prompt_is_refused_without_tokenizing_it(tiny_llama):
    tok = counting(tiny_llama)
    card = read_model_card(tiny_llama, max_model_len=64)
    text = "hello world " * 80_000  # 960k characters, under the 1 MiB cap
    started = time.perf_counter()
    with pytest.raises(InvalidArgument) as info:
        convert.router_request(text_request(text), tok, card)
    elapsed = time.perf_counter() - started
    assert info.value.field == "text" and "max_model_len 64" in str(info.value)
    assert tok.encoded == []  # never tokenized
    assert elapsed < 0.1, elapsed
    print(f"refused a {len(text)}-character prompt in {elapsed * 1e3:.1f} ms")


def test_a_prompt_at_the_limit_passes_and_one_token_more_is_refused_unencoded(tiny_llama):
    tok = counting(tiny_llama)
    card = read_model_card(tiny_llama, max_model_len=64)
    piece = longest_token(tok)
    n = card.max_model_len - 1
    at_limit = piece * n
    ids = tok.encode(at_limit, add_special_tokens=False)
    assert len(ids) <= n and tok.min_tokens(at_limit) == n  # the bound is tight here
    tok.encoded.clear()
    request = convert.router_request(text_request(at_limit), tok, card)
    assert request.prompt_token_ids == ids and tok.encoded == [len(at_limit)]
    tok.encoded.clear()
    with pytest.raises(InvalidArgument) as info:
        convert.router_request(text_request(at_limit + piece), tok, card)
    assert info.value.field == "text" and tok.encoded == []


def test_chat_messages_are_bounded_too(tiny_llama):
    from support.chat_templates import CHATML, model_with_template

    model_dir = model_with_template(tiny_llama, Path(tiny_llama).parent / "bound-chatml", CHATML)
    tok = RouterTokenizer.from_model_dir(model_dir)
    card = read_model_card(model_dir, max_model_len=64)
    msg = generation_pb2.GenerateRequest()
    msg.messages.messages.add(role="user", content="hello world " * 50_000)
    with pytest.raises(InvalidArgument) as info:
        convert.router_request(msg, tok, card)
    assert info.value.field == "messages"


def tokenizers_under_test(tiny_llama) -> list[Path]:
    return [tiny_llama, *([SMOLLM2] if (SMOLLM2 / "tokenizer.json").is_file() else [])]


def test_the_bound_never_exceeds_the_real_token_count(tiny_llama):
    rng = random.Random(17)
    alphabet = [" ", "  ", "\n", "\t", "#", "=", "a", "é", "日本", "🙂", "<s>", "</s>", "0", "."]
    for model_dir in tokenizers_under_test(tiny_llama):
        tok = RouterTokenizer.from_model_dir(model_dir)
        assert tok.max_token_bytes is not None, model_dir
        samples = [piece * 200 for piece in alphabet]
        samples += ["".join(rng.choices(alphabet, k=rng.randint(1, 400))) for _ in range(300)]
        for text in samples:
            for special in (False, True):
                assert tok.min_tokens(text) <= len(tok.encode(text, add_special_tokens=special))


def test_tokenizers_that_can_drop_input_give_no_bound():
    from tokenizers import models, normalizers, pre_tokenizers

    bert_like = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert max_token_bytes(bert_like) is None  # one [UNK] may stand for a whole word
    stripping = Tokenizer(models.BPE({"a": 0}, []))
    stripping.normalizer = normalizers.StripAccents()
    assert max_token_bytes(stripping) is None
    splitting = Tokenizer(models.BPE({"a": 0}, []))
    splitting.pre_tokenizer = pre_tokenizers.Whitespace()  # drops whitespace
    assert max_token_bytes(splitting) is None
    byte_level = Tokenizer(models.BPE({"ab": 0, "a": 1, "b": 2}, [("a", "b")]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert max_token_bytes(byte_level) == 2
