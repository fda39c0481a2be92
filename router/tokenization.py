"""`Tokenize` and `Detokenize`: the tokenizer and chat template behind the public API, with no
worker involved (the gateway's `/tokenize` and `/detokenize`, docs/gateway.md).

The edge of these two RPCs (as convert.py is Generate's): protobuf in, checked, protobuf out.
A chat is rendered exactly as Generate renders `messages` (router/chat.py, the router's
`--chat-template` or the model's), so `Tokenize` answers the prompt ids Generate would compute.
Unlike Generate, no max_model_len bound applies: counting a prompt that is too long is a use
of these RPCs. Bad input raises `InvalidArgument` naming the field.
"""

from __future__ import annotations

from pagedserve.errors import InvalidArgument
from pagedserve.router.convert import chat_messages
from pagedserve.router.tokenizer import ModelCard, RouterTokenizer
from pagedserve.v1 import generation_pb2

MAX_TEXT_CHARS = 1 << 20  # the same bound as a Generate text prompt
MAX_DETOKENIZE_IDS = 1 << 20


def tokenize(
    msg: generation_pb2.TokenizeRequest, tokenizer: RouterTokenizer
) -> generation_pb2.TokenizeResponse:
    """The ids (and with `return_token_strs` the vocabulary strings) of the text or chat."""
    if msg.WhichOneof("prompt") == "messages":
        text = _render(msg, tokenizer)
        add_special = msg.add_special_tokens if msg.HasField("add_special_tokens") else False
    else:
        text = msg.text
        if len(text) > MAX_TEXT_CHARS:
            raise InvalidArgument("text", f"must be <= {MAX_TEXT_CHARS} characters")
        add_special = msg.add_special_tokens if msg.HasField("add_special_tokens") else True
    ids = tokenizer.encode(text, add_special_tokens=add_special)
    strs = tokenizer.token_strings(ids) if msg.return_token_strs else []
    return generation_pb2.TokenizeResponse(token_ids=ids, token_strs=strs)


def detokenize(
    msg: generation_pb2.DetokenizeRequest, tokenizer: RouterTokenizer, card: ModelCard
) -> generation_pb2.DetokenizeResponse:
    """The text of the ids, special tokens written out."""
    ids = list(msg.token_ids)
    if len(ids) > MAX_DETOKENIZE_IDS:
        raise InvalidArgument("token_ids", f"at most {MAX_DETOKENIZE_IDS} ids, got {len(ids)}")
    for index, token_id in enumerate(ids):
        if token_id >= card.vocab_size:
            raise InvalidArgument(
                "token_ids",
                f"id {token_id} (at index {index}) is out of vocabulary (vocab_size "
                f"{card.vocab_size})",
            )
    return generation_pb2.DetokenizeResponse(text=tokenizer.decode(ids, skip_special_tokens=False))


def _render(msg: generation_pb2.TokenizeRequest, tokenizer: RouterTokenizer) -> str:
    """The conversation's prompt text (InvalidArgument naming `messages...` as Generate's)."""
    if not tokenizer.chat.available:
        raise InvalidArgument("messages", tokenizer.chat.unavailable_reason)
    messages = chat_messages(msg.messages)
    add_prompt = msg.add_generation_prompt if msg.HasField("add_generation_prompt") else True
    try:
        return tokenizer.chat.render(messages, add_generation_prompt=add_prompt)
    except InvalidArgument as exc:
        raise exc.with_prefix("messages") from None  # NOTE: the field's path, as Generate's
