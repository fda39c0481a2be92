"""Tool calling through the OpenAI API: the official `openai` SDK and LangChain's `ChatOpenAI`
against a real `pagedserve up --http-port` cluster of the tiny chat model (the shared one of
tests/gateway/test_structured_e2e.py). Its weights are random: a forced call (`required`, a
named function) is the grammar's doing, and its arguments must validate against the schemas."""

from __future__ import annotations

import json
from typing import Literal

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "Weather now.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "clock", "description": "Time now.",
                                      "parameters": CLOCK}},
]  # fmt: skip
QUESTION = [{"role": "user", "content": "What is the weather in Oslo?"}]


def valid(call) -> bool:
    """Whether a call's arguments are an instance of its function's schema (by hand: no
    jsonschema package here)."""
    arguments = json.loads(call.function.arguments)
    if call.function.name == "weather":
        city = arguments["city"]
        return (set(arguments) == {"city", "unit"} and city[:1].isupper() and city[1:].islower()
                and arguments["unit"] in ("celsius", "fahrenheit"))  # fmt: skip
    return (
        call.function.name == "clock"
        and arguments == {"zone": arguments["zone"]}
        and (arguments["zone"] in ("UTC", "CET"))
    )


def test_a_required_tool_loop_returns_valid_calls_then_an_answer(client, model):
    # NOTE: one call: a random model under the array grammar may go on adding calls
    first = client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, tool_choice="required", temperature=0.0,
        parallel_tool_calls=False, max_tokens=96,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and all(valid(c) for c in calls), calls
    assert all(c.id.startswith("call_") for c in calls)
    # the results go back as tool messages; the model answers (tools offered, none forced)
    history = [*QUESTION, choice.message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "12 C, rain"} for c in calls]
    final = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8,
        temperature=0.0,
    )  # fmt: skip
    assert final.choices[0].message.tool_calls is None
    assert isinstance(final.choices[0].message.content, str) and final.choices[0].message.content
    # sampled: every one of several seeds gives one valid call
    for seed in range(4):
        single = client.chat.completions.create(
            model=model, messages=QUESTION, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=96,
        )  # fmt: skip
        [call] = single.choices[0].message.tool_calls
        assert valid(call), call


def test_streamed_tool_call_deltas_reassemble_to_the_same_calls(client, model):
    named = {"type": "function", "function": {"name": "weather"}}
    whole = client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, tool_choice=named, temperature=0.0,
        max_tokens=64,
    )  # fmt: skip
    [call] = whole.choices[0].message.tool_calls
    assert call.function.name == "weather" and valid(call)
    stream = client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, tool_choice=named, temperature=0.0,
        max_tokens=64, stream=True,
    )  # fmt: skip
    parts, reasons = {}, []
    for chunk in stream:
        for delta_call in chunk.choices[0].delta.tool_calls or ():
            entry = parts.setdefault(delta_call.index, {"name": "", "arguments": ""})
            entry["name"] += delta_call.function.name or ""
            entry["arguments"] += delta_call.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert parts == {0: {"name": "weather", "arguments": call.function.arguments}}
    assert reasons[-1] == "tool_calls"


def test_langchain_binds_tools_and_gets_structured_output(cluster, model):
    llm = ChatOpenAI(base_url=f"{cluster[0].http_url}/v1", api_key="none", model=model,
                     temperature=0.0, max_tokens=64, max_retries=0)  # fmt: skip

    @tool
    def clock(zone: Literal["UTC", "CET"]) -> str:
        """Time now in a zone."""
        return "12:00"

    bound = llm.bind_tools([clock], tool_choice="required", parallel_tool_calls=False)
    message = bound.invoke("What time is it?")
    assert [c["name"] for c in message.tool_calls][:1] == ["clock"], message
    assert message.tool_calls[0]["args"]["zone"] in ("UTC", "CET")

    class Pet(BaseModel):
        """A pet."""

        name: str = Field(pattern="^[a-z]{1,8}$")
        kind: Literal["cat", "dog"]

    for method in ("function_calling", "json_schema"):
        pet = llm.with_structured_output(Pet, method=method).invoke("Describe a pet.")
        assert isinstance(pet, Pet), method
