"""sharpi.tool_calls: the text each template family makes a model emit, parsed back into OpenAI calls.

Two oracles: hand-written replies in each family's syntax with the calls they hold written out by
hand; and, where llama.cpp's template fixtures are available (tools/fetch_converter.sh, as
test_chat_templates.py uses them), each real template rendering an assistant turn with known
tool_calls: what the template writes after its generation prompt is exactly what a model trained on
it emits, and parsing it must give those calls back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sharpi
from reference import hf_export
from sharpi import InvalidArgument
from sharpi.models import default_model_path
from sharpi.tool_calls import FAMILIES, ToolCallStream, detect_family, parse_tool_calls, tool_call_grammar


def calls_of(reply) -> list:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls]


HAND_WRITTEN = [
    # (family, reply text, content, calls)
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>',
     "", [("get_weather", {"city": "Zürich"})]),
    ("hermes", ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
               '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'),
     "Let me check.", [("a", {"x": 1}), ("b", {})]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": "{\\"x\\": [1, 2]}"}\n</tool_call>',  # arguments as a string
     "", [("a", {"x": [1, 2]})]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": 1}}', "", [("a", {"x": 1})]),  # cut at EOS
    # Brackets and quotes inside strings do not end the arguments (a streamed call's scan).
    ("hermes", '<tool_call>\n{"name": "w", "arguments": {"s": "a}\\"]{[\\\\", "n": [1, {"k": "}"}]}}\n</tool_call>',
     "", [("w", {"s": 'a}"]{[\\', "n": [1, {"k": "}"}]})]),
    ("qwen3_xml", ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
                  "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
     "", [("get_weather", {"city": "San Francisco", "days": 3})]),
    ("glm45", ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>San Francisco</arg_value>\n"
               "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"),
     "", [("get_weather", {"city": "San Francisco", "days": 3})]),
    # GLM-4.7's compact spelling, text before the calls, a JSON object value, a call without arguments.
    ("glm45", ('On it.\n<tool_call>search<arg_key>q</arg_key><arg_value>a < b</arg_value>'
               '<arg_key>opts</arg_key><arg_value>{"k": [1, "</arg_value>"]}</arg_value></tool_call>'
               "\n<tool_call>now\n</tool_call>"),
     "On it.", [("search", {"q": "a < b", "opts": {"k": [1, "</arg_value>"]}}), ("now", {})]),
    ("minimax_m2", ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">San Francisco'
                    '</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>'),
     "", [("get_weather", {"city": "San Francisco", "days": 3})]),
    # Two calls in one section, text before it, a JSON value holding the closing tag, no arguments.
    ("minimax_m2", ('On it.\n<minimax:tool_call>\n<invoke name="search">\n<parameter name="q">a < b</parameter>\n'
                    '<parameter name="opts">{"k": [1, "</parameter>"]}</parameter>\n</invoke>\n'
                    '<invoke name="now">\n</invoke>\n</minimax:tool_call>'),
     "On it.", [("search", {"q": "a < b", "opts": {"k": [1, "</parameter>"]}}), ("now", {})]),
    # DSML (DeepSeek-V3.2): string="true" keeps the text as it is (even "42"), string="false" is JSON
    # (an object holding the closing tag, a list, a boolean); text before the section; two invokes.
    ("deepseek_v32", ('On it.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="search">\n'
                      '<｜DSML｜parameter name="q" string="true">42</｜DSML｜parameter>\n'
                      '<｜DSML｜parameter name="opts" string="false">{"k": [1, "</｜DSML｜parameter>"]}</｜DSML｜parameter>\n'
                      '<｜DSML｜parameter name="n" string="false">-3.5</｜DSML｜parameter>\n'
                      '</｜DSML｜invoke>\n<｜DSML｜invoke name="toggle">\n'
                      '<｜DSML｜parameter name="on" string="false">true</｜DSML｜parameter>\n'
                      '<｜DSML｜parameter name="tags" string="false">["a", "b"]</｜DSML｜parameter>\n'
                      '</｜DSML｜invoke>\n</｜DSML｜function_calls>'),
     "On it.", [("search", {"q": "42", "opts": {"k": [1, "</｜DSML｜parameter>"]}, "n": -3.5}),
                ("toggle", {"on": True, "tags": ["a", "b"]})]),
    # V4's section name; a call without arguments (V4's template writes an empty line); a string
    # value over lines, with "<"; cut at EOS before the section's end.
    ("deepseek_v4", ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>\n'
                     '<｜DSML｜invoke name="write">\n<｜DSML｜parameter name="text" string="true">a < b\n'
                     '  {not json</｜DSML｜parameter>\n</｜DSML｜invoke>\n'),
     "", [("now", {}), ("write", {"text": "a < b\n  {not json"})]),
    ("deepseek", ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                 '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
                 '```json\n{"tz": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'),
     "", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ("deepseek", ("Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Oslo\"}"
                 "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),  # V3.1
     "Sure.", [("get_weather", {"city": "Oslo"})]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Rome"}}', "", [("get_weather", {"city": "Rome"})]),
    ("llama3", '<|python_tag|>{"name": "f", "parameters": {}}<|eom_id|>', "", [("f", {})]),
    ("mistral", ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}, "id": "abcdefghi"}, '
                '{"name": "g", "arguments": {"b": "x"}}]</s>'), "", [("f", {"a": 1}), ("g", {"b": "x"})]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{"b": [true]}', "", [("f", {"a": 1}), ("g", {"b": [True]})]),
    ("nemotron_v2", 'Sure.\n<TOOLCALL>[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": "x]"}}]</TOOLCALL>\n',
     "Sure.", [("f", {"a": 1}), ("g", {"b": "x]"})]),
    ("harmony", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Lima"}<|call|>',
     "", [("get_weather", {"city": "Lima"})]),
]


@pytest.mark.parametrize("family,text,content,calls", HAND_WRITTEN,
                         ids=[f"{f}-{i}" for i, (f, *_rest) in enumerate(HAND_WRITTEN)])
def test_hand_written_replies(family, text, content, calls):
    reply = parse_tool_calls(text, family)
    assert calls_of(reply) == calls
    assert reply.content == content
    ids = [c["id"] for c in reply.tool_calls]
    assert all(i.startswith("call_") and len(i) > 10 for i in ids) and len(set(ids)) == len(ids)
    assert all(c["type"] == "function" and isinstance(c["function"]["arguments"], str) for c in reply.tool_calls)


@pytest.mark.parametrize("family,text", [
    ("hermes", "def f():\n    return 1\n"),
    ("hermes", "<tool_call>\nnot json\n</tool_call> after"),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>broken<｜tool▁call▁end｜>"),
    ("llama3", "The answer is {not a call}."),
    ("llama3", '{"name": "f", "parameters": [1]}'),
    ("mistral", "[TOOL_CALLS] nonsense"),
    ("qwen3_xml", "<tool_call>\n<oops>\n</tool_call>"),
    ("glm45", "<tool_call>f\n<arg_key>x</arg_key>\nno value\n</tool_call>"),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="f">\n<parameter name="x">1</parameter>\n</minimax:tool_call>'),
    ("deepseek_v32", '<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜function_calls>'),  # unclosed invoke
    ("deepseek_v4", ('<｜DSML｜tool_calls>\n<｜DSML｜parameter name="x" string="true">1</｜DSML｜parameter>\n'
                     '</｜DSML｜tool_calls>')),  # a parameter outside any invoke
    ("nemotron_v2", "<TOOLCALL>[not json]</TOOLCALL>"),
    ("nemotron_v2", '<TOOLCALL>[{"name": "f", "arguments": 1}]</TOOLCALL>'),
    ("harmony", "<|channel|>final<|message|>Just text."),
])
def test_text_that_is_no_call_stays_content(family, text):
    reply = parse_tool_calls(text, family)
    assert reply.tool_calls == [] and reply.content == text


def test_qwen3_xml_reads_values_by_parameter_type():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "code": {"type": "string"}, "n": {"type": "integer"}, "opts": {"type": "object"}}}}}]
    text = ("<tool_call>\n<function=f>\n<parameter=code>\n42\n</parameter>\n<parameter=n>\n42\n</parameter>\n"
            '<parameter=opts>\n{"a": [1]}\n</parameter>\n</function>\n</tool_call>')
    assert calls_of(parse_tool_calls(text, "qwen3_xml", tools)) == [("f", {"code": "42", "n": 42, "opts": {"a": [1]}})]


def test_dsml_string_attribute_decides_how_a_value_is_read():
    """string="true"/"false" beats the parameter's type; a parameter without it is read by its type."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "code": {"type": "string"}, "n": {"type": "integer"}, "m": {"type": "integer"}}}}}]
    text = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n'
            '<｜DSML｜parameter name="code" string="false">7</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="n" string="true">7</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="m">7</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')
    for family in ("deepseek_v32", "deepseek_v4"):
        assert calls_of(parse_tool_calls(text, family, tools)) == [("f", {"code": 7, "n": "7", "m": 7})]


def test_unknown_family_and_bad_tools_are_typed_errors():
    with pytest.raises(InvalidArgument):
        parse_tool_calls("x", "nope")
    with pytest.raises(InvalidArgument):
        tool_call_grammar("hermes", [])
    with pytest.raises(InvalidArgument):
        tool_call_grammar("hermes", [{"type": "function", "function": {"description": "no name"}}])
    with pytest.raises(InvalidArgument):
        tool_call_grammar("hermes", [{"type": "function", "function": {"name": "f", "parameters": []}}])


def test_detect_family_without_template():
    assert detect_family(None) == "hermes" and detect_family("") == "hermes"
    assert set(FAMILIES) >= {"hermes", "qwen3_xml", "glm45", "minimax_m2", "deepseek", "deepseek_v32", "deepseek_v4",
                             "llama3", "mistral", "nemotron_v2", "harmony"}


# -- real templates ------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
CALLS = [("get_weather", {"city": "Zürich", "days": 2}), ("get_weather", {"city": "Bern", "days": 1})]

# template -> (family, arguments as the template wants them ("object" or "string": OpenAI's JSON
# text, which the DeepSeek-R1 templates print as they get it and the V3.2 / V4 ones read with
# from_json), parallel calls rendered)
REAL_TEMPLATES = {
    "Qwen-Qwen2.5-7B-Instruct": ("hermes", "object", True),
    "Qwen-Qwen3-0.6B": ("hermes", "object", True),
    "Qwen-QwQ-32B": ("hermes", "object", True),
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": ("hermes", "object", True),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("hermes", "object", True),
    "Qwen3.5-4B": ("qwen3_xml", "object", True),
    "Qwen3-Coder": ("qwen3_xml", "object", True),
    "GLM-4.6": ("glm45", "object", True),
    "GLM-4.7-Flash": ("glm45", "object", True),
    "MiniMax-M2": ("minimax_m2", "object", True),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": ("deepseek", "string", True),
    "deepseek-ai-DeepSeek-V3.2": ("deepseek_v32", "string", True),
    "deepseek-ai-DeepSeek-V4": ("deepseek_v4", "string", True),
    "deepseek-ai-DeepSeek-V4-Flash-0731": ("deepseek_v4", "object", True),
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": ("qwen3_xml", "object", True),
    "NVIDIA-Nemotron-Nano-v2": ("nemotron_v2", "object", True),
    "meta-llama-Llama-3.1-8B-Instruct": ("llama3", "object", False),
    "meta-llama-Llama-3.2-3B-Instruct": ("llama3", "object", False),
    "meta-llama-Llama-3.3-70B-Instruct": ("llama3", "object", False),
    "mistralai-Mistral-Nemo-Instruct-2407": ("mistral", "object", True),
    "Mistral-Small-3.2-24B-Instruct-2506": ("mistral", "object", True),
    "unsloth-mistral-Devstral-Small-2507": ("mistral", "object", True),
    "openai-gpt-oss-120b": ("harmony", "object", False),
}


def _template_dir():
    try:
        return hf_export.converter_dir() / "models" / "templates"
    except hf_export.ConverterUnavailable as error:
        pytest.skip(f"llama.cpp source unavailable: {error}")


@pytest.fixture(scope="module")
def tokenizer():
    return sharpi.Session(default_model_path(), threads=1, n_ctx=64).tokenizer


# GLM's and MiniMax-M2's templates print a None content as "None": a calls-only turn has content "" there.
CALLS_ONLY_CONTENT = {"GLM-4.6": ("",), "GLM-4.7-Flash": ("",), "MiniMax-M2": ("",)}


def emitted_reply(tok, source: str, calls: list, args_form: str, contents=(None, "")) -> str:
    """What the template writes for an assistant turn with these calls after its generation prompt."""
    user = [{"role": "user", "content": "Weather, please?"}]
    tool_calls = [{"id": f"abc{i:06d}", "type": "function",  # 9 alphanumerics: Mistral's templates demand it
                   "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)
                                if args_form == "string" else args}} for i, (name, args) in enumerate(calls)]
    prompt = tok.apply_chat_template(user, template=source, tools=TOOLS, add_generation_prompt=True)
    full = None
    for content in contents:  # templates differ in how a calls-only turn is written
        try:
            full = tok.apply_chat_template(user + [{"role": "assistant", "content": content, "tool_calls": tool_calls}],
                                           template=source, tools=TOOLS, add_generation_prompt=False)
            break
        except InvalidArgument:
            continue
    assert full is not None
    # The reply starts where the rendered turn leaves the generation prompt, both taken after the
    # user's text (Mistral's templates move the tool list to the last user turn). A thinking
    # template's prompt opens a think block that the history's turn, its reasoning stripped, lacks:
    # then the reply starts at the end of the last line or marker they share.
    text = "Weather, please?"
    generation_prompt = prompt[prompt.rindex(text) + len(text):]
    turn = full[full.rindex(text) + len(text):]
    n = 0
    while n < min(len(generation_prompt), len(turn)) and generation_prompt[n] == turn[n]:
        n += 1
    if n < len(generation_prompt):
        while n > 0 and turn[n - 1] not in "\n>":
            n -= 1
    return turn[n:]


@pytest.mark.parametrize("name", sorted(REAL_TEMPLATES))
def test_real_template_round_trip(tokenizer, name):
    path = Path(_template_dir()) / f"{name}.jinja"
    source = path.read_text(encoding="utf-8")
    family, args_form, parallel = REAL_TEMPLATES[name]
    assert detect_family(source) == family
    for calls in (CALLS[:1], CALLS) if parallel else (CALLS[:1],):
        reply_text = emitted_reply(tokenizer, source, calls, args_form, CALLS_ONLY_CONTENT.get(name, (None, "")))
        reply = parse_tool_calls(reply_text, family, TOOLS)
        assert calls_of(reply) == calls, reply_text
        # What is left is the template's own framing: end-of-turn tokens, an empty think block.
        leftover = reply.content
        for framing in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>", "<think>", "</think>", "<|end|>",
                        "<|return|>", "[e~[", "<｜end▁of▁sentence｜>", "<SPECIAL_12>"):
            leftover = leftover.replace(framing, "")
        assert leftover.strip() == "", reply_text


# -- streaming -----------------------------------------------------------------------------------


def streamed(text: str, family: str, step: int, tools=None) -> tuple[str, list, list]:
    """(content, calls, events) of `text` pushed `step` characters at a time through a ToolCallStream,
    the calls put together from their events as a client does."""
    stream = ToolCallStream(family, tools)
    events = []
    for i in range(0, len(text), step):
        events += stream.push(text[i:i + step])
    events += stream.flush()
    calls: dict = {}
    for event in events:
        if event[0] == "call":
            assert event[1] == len(calls) and event[2].startswith("call_")
            calls[event[1]] = [event[3], ""]
        elif event[0] == "arguments":
            calls[event[1]][1] += event[2]
    content = "".join(e[1] for e in events if e[0] == "content")
    return content, [(name, json.loads(args)) for name, args in calls.values()], events


@pytest.mark.parametrize("family,text,content,calls", HAND_WRITTEN,
                         ids=[f"{f}-{i}" for i, (f, *_rest) in enumerate(HAND_WRITTEN)])
def test_streamed_replies_give_the_whole_replies_calls(family, text, content, calls):
    """Pushed a character at a time (the worst split of a marker) or in larger pieces, a reply gives
    the calls written out above, and the content around them."""
    for step in (1, 2, 5, len(text)):
        got_content, got_calls, events = streamed(text, family, step)
        assert got_calls == calls, (step, events)
        assert got_content.replace("<｜end▁of▁sentence｜>", "").replace("</s>", "").strip() == content, (step, events)
        if step == 1 and family != "llama3" and '"arguments": "' not in text:
            # Token by token: each call's name comes before its arguments are complete (arguments
            # written as a JSON string go out whole: their text is not the arguments' JSON).
            first_args = [e for e in events if e[0] == "arguments"]
            assert len(first_args) > len(calls), events


@pytest.mark.parametrize("family,text", [
    ("hermes", "def f():\n    return 1  # <tool_ is not a call\n"),
    ("hermes", "<tool_call>\nnot json\n</tool_call> after"),
    ("llama3", "The answer is {not a call}."),
    ("llama3", '{"name": "f", "parameters": [1]}'),
    ("mistral", "[TOOL_CALLS] nonsense"),
    ("harmony", "<|channel|>final<|message|>Just text."),
    ("deepseek_v32", "a <｜DSML｜ tag that begins no section <｜DSML｜function_call"),
    ("nemotron_v2", "<TOOL> is not <TOOLCALL"),
])
def test_streamed_text_that_is_no_call_stays_content(family, text):
    for step in (1, 3, len(text)):
        content, calls, _ = streamed(text, family, step)
        assert (content, calls) == (text, [])


@pytest.mark.parametrize("name", sorted(REAL_TEMPLATES))
def test_real_template_replies_streamed(tokenizer, name):
    """What each real template writes for a turn with calls, streamed a character at a time,
    gives the calls it was rendered with."""
    source = (Path(_template_dir()) / f"{name}.jinja").read_text(encoding="utf-8")
    family, args_form, parallel = REAL_TEMPLATES[name]
    for calls in (CALLS[:1], CALLS) if parallel else (CALLS[:1],):
        reply_text = emitted_reply(tokenizer, source, calls, args_form, CALLS_ONLY_CONTENT.get(name, (None, "")))
        assert streamed(reply_text, family, 1, TOOLS)[1] == calls, reply_text


# -- forced calls ----------------------------------------------------------------------------------

# template -> the call section its turn writes (start, end): the forced-call grammar must accept it.
# The families whose calls are written a parameter at a time, whose grammar follows the template's
# spelling; the JSON families' grammars force compact JSON (tool_calls._compact), which the
# templates' tojson spacing is not.
GRAMMAR_TEMPLATES = {
    "MiniMax-M2": ("<minimax:tool_call>", "</minimax:tool_call>"),
    "deepseek-ai-DeepSeek-V3.2": ("<｜DSML｜function_calls>", "</｜DSML｜function_calls>"),
    "deepseek-ai-DeepSeek-V4": ("<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"),
    "deepseek-ai-DeepSeek-V4-Flash-0731": ("<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"),
}


@pytest.mark.parametrize("name", sorted(GRAMMAR_TEMPLATES))
def test_forced_call_grammar_accepts_what_the_template_writes(tokenizer, name):
    """The grammar that forces a call (tool_choice "required") accepts the section the real template
    writes for the same calls (one call; two where parallel calls are on): what the model was
    trained on is what it may write. It refuses two calls where parallel calls are off, and a
    parameter the tool does not declare. Oracle: llguidance (the matcher the server masks with)
    walking the section's tokens."""
    constrained = pytest.importorskip("sharpi.constrained")
    pytest.importorskip("llguidance")
    source = (Path(_template_dir()) / f"{name}.jinja").read_text(encoding="utf-8")
    family, args_form, _ = REAL_TEMPLATES[name]
    start, end = GRAMMAR_TEMPLATES[name]
    one, two = (emitted_reply(tokenizer, source, calls, args_form, CALLS_ONLY_CONTENT.get(name, (None, "")))
                for calls in (CALLS[:1], CALLS))
    one, two = (reply[reply.index(start):reply.index(end) + len(end)] for reply in (one, two))

    def accepts(section: str, parallel: bool) -> bool:
        grammar = tool_call_grammar(family, TOOLS, constrained.marker_spelling(tokenizer), parallel=parallel)
        mask = constrained.GrammarMask(tokenizer, constrained.lark_grammar(grammar))
        try:
            mask.allowed(tokenizer.encode(section, add_bos=False))
        except InvalidArgument:  # a token the grammar refuses
            return False
        return mask.accepting

    assert accepts(one, parallel=False) and accepts(one, parallel=True), one
    assert accepts(two, parallel=True), two
    assert not accepts(two, parallel=False), two
    assert not accepts(one.replace("city", "town"), parallel=True), one
