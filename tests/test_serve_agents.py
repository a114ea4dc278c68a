"""`sharpi serve` for agents, with the official `openai` client and the shipped model (ChatML
fallback, so the Hermes tool syntax): forced tool calls, structured output, the tool round trip,
and 400s naming each parameter sharpi refuses.

Oracles: jsonschema validates json_schema replies; a forced call's arguments validate against the
tool's parameters schema; the shipped model writes Python, never a call or JSON, unless the
constrained decoder makes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import schema_suite
from reference import hf_export
from sharpi.tool_calls import detect_family
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


# The pinned JSON-Schema-Test-Suite cases (schema_suite.py) whose schemas name object properties,
# the shape structured output is most often asked for (test_suite_cases_name_properties checks it).
SUITE_CASES = [("properties.json", "object properties validation"), ("required.json", "required validation"),
               ("allOf.json", "allOf"), ("ref.json", "root pointer ref"),
               ("additionalProperties.json", "additionalProperties being false does not allow other properties")]


@pytest.fixture(scope="module")
def suite():
    return schema_suite.suite_dir()


def test_suite_cases_name_properties(suite):
    named = [key for key in schema_suite.PINNED
             if "properties" in json.dumps(schema_suite.pinned_case(suite, *key)["schema"])]
    assert named == SUITE_CASES


def strict_wrapper(schema) -> dict:
    """OpenAI's strict structured output wants an object at the root, every property required and
    no other allowed: the suite's schema (mostly no "type", so a bare number would meet it, and the
    shipped model then writes digits until max_tokens) becomes the value of the one property."""
    return {"type": "object", "properties": {"value": schema}, "required": ["value"], "additionalProperties": False}


@pytest.mark.parametrize("file,description", SUITE_CASES)
def test_suite_schema_response_format(server, suite, file, description):
    schema = schema_suite.pinned_case(suite, file, description)["schema"]
    wrapped = strict_wrapper(schema)
    for seed in (1, 2, 3):
        r = client(server).chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, max_tokens=200, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "suite", "schema": wrapped, "strict": True}})
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        reply = json.loads(r.choices[0].message.content)
        jsonschema.validate(reply, wrapped, format_checker=jsonschema.FormatChecker())
        jsonschema.validate(reply["value"], schema, format_checker=jsonschema.FormatChecker())


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


# ------------------------------------------------------------------ calls streamed token by token


def _template_file(tmp_path, name: str):
    try:
        source = (Path(hf_export.converter_dir()) / "models" / "templates" / f"{name}.jinja").read_text("utf-8")
    except hf_export.ConverterUnavailable as error:
        pytest.skip(f"llama.cpp source unavailable: {error}")
    path = tmp_path / f"{name}.jinja"
    path.write_text(source, encoding="utf-8")
    return path, source


# template -> its family; every family's forced call, streamed, must be the whole reply's call.
FAMILY_TEMPLATES = {"Qwen-Qwen3-0.6B": "hermes", "Qwen3-Coder": "qwen3_xml", "GLM-4.6": "glm45", "MiniMax-M2": "minimax_m2",
                    "deepseek-ai-DeepSeek-V3.1": "deepseek", "deepseek-ai-DeepSeek-V3.2": "deepseek_v32",
                    "deepseek-ai-DeepSeek-V4": "deepseek_v4", "NVIDIA-Nemotron-Nano-v2": "nemotron_v2",
                    "mistralai-Mistral-Nemo-Instruct-2407": "mistral", "openai-gpt-oss-120b": "harmony",
                    "meta-llama-Llama-3.1-8B-Instruct": "llama3"}


# Some templates print every tool's description.
DESCRIBED_TOOLS = [{"type": "function", "function": {"description": f"the {t['function']['name']} tool",
                                                     **t["function"]}} for t in TOOLS]


@pytest.mark.parametrize("name", sorted(FAMILY_TEMPLATES))
def test_streamed_calls_of_every_family_equal_the_whole_reply(tmp_path, name):
    path, source = _template_file(tmp_path, name)
    assert detect_family(source) == FAMILY_TEMPLATES[name]
    for port in start_server("--chat-template", str(path)):
        for seed in (5, 6):
            kw = {"model": MODEL_ID, "messages": MESSAGES, "tools": DESCRIBED_TOOLS, "tool_choice": "required",
                  "parallel_tool_calls": False, "max_tokens": 300, "seed": seed, "temperature": 0.7}
            whole = client(port).chat.completions.create(**kw).choices[0]
            chunks = list(client(port).chat.completions.create(stream=True, **kw))
            content, calls, finishes = reassemble(chunks)
            assert whole.finish_reason == "tool_calls" and finishes == ["tool_calls"], whole
            assert [(n, json.loads(a)) for _, n, a in calls] == [
                (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
            assert content.strip() == (whole.message.content or "")
            fragments = sum(1 for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])
                            if tc.function.arguments)
            # Llama 3's reply is a call only as a whole: its arguments come in one piece at the end.
            assert fragments == 1 if FAMILY_TEMPLATES[name] == "llama3" else fragments > 1


# Text, then a call: a grammar on a tools request ("auto") makes the shipped model write both.
TEXT_THEN_CALL = ('root ::= [a-z]{2,6} " " [a-z]{2,6} "\\n<tool_call>\\n{\\"name\\": \\"run\\", \\"arguments\\": '
                  '{\\"cmd\\": \\"" [a-z]{1,8} "\\"}}\\n</tool_call>"')


def test_text_before_a_call_streams_as_content(server):
    for seed in (1, 2, 3):
        kw = {"model": MODEL_ID, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 80, "seed": seed,
              "temperature": 0.9, "extra_body": {"grammar": TEXT_THEN_CALL}}
        whole = client(server).chat.completions.create(**kw).choices[0]
        chunks = list(client(server).chat.completions.create(stream=True, **kw))
        content, calls, finishes = reassemble(chunks)
        (call,) = whole.message.tool_calls
        words = whole.message.content.split(" ")
        assert len(words) == 2 and all(w.isalpha() and w.islower() for w in words), whole.message.content
        assert call.function.name == "run" and set(json.loads(call.function.arguments)) == {"cmd"}
        assert finishes == ["tool_calls"] and content.strip() == whole.message.content
        assert [(n, json.loads(a)) for _, n, a in calls] == [("run", json.loads(call.function.arguments))]
        # The content chunks all come before the call's first chunk.
        kinds = ["call" if c.delta.tool_calls else "text" for ch in chunks for c in ch.choices
                 if c.delta.tool_calls or c.delta.content]
        assert kinds == sorted(kinds, key=lambda k: k == "call") and kinds[0] == "text"


# ------------------------------------------------------------------ template variables


def test_reasoning_effort_and_chat_template_kwargs_reach_the_template(tmp_path):
    """reasoning_effort is gpt-oss's "Reasoning: X" system line, chat_template_kwargs
    enable_thinking false Qwen3's empty think block: each request's prompt is what the template
    renders with that variable (written out here), and its greedy reply is Session.generate's."""
    import sharpi
    from sharpi.models import default_model_path
    from test_serve import N_CTX, expected

    session = sharpi.Session(default_model_path(), threads=1, n_ctx=N_CTX)
    tok = session.tokenizer
    cases = []  # (template path, request extras, the text the prompt must hold, its ids)
    gpt_path, gpt = _template_file(tmp_path, "openai-gpt-oss-120b")
    for effort in ("low", "high"):
        prompt = tok.apply_chat_template(MESSAGES, template=gpt, add_generation_prompt=True, reasoning_effort=effort)
        assert f"Reasoning: {effort}\n" in prompt
        cases.append((gpt_path, {"reasoning_effort": effort}, prompt))
    qwen_path, qwen = _template_file(tmp_path, "Qwen-Qwen3-0.6B")
    for thinking in (True, False):
        prompt = tok.apply_chat_template(MESSAGES, template=qwen, add_generation_prompt=True, enable_thinking=thinking)
        assert prompt.endswith("<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n"))
        cases.append((qwen_path, {"chat_template_kwargs": {"enable_thinking": thinking}}, prompt))
    for path in (gpt_path, qwen_path):
        for port in start_server("--chat-template", str(path)):
            for _, extra, prompt in [c for c in cases if c[0] == path]:
                ids = tok.encode(prompt, special=True)
                want, n_gen = expected(session, ids, max_tokens=10, temperature=0.0)
                r = client(port).chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=10,
                                                         temperature=0, extra_body=extra)
                assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), n_gen), extra
                assert r.choices[0].message.content == want, extra
            for extra, param in [({"reasoning_effort": "extreme"}, "reasoning_effort"),
                                 ({"reasoning_effort": 2}, "reasoning_effort"),
                                 ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs"),
                                 ({"chat_template_kwargs": {"reasoning_effort": ["high"]}}, "chat_template_kwargs"),
                                 ({"chat_template_kwargs": [["enable_thinking", False]]}, "chat_template_kwargs")]:
                with pytest.raises(openai.BadRequestError) as e:
                    client(port).chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=2,
                                                         extra_body=extra)
                assert e.value.body["param"] == param, e.value.body
    session.close()


def test_a_forced_call_or_format_closes_an_open_think_block_first(thinking_server):
    # The prompt ends inside <think>: without closing it the call (or the JSON) would be reasoning,
    # never tool_calls or content. The constrained reply writes </think> first, then the part.
    c = client(thinking_server)
    r = c.chat.completions.create(model=MODEL_ID, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, max_tokens=300, seed=1)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert not choice.message.model_dump().get("reasoning_content")
    r = c.chat.completions.create(model=MODEL_ID, messages=MESSAGES, response_format={"type": "json_object"},
                                  max_tokens=200, seed=2)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(msg.content), dict), msg
    assert not msg.model_dump().get("reasoning_content")
