"""`sharpi serve`'s Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens), driven by
the official `anthropic` client and by raw HTTP, on the shipped model (ChatML fallback, so the
Hermes tool syntax) and on real templates from llama.cpp's fixtures (Qwen3, Hermes 2 Pro).

Oracles: Session.generate in this process on the prompt written out here by hand (ChatML), or
rendered here by the template from the OpenAI-shaped conversation an OpenAI client would send for
the same turns: a greedy reply must be exactly its text, its token counts the usage; a forced
call's input validates against the tool's input_schema (jsonschema); a streamed reply, put
together from Anthropic's events as its streaming guide says, equals the whole reply of the same
greedy request; the error shape and statuses are Anthropic's documented ones.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import anthropic  # the test requirements install it: a missing one fails, never skips
import pytest
import sharpi
from reference import hf_export
from sharpi.models import default_model_path
from test_serve import MODEL_ID, N_CTX, chatml_ids, expected, start_server

jsonschema = pytest.importorskip("jsonschema")

TOOLS = [
    {"name": "get_weather", "description": "Weather of a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                      "required": ["city", "days"]}},
    {"name": "run", "input_schema": {"type": "object", "properties": {"cmd": {"type": "string", "maxLength": 10}},
                                     "required": ["cmd"]}},
]
USER = "Weather in Bern for 2 days?"


@pytest.fixture(scope="module")
def server():
    yield from start_server()


@pytest.fixture(scope="module")
def session():
    s = sharpi.Session(default_model_path(), threads=1, n_ctx=N_CTX)
    yield s
    s.close()


def client(port: int, api_key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=api_key, max_retries=0, timeout=120)


def post(port: int, path: str, body, headers: dict | None = None) -> tuple[int, dict, bytes]:
    """(status, lower-cased headers, body bytes) of a raw POST."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def sse_events(data: bytes) -> list:
    """(event line's name, data) of each server-sent event; the data's `type` must be the name."""
    out = []
    for block in data.decode("utf-8").split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        payload = json.loads(lines["data"])
        assert payload["type"] == lines["event"], block
        out.append((lines["event"], payload))
    return out


def assert_anthropic_error(status: int, data: bytes, want_status: int, want_type: str) -> str:
    body = json.loads(data)
    assert status == want_status, body
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == want_type, body
    assert body["error"]["message"]
    return body["error"]["message"]


def stop_reason_of(n_generated: int, max_tokens: int) -> str:
    return "max_tokens" if n_generated == max_tokens else "end_turn"


# ------------------------------------------------------------------ text


def test_plain_text_round_trip(server, session):
    ids = chatml_ids(session, "Sort a list")
    want, n_gen = expected(session, ids, max_tokens=16, temperature=0.0)
    r = client(server).messages.create(model=MODEL_ID, max_tokens=16, temperature=0,
                                       messages=[{"role": "user", "content": "Sort a list"}])
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant" and r.model == MODEL_ID
    assert [(b.type, b.text) for b in r.content] == [("text", want)]
    assert r.stop_reason == stop_reason_of(n_gen, 16) and r.stop_sequence is None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(ids), n_gen)


def test_system_prompt_and_count_tokens(server, session):
    text = ("<|im_start|>system\nYou write Python.<|im_end|>\n<|im_start|>user\nSort a list<|im_end|>\n"
            "<|im_start|>assistant\n")
    ids = session.tokenize(text, special=True)
    want, _ = expected(session, ids, max_tokens=12, temperature=0.0)
    c = client(server)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Sort "}, {"type": "text", "text": "a list"}]}]
    for system in ("You write Python.", [{"type": "text", "text": "You write "}, {"type": "text", "text": "Python."}]):
        r = c.messages.create(model=MODEL_ID, max_tokens=12, temperature=0, system=system, messages=messages)
        assert r.content[0].text == want and r.usage.input_tokens == len(ids)
        assert c.messages.count_tokens(model=MODEL_ID, system=system, messages=messages).input_tokens == len(ids)


def test_prefill_is_continued(server, session):
    """A final assistant message is written after the generation prompt and the reply continues it."""
    ids = session.tokenize("<|im_start|>user\nSort a list<|im_end|>\n<|im_start|>assistant\ndef sort(", special=True)
    want, _ = expected(session, ids, max_tokens=8, temperature=0.0)
    r = client(server).messages.create(model=MODEL_ID, max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "Sort a list"}, {"role": "assistant", "content": "def sort("}])
    assert r.content[0].text == want and r.usage.input_tokens == len(ids)


def test_max_tokens_and_stop_sequences(server, session):
    ids = chatml_ids(session, "Sort a list")
    full, n_full = expected(session, ids, max_tokens=24, temperature=0.0)
    assert n_full == 24, full  # the shipped model runs on: the limit is what stops it
    c = client(server)
    r = c.messages.create(model=MODEL_ID, max_tokens=3, temperature=0, messages=[{"role": "user", "content": "Sort a list"}])
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3 and full.startswith(r.content[0].text)
    stop = full[6:9]
    want = full[: full.index(stop)]
    for kw in ({}, {"stream": True}):
        r = c.messages.create(model=MODEL_ID, max_tokens=24, temperature=0, stop_sequences=["never here", stop],
                              messages=[{"role": "user", "content": "Sort a list"}], **kw)
        if kw:
            events = list(r)
            text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
            (delta,) = [e for e in events if e.type == "message_delta"]
            assert (text, delta.delta.stop_reason, delta.delta.stop_sequence) == (want, "stop_sequence", stop)
        else:
            assert ("".join(b.text for b in r.content), r.stop_reason, r.stop_sequence) == (want, "stop_sequence", stop)


def test_streamed_text_equals_the_whole_reply(server):
    kw = {"model": MODEL_ID, "max_tokens": 20, "temperature": 0, "system": "You write Python.",
          "messages": [{"role": "user", "content": "Sort a list"}]}
    whole = client(server).messages.create(**kw)
    status, headers, data = post(server, "/v1/messages", {**kw, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(data)
    names = [name for name, _ in events]
    # Anthropic's order: message_start, then each block's start, deltas and stop, message_delta, message_stop.
    assert names[:3] == ["message_start", "content_block_start", "ping"] and names.count("ping") == 1
    assert names[-2:] == ["message_delta", "message_stop"]
    blocks = [n for n in names if n.startswith("content_block")]
    assert blocks == ["content_block_start"] + ["content_block_delta"] * (len(blocks) - 2) + ["content_block_stop"]
    assert blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop" and len(blocks) >= 3
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == whole.usage.input_tokens
    text = "".join(e["delta"]["text"] for n, e in events if n == "content_block_delta")
    assert all(e["delta"]["type"] == "text_delta" and e["index"] == 0 for n, e in events if n == "content_block_delta")
    delta = events[-2][1]
    assert text == whole.content[0].text
    assert delta["delta"]["stop_reason"] == whole.stop_reason
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    # The official client's own accumulation gives the same message.
    with client(server).messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.text) for b in final.content] == [("text", whole.content[0].text)]
    assert final.stop_reason == whole.stop_reason


# ------------------------------------------------------------------ tools


@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "run"}])
def test_forced_tool_use(server, choice):
    """The shipped model writes Python, never a call: only the constrained decoder makes one."""
    for temperature in (0.0, 0.8):
        r = client(server).messages.create(model=MODEL_ID, max_tokens=300, temperature=temperature, tools=TOOLS,
                                           tool_choice=choice, messages=[{"role": "user", "content": USER}])
        assert r.stop_reason == "tool_use", r
        uses = [b for b in r.content if b.type == "tool_use"]
        # Parallel calls unless disable_parallel_tool_use says one.
        assert len(uses) == 1 if choice.get("disable_parallel_tool_use") else len(uses) >= 1, r
        assert len({u.id for u in uses}) == len(uses) and all(u.id.startswith("toolu_") for u in uses)
        for use in uses:
            if choice["type"] == "tool":
                assert use.name == "run"
            assert isinstance(use.input, dict)
            jsonschema.validate(use.input, next(t["input_schema"] for t in TOOLS if t["name"] == use.name))


def test_forced_tool_use_is_openais_required_call(server):
    """tool_choice any is OpenAI's "required": the same greedy call through either endpoint."""
    import openai

    r = client(server).messages.create(model=MODEL_ID, max_tokens=300, temperature=0, tools=TOOLS,
                                       tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                       messages=[{"role": "user", "content": USER}])
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="none", max_retries=0)
    o = oa.chat.completions.create(
        model=MODEL_ID, max_tokens=300, temperature=0, parallel_tool_calls=False, tool_choice="required",
        tools=[{"type": "function", "function": {"name": t["name"], **({"description": t["description"]}
               if "description" in t else {}), "parameters": t["input_schema"]}} for t in TOOLS],
        messages=[{"role": "user", "content": USER}])
    (use,) = [b for b in r.content if b.type == "tool_use"]
    (call,) = o.choices[0].message.tool_calls
    assert (use.name, use.input) == (call.function.name, json.loads(call.function.arguments))
    assert r.usage.input_tokens == o.usage.prompt_tokens


def test_streamed_tool_use_equals_the_whole_reply(server):
    kw = {"model": MODEL_ID, "max_tokens": 300, "temperature": 0, "tools": TOOLS,
          "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
          "messages": [{"role": "user", "content": USER}]}
    whole = client(server).messages.create(**kw)
    events = sse_events(post(server, "/v1/messages", {**kw, "stream": True})[2])
    starts = [e for n, e in events if n == "content_block_start" and e["content_block"]["type"] == "tool_use"]
    assert len(starts) == 1 and starts[0]["content_block"]["input"] == {}
    index = starts[0]["index"]
    fragments = [e["delta"]["partial_json"] for n, e in events
                 if n == "content_block_delta" and e["index"] == index]
    assert len(fragments) > 1  # token by token, not one piece at the end
    (use,) = [b for b in whole.content if b.type == "tool_use"]
    block = starts[0]["content_block"]
    assert (block["name"], json.loads("".join(fragments))) == (use.name, use.input)
    assert block["id"].startswith("toolu_")
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    with client(server).messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(use.name, use.input)]


def _template(name: str) -> str:
    try:
        return (Path(hf_export.converter_dir()) / "models" / "templates" / f"{name}.jinja").read_text("utf-8")
    except hf_export.ConverterUnavailable as error:
        pytest.skip(f"llama.cpp source unavailable: {error}")


@pytest.mark.parametrize("template_name", ["Qwen-Qwen3-0.6B", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use"])
def test_tool_result_round_trip(session, tmp_path, template_name):
    """A tool_use block and the tool_result fed back render as the template renders the OpenAI
    conversation of the same turns (an assistant message with tool_calls, then a `tool` message):
    the next greedy reply is Session.generate's on that prompt."""
    source = _template(template_name)  # Hermes 2 Pro's prints every tool's description: one that has it
    path = tmp_path / "t.jinja"
    path.write_text(source, encoding="utf-8")
    for port in start_server("--chat-template", str(path)):
        c = client(port)
        r = c.messages.create(model=MODEL_ID, max_tokens=300, temperature=0, tools=TOOLS[:1],
                              tool_choice={"type": "any", "disable_parallel_tool_use": True},
                              messages=[{"role": "user", "content": USER}])
        (use,) = [b for b in r.content if b.type == "tool_use"]
        history = [{"role": "user", "content": USER},
                   {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                 "content": [{"type": "text", "text": "21 C, sunny"}]}]}]
        r2 = c.messages.create(model=MODEL_ID, max_tokens=8, temperature=0, tools=TOOLS[:1], messages=history)
        n_counted = c.messages.count_tokens(model=MODEL_ID, tools=TOOLS[:1], messages=history).input_tokens
    tok = session.tokenizer
    openai_tools = [{"type": "function", "function": {"name": t["name"], **({"description": t["description"]}
                     if "description" in t else {}), "parameters": t["input_schema"]}} for t in TOOLS[:1]]
    said = "".join(b.text for b in r.content if b.type == "text")
    openai_history = [
        {"role": "user", "content": USER},
        # Arguments as an object, as both templates print a call (Hermes 2 Pro with tojson, which would
        # escape OpenAI's JSON text a second time; test_tool_calls.REAL_TEMPLATES).
        {"role": "assistant", "content": said, "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": use.input}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "21 C, sunny"}]
    prompt = tok.apply_chat_template(openai_history, template=source, tools=openai_tools, add_generation_prompt=True)
    assert "21 C, sunny" in prompt and use.name in prompt.split("21 C, sunny")[0]
    ids = tok.encode(prompt, add_bos=False if prompt.startswith(tok.id_to_token(tok.bos_id)) else None, special=True)
    want, _ = expected(session, ids, max_tokens=8, temperature=0.0)
    assert r2.usage.input_tokens == n_counted == len(ids)
    assert [(b.type, b.text) for b in r2.content] == [("text", want)]


THINKING_TEMPLATE = (  # ChatML whose generation prompt opens a think block when enable_thinking is on
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking %}{{ '<think>\\n' }}{% endif %}{% endif %}")


def test_thinking_enabled_and_disabled(session, tmp_path):
    path = tmp_path / "thinking.jinja"
    path.write_text(THINKING_TEMPLATE, encoding="utf-8")
    base = "<|im_start|>user\nSort a list<|im_end|>\n<|im_start|>assistant\n"
    thought, _ = expected(session, session.tokenize(base + "<think>\n", special=True), max_tokens=10, temperature=0.0)
    said, _ = expected(session, session.tokenize(base, special=True), max_tokens=10, temperature=0.0)
    assert "</think>" not in thought  # the shipped model never closes the block: all of it is thinking
    for port in start_server("--chat-template", str(path)):
        c = client(port)
        kw = {"model": MODEL_ID, "max_tokens": 10, "temperature": 0, "messages": [{"role": "user", "content": "Sort a list"}]}
        r = c.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **kw)
        assert [(b.type, b.thinking) for b in r.content] == [("thinking", thought.strip())]
        with c.messages.stream(thinking={"type": "enabled", "budget_tokens": 1024}, **kw) as stream:
            final = stream.get_final_message()
        assert [(b.type, b.thinking.strip()) for b in final.content] == [("thinking", thought.strip())]
        r = c.messages.create(thinking={"type": "disabled"}, **kw)
        assert [(b.type, b.text) for b in r.content] == [("text", said)]


# ------------------------------------------------------------------ errors and auth

GOOD = {"model": MODEL_ID, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body,needle", [
    ({k: v for k, v in GOOD.items() if k != "max_tokens"}, "max_tokens"),
    ({**GOOD, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "image"),
    ({**GOOD, "messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "hi"}]}, "messages[0]"),
    ({**GOOD, "messages": [{"role": "system", "content": "hi"}]}, "role"),
    ({**GOOD, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]}, "tool_use"),
    ({**GOOD, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "run", "input": {}}]}, {"role": "user", "content": "and?"}]},
     "tool_result"),
    ({**GOOD, "temperature": 1.5}, "temperature"),
    ({**GOOD, "stop_sequences": "END"}, "stop_sequences"),
    ({**GOOD, "tool_choice": {"type": "any"}}, "tools"),
    ({**GOOD, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({**GOOD, "tools": [{"name": "x"}]}, "input_schema"),
    ({**GOOD, "thinking": {"type": "enabled"}}, "budget_tokens"),
    ({**GOOD, "tools": TOOLS, "tool_choice": {"type": "any"}, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     "thinking may not be enabled"),
])
def test_bad_requests_get_anthropic_errors(server, body, needle):
    status, _, data = post(server, "/v1/messages", body)
    assert needle in assert_anthropic_error(status, data, 400, "invalid_request_error")


def test_the_official_client_raises_its_typed_errors(server):
    c = client(server)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=MODEL_ID, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert e.value.status_code == 400 and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    status, _, data = post(server, "/v1/messages", b"{not json")
    assert_anthropic_error(status, data, 400, "invalid_request_error")
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=60)
    conn.request("GET", "/v1/messages")
    resp = conn.getresponse()
    assert_anthropic_error(resp.status, resp.read(), 405, "invalid_request_error")
    conn.close()


def test_api_key_as_x_api_key():
    for port in start_server("--api-key", "k-right"):
        r = client(port, "k-right").messages.create(**GOOD)  # the official client sends x-api-key
        assert r.usage.output_tokens >= 1
        with pytest.raises(anthropic.AuthenticationError) as e:
            client(port, "k-wrong").messages.create(**GOOD)
        assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
        status, _, data = post(port, "/v1/messages/count_tokens", {"messages": GOOD["messages"]},
                               {"x-api-key": "k-wrong"})
        assert_anthropic_error(status, data, 401, "authentication_error")
        status, _, data = post(port, "/v1/messages/count_tokens", {"messages": GOOD["messages"]},
                               {"Authorization": "Bearer k-right"})
        assert status == 200 and json.loads(data)["input_tokens"] > 0


def test_each_request_is_one_log_line_with_its_generation():
    from test_serve_api import LINE, Server

    s = Server()
    try:
        r = client(s.port).messages.create(**GOOD)
        with client(s.port).messages.stream(**GOOD) as stream:
            streamed = stream.get_final_message()
        client(s.port).messages.count_tokens(model=MODEL_ID, messages=GOOD["messages"])
        lines = s.log_lines(3)
    finally:
        s.stop()
    parsed = [LINE.match(line.rstrip("\n")) for line in lines]
    assert all(parsed), lines
    assert [(m[1], m[2], m[3]) for m in parsed] == [
        ("POST", "/v1/messages", "200"), ("POST", "/v1/messages", "200"), ("POST", "/v1/messages/count_tokens", "200")]
    for m, usage in zip(parsed, (r.usage, streamed.usage)):
        assert f"| prompt {usage.input_tokens} tokens " in m[5] and f", {usage.output_tokens} tokens generated" in m[5]
    assert not parsed[2][5]  # counting generates nothing
