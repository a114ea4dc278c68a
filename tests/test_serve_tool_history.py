"""A conversation that carries tool calls and their results back to the model (the agent's round
trip) rendered the way `sharpi serve` renders it (openai_api's message checks, agents.plan,
prompt.fit_tool_calls, render_chat), through every template llama.cpp keeps as a test fixture (the
tool-call tests' real templates and llama.cpp's own deepseek-r1 among them): OpenAI's shapes (a calls-only turn with content null,
arguments as JSON text) must come out with the call's name, its arguments as the template writes
JSON (never a JSON string escaped inside JSON; in the content, as minja writes them, where the
template shows no calls) and the tool's result.

Oracle: the request's own strings, looked for in the rendered prompt after the user's turn.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sharpi
from sharpi.models import default_model_path
from sharpi.server import agents
from sharpi.server.openai_api import _chat_messages
from sharpi.server.prompt import fit_tool_calls, render_chat, tool_call_form
from test_tool_calls import REAL_TEMPLATES, _template_dir

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
USER = "What is the weather in Zürich?"
RESULT = "21 degrees, sunny"


@pytest.fixture(scope="module")
def tokenizer():
    return sharpi.Session(default_model_path(), threads=1, n_ctx=64).tokenizer


def served_prompt(tok, source: str, arguments) -> str:
    body = {"tools": TOOLS, "messages": [
        {"role": "user", "content": USER},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call00001", "content": RESULT}]}
    messages = _chat_messages(body)
    _, messages = agents.plan(body, tok, source, messages)
    return render_chat(tok, fit_tool_calls(tok, source, messages), source, tools=TOOLS)


# Fixture templates a tool round trip cannot render through, and why (each must still refuse with
# a clear error, never render silently wrong; a fix shows up here as a failure to update).
CANNOT_RENDER = {
    # Cohere's own tool shape ({name, description, parameter_definitions}), not OpenAI's.
    "CohereForAI-c4ai-command-r-plus-tool_use": "has no attribute 'description'",
    # Takes the tools as a `functions` variable that no OpenAI request sets.
    "fireworks-ai-llama-3-firefunction-v2": "'functions' is undefined",
    # No system role, and a template that cannot show tools gets the Hermes tool prompt as one.
    "google-gemma-2-2b-it": "System role not supported",
}


def _every_fixture_template() -> list:
    try:
        names = sorted(p.stem for p in Path(_template_dir()).glob("*.jinja"))
    except pytest.skip.Exception as e:  # llama.cpp's sources are not there: the real-template tests skip too
        return [pytest.param(None, marks=pytest.mark.skip(reason=str(e)))]
    assert set(REAL_TEMPLATES) | {"llama-cpp-deepseek-r1"} <= set(names)
    return names


@pytest.mark.parametrize("name", _every_fixture_template())
@pytest.mark.parametrize("arguments", [json.dumps({"city": "Zürich"}, ensure_ascii=False), {"city": "Zürich"}],
                         ids=["openai-string", "object"])
def test_tool_round_trip_renders(tokenizer, name, arguments):
    source = (Path(_template_dir()) / f"{name}.jinja").read_text(encoding="utf-8")
    if name in CANNOT_RENDER:
        with pytest.raises(sharpi.InvalidArgument, match=CANNOT_RENDER[name]):
            served_prompt(tokenizer, source, arguments)
        return
    if name in REAL_TEMPLATES:  # templates that write calls themselves: never the content fallback
        assert tool_call_form(tokenizer, source)[1] != "content"
    text = served_prompt(tokenizer, source, arguments)
    after = text[text.index(USER) + len(USER):]
    assert "get_weather" in after, after
    assert "Zürich" in after and '\\"Zürich' not in after, after
    assert RESULT in after, after


def test_probe_finds_each_templates_form(tokenizer):
    """What each template family needs, known from reading the templates: DeepSeek-R1-Distill
    concatenates the arguments and writes calls only for content None; Qwen3-Coder iterates them
    as a mapping; Qwen2.5 prints them with tojson; Qwen3 writes a string as it is; DeepSeek-V3.2's
    and V4's read a string with from_json (llama.cpp's Jinja filter, which transformers lacks)."""
    root = Path(_template_dir())

    def form(name):
        return tool_call_form(tokenizer, (root / f"{name}.jinja").read_text(encoding="utf-8"))

    assert form("deepseek-ai-DeepSeek-R1-Distill-Llama-8B") == (None, "string")
    assert form("Qwen3-Coder")[1] == "object"
    assert form("Qwen-Qwen2.5-7B-Instruct")[1] == "object"
    assert form("Qwen-Qwen3-0.6B")[1] == "string"
    assert form("deepseek-ai-DeepSeek-V3.2")[1] == form("deepseek-ai-DeepSeek-V4")[1] == "string"
    assert form("HuggingFaceTB-SmolLM3-3B") == ("", "content")  # expects the model's raw text


def test_calls_a_template_drops_go_into_the_content(tokenizer):
    source = (Path(_template_dir()) / "HuggingFaceTB-SmolLM3-3B.jinja").read_text(encoding="utf-8")
    messages = [{"role": "user", "content": USER},
                {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "call00001", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}]}]
    fitted = fit_tool_calls(tokenizer, source, messages)
    assert "tool_calls" not in fitted[1]
    assert json.loads(fitted[1]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Zürich"},
                                                                "id": "call00001"}], "content": "Checking."}


def test_tojson_takes_a_filters_generator(tokenizer):
    # `tools | map(attribute='function')` is a generator in Jinja; llama.cpp's deepseek-r1 template
    # hands it to tojson.
    template = "{{ tools | map(attribute='function') | tojson(indent=2) }}"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], template=template, tools=TOOLS)
    assert json.loads(text) == [TOOLS[0]["function"]]
