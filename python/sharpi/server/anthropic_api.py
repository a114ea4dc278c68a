"""Anthropic's Messages protocol: POST /v1/messages (server-sent events with "stream": true) and
POST /v1/messages/count_tokens, for clients and agents written against Anthropic's API.

A request is translated into the OpenAI-shaped chat request the rest of the server already serves
(one pipeline: openai_api.chat_prompt renders it, agents.plan compiles its tool_choice into the
same constrained decoding as OpenAI's "required"/forced function, the scheduler runs it, stops.py
cuts it at stop_sequences, agents.message / agents.ReplyStream parse its reasoning and tool calls),
and the reply is written back in Anthropic's shapes:

- system (a string or text blocks) -> a system message; content blocks: text, tool_use (an
  assistant's call) -> tool_calls, tool_result (a string or text blocks) -> a `tool` message,
  thinking -> the assistant's reasoning_content. Image and document blocks are a 400: no model
  sharpi runs can see them.
- tools {name, description, input_schema} -> function tools; tool_choice auto / any / tool / none
  -> "auto" / "required" / that function / "none" (disable_parallel_tool_use: one call);
  thinking enabled / disabled -> the template's enable_thinking; a final assistant message is a
  prefill the reply continues.
- The reply's content blocks: thinking (reasoning), text, tool_use {id "toolu_...", input};
  stop_reason end_turn / max_tokens / stop_sequence (with the sequence) / tool_use.

Errors are in Anthropic's shape, {"type": "error", "error": {"type", "message"}} (errors.py), with
the same statuses as the OpenAI endpoints. Runs on the event loop; rendering and tokenizing run in
the thread pool (openai_api.chat_prompt).
"""

from __future__ import annotations

import json
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from .. import _core
from . import agents
from .errors import ApiError
from .openai_api import chat_options, chat_prompt, gather_unless_gone, read_body, submit_all, timings
from .served import ServedModel
from .stops import stream_until_stop


def error_response(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else None  # a full queue: try again
    return JSONResponse(e.anthropic_body(), status_code=e.status, headers=headers)


# ------------------------------------------------------------------ requests


def _unsupported(kind: str, where: str) -> ApiError:
    if kind in ("image", "document"):
        return ApiError(400, f"{where}: {kind} blocks are not supported: no model sharpi serves can see them",
                        param=where)
    return ApiError(400, f"{where}: content blocks of type {kind!r} are not supported here", param=where)


def _block(block, where: str) -> str:
    """A content block's type (ApiError 400 when it is not a block)."""
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise ApiError(400, f"{where} must be a content block, an object with a 'type'", param=where)
    return block["type"]


def _string(block: dict, key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{key} must be a string", param=where)
    return value


def _text(value, where: str) -> str:
    """The text of a string or a list of text blocks (system, a tool_result's content)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ApiError(400, f"{where} must be a string or a list of text blocks", param=where)
    texts = []
    for j, block in enumerate(value):
        kind = _block(block, f"{where}[{j}]")
        if kind != "text":
            raise _unsupported(kind, f"{where}[{j}]")
        texts.append(_string(block, "text", f"{where}[{j}]"))
    return "".join(texts)


def _user_turn(blocks: list, where: str, open_calls: set) -> list:
    """The chat messages of a user turn: a `tool` message per tool_result (which must answer
    every tool_use of the assistant turn before it, before any text), then the user's text."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _block(block, at)
        if kind == "text":
            texts.append(_string(block, "text", at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if call_id not in open_calls:
                raise ApiError(400, f"{at}: tool_result for {call_id!r}, which the assistant message before it "
                               "did not call (tool_use)", param=at)
            if texts:
                raise ApiError(400, f"{at}: tool_result blocks come first in a user message", param=at)
            results.append({"role": "tool", "tool_call_id": call_id,
                            "content": _text(block.get("content", ""), f"{at}.content")})
        else:
            raise _unsupported(kind, at)
    answered = {r["tool_call_id"] for r in results}
    if open_calls - answered:
        raise ApiError(400, f"{where} must answer each tool_use of the assistant message before it with a "
                       f"tool_result; missing: {', '.join(sorted(open_calls - answered))}", param=where)
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _assistant_turn(blocks: list, where: str) -> dict:
    """The chat message of an assistant turn: its text, its tool_use blocks as tool_calls (their
    input as a JSON string, as OpenAI's clients send arguments) and its thinking as reasoning."""
    texts, calls, thoughts = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _block(block, at)
        if kind == "text":
            texts.append(_string(block, "text", at))
        elif kind == "thinking":
            thoughts.append(_string(block, "thinking", at))
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic: nothing a local model could read
        elif kind == "tool_use":
            if not isinstance(block.get("input"), dict):
                raise ApiError(400, f"{at}.input must be an object", param=at)
            calls.append({"id": _string(block, "id", at), "type": "function",
                          "function": {"name": _string(block, "name", at),
                                       "arguments": json.dumps(block["input"], ensure_ascii=False)}})
        else:
            raise _unsupported(kind, at)
    msg = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    if thoughts:
        msg["reasoning_content"] = "".join(thoughts)
    return msg


def _messages(body: dict) -> tuple[list, str]:
    """The chat messages of a request (its system prompt first) and the prefill: the text of a
    final assistant message, which the reply continues."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text(body["system"], "system")})
    open_calls: set = set()  # the tool_use ids of the assistant turn just read
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"{where}.role must be 'user' or 'assistant' (the system prompt is the top-level "
                           "'system')", param=where)
        if i == 0 and m["role"] != "user":
            raise ApiError(400, "messages[0] must be a user message: a conversation starts with the user",
                           param=where)
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise ApiError(400, f"{where}.content must be a string or a list of content blocks", param=where)
        if m["role"] == "user":
            out += _user_turn(blocks, where, open_calls)
            open_calls = set()
        else:
            if open_calls:
                raise ApiError(400, f"{where}: the assistant's tool_use needs a user message with its tool_result "
                               "first", param=where)
            out.append(_assistant_turn(blocks, where))
            open_calls = {c["id"] for c in out[-1].get("tool_calls", [])}
    prefill = ""
    if messages[-1]["role"] == "assistant":
        last = out.pop()
        if last.get("tool_calls") or last.get("reasoning_content"):
            raise ApiError(400, "a final assistant message (a prefill) may hold only text", param="messages")
        prefill = last["content"]
    return out, prefill


def _tools(body: dict) -> list | None:
    """Anthropic's custom tools as OpenAI function tools; None for none."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list", param="tools")
    out = []
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise ApiError(400, f"{where} must be an object with a non-empty 'name'", param="tools")
        if tool.get("type") not in (None, "custom"):
            raise ApiError(400, f"{where}: Anthropic's server tools ({tool['type']!r}) are not available here; "
                           "give custom tools (name, description, input_schema)", param="tools")
        if not isinstance(tool.get("input_schema"), dict):
            raise ApiError(400, f"{where}.input_schema must be a JSON schema object", param="tools")
        # In the order OpenAI's clients write them: a template that prints the tool as JSON prints
        # the same text for the same tool through either endpoint.
        description = {"description": tool["description"]} if isinstance(tool.get("description"), str) else {}
        out.append({"type": "function", "function": {"name": tool["name"], **description,
                                                      "parameters": tool["input_schema"]}})
    return out or None


def _tool_choice(body: dict) -> dict:
    """OpenAI's tool_choice (and parallel_tool_calls) of Anthropic's tool_choice."""
    choice = body.get("tool_choice")
    if choice is None:
        return {}
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise ApiError(400, "tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', "
                       "'name': ...}", param="tool_choice")
    fields = {}
    single = choice.get("disable_parallel_tool_use")
    if single is not None:
        if not isinstance(single, bool):
            raise ApiError(400, "tool_choice.disable_parallel_tool_use must be true or false", param="tool_choice")
        fields["parallel_tool_calls"] = not single
    if choice["type"] == "tool":
        if not isinstance(choice.get("name"), str):
            raise ApiError(400, "tool_choice {'type': 'tool'} needs the tool's 'name'", param="tool_choice")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice["type"]]
    return fields


def _template_kwargs(body: dict) -> dict:
    """thinking enabled / disabled: the template's enable_thinking (Qwen3's; templates without
    reasoning ignore it). budget_tokens is checked but not enforced: max_tokens bounds the reply."""
    thinking = body.get("thinking")
    if thinking is None:
        return {}
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled"):
        raise ApiError(400, "thinking must be {'type': 'enabled', 'budget_tokens': N} or {'type': 'disabled'}",
                       param="thinking")
    if thinking["type"] == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ApiError(400, "thinking.budget_tokens must be a positive integer", param="thinking")
        # As Anthropic's API: a forced call leaves no room for reasoning before it (the grammar
        # starts the reply with the call, which a template's open think block would swallow).
        if isinstance(body.get("tool_choice"), dict) and body["tool_choice"].get("type") in ("any", "tool"):
            raise ApiError(400, "thinking may not be enabled when tool_choice forces tool use", param="thinking")
    return {"enable_thinking": thinking["type"] == "enabled"}


def _chat_body(body: dict, generating: bool = True) -> dict:
    """The OpenAI-shaped chat request the shared pipeline takes: tools and tool_choice and, for a
    request that generates (not count_tokens), the sampling fields (Anthropic's names are OpenAI's,
    temperature in [0, 1]) with max_tokens required."""
    chat = {}
    if generating:
        if body.get("max_tokens") is None:
            raise ApiError(400, "'max_tokens' is required", param="max_tokens")
        temperature = body.get("temperature")
        if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and not 0 <= temperature <= 1:
            raise ApiError(400, f"'temperature' must be between 0 and 1, got {temperature!r}", param="temperature")
        chat = {k: body[k] for k in ("max_tokens", "temperature", "top_p", "top_k") if body.get(k) is not None}
    tools = _tools(body)
    if tools is not None:
        chat["tools"] = tools
    return {**chat, **_tool_choice(body)}


def _stop_sequences(body: dict) -> list:
    stops = body.get("stop_sequences")
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "'stop_sequences' must be a list of non-empty strings", param="stop_sequences")
    return stops


async def _prompt(served: ServedModel, body: dict, generating: bool = True) -> tuple[dict, agents.ChatPlan, list]:
    """(the OpenAI-shaped request, its ChatPlan, the prompt ids) of a Messages request."""
    chat = _chat_body(body, generating)
    messages, prefill = _messages(body)
    plan, prompt_ids = await chat_prompt(served, chat, messages, _template_kwargs(body), prefill)
    return chat, plan, prompt_ids


# ------------------------------------------------------------------ responses


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _stop(job, has_calls: bool) -> dict:
    """stop_reason and stop_sequence of a finished Job."""
    if has_calls:
        reason = "tool_use"
    elif job.stop_sequence is not None:
        reason = "stop_sequence"
    else:
        reason = "max_tokens" if job.finish_reason == "length" else "end_turn"
    return {"stop_reason": reason, "stop_sequence": job.stop_sequence if reason == "stop_sequence" else None}


def _content(msg: dict) -> list:
    """The content blocks of agents.message's assistant message."""
    blocks = []
    if msg.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        blocks.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls", []):
        blocks.append({"type": "tool_use", "id": _tool_use_id(call["id"]), "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"])})
    return blocks


def _event(kind: str, data: dict) -> str:
    """One server-sent event as Anthropic sends them: an `event:` line naming the type, and the
    data with the same `type`."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class _StreamedBlocks:
    """agents.ReplyStream events as Anthropic's content block events: a block opens at the first
    event of its kind (content_block_start), takes deltas (text_delta, thinking_delta,
    input_json_delta) and stops when another kind begins. Whitespace-only text is held until text
    follows it, so the text before a tool call is not a block of its own (message() drops it too)."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None
        self.held = ""  # whitespace not yet in a text block

    def _stop(self) -> list:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def _start(self, kind: str, block: dict) -> list:
        out = self._stop()
        self.index += 1
        self.open = kind
        # A ping after the first block's start, where Anthropic's API sends one.
        ping = [_event("ping", {})] if self.index == 0 else []
        return out + [_event("content_block_start", {"index": self.index, "content_block": block})] + ping

    def _delta(self, delta: dict) -> str:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def write(self, events: list) -> list:
        out = []
        for event in events:
            kind = event[0]
            if kind == "reasoning":
                if self.open != "thinking":
                    out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": event[1]}))
            elif kind == "content":
                text = self.held + event[1]
                if self.open != "text" and not text.strip():
                    self.held = text
                    continue
                self.held = ""
                if self.open != "text":
                    out += self._start("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": text}))
            elif kind == "call":
                out += self._start("tool_use", {"type": "tool_use", "id": _tool_use_id(event[2]), "name": event[3],
                                                "input": {}})
            else:  # a fragment of the open call's input
                out.append(self._delta({"type": "input_json_delta", "partial_json": event[2]}))
        return out

    def close(self) -> list:
        return self._stop()


# ------------------------------------------------------------------ handlers


async def messages(request: Request, served: ServedModel):
    """POST /v1/messages: one reply, whole or as Anthropic's server-sent events."""
    engine = served.engine
    try:
        body = await read_body(request, served)
        if not isinstance(body.get("stream", False), bool):
            raise ApiError(400, "'stream' must be true or false", param="stream")
        stops = _stop_sequences(body)
        chat, plan, prompt_ids = await _prompt(served, body)
        options = chat_options(served, chat, plan, prompt_ids)
    except ApiError as e:
        return error_response(e)
    except _core.SharpiError as e:  # a template that refuses these messages
        return error_response(ApiError(400, str(e)))

    try:
        job, = submit_all(engine, [(prompt_ids, options, {"keep_special": bool(plan.tools)})])
    except ApiError as e:
        return error_response(e)
    head = {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant", "model": served.model_id}

    if body.get("stream"):
        async def events():
            yield _event("message_start", {"message": {
                **head, "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": len(prompt_ids), "output_tokens": 0}}})
            reply, blocks = agents.ReplyStream(plan), _StreamedBlocks()
            try:
                async for text, _ in stream_until_stop(engine, job, stops):
                    for chunk in blocks.write(reply.push(text)):
                        yield chunk
            except Exception as e:  # noqa: BLE001 - the status line is sent: report in-stream
                yield _event("error", {"error": ApiError(500, f"generation failed: {e}").anthropic_body()["error"]})
                return
            for chunk in blocks.write(reply.flush()) + blocks.close():
                yield chunk
            if blocks.index < 0:  # an empty reply still gets its ping
                yield _event("ping", {})
            request.state.generation = timings(job)  # for the access log line
            yield _event("message_delta", {"delta": _stop(job, reply.n_calls > 0),
                                           "usage": {"output_tokens": job.n_generated}})
            yield _event("message_stop", {})

        return StreamingResponse(events(), media_type="text/event-stream")

    try:
        gathered = await gather_unless_gone(request, engine, job, stops)
    except Exception as e:  # noqa: BLE001
        return error_response(ApiError(500, f"generation failed: {e}"))
    if gathered is None:
        return JSONResponse({}, status_code=499)
    msg, finish = agents.message(plan, gathered[0], engine.tokenizer, job.finish_reason)
    return JSONResponse({**head, "content": _content(msg), **_stop(job, finish == "tool_calls"),
                         "usage": {"input_tokens": len(prompt_ids), "output_tokens": job.n_generated}})


async def count_tokens(request: Request, served: ServedModel):
    """POST /v1/messages/count_tokens: the prompt tokens a Messages request would be."""
    try:
        body = await read_body(request, served)
        _chat, _plan, prompt_ids = await _prompt(served, body, generating=False)
    except ApiError as e:
        return error_response(e)
    except _core.SharpiError as e:
        return error_response(ApiError(400, str(e)))
    return JSONResponse({"input_tokens": len(prompt_ids)})
