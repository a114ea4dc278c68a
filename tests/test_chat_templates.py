"""Chat templates render exactly as transformers' reference renderer renders them (issue 20), on
every real template llama.cpp keeps as a test fixture (models/templates/*.jinja in the
llama-cpp-python source package, unpacked by tools/fetch_converter.sh).

Oracle: transformers.utils.chat_template_utils.render_jinja_template, given the same messages,
tools, template keyword arguments and BOS/EOS texts. Each template is rendered with several
conversations (a system message, several turns, tool definitions with a tool call and its result,
non-ASCII text, reasoning); where transformers refuses one (a template that raises, e.g. on a
role it does not know), sharpi must refuse it too, with its typed error.

Skips (never fails) without transformers or when the source package cannot be fetched.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import sharpi
from sharpi.models import default_model_path

chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")

from reference import hf_export

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Stadt"}},
                   "required": ["city"]}}}]

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello!"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    "multi_turn": [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Write a function."},
        {"role": "assistant", "content": "def f():\n    return 1"},
        {"role": "user", "content": "Now make it return 2."},
    ],
    "non_ascii": [
        {"role": "user", "content": "Größe? 你好, мир — ✓ 🚀"},
        {"role": "assistant", "content": "Très bien « ok »"},
        {"role": "user", "content": "Ünïcödé <tags> & \"quotes\""},
    ],
    "reasoning": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
        {"role": "user", "content": "3+3?"},
    ],
    "tools": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp\": 21}"},
        {"role": "user", "content": "Thanks"},
    ],
}


def _templates() -> list:
    try:
        root = hf_export.converter_dir() / "models" / "templates"
    except hf_export.ConverterUnavailable as error:
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"llama.cpp source unavailable: {error}"))]
    return sorted(root.glob("*.jinja"))


TEMPLATES = _templates()


@pytest.fixture(scope="module")
def tokenizer():
    return sharpi.Session(default_model_path(), threads=1, n_ctx=64).tokenizer


def test_every_fixture_template_is_there():
    assert len(TEMPLATES) >= 70, [str(t) for t in TEMPLATES]


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem if isinstance(p, Path) else "none")
def test_template_renders_as_transformers(tokenizer, path):
    source = path.read_text(encoding="utf-8")
    tok = tokenizer
    specials = {"bos_token": tok.id_to_token(tok.bos_id) if tok.bos_id is not None else "",
                "eos_token": tok.id_to_token(tok.eos_id) if tok.eos_id is not None else ""}
    rendered = 0
    for name, messages in CONVERSATIONS.items():
        tools = TOOLS if name == "tools" else None
        # Template keyword arguments: a thinking switch, and firefunction's `functions` and `datetime`.
        for kwargs in ({}, {"enable_thinking": False}, {"functions": "[]", "datetime": "2026-11-25"}):
            # transformers' tojson refuses the generator Jinja's map gives (llama.cpp's deepseek-r1
            # template: `tools | map(attribute='function') | tojson`); sharpi writes it as the list it
            # yields, which is transformers' rendering with `| list` added.
            listed = re.sub(r"(map\([^)]*\))\s*\|\s*tojson", r"\1 | list | tojson", source)
            try:
                want = chat_template_utils.render_jinja_template(
                    conversations=[messages], tools=tools, chat_template=listed, add_generation_prompt=True,
                    **specials, **kwargs)[0][0]
            except Exception as error:  # noqa: BLE001 - the template refuses: sharpi must refuse too
                with pytest.raises((sharpi.InvalidArgument, sharpi.FormatError)):
                    tok.apply_chat_template(messages, template=source, tools=tools, **kwargs)
                assert error is not None
                continue
            got = tok.apply_chat_template(messages, template=source, tools=tools, **kwargs)
            assert got == want, f"{path.stem}, {name}, {kwargs}"
            rendered += 1
    assert rendered > 0, f"{path.stem}: transformers rendered none of the conversations"


def test_llama4_template_renders_as_transformers(tokenizer):
    # Llama 4's chat template is not among llama.cpp's fixtures; transformers ships it with its
    # Llama 4 processor (the template Llama-4-Scout / Maverick's tokenizer_config.json carries).
    processing = pytest.importorskip("transformers.models.llama4.processing_llama4")
    source = processing.chat_template
    assert "<|header_start|>" in source and "<|eot|>" in source
    tok = tokenizer
    specials = {"bos_token": tok.id_to_token(tok.bos_id) if tok.bos_id is not None else "",
                "eos_token": tok.id_to_token(tok.eos_id) if tok.eos_id is not None else ""}
    for name, messages in CONVERSATIONS.items():
        tools = TOOLS if name == "tools" else None
        for kwargs in ({}, {"tools_in_user_message": False}, {"date_string": "25 Nov 2026"}):
            want = chat_template_utils.render_jinja_template(
                conversations=[messages], tools=tools, chat_template=source, add_generation_prompt=True,
                **specials, **kwargs)[0][0]
            got = tok.apply_chat_template(messages, template=source, tools=tools, **kwargs)
            assert got == want, f"llama4, {name}, {kwargs}"
