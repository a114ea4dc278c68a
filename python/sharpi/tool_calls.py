"""Tool calls in the text a chat model emits: parsing them into OpenAI `tool_calls`, and the grammar
that forces a call when a request says `tool_choice: "required"` or names a function.

Each template family writes calls its own way; the family is recognised from the chat template's
text (detect_family), since the template is what taught the model the syntax:

- "hermes" (Qwen2.5/Qwen3/Qwen3.5, Hermes, and sharpi's ChatML fallback, whose tool prompt asks for
  it): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call.
- "qwen3_xml" (Qwen3.5, Qwen3-Coder): the same <tool_call> blocks around XML,
  `<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>`; a value is its text
  for a string parameter, JSON otherwise (the template writes mappings and lists with tojson).
- "glm45" (GLM-4.5, GLM-4.6, GLM-4.7): <tool_call> blocks holding the name, then one
  `<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>` pair per argument:
  `<tool_call>NAME\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>`; a value
  is read as qwen3_xml's are (its text for a string parameter, JSON otherwise: the template writes
  non-strings with tojson).
- "minimax_m2" (MiniMax-M2, M2.1): one `<minimax:tool_call>` section holding an `<invoke>` per call,
  `<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="KEY">VALUE</parameter>\n</invoke>\n
  </minimax:tool_call>`; a value is read as qwen3_xml's are (its text for a string parameter, JSON
  otherwise: the template writes non-strings with tojson).
- "deepseek_v32" (DeepSeek-V3.2) and "deepseek_v4" (DeepSeek-V4): minimax_m2's shape in DeepSeek's
  DSML markup, each tag having ｜DSML｜ (fullwidth bars) after its "<" or "</" (a forced call spells
  that as one control token where the vocabulary has it as one, as constrained.marker_spelling does):
  `<｜DSML｜function_calls>\n<｜DSML｜invoke name="NAME">\n<｜DSML｜parameter name="KEY" string="true">
  VALUE</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>` (V4's section is
  `<｜DSML｜tool_calls>`; either family reads both). string="true": the value is its text as it is;
  string="false": JSON (the template writes non-strings with tojson); a parameter without the
  attribute is read as minimax_m2's are. The two differ only in the section a forced call writes.
- "deepseek" (DeepSeek-V3/R1): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
  \\n```json\\nARGS\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; V3.1 drops the "function" type and
  the fence: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`.
- "llama3" (Llama 3.1-3.3 JSON tool calling): the whole reply is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`.
- "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the v11 tokenizer's
  `[TOOL_CALLS]NAME[ARGS]{...}` per call (Devstral: `NAME[CALL_ID]ID[ARGS]{...}`).
- "nemotron_v2" (NVIDIA Nemotron-Nano v2): `<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>`.
  (Nemotron-3-Nano writes qwen3_xml.)
- "harmony" (gpt-oss): a commentary-channel message addressed to the function,
  `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>` (the header's
  parts in either order, as the model and the template write them).

The text given to parse_tool_calls must keep control tokens (decode with skip_special=False): the
DeepSeek and Mistral markers are control tokens that a plain decode drops. A block that does not
parse as a call stays in the content, as llama-server leaves it, rather than being lost.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from ._core import InvalidArgument
from .stop_text import held_prefix_len

FAMILIES = ("hermes", "qwen3_xml", "glm45", "minimax_m2", "deepseek", "deepseek_v32", "deepseek_v4", "llama3",
            "mistral", "nemotron_v2", "harmony")

_DS_CALLS_BEGIN, _DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL_BEGIN, _DS_CALL_END, _DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_MISTRAL_CALLS, _MISTRAL_ARGS, _MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_LLAMA_PYTHON_TAG = "<|python_tag|>"
_MINIMAX_CALLS, _MINIMAX_CALLS_END = "<minimax:tool_call>", "</minimax:tool_call>"
# DeepSeek-V3.2's and V4's markup: every tag begins with this text after its "<" or "</".
_DSML = "｜DSML｜"
_DSML_V32_CALLS, _DSML_V4_CALLS = f"<{_DSML}function_calls>", f"<{_DSML}tool_calls>"
_DSML_SECTIONS = ((_DSML_V32_CALLS, f"</{_DSML}function_calls>"), (_DSML_V4_CALLS, f"</{_DSML}tool_calls>"))
# What begins a DSML call section; a reply may begin one inside its open think block (reasoning.py).
DSML_SECTION_STARTS = (_DSML_V32_CALLS, _DSML_V4_CALLS)
_NEMOTRON_CALLS, _NEMOTRON_CALLS_END = "<TOOLCALL>", "</TOOLCALL>"


def detect_family(template: str | None) -> str:
    """The tool-call syntax a chat template teaches; "hermes" for no template (sharpi's ChatML
    fallback) and for templates that show none of the others' markers."""
    if not template:
        return "hermes"
    if _DSML in template:  # V4 renamed the section (llama.cpp tells them apart the same way)
        return "deepseek_v32" if "function_calls" in template else "deepseek_v4"
    if "tool▁calls▁begin" in template:
        return "deepseek"
    if "<|channel|>" in template and "<|call|>" in template:
        return "harmony"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_xml"
    if "<arg_key>" in template and "<arg_value>" in template:
        return "glm45"
    if _MINIMAX_CALLS in template:
        return "minimax_m2"
    if _MISTRAL_CALLS in template:
        return "mistral"
    if _NEMOTRON_CALLS in template:
        return "nemotron_v2"
    if "<tool_call>" in template:
        return "hermes"
    if _LLAMA_PYTHON_TAG in template or ("<|start_header_id|>" in template and "parameters" in template):
        return "llama3"
    return "hermes"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ParsedReply:
    """A reply split into its text and its calls ({"id", "type": "function", "function": {"name",
    "arguments": a JSON string}}), in the order the model wrote them."""

    content: str
    tool_calls: list = field(default_factory=list)


def _call(name, arguments) -> dict | None:
    """An OpenAI tool call, or None when name/arguments are not a call (arguments: an object, or a
    string holding one, as some models write)."""
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _call_from_object(obj, args_keys=("arguments", "parameters")) -> dict | None:
    if not isinstance(obj, dict):
        return None
    args = next((obj[k] for k in args_keys if k in obj), None)
    return _call(obj.get("name"), args)


def _one(call: dict | None) -> list:
    return [] if call is None else [call]


def _calls_of_array(value) -> list:
    """The calls of a JSON array of {"name": ..., "arguments": {...}} objects; [] unless it is a
    non-empty array of calls only."""
    calls = [_call_from_object(o) for o in value] if isinstance(value, list) else []
    return calls if calls and None not in calls else []


def _parse_tagged_blocks(text: str, calls_of, opening: str = "<tool_call>", closing: str = "</tool_call>") -> ParsedReply:
    """The opening...closing blocks of `text` (the last may be unclosed: the model stopped at EOS)
    turned into calls by `calls_of(body)`; a block it returns no calls for stays in the content."""
    content, calls, pos = [], [], 0
    while True:
        start = text.find(opening, pos)
        if start < 0:
            content.append(text[pos:])
            break
        content.append(text[pos:start])
        end = text.find(closing, start)
        body_end = len(text) if end < 0 else end
        after = len(text) if end < 0 else end + len(closing)
        found = calls_of(text[start + len(opening):body_end])
        if found:
            calls += found
        else:
            content.append(text[start:after])
        pos = after
    return ParsedReply("".join(content).strip() if calls else "".join(content), calls)


def _parse_hermes(text: str) -> ParsedReply:
    def call_of(body: str):
        try:
            return _call_from_object(json.loads(body))
        except ValueError:
            return None

    return _parse_tagged_blocks(text, lambda body: _one(call_of(body)))


def _parse_nemotron_v2(text: str) -> ParsedReply:
    def calls_of(body: str):
        try:
            return _calls_of_array(json.loads(body))
        except ValueError:
            return []

    return _parse_tagged_blocks(text, calls_of, _NEMOTRON_CALLS, _NEMOTRON_CALLS_END)


_XML_FUNCTION = re.compile(r"\A\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _xml_value(text: str, schema) -> object:
    """A parameter's value: its text where the schema says string (or gives no type and the text
    is not JSON), else the JSON it spells."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _parameter_schemas(tools) -> dict:
    """function name -> its parameters' schemas ({} when it declares none)."""
    params_of = {}
    for tool in tools or []:
        fn = tool.get("function", {}) if isinstance(tool, dict) else {}
        props = (fn.get("parameters") or {}).get("properties") if isinstance(fn.get("parameters"), dict) else None
        params_of[fn.get("name")] = props if isinstance(props, dict) else {}
    return params_of


def _xml_arguments(params_text: str, props: dict) -> dict:
    """The arguments of a qwen3_xml call's complete <parameter=...> elements."""
    return {k.strip(): _xml_value(v, props.get(k.strip())) for k, v in _XML_PARAMETER.findall(params_text)}


def _parse_qwen3_xml(text: str, tools=None) -> ParsedReply:
    params_of = _parameter_schemas(tools)

    def call_of(body: str):
        m = _XML_FUNCTION.match(body)
        if not m:
            return None
        name = m.group(1).strip()
        return _call(name, _xml_arguments(m.group(2), params_of.get(name, {})))

    return _parse_tagged_blocks(text, lambda body: _one(call_of(body)))


_GLM_HEAD = re.compile(r"\A\s*([^\s<]+)\s*(?=<arg_key>|</tool_call>|\Z)")
_GLM_KEY = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>", re.DOTALL)
_GLM_VALUE_END = "</arg_value>"


def _tagged_arguments(text: str, pos: int, props: dict, parameter: re.Pattern, parameter_end: str,
                      complete: bool = True) -> tuple:
    """(arguments, end) of the complete parameters of a call written one tag per parameter (glm45's
    <arg_key>/<arg_value> pairs, minimax_m2's and DSML's <parameter> elements) from text[pos:]: end
    is where they stop. `parameter` matches a parameter's head up to its value (group 1: the key;
    group 2, DSML's only: its string="true|false"), `parameter_end` the text after the value.

    A value is its text where DSML says string="true", JSON where it says "false", else read by
    the schema (_xml_value). A value that opens a JSON object or array runs to its closing bracket
    (so the closing tag inside one of its strings does not end it), any other to the first
    parameter_end. complete=False (a call still streaming): a JSON value stops the parameters until
    its closing bracket has arrived."""
    args = {}
    while m := parameter.match(text, pos):
        key, start = m.group(1).strip(), m.end()
        flag = m.group(2) if parameter.groups > 1 else None
        close = -1
        if flag != "true" and text[start:start + 1] in ("{", "["):
            end = _json_value_end(text, start)
            if end is not None and text.startswith(parameter_end, end):
                close = end
            elif not complete:
                break
        if close < 0:
            close = text.find(parameter_end, start)
            if close < 0:
                break
        value = text[start:close]
        args[key] = value if flag == "true" else _xml_value(value, None if flag == "false" else props.get(key))
        pos = close + len(parameter_end)
    return args, pos


def _parse_glm45(text: str, tools=None) -> ParsedReply:
    params_of = _parameter_schemas(tools)

    def call_of(body: str):
        head = _GLM_HEAD.match(body)
        if not head:
            return None
        name = head.group(1)
        args, end = _tagged_arguments(body, head.end(), params_of.get(name, {}), _GLM_KEY, _GLM_VALUE_END)
        return _call(name, args) if not body[end:].strip() else None

    return _parse_tagged_blocks(text, lambda body: _one(call_of(body)))


@dataclass(frozen=True)
class _InvokeSyntax:
    """How a family that writes its calls as <invoke> elements in a call section spells them
    (minimax_m2, deepseek_v32, deepseek_v4): the (start, end) markers of a section, the heads of an
    invoke (group 1: the name) and of a parameter (as _tagged_arguments takes them), and the ends."""

    sections: tuple
    invoke: re.Pattern
    parameter: re.Pattern
    parameter_end: str
    invoke_end: re.Pattern


_MINIMAX = _InvokeSyntax(((_MINIMAX_CALLS, _MINIMAX_CALLS_END),), re.compile(r'\s*<invoke name="([^"\n]+)">'),
                         re.compile(r'\s*<parameter name="([^"\n]+)">'), "</parameter>", re.compile(r"\s*</invoke>"))
_DSML_SYNTAX = _InvokeSyntax(
    _DSML_SECTIONS, re.compile(rf'\s*<{_DSML}invoke name="([^"\n]+)">'),
    re.compile(rf'\s*<{_DSML}parameter name="([^"\n]+)"(?: string="(true|false)")?>'), f"</{_DSML}parameter>",
    re.compile(rf"\s*</{_DSML}invoke>"))
_INVOKE_SYNTAX = {"minimax_m2": _MINIMAX, "deepseek_v32": _DSML_SYNTAX, "deepseek_v4": _DSML_SYNTAX}


def _invokes(body: str, params_of: dict, syntax: _InvokeSyntax, complete: bool = True) -> tuple:
    """([(name, arguments, closed)], end) of the invokes at the start of a call section's body
    (after its start marker); end is where they stop. Only the last one may be unclosed (its end
    has not arrived, or what follows its parameters is not one)."""
    invokes, pos = [], 0
    while m := syntax.invoke.match(body, pos):
        name = m.group(1)
        args, pos = _tagged_arguments(body, m.end(), params_of.get(name, {}), syntax.parameter, syntax.parameter_end,
                                      complete)
        closing = syntax.invoke_end.match(body, pos)
        invokes.append((name, args, closing is not None))
        if closing is None:
            break
        pos = closing.end()
    return invokes, pos


def _section_start(text: str, pos: int, sections: tuple) -> tuple | None:
    """(index, start marker, end marker) of the first call section in text[pos:], None if none."""
    hits = [(at, start, end) for start, end in sections if (at := text.find(start, pos)) >= 0]
    return min(hits) if hits else None


def _parse_invoke_sections(text: str, tools, syntax: _InvokeSyntax) -> ParsedReply:
    """The call sections of `text` (the last may be unclosed: the model stopped at EOS), each one or
    more invokes; a section that is not all well-formed invokes stays in the content."""
    params_of = _parameter_schemas(tools)
    content, calls, pos = [], [], 0
    while (hit := _section_start(text, pos, syntax.sections)) is not None:
        start, opening, closing = hit
        content.append(text[pos:start])
        end = text.find(closing, start)
        body = text[start + len(opening):len(text) if end < 0 else end]
        after = len(text) if end < 0 else end + len(closing)
        invokes, stop = _invokes(body, params_of, syntax)
        found = [_call(name, args) for name, args, closed in invokes if closed]
        if invokes and len(found) == len(invokes) and None not in found and not body[stop:].strip():
            calls += found
        else:
            content.append(text[start:after])
        pos = after
    content.append(text[pos:])
    return ParsedReply("".join(content).strip() if calls else "".join(content), calls)


_HARMONY_CALL = re.compile(
    r"(?:<\|start\|>assistant)?(?:<\|channel\|>commentary\s*)?\s*to=functions\.([^\s<]+)\s*"
    r"(?:<\|channel\|>commentary\s*)?(?:<\|constrain\|>)?\s*(?:json)?\s*<\|message\|>(.*?)(?:<\|call\|>|\Z)",
    re.DOTALL)


def _parse_harmony(text: str) -> ParsedReply:
    calls, content, pos = [], [], 0
    for m in _HARMONY_CALL.finditer(text):
        call = _call(m.group(1), m.group(2).strip())
        if call is None:
            continue
        content.append(text[pos:m.start()])
        calls.append(call)
        pos = m.end()
    content.append(text[pos:])
    return ParsedReply("".join(content).strip() if calls else text, calls)


_FENCED_JSON = re.compile(r"\A\s*```(?:json)?\s*\n(.*?)\n?\s*```\s*\Z", re.DOTALL)


def _parse_deepseek(text: str) -> ParsedReply:
    begin = text.find(_DS_CALLS_BEGIN)
    first_call = text.find(_DS_CALL_BEGIN)
    if begin < 0 and first_call < 0:
        return ParsedReply(text)
    cut = begin if begin >= 0 else first_call
    end = text.find(_DS_CALLS_END, cut)
    section = text[cut:] if end < 0 else text[cut:end]
    tail = "" if end < 0 else text[end + len(_DS_CALLS_END):]
    calls = []
    for chunk in section.split(_DS_CALL_BEGIN)[1:]:
        body = chunk.split(_DS_CALL_END)[0]
        if _DS_SEP not in body:
            return ParsedReply(text)
        left, right = body.split(_DS_SEP, 1)
        if left.strip() == "function" and "\n" in right:  # V3 / R1: type, then name and fenced JSON
            name, args = right.split("\n", 1)
            fenced = _FENCED_JSON.match(args)
            args = fenced.group(1) if fenced else args
        else:  # V3.1: name, then the bare JSON
            name, args = left, right
        call = _call(name.strip(), args.strip())
        if call is None:
            return ParsedReply(text)
        calls.append(call)
    if not calls:
        return ParsedReply(text)
    tail = tail.replace("<｜end▁of▁sentence｜>", "")
    return ParsedReply((text[:cut] + tail).strip(), calls)


def _parse_llama3(text: str) -> ParsedReply:
    body = text.strip()
    if body.startswith(_LLAMA_PYTHON_TAG):
        body = body[len(_LLAMA_PYTHON_TAG):].strip()
    for suffix in ("<|eom_id|>", "<|eot_id|>"):
        body = body.removesuffix(suffix).strip()
    try:
        obj = json.loads(body)
    except ValueError:
        return ParsedReply(text)
    objs = obj if isinstance(obj, list) else [obj]
    calls = [_call_from_object(o, ("parameters", "arguments")) for o in objs]
    if not calls or any(c is None for c in calls):
        return ParsedReply(text)
    return ParsedReply("", calls)


def _parse_mistral(text: str) -> ParsedReply:
    cut = text.find(_MISTRAL_CALLS)
    if cut < 0:
        return ParsedReply(text)
    rest = text[cut + len(_MISTRAL_CALLS):].strip()
    decoder = json.JSONDecoder()
    calls = []
    if rest.startswith("["):  # v3: a JSON array of calls
        try:
            arr, end = decoder.raw_decode(rest)
        except ValueError:
            return ParsedReply(text)
        calls = _calls_of_array(arr)
        rest = rest[end:]
    else:  # v11: NAME[ARGS]{...}, repeated, each after its own [TOOL_CALLS]
        while rest:
            name, sep, after = rest.partition(_MISTRAL_ARGS)
            if not sep:
                return ParsedReply(text)
            name = name.split(_MISTRAL_CALL_ID)[0]  # Devstral: NAME[CALL_ID]ID[ARGS]{...}
            try:
                args, end = decoder.raw_decode(after.lstrip())
            except ValueError:
                return ParsedReply(text)
            calls.append(_call(name.strip(), args))
            rest = after.lstrip()[end:].strip()
            if rest.startswith(_MISTRAL_CALLS):
                rest = rest[len(_MISTRAL_CALLS):].strip()
            else:
                break
    if not calls or any(c is None for c in calls):
        return ParsedReply(text)
    rest = rest.replace("</s>", "").strip()
    return ParsedReply((text[:cut] + rest).strip(), calls)


def _parse_invokes(family: str):
    return lambda text, tools: _parse_invoke_sections(text, tools, _INVOKE_SYNTAX[family])


_PARSERS = {"hermes": _parse_hermes, "qwen3_xml": _parse_qwen3_xml, "glm45": _parse_glm45,
            "minimax_m2": _parse_invokes("minimax_m2"), "deepseek": _parse_deepseek,
            "deepseek_v32": _parse_invokes("deepseek_v32"), "deepseek_v4": _parse_invokes("deepseek_v4"),
            "llama3": _parse_llama3, "mistral": _parse_mistral, "nemotron_v2": _parse_nemotron_v2,
            "harmony": _parse_harmony}
# The families whose values are read by the parameter's type (the request's tools).
_TYPED = ("qwen3_xml", "glm45", "minimax_m2", "deepseek_v32", "deepseek_v4")


def parse_tool_calls(text: str, family: str, tools: list | None = None) -> ParsedReply:
    """The content and tool calls of a reply written in `family`'s syntax (see the module docstring).
    tools (the request's): the parameter types the values of the families in _TYPED are read with."""
    if family not in _PARSERS:
        raise InvalidArgument(f"unknown tool-call family {family!r} (known: {', '.join(FAMILIES)})")
    if family in _TYPED:
        return _PARSERS[family](text, tools)
    return _PARSERS[family](text)


# -- streaming ----------------------------------------------------------------------------------

# The texts a call section of each family begins with (those parse_tool_calls looks for). llama3
# has none: its reply is a call only as a whole.
_CALL_STARTS = {
    "hermes": ("<tool_call>",), "qwen3_xml": ("<tool_call>",), "glm45": ("<tool_call>",),
    "minimax_m2": (_MINIMAX_CALLS,), "deepseek_v32": DSML_SECTION_STARTS,
    "deepseek_v4": DSML_SECTION_STARTS,
    "deepseek": (_DS_CALLS_BEGIN, _DS_CALL_BEGIN),
    "mistral": (_MISTRAL_CALLS,), "nemotron_v2": (_NEMOTRON_CALLS,),
    "harmony": ("<|start|>assistant<|channel|>commentary to=functions.", "<|channel|>commentary to=functions.",
                "to=functions."),
}
_JSON_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_XML_FUNCTION_HEAD = re.compile(r"\s*<function=([^>\n]+)>")
_HARMONY_HEAD = re.compile(r"to=functions\.([^\s<]+)[\s<]")


# What decides where a JSON value ends: strings (skipped whole, so their brackets do not count; an
# unterminated one runs to the end of the text) and brackets. A regex, so the scan runs at C speed:
# a streamed call's section is scanned again at every token.
_JSON_SCAN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)|[{}\[\]]')


def _json_value_end(text: str, start: int) -> int | None:
    """Index just past the JSON object or array that opens at text[start], None while it is open."""
    depth = 0
    for m in _JSON_SCAN.finditer(text, start):
        c = text[m.start()]
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return m.end()
    return None


def _json_head(text: str, pos: int = 0) -> tuple | None:
    """(name, arguments so far, end of the object or None) of a {"name": ..., "arguments": {...}}
    object at text[pos:] whose name comes first; None until its name and the '{' of its arguments
    have arrived (or when it is not such an object)."""
    m = _JSON_CALL_HEAD.match(text, pos)
    if not m:
        return None
    try:
        name = json.loads(f'"{m.group(1)}"')
    except ValueError:
        return None
    end = _json_value_end(text, m.end())
    return name, text[m.end():end], None if end is None else _json_value_end(text, text.index("{", pos))


def _array_calls(text: str) -> list:
    """(name, arguments so far) of each call whose name is known in the JSON array of calls that
    `text` begins (mistral's, nemotron_v2's)."""
    calls = []
    if not text.startswith("["):
        return calls
    pos = 1
    while True:
        while pos < len(text) and text[pos] in " \t\n,":
            pos += 1
        head = _json_head(text, pos)
        if head is None:
            return calls
        calls.append(head[:2])
        if head[2] is None:
            return calls
        pos = head[2]


def _partial_calls(section: str, family: str, params_of: dict) -> list:
    """(name, arguments so far) of each call in the call section `section` (from its start marker
    on) whose name is known. The arguments only ever grow as the section does, and are JSON once
    the call is complete: what a stream sends as argument fragments."""
    if family in ("hermes", "qwen3_xml"):
        body = section[len("<tool_call>"):]
        if family == "hermes":
            head = _json_head(body)
            return [] if head is None else [head[:2]]
        m = _XML_FUNCTION_HEAD.match(body)
        if not m:
            return []
        name = m.group(1).strip()
        params = body[m.end():]
        closed = params.find("</function>")
        args = _xml_arguments(params if closed < 0 else params[:closed], params_of.get(name, {}))
        text = "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
                               for k, v in args.items())
        return [(name, text + ("}" if closed >= 0 else ""))]
    if family == "glm45":
        body = section[len("<tool_call>"):]
        head = _GLM_HEAD.match(body)
        # The name is complete once what follows it (a newline, its first <arg_key>, the block's
        # end) has arrived.
        if not head or head.end() == len(body) and "</tool_call>" not in body:
            return []
        name = head.group(1)
        args, end = _tagged_arguments(body, head.end(), params_of.get(name, {}), _GLM_KEY, _GLM_VALUE_END,
                                      complete=False)
        text = "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
                               for k, v in args.items())
        closed = body[end:].lstrip().startswith("</tool_call>")
        return [(name, text + ("}" if closed else ""))]
    if family in _INVOKE_SYNTAX:
        syntax = _INVOKE_SYNTAX[family]
        opening = next(start for start, _ in syntax.sections if section.startswith(start))
        invokes, _ = _invokes(section[len(opening):], params_of, syntax, complete=False)
        return [(name, "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
                                       for k, v in args.items()) + ("}" if closed else ""))
                for name, args, closed in invokes]
    if family == "harmony":
        m = _HARMONY_HEAD.search(section)
        if not m:
            return []
        at = section.find("<|message|>", m.end())
        args = "" if at < 0 else section[at + len("<|message|>"):].split("<|call|>")[0]
        if "<|call|>" not in section:
            args = args[:len(args) - held_prefix_len(args, ("<|call|>",))]
        return [(m.group(1), args)]
    if family == "deepseek":
        calls = []
        for chunk in section.split(_DS_CALL_BEGIN)[1:]:
            body, closed = chunk.split(_DS_CALL_END)[0], _DS_CALL_END in chunk
            if _DS_SEP not in body:
                break
            left, right = body.split(_DS_SEP, 1)
            ends = (_DS_CALL_END,)
            if left.strip() == "function":  # V3 / R1: NAME, a newline, then fenced JSON
                if "\n" not in right:
                    break
                name, args = right.split("\n", 1)
                if args.startswith("```"):
                    args = args.split("\n", 1)[1] if "\n" in args else ""
                elif "```".startswith(args):
                    args = ""
                args, ends = args.split("\n```")[0], ("\n```", _DS_CALL_END)
            else:  # V3.1: NAME<sep>ARGS
                name, args = left, right
            if not closed:
                args = args[:len(args) - held_prefix_len(args, ends)]
            calls.append((name.strip(), args))
            if not closed:
                break
        return calls
    if family == "nemotron_v2":  # <TOOLCALL> then a JSON array of calls
        return _array_calls(section[len(_NEMOTRON_CALLS):].lstrip())
    # mistral: [TOOL_CALLS] then a JSON array of calls, or NAME[ARGS]{...} per call
    rest = section[len(_MISTRAL_CALLS):].lstrip()
    if rest.startswith("["):
        return _array_calls(rest)
    calls = []
    for part in rest.split(_MISTRAL_CALLS):
        name, sep, after = part.partition(_MISTRAL_ARGS)
        after = after.lstrip()
        if not sep or not after.startswith("{"):
            break
        end = _json_value_end(after, 0)
        calls.append((name.split(_MISTRAL_CALL_ID)[0].strip(), after[:end]))
    return calls


def _section_end(section: str, family: str) -> int | None:
    """Where the call section `section` ends (the index just past it), None while it goes on."""
    closing = {"hermes": "</tool_call>", "qwen3_xml": "</tool_call>", "glm45": "</tool_call>", "deepseek": _DS_CALLS_END,
               "harmony": "<|call|>", "nemotron_v2": _NEMOTRON_CALLS_END}.get(family)
    if family in _INVOKE_SYNTAX:  # the end of the section's own start marker (DSML has two)
        closing = next(end for start, end in _INVOKE_SYNTAX[family].sections if section.startswith(start))
    if closing is None:  # mistral's calls (and llama3's whole reply) go on to the end
        return None
    at = section.find(closing)
    return None if at < 0 else at + len(closing)


class ToolCallStream:
    """parse_tool_calls for a reply that arrives in pieces, giving events as soon as they are
    known: ("content", text), ("call", index, id, name) when a call's name is complete, then
    ("arguments", index, fragment) as its arguments arrive (their concatenation is the call's
    arguments as JSON text, as the model wrote them). Text that may begin a call's marker is held
    back until the next piece tells, as StopText holds back a stop string's start.

    Invariant: the calls and their arguments (as JSON values) are those parse_tool_calls finds in
    the whole text. Each call section is parsed by parse_tool_calls once it is complete; a call it
    finds that was not streamed (its name came after its arguments, or its arguments were a JSON
    string) goes out whole then. The exception: a section whose streamed call turns out malformed
    cannot be taken back (the whole-text parse would keep it as content). llama3's reply is a call
    only as a whole, so a reply that may be one (it begins with '{', '[' or <|python_tag|>) is held
    to the end.

    Cost: each push scans the open call section again (regexes, at C speed): about 1 s in all for
    a call with 24 KB of arguments arriving 4 characters at a time, a small part of the time a
    model takes to write them."""

    def __init__(self, family: str, tools: list | None = None):
        if family not in _PARSERS:
            raise InvalidArgument(f"unknown tool-call family {family!r} (known: {', '.join(FAMILIES)})")
        self.family, self.tools = family, tools
        self._params_of = _parameter_schemas(tools)
        self._pending = ""  # held-back text, or the call section so far
        self._in_section = False
        self._whole = False  # llama3: the reply may be a call, held to the end
        self._undecided = family == "llama3"  # llama3: nothing but whitespace seen yet
        self.calls: list = []  # [id, name, arguments sent] of each call announced
        self._section_first = 0  # index in self.calls of the current section's first call

    def push(self, text: str) -> list:
        self._pending += text
        events: list = []
        while True:
            if self._undecided:
                head = self._pending.lstrip()
                if not head:
                    return events
                self._undecided = False
                self._whole = head.startswith(("{", "[", _LLAMA_PYTHON_TAG[:len(head)]))
            if self._whole:
                return events
            if self._in_section:
                end = _section_end(self._pending, self.family)
                if end is None:
                    self._stream(self._pending, events)
                    return events
                section, self._pending = self._pending[:end], self._pending[end:]
                self._finish(section, events)
                self._in_section = False
                continue
            starts = _CALL_STARTS.get(self.family, ())
            hits = [self._pending.find(s) for s in starts if s in self._pending]
            if hits:
                at = min(hits)
                if at:
                    events.append(("content", self._pending[:at]))
                self._pending, self._in_section, self._section_first = self._pending[at:], True, len(self.calls)
                continue
            out = self._pending[:len(self._pending) - held_prefix_len(self._pending, starts)]
            if out:
                events.append(("content", out))
            self._pending = self._pending[len(out):]
            return events

    def flush(self) -> list:
        """The events of what was held back, at the end of the reply."""
        events: list = []
        rest, self._pending = self._pending, ""
        if self._in_section or self._whole:
            self._section_first = len(self.calls) if self._whole else self._section_first
            self._finish(rest, events)
        elif rest:
            events.append(("content", rest))
        self._in_section = self._whole = False
        return events

    def _announce(self, name: str, events: list) -> None:
        self.calls.append([new_call_id(), name, ""])
        events.append(("call", len(self.calls) - 1, self.calls[-1][0], name))

    def _stream(self, section: str, events: list) -> None:
        for k, (name, args) in enumerate(_partial_calls(section, self.family, self._params_of)):
            i = self._section_first + k
            if i == len(self.calls):
                self._announce(name, events)
            sent = self.calls[i][2]
            if len(args) > len(sent) and args.startswith(sent):
                events.append(("arguments", i, args[len(sent):]))
                self.calls[i][2] = args

    def _finish(self, section: str, events: list) -> None:
        if self.family != "llama3":
            self._stream(section, events)
        reply = parse_tool_calls(section, self.family, self.tools)
        if not reply.tool_calls and len(self.calls) > self._section_first:
            return  # announced, then malformed: see the class docstring
        for k, call in enumerate(reply.tool_calls):
            i = self._section_first + k
            if i == len(self.calls):
                self._announce(call["function"]["name"], events)
            if not self.calls[i][2]:
                self.calls[i][2] = call["function"]["arguments"]
                events.append(("arguments", i, self.calls[i][2]))
        if reply.content:
            events.append(("content", reply.content))


# -- forcing a call -----------------------------------------------------------------------------

def tool_function(tool) -> dict:
    """The `function` of an OpenAI tool ({"type": "function", "function": {"name", "parameters"}}),
    checked: InvalidArgument naming what is wrong."""
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise InvalidArgument("each tool must be {'type': 'function', 'function': {...}}")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise InvalidArgument("each tool's 'function' must have a non-empty 'name'")
    params = fn.get("parameters", {"type": "object"})
    if not isinstance(params, dict):
        raise InvalidArgument(f"tool {fn['name']!r}: 'parameters' must be a JSON schema object")
    return {**fn, "parameters": params}


def _lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _closed(schema):
    """The schema with "additionalProperties": false on every object schema that lists its
    properties and says nothing about others: a function takes the parameters it declares, and an
    open object would let a forced call go on inventing keys until max_tokens."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("enum", "const", "default", "examples") else _closed(v)) for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict):
        out["properties"] = {k: _closed(v) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


def _args_schema(fn: dict) -> dict:
    params = _closed(fn["parameters"])
    params.setdefault("type", "object")
    return params


def _compact(schema: dict) -> dict:
    # Compact separators: a model that does not know the syntax (the shipped one) would otherwise
    # fill the allowed whitespace forever.
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def _keyed_call_rules(fns, rules: list, more: str, param_rule, call_rule) -> None:
    """Grammar rules for calls written one parameter at a time (qwen3_xml, glm45, the invoke
    families): per function i and parameter k, p{i}_{k} = param_rule(key, "v{i}_{k}", its schema)
    and v{i}_{k} its value by type; a call
    is call_rule(i, fn, its parameters in order, the optional ones marked "?"); `more` repeats it."""
    names = []
    for i, fn in enumerate(fns):
        params = _args_schema(fn)
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        parts = []
        for k, (key, schema) in enumerate(props.items()):
            rules.append(f"p{i}_{k}: {param_rule(key, f'v{i}_{k}', schema)}")
            rules.append(f"v{i}_{k}: {_xml_value_rule(schema)}")
            parts.append(f"p{i}_{k}" + ("" if key in required else "?"))
        rules.append(f"call{i}: {call_rule(i, fn, ' '.join(parts))}")
        names.append(f"call{i}")
    rules.insert(0, f"start: call{more}\ncall: {' | '.join(names)}")


def _xml_value_rule(schema) -> str:
    """The Lark rule of a parameter value written as text (qwen3_xml, glm45, the invoke families): text for a string (its enum, its pattern, or
    any text without a tag, within its length bounds), JSON matching the schema otherwise."""
    schema = schema if isinstance(schema, dict) else {}
    if schema.get("type") != "string":
        return f"%json {json.dumps(_compact(schema))}"
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return " | ".join(_lark_literal(str(v)) for v in schema["enum"])
    if isinstance(schema.get("pattern"), str):
        return "/" + schema["pattern"].removeprefix("^").removesuffix("$").replace("/", "\\/") + "/"
    lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
    return f"/[^<]{{{lo},{'' if hi is None else int(hi)}}}/"


def tool_call_grammar(family: str, tools: list, marker=_lark_literal, parallel: bool = True) -> str:
    """A Lark grammar (llguidance's dialect, with %json) for one call (or, parallel=True, one or
    more) in `family`'s syntax, of the given tools (the OpenAI tool objects), each call's arguments
    matching its function's parameters schema (objects closed: see _closed). marker(text) spells a fixed marker in the grammar: a quoted
    literal by default; constrained.marker_spelling gives the special-token form where the marker
    is one control token of the vocabulary."""
    fns = [tool_function(t) for t in tools]
    if not fns:
        raise InvalidArgument("a forced tool call needs at least one tool")
    if family not in _PARSERS:
        raise InvalidArgument(f"unknown tool-call family {family!r} (known: {', '.join(FAMILIES)})")
    args_key = "parameters" if family == "llama3" else "arguments"
    more = ' ("\\n" call)*' if parallel else ""

    def call_object(fn: dict) -> dict:
        return {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: _args_schema(fn)},
                "required": ["name", args_key], "additionalProperties": False}

    rules = []
    if family in ("hermes", "llama3", "mistral", "nemotron_v2"):
        one = {"anyOf": [call_object(fn) for fn in fns]} if len(fns) > 1 else call_object(fns[0])
        if family == "hermes":
            rules.append(f"start: call{more}\ncall: {marker('<tool_call>')} \"\\n\" obj \"\\n\" "
                         f"{marker('</tool_call>')}")
            rules.append(f"obj: %json {json.dumps(_compact(one))}")
        elif family == "llama3":
            rules.append("start: obj")
            rules.append(f"obj: %json {json.dumps(_compact(one))}")
        else:  # mistral, nemotron_v2: a JSON array of calls after the marker
            array = {"type": "array", "items": one, "minItems": 1, **({} if parallel else {"maxItems": 1})}
            if family == "mistral":
                rules.append(f"start: {marker(_MISTRAL_CALLS)} arr")
            else:
                rules.append(f"start: {marker(_NEMOTRON_CALLS)} arr {marker(_NEMOTRON_CALLS_END)}")
            rules.append(f"arr: %json {json.dumps(_compact(array))}")
    elif family == "qwen3_xml":
        def qwen_call(i, fn, body):
            return (f"{marker('<tool_call>')} {_lark_literal(chr(10) + '<function=' + fn['name'] + '>' + chr(10))} "
                    f"{body} \"</function>\\n\" {marker('</tool_call>')}")

        def qwen_param(key, value, _schema):
            return f"\"<parameter={key}>\\n\" {value} \"\\n</parameter>\\n\""

        _keyed_call_rules(fns, rules, more, qwen_param, qwen_call)
    elif family == "glm45":
        # As the template writes a call: the name on the <tool_call> line, then one key/value pair
        # per line; parallel calls separated by a newline.
        def glm_param(key, value, _schema):
            return (f"{marker('<arg_key>')} {_lark_literal(key)} {marker('</arg_key>')} \"\\n\" "
                    f"{marker('<arg_value>')} {value} {marker('</arg_value>')} \"\\n\"")

        def glm_call(i, fn, body):
            return f"{marker('<tool_call>')} {_lark_literal(fn['name'] + chr(10))} {body} {marker('</tool_call>')}"

        _keyed_call_rules(fns, rules, more, glm_param, glm_call)
    elif family in _INVOKE_SYNTAX:
        # As the templates write calls: one section, an invoke per call, a parameter per line.
        # DSML's tags have its marker after their "<" or "</", and its parameters say whether their
        # value is a string (written as it is) or JSON.
        dsml = family != "minimax_m2"

        def tag(text: str) -> str:
            if not dsml:
                return _lark_literal(text)
            slash = "</" if text.startswith("</") else "<"
            return f"{_lark_literal(slash)} {marker(_DSML)} {_lark_literal(text[len(slash):])}"

        def invoke_param(key, value, schema):
            head = "<parameter name=" + json.dumps(key, ensure_ascii=False)
            if dsml:
                is_string = isinstance(schema, dict) and schema.get("type") == "string"
                head += ' string="true"' if is_string else ' string="false"'
            return f"{tag(head + '>')} {value} {tag('</parameter>' + chr(10))}"

        def invoke_call(i, fn, body):
            head = "<invoke name=" + json.dumps(fn["name"], ensure_ascii=False) + ">\n"
            return f"{tag(head)} {body} {tag('</invoke>' + chr(10))}"

        if dsml:
            block = "function_calls" if family == "deepseek_v32" else "tool_calls"
            opening, closing = tag(f"<{block}>"), tag(f"</{block}>")
        else:
            opening, closing = marker(_MINIMAX_CALLS), marker(_MINIMAX_CALLS_END)
        calls = " call*" if parallel else ""
        _keyed_call_rules(fns, rules, calls, invoke_param, invoke_call)
        alternatives = rules[0].split("\n", 1)[1]
        rules[0] = f"start: {opening} \"\\n\" call{calls} {closing}\n{alternatives}"
    elif family == "harmony":
        names = []
        for i, fn in enumerate(fns):
            rules.append(f"call{i}: {marker('<|channel|>')} {_lark_literal('commentary to=functions.' + fn['name'] + ' ')} "
                         f"{marker('<|constrain|>')} \"json\" {marker('<|message|>')} args{i} {marker('<|call|>')}")
            rules.append(f"args{i}: %json {json.dumps(_compact(_args_schema(fn)))}")
            names.append(f"call{i}")
        rules.insert(0, f"start: call\ncall: {' | '.join(names)}")
    else:  # deepseek (V3 / R1 spelling, which the V3 and R1 templates render)
        names = []
        for i, fn in enumerate(fns):
            rules.append(f"call{i}: {marker(_DS_CALL_BEGIN)} \"function\" {marker(_DS_SEP)} "
                         f"{_lark_literal(fn['name'] + chr(10) + '```json' + chr(10))} args{i} "
                         f"\"\\n```\" {marker(_DS_CALL_END)}")
            rules.append(f"args{i}: %json {json.dumps(_compact(_args_schema(fn)))}")
            names.append(f"call{i}")
        rules.insert(0, f"start: {marker(_DS_CALLS_BEGIN)} call{more} {marker(_DS_CALLS_END)}\n"
                        f"call: {' | '.join(names)}")
    return "\n".join(rules) + "\n"


def hermes_tools_prompt(tools: list) -> str:
    """The system text that teaches a template without tool support (sharpi's ChatML fallback) the
    Hermes syntax, in the words Qwen2.5's and Qwen3's templates use."""
    lines = ["# Tools", "", "You may call one or more functions to assist with the user query.", "",
             "You are provided with function signatures within <tools></tools> XML tags:", "<tools>"]
    lines += [json.dumps(t, ensure_ascii=False) for t in tools]
    lines += ["</tools>", "",
              ("For each function call, return a json object with function name and arguments within "
               "<tool_call></tool_call> XML tags:"),
              "<tool_call>", '{"name": <function-name>, "arguments": <args-json-object>}', "</tool_call>"]
    return "\n".join(lines)
