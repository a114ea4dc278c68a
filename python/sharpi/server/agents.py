"""What a chat request asks of the reply's shape: `tools` and `tool_choice`, `response_format`,
llama-server's `grammar`, and the reasoning split; and the reply's message built from the text.

plan(...) reads those fields once, on the event loop, before the job is queued: it refuses
combinations sharpi does not do (a 400 naming the parameter, never a field silently ignored),
compiles the grammar into a GrammarMask (sharpi.constrained) that the job samples through, and adds
a Hermes tool prompt when the template cannot render tools itself (sharpi's ChatML fallback).
message(...) turns the finished text into the OpenAI message: tool_calls (finish_reason
"tool_calls") parsed in the template's family syntax (sharpi.tool_calls) and reasoning_content
(sharpi.reasoning). ReplyStream gives the same reply as it streams, as protocol-neutral events
(reasoning, content, a call's start, its argument fragments) that each protocol adapter
(openai_api, anthropic_api) writes in its own shape. A reply parsed for calls is generated with
control tokens kept (Engine.submit keep_special), streamed or not, so both parse the same text.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import _core, constrained, reasoning, tool_calls
from .errors import ApiError


@dataclass
class ChatPlan:
    tools: list | None  # the request's tools when the reply is parsed for calls
    family: str
    markers: reasoning.ReasoningMarkers | None
    start_in_reasoning: bool = False
    mask: constrained.GrammarMask | None = None
    grammar: tuple | None = None  # (the request parameter it came from, the grammar) behind mask


def _tool_choice(body: dict, tools: list | None):
    """"none", "auto", "required", or the forced function's name."""
    choice = body.get("tool_choice", "auto" if tools else "none")
    if isinstance(choice, str) and choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise ApiError(400, f"tool_choice '{choice}' needs 'tools'", param="tool_choice")
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not tools or name not in [t.get("function", {}).get("name") for t in tools if isinstance(t, dict)]:
            raise ApiError(400, f"tool_choice names the function {name!r}, which is not among 'tools'",
                           param="tool_choice")
        return name
    raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                   "'function': {'name': ...}}", param="tool_choice")


def _grammar_of_format(body: dict) -> str | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "response_format.type must be 'text', 'json_object' or 'json_schema'",
                       param="response_format")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return constrained.json_object_grammar()
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ApiError(400, "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                       param="response_format")
    try:
        return constrained.json_schema_grammar(spec["schema"])
    except _core.InvalidArgument as e:
        raise ApiError(400, str(e), param="response_format") from None


def _hermes_history(messages: list) -> list:
    """Earlier calls and their results written as Qwen's templates write them, for a template that
    knows neither (the ChatML fallback would drop an assistant turn's tool_calls): each call as a
    <tool_call> block after the turn's text, each `tool` message as a <tool_response> in a user turn."""
    import json

    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            blocks = []
            for call in m["tool_calls"]:
                fn = call.get("function", {}) if isinstance(call, dict) else {}
                args = fn.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        raise ApiError(400, "an assistant tool call's arguments are not JSON",
                                       param="messages") from None
                blocks.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args},
                                                           ensure_ascii=False) + "\n</tool_call>")
            text = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
            out.append({"role": "assistant", "content": text})
        elif m.get("role") == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"})
        else:
            out.append(m)
    return out


def plan(body: dict, tok, template: str | None, messages: list) -> tuple[ChatPlan, list]:
    """The request's ChatPlan and the messages to render (with a tool prompt added where needed)."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not tools:
            raise ApiError(400, "'tools' must be a non-empty list", param="tools")
        try:
            for t in tools:
                tool_calls.tool_function(t)
        except _core.InvalidArgument as e:
            raise ApiError(400, str(e), param="tools") from None
    choice = _tool_choice(body, tools)
    family = tool_calls.detect_family(template)
    markers = reasoning.markers_for_template(template)
    grammars = []
    format_grammar = _grammar_of_format(body)
    if format_grammar is not None:
        grammars.append(("response_format", format_grammar))
    if body.get("grammar") is not None:
        try:
            grammars.append(("grammar", constrained.gbnf_grammar(body["grammar"])))
        except _core.InvalidArgument as e:
            raise ApiError(400, str(e), param="grammar") from None
    if choice not in ("none", "auto"):
        forced = tools if choice == "required" else [t for t in tools if t["function"]["name"] == choice]
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise ApiError(400, "'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
        grammars.append(("tool_choice", constrained.lark_grammar(tool_calls.tool_call_grammar(
            family, forced, constrained.marker_spelling(tok), parallel=parallel))))
    if len(grammars) > 1:
        raise ApiError(400, f"{' and '.join(n for n, _ in grammars)} cannot be combined (one grammar per reply)",
                       param=grammars[1][0])
    mask = None
    if grammars:
        try:
            mask = constrained.GrammarMask(tok, grammars[0][1])
        except _core.InvalidArgument as e:
            raise ApiError(400, str(e), param=grammars[0][0]) from None
        except _core.UnsupportedError as e:
            raise ApiError(400, str(e), param=grammars[0][0]) from None
    if template is not None and "tool" not in template:
        messages = _hermes_history(messages)
    if tools and template is not None and "tools" not in template:
        # A template that cannot show tools (sharpi's ChatML fallback): teach the Hermes syntax in
        # the system message, as Qwen's templates do.
        prompt = tool_calls.hermes_tools_prompt(tools)
        if messages and messages[0].get("role") == "system":
            messages = [{**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}, *messages[1:]]
        else:
            messages = [{"role": "system", "content": prompt}, *messages]
    return ChatPlan(tools if choice != "none" else None, family, markers, mask=mask,
                    grammar=grammars[0] if grammars else None), messages


def close_reasoning_first(chat_plan: ChatPlan, tok) -> None:
    """A constrained reply (a forced tool call, response_format, grammar) whose prompt left a think
    block open (DeepSeek-R1's templates, Qwen3's with thinking on): the mask makes the reply close
    the block first, empty, so the call or the JSON is the answer (tool_calls, content), never
    swallowed into reasoning_content as an unclosed block would make it. The model gives up its
    reasoning for such a reply: a constrained part is enforced from the first token."""
    if chat_plan.mask is None or not chat_plan.start_in_reasoning or chat_plan.markers is None:
        return
    param, grammar = chat_plan.grammar
    wrapped = constrained.after_marker(grammar, constrained.marker_spelling(tok)(chat_plan.markers.close))
    try:
        chat_plan.mask = constrained.GrammarMask(tok, wrapped)
    except (_core.InvalidArgument, _core.UnsupportedError) as e:
        raise ApiError(400, str(e), param=param) from None


def message(chat_plan: ChatPlan, text: str, tok, finish_reason: str) -> tuple[dict, str]:
    """The assistant message of a finished reply and its finish_reason. `text`: the reply, with
    control tokens kept when it is parsed for calls (DeepSeek's and Mistral's markers are control
    tokens; Engine.submit keep_special)."""
    msg: dict = {"role": "assistant"}
    if chat_plan.markers is not None:
        reasoning_text, text = reasoning.split_reasoning(text, chat_plan.markers, chat_plan.start_in_reasoning)
        if reasoning_text:
            msg["reasoning_content"] = reasoning_text
    if chat_plan.tools:
        reply = tool_calls.parse_tool_calls(text, chat_plan.family, chat_plan.tools)
        if reply.tool_calls:
            for eog in (tok.id_to_token(i) for i in tok.eog_ids):
                reply.content = reply.content.replace(eog, "")
            msg["content"] = reply.content.strip() or None
            msg["tool_calls"] = reply.tool_calls
            return msg, "tool_calls"
    msg["content"] = text
    return msg, finish_reason


class ReplyStream:
    """message() for a reply that arrives in pieces: push(piece) and flush() give events in the
    order the reply says them, ("reasoning", text), ("content", text), ("call", index, id, name) and
    ("arguments", index, JSON fragment) (tool_calls.ToolCallStream); `n_calls` counts the calls, so
    the finish reason is "tool_calls" when there are any, as message() gives it."""

    def __init__(self, chat_plan: ChatPlan):
        self._splitter = None
        if chat_plan.markers is not None:
            self._splitter = reasoning.ReasoningSplitter(chat_plan.markers, chat_plan.start_in_reasoning)
        self._calls = tool_calls.ToolCallStream(chat_plan.family, chat_plan.tools) if chat_plan.tools else None

    @property
    def n_calls(self) -> int:
        return 0 if self._calls is None else len(self._calls.calls)

    def _events(self, thought: str, said: str, last: bool) -> list:
        events = [("reasoning", thought)] if thought else []
        if self._calls is None:
            return events + ([("content", said)] if said else [])
        return events + self._calls.push(said) + (self._calls.flush() if last else [])

    def push(self, piece: str) -> list:
        thought, said = self._splitter.push(piece) if self._splitter is not None else ("", piece)
        return self._events(thought, said, last=False)

    def flush(self) -> list:
        thought, said = self._splitter.flush() if self._splitter is not None else ("", "")
        return self._events(thought, said, last=True)
