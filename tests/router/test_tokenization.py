"""The router's Tokenize and Detokenize (router/tokenization.py) and `--chat-template FILE`
(router/chat.py): a chat tokenizes to the ids Generate computes for it, ids detokenize back,
bad input is INVALID_ARGUMENT naming the field, and the flag's template renders every
conversation (or supplies one for a model without any), a bad file stopping the router at start.

The servicer is the one `pagedserve router` builds (`build_servicer`, no workers needed: these
RPCs reach none), called on an event loop without gRPC around it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from support.chat_templates import CHATML, model_with_template

from pagedserve import launcher
from pagedserve.cli import build_parser
from pagedserve.cli import main as cli_main
from pagedserve.errors import InvalidArgument
from pagedserve.router import convert
from pagedserve.router.chat import ChatMessage
from pagedserve.router.server import RouterOptions, build_servicer
from pagedserve.v1 import generation_pb2

# A template of our own: one line per turn, so its rendering is easy to assert exactly.
PLAIN = (
    "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
CONVERSATION = [("system", "Be brief."), ("user", "Name a colour.")]


@pytest.fixture(scope="module")
def models(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenization")
    return {
        "chatml": model_with_template(tiny_llama, root / "chatml", CHATML),
        "base": model_with_template(tiny_llama, root / "base", None),
    }


@pytest.fixture(scope="module")
def plain_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("template") / "plain.jinja"
    path.write_text(PLAIN)
    return path


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def servicer_of(model_dir: Path, *flags: str):
    options = RouterOptions.from_args(parse("router", "--model", str(model_dir), *flags))

    async def build():
        return build_servicer(options)[0]

    return asyncio.run(build())


def call(method, request):
    return asyncio.run(method(request, None))


def chat_request(kind, conversation=CONVERSATION, **fields):
    msg = kind(**fields)
    msg.messages.SetInParent()
    for role, content in conversation:
        msg.messages.messages.add(role=role, content=content)
    return msg


def field_of(method, request) -> str:
    with pytest.raises(InvalidArgument) as info:
        call(method, request)
    return info.value.field


def test_text_tokenizes_with_special_tokens_unless_asked_not_to(models):
    servicer = servicer_of(models["chatml"])
    tok = servicer.tokenizer
    text = "Hello world, héllo ✓"
    answer = call(servicer.Tokenize, generation_pb2.TokenizeRequest(text=text))
    assert list(answer.token_ids) == tok.encode(text, add_special_tokens=True)
    assert list(answer.token_strs) == []
    plain = generation_pb2.TokenizeRequest(text=text, add_special_tokens=False)
    assert list(call(servicer.Tokenize, plain).token_ids) == tok.encode(
        text, add_special_tokens=False
    )


def test_a_chat_tokenizes_to_the_prompt_ids_generate_computes(models):
    servicer = servicer_of(models["chatml"])
    for add_prompt in (True, False):
        tokenize = chat_request(generation_pb2.TokenizeRequest, add_generation_prompt=add_prompt)
        generate = chat_request(generation_pb2.GenerateRequest, add_generation_prompt=add_prompt)
        want = convert.router_request(generate, servicer.tokenizer, servicer.card).prompt_token_ids
        assert list(call(servicer.Tokenize, tokenize).token_ids) == want
    bare = chat_request(generation_pb2.TokenizeRequest)  # unset add_generation_prompt: true
    rendered = servicer.tokenizer.decode(list(call(servicer.Tokenize, bare).token_ids),
                                         skip_special_tokens=False)  # fmt: skip
    assert rendered.endswith("<|im_start|>assistant\n")


def test_token_strs_are_the_vocabulary_strings_and_detokenize_inverts(models):
    servicer = servicer_of(models["chatml"])
    request = generation_pb2.TokenizeRequest(
        text="Hello world", add_special_tokens=False, return_token_strs=True
    )
    answer = call(servicer.Tokenize, request)
    strs = list(answer.token_strs)
    assert len(strs) == len(answer.token_ids) > 1 and all(strs)
    vocab = servicer.tokenizer._tok.get_vocab()
    assert [vocab[s] for s in strs] == list(answer.token_ids)
    back = call(servicer.Detokenize, generation_pb2.DetokenizeRequest(token_ids=answer.token_ids))
    assert back.text == "Hello world"
    empty = call(servicer.Detokenize, generation_pb2.DetokenizeRequest())
    assert empty.text == ""


def test_detokenize_writes_special_tokens_out(models):
    servicer = servicer_of(models["chatml"])
    chat = call(servicer.Tokenize, chat_request(generation_pb2.TokenizeRequest))
    text = call(servicer.Detokenize, generation_pb2.DetokenizeRequest(token_ids=chat.token_ids))
    assert text.text == servicer.tokenizer.chat.render(
        [ChatMessage(r, c) for r, c in CONVERSATION], add_generation_prompt=True
    )


def test_bad_input_is_invalid_argument_naming_the_field(models):
    servicer = servicer_of(models["chatml"])
    vocab = servicer.card.vocab_size
    bad_ids = generation_pb2.DetokenizeRequest(token_ids=[1, vocab])
    with pytest.raises(InvalidArgument, match=f"id {vocab} \\(at index 1\\) is out of vocab"):
        call(servicer.Detokenize, bad_ids)
    assert field_of(servicer.Detokenize, bad_ids) == "token_ids"
    huge = generation_pb2.TokenizeRequest(text="a" * ((1 << 20) + 1))
    assert field_of(servicer.Tokenize, huge) == "text"
    robot = chat_request(generation_pb2.TokenizeRequest, [("robot", "beep")])
    assert field_of(servicer.Tokenize, robot) == "messages.messages[0].role"
    empty = chat_request(generation_pb2.TokenizeRequest, [])
    assert field_of(servicer.Tokenize, empty) == "messages.messages"
    no_template = chat_request(generation_pb2.TokenizeRequest)
    assert field_of(servicer_of(models["base"]).Tokenize, no_template) == "messages"


def test_chat_template_flag_overrides_the_models_template(models, plain_file):
    servicer = servicer_of(models["chatml"], "--chat-template", str(plain_file))
    want = "SYSTEM: Be brief.\nUSER: Name a colour.\nASSISTANT:"
    answer = call(servicer.Tokenize, chat_request(generation_pb2.TokenizeRequest))
    assert list(answer.token_ids) == servicer.tokenizer.encode(want, add_special_tokens=False)
    # ... and chat completions (Generate) render with it too
    generate = chat_request(generation_pb2.GenerateRequest)
    req = convert.router_request(generate, servicer.tokenizer, servicer.card)
    assert req.prompt_token_ids == list(answer.token_ids)


def test_chat_template_flag_gives_a_base_model_chat(models, plain_file):
    assert not servicer_of(models["base"]).tokenizer.chat.available
    servicer = servicer_of(models["base"], "--chat-template", str(plain_file))
    assert servicer.tokenizer.chat.available
    info = call(servicer.GetModelInfo, generation_pb2.GetModelInfoRequest())
    assert info.has_chat_template
    answer = call(servicer.Tokenize, chat_request(generation_pb2.TokenizeRequest))
    assert servicer.tokenizer.decode(list(answer.token_ids)).startswith("SYSTEM: Be brief.")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "No such file"),
        ("", "the file is empty"),
        ("{% for m in messages %}{{ m }}", "does not compile"),
        (b"\xff\xfe{{ x }}", "not UTF-8"),
    ],
    ids=["missing", "empty", "syntax", "binary"],
)
def test_a_bad_template_file_stops_the_router_and_up_at_start(
    models, tmp_path, capsys, content, message
):
    path = tmp_path / "template.jinja"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    model = str(models["chatml"])
    with pytest.raises(ValueError, match=f"--chat-template {path}: .*{message}"):
        RouterOptions.from_args(parse("router", "--model", model, "--chat-template", str(path)))
    assert cli_main(["router", "--model", model, "--chat-template", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"pagedserve router: error: --chat-template {path}" in err and message in err
    assert launcher.main(parse("up", "--model", model, "--chat-template", str(path))) == 2
    assert f"pagedserve up: error: --chat-template {path}" in capsys.readouterr().err


def test_up_passes_the_template_to_the_router_as_an_absolute_path(plain_file, monkeypatch):
    monkeypatch.chdir(plain_file.parent)
    args = parse("up", "--model", "m", "--chat-template", plain_file.name)
    flags = launcher._router_flags(args, [])
    assert flags[flags.index("--chat-template") + 1] == str(plain_file)
    assert "--chat-template" not in launcher._router_flags(parse("up", "--model", "m"), [])
    assert parse("router", "--model", "m", *flags).chat_template == str(plain_file)
