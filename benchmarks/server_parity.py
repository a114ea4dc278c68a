"""`sharpi serve` and llama.cpp's `llama-server` side by side, request by request (issue 43,
acceptance 4; not in CI, not a test: it records what each server does, it asserts nothing).

Both servers load the same GGUF file (default: the shipped model) with the same chat template
(default: llama.cpp's own Qwen3-0.6B fixture, which renders tools), one thread, the same context,
and the same model alias, so a request is sent to both as the same bytes. llama-server is the one
tools/build_llama_tools.sh --server builds from the llama.cpp vendored in the llama-cpp-python
source package (or --llama-server PATH). A second pair of servers loads a model with fill-in-the-middle
tokens (sharpi make-model --fim), for `suffix`; one of its requests goes to llama-server's /infill
instead (the one request not sent as the same bytes: llama-server does fill-in-the-middle only there).
A third pair runs with an API key (and, for sharpi, a CORS origin) for the requests about access.

For every request the table shows, for sharpi and llama-server: the HTTP status; the error's shape
(the keys of its error object and its type); finish_reason (or Anthropic's stop_reason); how many
tool calls came back; the prompt and completion tokens its usage counts; for a stream, the events'
shape (count, object/event kinds, the [DONE] terminator); the response fields only one of them sent; and, for greedy requests both answered with
200, whether the generated text (or token ids) is the same ("sampled/constrained" where sampling or
a different constraint engine may rightly pick other tokens). Fields one server adds to nearly every
generation answer (timings...) are listed once above the table. Below it: each side's status,
seconds, and error message or first characters. Beside the table, in OUT's stem + "-logs/": both
servers' logs and every raw answer (responses.jsonl), so a difference can be explained from the
record; docs/server_parity.md is such a record with the reasons.

    PYTHONPATH=python python benchmarks/server_parity.py --out /tmp/parity/table.md
    python benchmarks/server_parity.py --llama-server /path/to/llama-server --model FILE.gguf \\
        --chat-template FILE.jinja --out table.md
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import io
import json
import socket
import subprocess
import sys
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ALIAS = "parity"
API_KEY = "sk-parity-test"
CTX = 2048
SERVE_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 600

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "properties": {"cmd": {"type": "string", "maxLength": 10}}, "required": ["cmd"]}}}]
MESSAGES = [{"role": "user", "content": "Write a function that adds two numbers."}]
WEATHER = [{"role": "user", "content": "Weather in Bern for 2 days?"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "n"], "additionalProperties": False}
# A minimal one-page PDF (a real document, so a refusal is about the part's kind; the WAV is
# wav_silence()).
PDF_PAGE = base64.b64encode(b"%PDF-1.1\n1 0 obj<</Type/Catalog/Pages 2 0 R>>endobj\n"
                            b"2 0 obj<</Type/Pages/Kids[3 0 R]/Count 1>>endobj\n"
                            b"3 0 obj<</Type/Page/Parent 2 0 R/MediaBox[0 0 612 792]>>endobj\n"
                            b"trailer<</Root 1 0 R>>\n%%EOF\n").decode()
FIM_PREFIX, FIM_SUFFIX = "def add(a, b):\n", "\n    return c\n"
# A 1x1 PNG: a real image, so a refusal is about images, not about a malformed data URL.
PNG_1X1 = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")


@dataclass
class Case:
    """One request. body: a dict (sent as JSON), bytes (sent as they are), or a function of the
    context (values learned before the suite, e.g. token ids) returning either. greedy: the text (or
    the token ids) of two 200 answers is expected to be the same (temperature 0, no sampling left)."""

    name: str
    method: str
    path: str
    body: object = None
    headers: dict = field(default_factory=dict)
    greedy: bool = False
    pair: str = "main"  # "main", "auth" (the servers started with an API key) or "fim" (a model with FIM tokens)
    # (path, body) sent to llama-server instead, where it has the same feature at another endpoint
    # (fill-in-the-middle: /infill); None: the same request to both.
    llama: tuple | None = None


def chat(**kw) -> dict:
    return {"model": ALIAS, "messages": MESSAGES, "max_tokens": 24, "temperature": 0, **kw}


def completion(**kw) -> dict:
    return {"model": ALIAS, "prompt": "def fib(n):", "max_tokens": 24, "temperature": 0, **kw}


def anthropic(**kw) -> dict:
    return {"model": ALIAS, "max_tokens": 24, "messages": MESSAGES, "temperature": 0, **kw}


ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01"}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def wav_silence(seconds: float = 0.1, rate: int = 8000) -> str:
    """Base64 of a mono 16-bit WAV file of `seconds` of silence."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\0\0" * int(seconds * rate))
    return base64.b64encode(buf.getvalue()).decode()


def big_chat(size: int) -> bytes:
    """A chat body of about `size` bytes: one user message of words (a long prompt, not padding)."""
    words = ("lorem ipsum dolor sit amet " * (size // 27 + 1))[: size - 200]
    return json.dumps(chat(messages=[{"role": "user", "content": words}], max_tokens=4)).encode()


def suite() -> list[Case]:
    g = {"greedy": True}
    return [
        Case("GET /health", "GET", "/health"),
        Case("GET /v1/models", "GET", "/v1/models"),
        Case("GET /props", "GET", "/props"),
        Case("GET /metrics", "GET", "/metrics"),
        Case("POST /tokenize", "POST", "/tokenize", {"content": "def fib(n):\n    return n"}, **g),
        Case("POST /tokenize with_pieces", "POST", "/tokenize", {"content": "def f():", "with_pieces": True}, **g),
        Case("POST /detokenize", "POST", "/detokenize", lambda ctx: {"tokens": ctx["fib_ids"]}, **g),
        Case("chat, greedy", "POST", "/v1/chat/completions", chat(), **g),
        Case("chat, greedy, stream", "POST", "/v1/chat/completions", chat(stream=True), **g),
        Case("chat, stream with include_usage", "POST", "/v1/chat/completions",
             chat(stream=True, stream_options={"include_usage": True}), **g),
        Case("completions, greedy", "POST", "/v1/completions", completion(), **g),
        Case("completions, greedy, stream", "POST", "/v1/completions", completion(stream=True), **g),
        Case("tools, tool_choice auto", "POST", "/v1/chat/completions",
             chat(messages=WEATHER, tools=TOOLS, max_tokens=48), **g),
        Case("tools, tool_choice required", "POST", "/v1/chat/completions",
             chat(messages=WEATHER, tools=TOOLS, tool_choice="required", max_tokens=96)),
        Case("tools, forced function", "POST", "/v1/chat/completions",
             chat(messages=WEATHER, tools=TOOLS, max_tokens=96,
                  tool_choice={"type": "function", "function": {"name": "run"}})),
        Case("tools, required, enable_thinking false", "POST", "/v1/chat/completions",
             chat(messages=WEATHER, tools=TOOLS, tool_choice="required", max_tokens=96,
                  chat_template_kwargs={"enable_thinking": False})),
        Case("tools, tool_choice none", "POST", "/v1/chat/completions",
             chat(messages=WEATHER, tools=TOOLS, tool_choice="none", max_tokens=24), **g),
        Case("tools, required, stream", "POST", "/v1/chat/completions",
             chat(messages=WEATHER, tools=TOOLS, tool_choice="required", max_tokens=96, stream=True)),
        Case("tool result round trip", "POST", "/v1/chat/completions", chat(
            messages=[*WEATHER, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Bern", "days": 2}'}}]},
                      {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}],
            tools=TOOLS, max_tokens=16), **g),
        Case("response_format json_object", "POST", "/v1/chat/completions",
             chat(response_format={"type": "json_object"}, max_tokens=64)),
        Case("response_format json_schema", "POST", "/v1/chat/completions",
             chat(max_tokens=64, response_format={"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}})),
        Case("json_schema, enable_thinking false", "POST", "/v1/chat/completions",
             chat(max_tokens=64, chat_template_kwargs={"enable_thinking": False},
                  response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}})),
        Case("grammar (GBNF)", "POST", "/v1/chat/completions", chat(grammar='root ::= "yes" | "no"', max_tokens=8)),
        Case("grammar, undefined rule", "POST", "/v1/chat/completions", chat(grammar="root ::= undefined")),
        Case("chat logprobs, top_logprobs 3", "POST", "/v1/chat/completions",
             chat(logprobs=True, top_logprobs=3, max_tokens=4), **g),
        Case("completions logprobs 3", "POST", "/v1/completions", completion(logprobs=3, max_tokens=4), **g),
        Case("chat n=2", "POST", "/v1/chat/completions", chat(n=2, temperature=0.8, seed=1, max_tokens=8)),
        Case("completions n=2", "POST", "/v1/completions", completion(n=2, temperature=0.8, seed=1, max_tokens=8)),
        Case("completions echo", "POST", "/v1/completions", completion(echo=True, max_tokens=8), **g),
        Case("completions suffix", "POST", "/v1/completions",
             completion(prompt="def add(a, b):\n", suffix="\n    return c\n", max_tokens=8), **g),
        Case("completions, the suffix case's prompt without it", "POST", "/v1/completions",
             completion(prompt="def add(a, b):\n", max_tokens=8), **g),
        Case("completions, token-id prompt", "POST", "/v1/completions",
             lambda ctx: completion(prompt=ctx["fib_ids"]), **g),
        Case("completions, list of 2 prompts", "POST", "/v1/completions",
             completion(prompt=["def fib(n):", "import os"], max_tokens=8), **g),
        # Added after n, prompt lists, echo, suffix, logit_bias and the 400s for unimplemented fields landed.
        Case("chat n=3, temperature 0", "POST", "/v1/chat/completions", chat(n=3, max_tokens=8), **g),
        Case("completions n=3, seed 7, temperature 0.8", "POST", "/v1/completions",
             completion(n=3, seed=7, temperature=0.8, max_tokens=8)),
        Case("completions, list of 2 token-id prompts", "POST", "/v1/completions",
             lambda ctx: completion(prompt=[ctx["fib_ids"], ctx["os_ids"]], max_tokens=8), **g),
        Case("completions echo + logprobs 2", "POST", "/v1/completions",
             completion(echo=True, logprobs=2, max_tokens=4), **g),
        Case("completions echo, token-id prompt", "POST", "/v1/completions",
             lambda ctx: completion(prompt=ctx["fib_ids"], echo=True, max_tokens=4), **g),
        Case("logit_bias +100 on ' pass'", "POST", "/v1/completions",
             lambda ctx: completion(logit_bias={str(ctx["pass_id"]): 100}, max_tokens=4), **g),
        Case("chat logit_bias -100 on the greedy first token", "POST", "/v1/chat/completions",
             lambda ctx: chat(logit_bias={str(ctx["chat_first_id"]): -100}, max_tokens=8), **g),
        Case("tools, required, parallel_tool_calls false", "POST", "/v1/chat/completions",
             chat(messages=WEATHER, tools=TOOLS, tool_choice="required", max_tokens=96, parallel_tool_calls=False)),
        Case("store true", "POST", "/v1/chat/completions", chat(store=True, max_tokens=4)),
        Case("modalities [text, audio] + audio", "POST", "/v1/chat/completions",
             chat(modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"}, max_tokens=4)),
        Case("prediction (predicted outputs)", "POST", "/v1/chat/completions",
             chat(prediction={"type": "content", "content": "def add(a, b):"}, max_tokens=4)),
        Case("service_tier flex", "POST", "/v1/chat/completions", chat(service_tier="flex", max_tokens=4)),
        Case("input_audio part", "POST", "/v1/chat/completions", chat(max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "input_audio", "input_audio": {"data": wav_silence(), "format": "wav"}}]}])),
        Case("file part", "POST", "/v1/chat/completions", chat(max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "file", "file": {"filename": "a.pdf", "file_data": f"data:application/pdf;base64,{PDF_PAGE}"}}]}])),
        Case("Anthropic image block", "POST", "/v1/messages", anthropic(max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_1X1}}]}]),
             ANTHROPIC_HEADERS),
        Case("Anthropic system + stop_sequences", "POST", "/v1/messages",
             anthropic(system="You write Python.", stop_sequences=[">"]), ANTHROPIC_HEADERS, greedy=True),
        Case("presence 1.5 + frequency 1.0 penalty", "POST", "/v1/chat/completions",
             chat(presence_penalty=1.5, frequency_penalty=1.0, max_tokens=32), **g),
        Case("logit_bias -100 on the greedy first token", "POST", "/v1/completions",
             lambda ctx: completion(logit_bias={str(ctx["first_id"]): -100}, max_tokens=8), **g),
        Case("repeat_penalty 1.3 (llama.cpp's)", "POST", "/v1/chat/completions", chat(repeat_penalty=1.3), **g),
        Case("seed 42, temperature 0.9", "POST", "/v1/chat/completions", chat(seed=42, temperature=0.9)),
        Case("stop [\"\\n\"]", "POST", "/v1/chat/completions", chat(stop=["\n"]), **g),
        Case("max_tokens 1", "POST", "/v1/chat/completions", chat(max_tokens=1), **g),
        Case("malformed JSON", "POST", "/v1/chat/completions", b'{"model": "parity", "messages": ['),
        Case("body not an object", "POST", "/v1/chat/completions", b"[1, 2]"),
        Case("messages missing", "POST", "/v1/chat/completions", {"model": ALIAS, "max_tokens": 4}),
        Case("unknown model", "POST", "/v1/chat/completions", chat(model="no-such-model", max_tokens=4)),
        Case("temperature -1", "POST", "/v1/chat/completions", chat(temperature=-1, max_tokens=4)),
        Case("top_p 2", "POST", "/v1/chat/completions", chat(top_p=2, max_tokens=4)),
        Case("max_tokens -5", "POST", "/v1/chat/completions", chat(max_tokens=-5)),
        Case("n 0", "POST", "/v1/chat/completions", chat(n=0, max_tokens=4)),
        Case("temperature as a string", "POST", "/v1/chat/completions", chat(temperature="hot", max_tokens=4)),
        Case("image_url part", "POST", "/v1/chat/completions", chat(max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG_1X1}"}}]}])),
        Case("4 MB chat body", "POST", "/v1/chat/completions", big_chat(4 * 2**20)),
        Case("10 MB chat body", "POST", "/v1/chat/completions", big_chat(10 * 2**20)),
        Case("GET on a POST route", "GET", "/v1/chat/completions"),
        Case("unknown path", "GET", "/v1/nothing-here"),
        Case("CORS preflight, default flags", "OPTIONS", "/v1/chat/completions", None, {
            "Origin": "http://example.com", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,authorization"}),
        Case("Anthropic /v1/messages", "POST", "/v1/messages", anthropic(), ANTHROPIC_HEADERS, greedy=True),
        Case("Anthropic /v1/messages, stream", "POST", "/v1/messages", anthropic(stream=True), ANTHROPIC_HEADERS,
             greedy=True),
        Case("Anthropic tools, tool_choice any", "POST", "/v1/messages", anthropic(
            messages=WEATHER, max_tokens=96, tool_choice={"type": "any"},
            tools=[{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]), ANTHROPIC_HEADERS),
        Case("Anthropic, max_tokens missing", "POST", "/v1/messages",
             {"model": ALIAS, "messages": MESSAGES}, ANTHROPIC_HEADERS),
        Case("Anthropic count_tokens", "POST", "/v1/messages/count_tokens",
             {"model": ALIAS, "messages": MESSAGES}, ANTHROPIC_HEADERS, greedy=True),
        # A model with fill-in-the-middle tokens (make-model --fim), on a third pair of servers.
        Case("FIM model: completions suffix", "POST", "/v1/completions",
             completion(prompt=FIM_PREFIX, suffix=FIM_SUFFIX, max_tokens=8), greedy=True, pair="fim"),
        Case("FIM model: the same prompt without suffix", "POST", "/v1/completions",
             completion(prompt=FIM_PREFIX, max_tokens=8), greedy=True, pair="fim"),
        Case("FIM model: suffix, llama-server at /infill", "POST", "/v1/completions",
             completion(prompt=FIM_PREFIX, suffix=FIM_SUFFIX, max_tokens=8), greedy=True, pair="fim",
             llama=("/infill", {"input_prefix": FIM_PREFIX, "input_suffix": FIM_SUFFIX, "n_predict": 8,
                                "temperature": 0})),
        Case("FIM model: POST /infill", "POST", "/infill",
             {"input_prefix": FIM_PREFIX, "input_suffix": FIM_SUFFIX, "n_predict": 8, "temperature": 0}, pair="fim"),
        Case("FIM model: suffix + echo", "POST", "/v1/completions",
             completion(prompt=FIM_PREFIX, suffix=FIM_SUFFIX, echo=True, max_tokens=8), pair="fim"),
        # With --api-key on both (and sharpi --cors-origin '*', llama-server's default).
        Case("api key: none sent", "POST", "/v1/chat/completions", chat(max_tokens=4), pair="auth"),
        Case("api key: wrong", "POST", "/v1/chat/completions", chat(max_tokens=4),
             {"Authorization": "Bearer wrong"}, pair="auth"),
        Case("api key: right", "POST", "/v1/chat/completions", chat(max_tokens=4), AUTH, greedy=True, pair="auth"),
        Case("api key: x-api-key header", "POST", "/v1/messages", anthropic(max_tokens=4),
             {**ANTHROPIC_HEADERS, "x-api-key": API_KEY}, greedy=True, pair="auth"),
        Case("api key: GET /health without it", "GET", "/health", pair="auth"),
        Case("api key: GET /v1/models without it", "GET", "/v1/models", pair="auth"),
        Case("api key: CORS preflight without it", "OPTIONS", "/v1/chat/completions", None, {
            "Origin": "http://example.com", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,authorization"}, pair="auth"),
    ]


# ------------------------------------------------------------------ servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, headers as a lower-cased dict, body bytes, seconds) of one request on a new connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    hdrs = dict(headers or {})
    if body is not None:
        hdrs.setdefault("Content-Type", "application/json")
    t0 = time.monotonic()
    try:
        conn.request(method, path, body=body, headers=hdrs)
        r = conn.getresponse()
        data = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, data, time.monotonic() - t0
    finally:
        conn.close()


@contextlib.contextmanager
def started(name: str, cmd: list[str], port: int, log: Path):
    """Runs cmd until the block ends; yields once GET /health answers 200."""
    with open(log, "wb") as out:
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + SERVE_TIMEOUT_S
            while True:
                if child.poll() is not None:
                    raise SystemExit(f"{name} exited with {child.returncode}; log: {log}\n{log.read_text()[-3000:]}")
                with contextlib.suppress(OSError):
                    if request(port, "GET", "/health")[0] == 200:
                        break
                if time.monotonic() > deadline:
                    raise SystemExit(f"{name} did not answer /health within {SERVE_TIMEOUT_S} s; log: {log}")
                time.sleep(0.3)
            yield port
        finally:
            child.terminate()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def sharpi_cmd(args, port: int, auth: bool) -> list[str]:
    cmd = [sys.executable, "-m", "sharpi.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.threads), "-c", str(CTX), "--alias", ALIAS, "--chat-template", str(args.chat_template)]
    if args.model:
        cmd += ["-m", str(args.model)]
    if auth:
        cmd += ["--api-key", API_KEY, "--cors-origin", "*"]
    return cmd


def llama_cmd(args, port: int, auth: bool) -> list[str]:
    model = args.model or REPO / "python" / "sharpi" / "models" / "stdlib-moe-q8_0.gguf"
    cmd = [str(args.llama_server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.threads), "-tb", str(args.threads), "-c", str(CTX), "--alias", ALIAS,
           "--jinja", "--chat-template-file", str(args.chat_template), "--metrics", "--no-webui"]
    if auth:
        cmd += ["--api-key", API_KEY]
    return cmd


# ------------------------------------------------------------------ what came back


def key_paths(obj, prefix: str = "", depth: int = 0) -> set[str]:
    """Dotted paths of every key (a list as its first element, "[]"), four levels deep."""
    out: set[str] = set()
    if depth > 4:
        return out
    if isinstance(obj, dict):
        for k, v in obj.items():
            p = f"{prefix}.{k}" if prefix else str(k)
            out.add(p)
            out |= key_paths(v, p, depth + 1)
    elif isinstance(obj, list) and obj and isinstance(obj[0], (dict, list)):
        out |= key_paths(obj[0], prefix + "[]", depth + 1)
    return out


def sse_events(text: str) -> list[tuple[str, str]]:
    """(event name or "", data) of each server-sent event."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data = "", []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if name or data:
            events.append((name, "\n".join(data)))
    return events


@dataclass
class Seen:
    status: int
    error: str = ""  # the error object's shape, "" when none
    message: str = ""  # an error's message, or the first characters of the body
    fields: set = field(default_factory=set)
    finish: str = ""
    tool_calls: int | None = None
    stream: str = ""
    text: str | None = None
    extra: str = ""  # a line of case-specific detail (first logprob, CORS headers...)
    seconds: float = 0.0
    usage: str = ""  # "prompt/completion" tokens as the answer's usage counts them


def error_shape(obj) -> tuple[str, str]:
    err = obj.get("error") if isinstance(obj, dict) else None
    if err is None:
        return "", ""
    if isinstance(err, dict):
        kind = err.get("type", "")
        shape = "{" + ",".join(sorted(err)) + "}"
        if obj.get("type") == "error":  # Anthropic's envelope
            shape = "anthropic " + shape
        return f"{shape} {kind}".strip(), str(err.get("message", ""))
    return "error: " + type(err).__name__, str(err)


def choice_text(c: dict) -> str | None:
    if "message" in c:
        m = c["message"] or {}
        return (m.get("reasoning_content") or "") + (m.get("content") or "")
    return c.get("text")


def anthropic_summary(obj: dict, seen: Seen) -> None:
    blocks = obj.get("content") or []
    seen.text = "".join(b.get("text", "") + b.get("thinking", "") for b in blocks if isinstance(b, dict))
    seen.tool_calls = sum(1 for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use")
    seen.finish = str(obj.get("stop_reason", ""))


def number(x) -> str:
    """A log-probability as three decimals (None: the first prompt token of an echo has none)."""
    return f"{x:.3f}" if isinstance(x, (int, float)) else repr(x)


def usage_text(usage) -> str:
    """"prompt/completion" from OpenAI's usage or Anthropic's (whose input_tokens leave out the
    tokens read from or written to a prompt cache: they are added back, so both count the prompt)."""
    if not isinstance(usage, dict):
        return ""
    if "input_tokens" in usage:
        prompt = sum(usage.get(k) or 0 for k in ("input_tokens", "cache_read_input_tokens",
                                                  "cache_creation_input_tokens"))
        return f"{prompt}/{usage.get('output_tokens', '?')}"
    return f"{usage.get('prompt_tokens', '?')}/{usage.get('completion_tokens', '?')}"


def summarize_json(obj, seen: Seen) -> None:
    seen.fields = key_paths(obj)
    seen.usage = usage_text(obj.get("usage")) if isinstance(obj, dict) else ""
    if isinstance(obj, dict) and "tokens_evaluated" in obj:  # llama-server's /infill, /completion
        seen.usage = f"{obj['tokens_evaluated']}/{obj.get('tokens_predicted', '?')}"
    seen.error, msg = error_shape(obj)
    if seen.error:
        seen.message = msg
        return
    if isinstance(obj, dict) and obj.get("type") == "message":
        anthropic_summary(obj, seen)
        return
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if isinstance(choices, list) and choices:
        seen.finish = ",".join(str(c.get("finish_reason")) for c in choices)
        seen.tool_calls = sum(len((c.get("message") or {}).get("tool_calls") or []) for c in choices)
        texts = [choice_text(c) for c in choices]
        seen.text = " | ".join(t or "" for t in texts)
        lp = choices[0].get("logprobs")
        if isinstance(lp, dict):
            if lp.get("content"):
                first = lp["content"][0]
                tops = [t.get("token") for t in first.get("top_logprobs") or []]
                seen.extra = f"first token {first.get('token')!r} logprob {number(first.get('logprob'))}, top {tops}"
            elif lp.get("tokens"):
                seen.extra = (f"{len(lp['tokens'])} tokens, first {lp['tokens'][0]!r} logprob "
                              f"{number(lp['token_logprobs'][0])}, top {list((lp.get('top_logprobs') or [{}])[0] or {})}")
    elif isinstance(obj, dict) and "input_tokens" in obj:
        seen.text = str(obj["input_tokens"])
    elif isinstance(obj, dict) and "content" in obj and isinstance(obj["content"], str):  # /detokenize, /infill
        seen.text = obj["content"]
    elif isinstance(obj, dict) and "tokens" in obj:
        seen.text = json.dumps(obj["tokens"])


def _anthropic_start_usage(datas: list) -> dict:
    """The usage of an Anthropic stream's message_start (input tokens), which message_delta may leave out."""
    for obj in datas:
        if obj.get("type") == "message_start":
            return dict((obj.get("message") or {}).get("usage") or {})
    return {}


def summarize_stream(body: str, seen: Seen) -> None:
    events = sse_events(body)
    datas, names, done, text, finishes, calls = [], [], False, "", [], set()
    anthropic_calls = 0
    for name, data in events:
        if name:
            names.append(name)
        if data == "[DONE]":
            done = True
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            continue
        datas.append(obj)
        for usage in (obj.get("usage"), (obj.get("message") or {}).get("usage")):
            if isinstance(usage, dict):  # the last one wins: Anthropic's message_delta, OpenAI's usage chunk
                if "output_tokens" in usage:  # Anthropic's message_delta may leave out the input tokens
                    usage = {**_anthropic_start_usage(datas), **usage}
                seen.usage = usage_text(usage)
        if error_shape(obj)[0]:
            seen.error, seen.message = error_shape(obj)
            seen.error = "in-stream " + seen.error
        if obj.get("type") == "content_block_start" and (obj.get("content_block") or {}).get("type") == "tool_use":
            anthropic_calls += 1
        if obj.get("type") == "content_block_delta":
            d = obj.get("delta") or {}
            text += d.get("text", "") + d.get("thinking", "")
        if obj.get("type") == "message_delta":
            finishes.append(str((obj.get("delta") or {}).get("stop_reason")))
        for c in obj.get("choices") or []:
            d = c.get("delta") or {}
            text += (d.get("reasoning_content") or "") + (d.get("content") or "") + (c.get("text") or "")
            for tc in d.get("tool_calls") or []:
                calls.add(tc.get("index"))
            if c.get("finish_reason"):
                finishes.append(str(c["finish_reason"]))
    fields: set[str] = set()
    for obj in datas:
        fields |= key_paths(obj, "chunk")
    seen.fields = fields
    kinds = sorted(set(names)) or sorted({str(o.get("object", "?")) for o in datas})
    usage_last = bool(datas) and bool(datas[-1].get("usage")) and not datas[-1].get("choices")
    seen.stream = (f"{len(events)} events: {'/'.join(kinds)}" + (", [DONE]" if done else ", no [DONE]")
                   + (", usage chunk last" if usage_last else ""))
    seen.text = text
    seen.finish = ",".join(finishes)
    seen.tool_calls = len(calls) if not names else anthropic_calls


def summarize(status: int, headers: dict, body: bytes) -> Seen:
    seen = Seen(status)
    ctype = headers.get("content-type", "")
    text = body.decode("utf-8", "replace")
    if "text/event-stream" in ctype:
        summarize_stream(text, seen)
    else:
        try:
            obj = json.loads(text) if text.strip() else None
        except ValueError:
            obj = None
        if obj is None and "# TYPE " in text:  # Prometheus text: the metric families are its fields
            seen.fields = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
            seen.message = f"{len(seen.fields)} metric families"
        elif obj is None:
            seen.message = (ctype.split(";")[0] + ": " if ctype else "") + text[:160].replace("\n", " ")
        else:
            summarize_json(obj, seen)
            if not seen.message and status >= 400:
                seen.message = text[:160]
    # llama-server sends an empty Access-Control-Allow-Origin on every answer: only set ones count.
    cors = {k: v for k, v in headers.items() if k.startswith("access-control-") and v}
    if cors:
        seen.extra = "; ".join(filter(None, [seen.extra, *(f"{k}: {v}" for k, v in sorted(cors.items()))]))
    return seen


# ------------------------------------------------------------------ the table


def cell(value) -> str:
    s = str(value if value is not None else "—") or "—"
    return s.replace("|", "\\|").replace("\n", "\\n")


def pair_cell(a, b) -> str:
    a, b = cell(a), cell(b)
    return a if a == b else f"{a} / {b}"


def field_name(path: str) -> str:
    return path.removeprefix("chunk.")


def common_differences(rows: list[tuple[Case, Seen, Seen]]) -> tuple[set, set]:
    """Fields one server adds to (nearly) every generation answer (timings, system_fingerprint...):
    those seen only on one side in at least half the rows both answered with 200. Listed once
    above the table instead of in every row."""
    both = [(s, ll) for _, s, ll in rows if s.status == ll.status == 200 and (s.finish or ll.finish)]
    counts_s: dict[str, int] = {}
    counts_l: dict[str, int] = {}
    for s, ll in both:
        for f in {field_name(x) for x in s.fields} - {field_name(x) for x in ll.fields}:
            counts_s[f] = counts_s.get(f, 0) + 1
        for f in {field_name(x) for x in ll.fields} - {field_name(x) for x in s.fields}:
            counts_l[f] = counts_l.get(f, 0) + 1
    half = max(1, len(both) // 2)
    return {f for f, n in counts_s.items() if n >= half}, {f for f, n in counts_l.items() if n >= half}


def fields_cell(s: Seen, ll: Seen, common: tuple[set, set]) -> str:
    only_s = sorted(f for f in s.fields - ll.fields if field_name(f) not in common[0])
    only_l = sorted(f for f in ll.fields - s.fields if field_name(f) not in common[1])

    def short(xs):
        return ", ".join(xs[:5]) + (f" +{len(xs) - 5}" if len(xs) > 5 else "")

    parts = []
    if only_s:
        parts.append("sharpi only: " + short(only_s))
    if only_l:
        parts.append("llama only: " + short(only_l))
    return cell("; ".join(parts)) if parts else "same"


def text_cell(case: Case, s: Seen, ll: Seen) -> str:
    if not (s.status == ll.status == 200) or s.text is None or ll.text is None:
        return "—"
    if not case.greedy:
        return "sampled/constrained"
    return "same" if s.text == ll.text else "differs"


def render(rows: list[tuple[Case, Seen, Seen]], meta: dict) -> str:
    lines = [(f"Model `{meta['model']}`, chat template `{meta['template']}`, {meta['threads']} thread(s), "
              f"context {CTX}; llama-server {meta['llama_version']}. Rows marked FIM servers: both load "
              "`sharpi make-model --fim --quant q8_0` (tiny qwen3moe, random weights, fill-in-the-middle tokens). "
              "usage: prompt/completion tokens as the answer counts them (Anthropic's cache tokens added to "
              "the prompt). A cell with one value: both sent it; `sharpi / llama-server` otherwise."), "",
             ("| # | request | status | error shape | finish | tool calls | usage | stream | fields only one sent "
              "| same text |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    common = common_differences(rows)
    lines[1:1] = ["", "Fields left out of the table's field column because one server sends them in most generation "
                  "answers: sharpi only: " + (", ".join(sorted(common[0])) or "none") + "; llama-server only: "
                  + (", ".join(sorted(common[1])) or "none") + "."]
    for i, (case, s, ll) in enumerate(rows, 1):
        lines.append("| " + " | ".join([
            str(i), cell(case.name + {"auth": " (api-key servers)", "fim": " (FIM servers)"}.get(case.pair, "")),
            pair_cell(s.status, ll.status), pair_cell(s.error, ll.error), pair_cell(s.finish, ll.finish),
            pair_cell(s.tool_calls, ll.tool_calls), pair_cell(s.usage or None, ll.usage or None),
            pair_cell(s.stream, ll.stream), fields_cell(s, ll, common),
            text_cell(case, s, ll)]) + " |")
    lines += ["", "## What each sent", ""]
    for i, (case, s, ll) in enumerate(rows, 1):
        lines.append(f"{i}. **{case.name}**")
        for who, seen in (("sharpi", s), ("llama-server", ll)):
            what = seen.message or (repr(seen.text[:120]) if seen.text is not None else "")
            extra = f" [{seen.extra}]" if seen.extra else ""
            lines.append(f"   - {who}: {seen.status} in {seen.seconds:.2f} s {what}{extra}".rstrip())
    return "\n".join(lines) + "\n"


def learn_context(port: int) -> dict:
    """Token ids both servers' requests use, from llama-server's tokenizer (the oracle here): the
    ids of the completion prompt and of "import os"; the first token the greedy continuation of the
    completion prompt and of the chat request start with; the id of " pass" (one token)."""
    def tokenize(text: str) -> list:
        return json.loads(request(port, "POST", "/tokenize", json.dumps({"content": text}).encode())[2])["tokens"]

    def first_token(path: str, body: dict, before: str) -> int:
        obj = json.loads(request(port, "POST", path, json.dumps(body).encode())[2])
        text = choice_text(obj["choices"][0]) or ""
        ids = tokenize(text)
        return ids[0] if not before else tokenize(before + text)[len(tokenize(before))]

    fib_ids = tokenize("def fib(n):")
    return {"fib_ids": fib_ids, "os_ids": tokenize("import os"),
            "first_id": first_token("/v1/completions", completion(max_tokens=1), "def fib(n):"),
            "chat_first_id": first_token("/v1/chat/completions", chat(max_tokens=1), ""),
            "pass_id": tokenize(" pass")[0]}


def fim_model(log_dir: Path) -> Path:
    """A small model whose vocabulary has fill-in-the-middle tokens (sharpi make-model --fim; random
    weights, so its text means nothing, but both servers must pick the same greedy tokens)."""
    path = log_dir / "fim-model.gguf"
    if not path.exists():
        subprocess.run([sys.executable, "-m", "sharpi.cli", "make-model", str(path), "--fim", "--quant", "q8_0"],
                       check=True, capture_output=True)
    return path


def run_pair(args, pair: str, cases: list[Case], ctx: dict, log_dir: Path) -> list[tuple[Case, Seen, Seen]]:
    auth = pair == "auth"
    if pair == "fim":
        args = argparse.Namespace(**{**vars(args), "model": fim_model(log_dir)})
    s_port, l_port = free_port(), free_port()
    out = []
    with open(log_dir / "responses.jsonl", "a", encoding="utf-8") as responses, \
            started("sharpi serve", sharpi_cmd(args, s_port, auth), s_port, log_dir / f"sharpi-{pair}.log"), \
            started("llama-server", llama_cmd(args, l_port, auth), l_port, log_dir / f"llama-server-{pair}.log"):
        if not ctx:  # learnt on the first pair, which loads the suite's model
            ctx.update(learn_context(l_port))
        for case in cases:
            body = case.body(ctx) if callable(case.body) else case.body
            data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            seen = []
            for who, port in (("sharpi", s_port), ("llama-server", l_port)):
                path = case.path
                if who == "llama-server" and case.llama:
                    path, data = case.llama[0], json.dumps(case.llama[1]).encode()
                try:
                    status, headers, raw, secs = request(port, case.method, path, data, case.headers)
                    seen.append(summarize(status, headers, raw))
                    seen[-1].seconds = secs
                    record = {"case": case.name, "server": who, "status": status, "seconds": round(secs, 3),
                              "headers": headers, "body": raw[:20000].decode("utf-8", "replace")}
                except (OSError, http.client.HTTPException) as e:
                    seen.append(Seen(0, error="no answer", message=f"{type(e).__name__}: {e}"))
                    record = {"case": case.name, "server": who, "error": seen[-1].message}
                responses.write(json.dumps(record) + "\n")
            print(f"{case.name:45s} sharpi {seen[0].status:3d}  llama-server {seen[1].status:3d}", flush=True)
            out.append((case, seen[0], seen[1]))
    return out


def default_template() -> Path:
    converter = subprocess.run(["bash", str(REPO / "tools" / "fetch_converter.sh")], check=True,
                               capture_output=True, text=True).stdout.strip()
    return Path(converter) / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja"


def default_llama_server() -> Path:
    bin_dir = subprocess.run(["bash", str(REPO / "tools" / "build_llama_tools.sh"), "--server"], check=True,
                             capture_output=True, text=True).stdout.strip()
    return Path(bin_dir) / "llama-server"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", type=Path, help="llama-server binary (default: tools/build_llama_tools.sh --server)")
    ap.add_argument("--model", type=Path, help="GGUF file both load (default: sharpi's shipped model)")
    ap.add_argument("--chat-template", type=Path, help="Jinja template both use (default: llama.cpp's Qwen3-0.6B)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", help="run only the requests whose name contains this")
    ap.add_argument("--out", type=Path, required=True, help="markdown file the table is written to")
    args = ap.parse_args(argv)
    args.chat_template = args.chat_template or default_template()
    args.llama_server = args.llama_server or default_llama_server()
    version = subprocess.run([str(args.llama_server), "--version"], check=False, capture_output=True, text=True)
    meta = {"model": (args.model or Path("stdlib-moe-q8_0.gguf (shipped)")).name, "template": args.chat_template.name,
            "threads": args.threads,
            "llama_version": (version.stdout + version.stderr).split("\n")[0].removeprefix("version: ")}
    cases = [c for c in suite() if not args.only or args.only in c.name]
    log_dir = args.out.parent / (args.out.stem + "-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "responses.jsonl").unlink(missing_ok=True)
    ctx: dict = {}
    rows = []
    for pair in ("main", "fim", "auth"):
        chosen = [c for c in cases if c.pair == pair]
        if chosen:
            rows += run_pair(args, pair, chosen, ctx, log_dir)
    table = render(rows, meta)
    args.out.write_text(table, encoding="utf-8")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
