"""`sharpi serve` for agents, with the official `openai` client and the shipped model (ChatML
fallback, so the Hermes tool syntax): forced tool calls, structured output, the tool round trip,
and 400s naming each parameter sharpi refuses.

Oracles: jsonschema validates json_schema replies; a forced call's arguments validate against the
tool's parameters schema; the shipped model writes Python, never a call or JSON, unless the
constrained decoder makes it.
"""

from __future__ import annotations

import json

import openai
import pytest
from test_serve import MODEL_ID, client, start_server

jsonschema = pytest.importorskip("jsonschema")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "properties": {"cmd": {"type": "string", "maxLength": 10}}, "required": ["cmd"]}}}]
MESSAGES = [{"role": "user", "content": "Weather in Bern for 2 days?"}]


@pytest.fixture(scope="module")
def server():
    yield from start_server()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "run"}}])
def test_forced_tool_call(server, choice):
    for seed in (1, 2):
        r = client(server).chat.completions.create(model=MODEL_ID, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                                   parallel_tool_calls=False, max_tokens=300, seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        (call,) = c.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        if isinstance(choice, dict):
            assert call.function.name == "run"
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)


def reassemble(chunks: list) -> tuple[str, list, list]:
    """(content, calls as (id, name, arguments text), finish reasons) of a streamed chat reply,
    put together as OpenAI's streaming guide says: a call's first delta carries its index, id,
    type and name with empty arguments, later ones under the same index only argument fragments."""
    content, calls, finishes = "", {}, []
    for ch in chunks:
        for c in ch.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.type == "function" and tc.function.name and tc.function.arguments == "", tc
                    calls[tc.index] = [tc.id, tc.function.name, ""]
                else:
                    assert tc.id is None and not tc.function.name, tc
                    calls[tc.index][2] += tc.function.arguments
            if c.finish_reason:
                finishes.append(c.finish_reason)
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in range(len(calls))], finishes


def test_streamed_forced_call_equals_the_whole_one(server):
    kw = {"model": MODEL_ID, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
          "parallel_tool_calls": False, "max_tokens": 300, "seed": 4, "temperature": 0.7}
    whole = client(server).chat.completions.create(**kw).choices[0]
    chunks = list(client(server).chat.completions.create(stream=True, **kw))
    content, calls, finishes = reassemble(chunks)
    assert finishes == ["tool_calls"] and not content.strip()
    assert len(calls) == 1 and calls[0][0].startswith("call_")
    # Token by token: the arguments arrive in more than one fragment.
    assert sum(1 for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])) > 2
    assert (calls[0][1], json.loads(calls[0][2])) == (
        whole.message.tool_calls[0].function.name, json.loads(whole.message.tool_calls[0].function.arguments))


def test_auto_lets_the_model_answer_in_text(server):
    r = client(server).chat.completions.create(model=MODEL_ID, messages=MESSAGES, tools=TOOLS, max_tokens=16,
                                               seed=1)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length") and not c.message.tool_calls and c.message.content


def test_tool_result_round_trip(server):
    r = client(server).chat.completions.create(model=MODEL_ID, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=300, seed=3)
    call = r.choices[0].message.tool_calls[0]
    history = [*MESSAGES, r.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    r2 = client(server).chat.completions.create(model=MODEL_ID, messages=history, tools=TOOLS, max_tokens=8, seed=1)
    assert r2.choices[0].message.content is not None
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_json_schema_response_format(server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["name", "n"], "additionalProperties": False}
    for seed in (1, 2, 3):
        r = client(server).chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, max_tokens=200, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_gbnf_grammar(server):
    r = client(server).chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=20, seed=1,
                                               extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert r.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("kwargs,param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"extra_body": {"grammar": "root ::= undefined"}}, "grammar"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools"),
])
def test_refused_combinations_name_the_parameter(server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=4, **kwargs)
    assert e.value.body["param"] == param, e.value.body


THINKING_TEMPLATE = (  # ChatML whose generation prompt opens a think block, as Qwen3's with thinking on
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "thinking.jinja"
    path.write_text(THINKING_TEMPLATE, encoding="utf-8")
    yield from start_server("--chat-template", str(path))


def test_reasoning_content_of_an_open_think_block(thinking_server):
    """The shipped model never writes </think>: everything it writes is reasoning, none of it content."""
    r = client(thinking_server).chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=12, seed=1)
    msg = r.choices[0].message.model_dump()
    assert msg["reasoning_content"] and not msg["content"], msg


def test_streamed_reasoning_content(thinking_server):
    kw = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 12, "seed": 1}
    whole = client(thinking_server).chat.completions.create(**kw).choices[0].message.model_dump()
    chunks = list(client(thinking_server).chat.completions.create(stream=True, **kw))
    deltas = [c.delta.model_dump() for ch in chunks for c in ch.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas).strip() == whole["reasoning_content"]
    assert not "".join(d.get("content") or "" for d in deltas)


def test_reasoning_format_none_keeps_it_in_the_content(tmp_path):
    path = tmp_path / "thinking.jinja"
    path.write_text(THINKING_TEMPLATE, encoding="utf-8")
    for port in start_server("--chat-template", str(path), "--reasoning-format", "none"):
        msg = client(port).chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=12,
                                                   seed=1).choices[0].message
        assert msg.content and not (msg.model_extra or {}).get("reasoning_content")
