"""`sharpi serve`'s operator features (issue 43): --api-key, CORS, /metrics, llama-server's
/tokenize, /detokenize and /props, one log line per request, the bind error before anything else,
and the OpenAPI document at /openapi.json.

Oracles: the HTTP rules each feature follows, written out here (Bearer auth and OpenAI's 401 shape,
the CORS preflight headers a browser checks, Prometheus' text format read back with
prometheus_client's own parser); the `usage` each answer reports against the counters and log
lines; the shipped model's tokenizer (tested against llama.cpp elsewhere) for /tokenize, with the
text each piece stands for concatenating back to the input; for the OpenAPI document, the
application's own route table and the server's answers to bodies just outside each documented limit.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest
import sharpi
from prometheus_client.parser import text_string_to_metric_families
from sharpi.models import default_model_path
from sharpi.server.prompt import CHATML_TEMPLATE
from subprocess_env import child_env
from test_serve import MODEL_ID, N_CTX, free_port

KEYS = ("k-one", "k-two")


class Server:
    """`sharpi serve ARGS` as a child process on a free port, its stderr collected line by line."""

    def __init__(self, *extra: str):
        self.port = free_port()
        cmd = [sys.executable, "-m", "sharpi.cli", "serve", "--port", str(self.port), "-t", "1", "-c", str(N_CTX),
               *extra]
        self.child = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True)
        self.lines: list = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(self.child.stderr.readline, "")))
        self._reader.start()
        deadline = time.monotonic() + 300
        while True:
            assert self.child.poll() is None, f"sharpi serve exited: {''.join(self.lines)}"
            try:
                if self.request("GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "sharpi serve did not answer /health within 300 s"
            time.sleep(0.2)

    def request(self, method: str, path: str, body=None, headers: dict | None = None):
        """(status, headers as a lower-cased dict, body bytes)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
            conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def json(self, method: str, path: str, body=None, headers: dict | None = None) -> tuple[int, dict]:
        status, _, data = self.request(method, path, body, headers)
        return status, json.loads(data)

    def client(self, api_key: str = "none"):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=api_key, max_retries=0,
                             timeout=120)

    def log_lines(self, n_wanted: int, timeout: float = 10) -> list:
        """The request lines logged so far, waiting until there are n_wanted of them."""
        deadline = time.monotonic() + timeout
        while True:
            got = [line for line in self.lines if line.startswith("sharpi: ") and " ms" in line]
            if len(got) >= n_wanted or time.monotonic() > deadline:
                return got
            time.sleep(0.05)

    def stop(self) -> None:
        self.child.terminate()
        try:
            self.child.wait(timeout=30)
        finally:
            self._reader.join(timeout=10)


@pytest.fixture(scope="module")
def plain():
    s = Server()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def secured():
    s = Server("--api-key", ",".join(KEYS), "--cors-origin", "http://app.example", "--temp", "0.25")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def session():
    s = sharpi.Session(default_model_path(), threads=1, n_ctx=N_CTX)
    yield s
    s.close()


def assert_openai_error(status: int, body: dict, want_status: int, code: str | None = None) -> None:
    assert status == want_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code


# ------------------------------------------------------------------ bind error


def test_a_taken_port_is_the_first_and_only_thing_said():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "sharpi.cli", "serve", "--port", str(port), "-t", "1"],
                              check=False, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith(f"sharpi: error: cannot listen on 127.0.0.1:{port}: "), proc.stderr
    assert "in use" in proc.stderr.lower()
    assert "serving" not in proc.stderr


# ------------------------------------------------------------------ log lines


LINE = re.compile(r"^sharpi: (GET|POST|OPTIONS) (\S+) (\d{3}) 127\.0\.0\.1 (\d+\.\d) ms(.*)$")


def test_one_log_line_per_request_with_timings(session):
    s = Server()
    try:
        serving = [i for i, line in enumerate(s.lines) if line.startswith("sharpi: serving ")]
        assert len(serving) == 1 and s.lines[serving[0]].startswith(f"sharpi: serving {MODEL_ID} on "
                                                                    f"http://127.0.0.1:{s.port}/v1")
        prompt = "def add(a, b):"
        r = s.client().completions.create(model=MODEL_ID, prompt=prompt, max_tokens=7, temperature=0)
        s.request("GET", "/no/such/path")
        s.request("GET", "/health")  # not logged
        s.request("POST", "/v1/chat/completions", b"{not json")
        chunks = list(s.client().chat.completions.create(model=MODEL_ID, max_tokens=5, temperature=0, stream=True,
                                                         messages=[{"role": "user", "content": "hi"}]))
        assert chunks
        lines = s.log_lines(4)
    finally:
        s.stop()
    assert len(lines) == 4, lines
    parsed = [LINE.match(line.rstrip("\n")) for line in lines]
    assert all(parsed), lines
    assert [(m[1], m[2], m[3]) for m in parsed] == [
        ("POST", "/v1/completions", "200"), ("GET", "/no/such/path", "404"),
        ("POST", "/v1/chat/completions", "400"), ("POST", "/v1/chat/completions", "200")]
    n_prompt = len(session.tokenize(prompt))
    gen = re.match(r"^ \| prompt (\d+) tokens \((\d+) cached\), first text after (\d+\.\d) ms, (\d+) tokens "
                   r"generated at (\d+\.\d) tokens/s$", parsed[0][5])
    assert gen, parsed[0][5]
    assert (int(gen[1]), int(gen[4])) == (n_prompt, r.usage.completion_tokens)
    assert 0 < float(gen[3]) <= float(parsed[0][4])  # the first text comes inside the request's time
    assert parsed[1][5] == "" and parsed[2][5] == ""
    assert " tokens generated at " in parsed[3][5]  # a stream's line has its timings too


# ------------------------------------------------------------------ API key


def test_api_key_guards_everything_but_health(secured):
    for path in ("/v1/models", "/props", "/metrics", "/v1/sharpi/stats"):
        status, headers, body = secured.request("GET", path)
        assert_openai_error(status, json.loads(body), 401, "invalid_api_key")
        assert headers["www-authenticate"] == "Bearer"
    for method, path in (("POST", "/v1/completions"), ("POST", "/tokenize"), ("POST", "/v1/chat/completions")):
        status, body = secured.json(method, path, {"prompt": "x", "content": "x"},
                                    headers={"Authorization": "Bearer wrong"})
        assert_openai_error(status, body, 401, "invalid_api_key")
    assert secured.json("GET", "/health") == (200, {"status": "ok"})
    assert secured.request("GET", "/openapi.json")[0] == 200
    for headers in ({"Authorization": f"Bearer {KEYS[0]}"}, {"authorization": f"bearer {KEYS[1]}"},
                    {"x-api-key": KEYS[1]}):
        assert secured.request("GET", "/v1/models", headers=headers)[0] == 200
    r = secured.client(KEYS[1]).completions.create(model=MODEL_ID, prompt="import ", max_tokens=2)
    assert r.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        secured.client("k-three").models.list()


# ------------------------------------------------------------------ CORS


def preflight(server: Server, origin: str, path: str = "/v1/chat/completions"):
    return server.request("OPTIONS", path, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_preflight_and_allowed_origin(secured):
    status, headers, _ = preflight(secured, "http://app.example")
    assert status == 200
    assert headers["access-control-allow-origin"] == "http://app.example"
    assert "POST" in headers["access-control-allow-methods"]
    assert {"authorization", "content-type"} <= {h.strip().lower() for h in headers["access-control-allow-headers"]
                                                  .split(",")}
    # The request that follows carries the key, and its answer names the origin.
    status, headers, _ = secured.request("GET", "/v1/models", headers={"Origin": "http://app.example",
                                                                       "Authorization": f"Bearer {KEYS[0]}"})
    assert status == 200 and headers["access-control-allow-origin"] == "http://app.example"
    # Another origin is refused at the preflight and gets no allow header on a request.
    status, headers, _ = preflight(secured, "http://evil.example")
    assert status == 400 and "access-control-allow-origin" not in headers
    status, headers, _ = secured.request("GET", "/v1/models", headers={"Origin": "http://evil.example",
                                                                       "Authorization": f"Bearer {KEYS[0]}"})
    assert "access-control-allow-origin" not in headers


def test_preflight_is_answered_without_cors_origins(plain):
    """No --cors-origin: a preflight is answered (refused, 400), never 405, and allows nothing."""
    status, headers, _ = preflight(plain, "http://app.example")
    assert status == 400 and "access-control-allow-origin" not in headers


def test_cors_any_origin():
    s = Server("--cors-origin", "*")
    try:
        status, headers, _ = preflight(s, "http://anything.example", "/tokenize")
        assert status == 200 and headers["access-control-allow-origin"] == "*"
    finally:
        s.stop()


# ------------------------------------------------------------------ /metrics


def scrape(server: Server, headers: dict | None = None) -> dict:
    """{(name, sorted label items): value} of every sample on /metrics."""
    status, h, body = server.request("GET", "/metrics", headers=headers)
    assert status == 200 and h["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def test_metrics_count_what_the_answers_report():
    s = Server()
    try:
        c = s.client()
        answers = [c.completions.create(model=MODEL_ID, prompt=p, max_tokens=6, temperature=0)
                   for p in ("def f(x):", "import sys\n")]
        s.request("GET", "/no/such/path")
        m = scrape(s)
    finally:
        s.stop()
    assert m[("sharpi_generations_total", ())] == 2
    assert m[("sharpi_generations_cancelled_total", ())] == 0
    assert m[("sharpi_completion_tokens_total", ())] == sum(a.usage.completion_tokens for a in answers)
    prompt = sum(a.usage.prompt_tokens for a in answers)
    cached = sum(a.usage.prompt_tokens_details.cached_tokens for a in answers)
    assert m[("sharpi_prompt_tokens_prefilled_total", ())] == prompt - cached
    assert m[("sharpi_prompt_tokens_reused_total", ())] == cached
    assert m[("sharpi_prompt_seconds_total", ())] > 0 and m[("sharpi_decode_seconds_total", ())] > 0
    assert m[("sharpi_requests_processing", ())] == 0 and m[("sharpi_requests_waiting", ())] == 0
    assert m[("sharpi_context_tokens", ())] == N_CTX
    assert m[("sharpi_http_requests_total", (("route", "/v1/completions"), ("status", "200")))] == 2
    assert m[("sharpi_http_requests_total", (("route", "unmatched"), ("status", "404")))] == 1
    assert m[("sharpi_http_request_duration_seconds_count", (("route", "/v1/completions"),))] == 2


# ------------------------------------------------------------------ /tokenize, /detokenize


def test_tokenize_and_detokenize(plain, session):
    tok = session.tokenizer
    text = "def größe(x):\n    return x  # 😀"
    status, got = plain.json("POST", "/tokenize", {"content": text})
    assert status == 200 and got == {"tokens": tok.encode(text, add_bos=False, special=True)}
    ids = got["tokens"]
    assert plain.json("POST", "/detokenize", {"tokens": ids}) == (200, {"content": text})
    # with_pieces: each piece is the token's text, or its bytes where that is not whole UTF-8; in
    # order, the bytes are the text's.
    status, got = plain.json("POST", "/tokenize", {"content": text, "with_pieces": True})
    assert [p["id"] for p in got["tokens"]] == ids
    pieces = [p["piece"] for p in got["tokens"]]
    assert any(isinstance(p, list) for p in pieces), "the emoji should be split into byte pieces"
    joined = b"".join(bytes(p) if isinstance(p, list) else p.encode() for p in pieces)
    assert joined == text.encode()
    # parse_special: a control token's text is one token, or plain text.
    control = tok.id_to_token(tok.eos_id)  # the shipped model's one control token, <|endoftext|>
    marker = control + "user"
    as_special = plain.json("POST", "/tokenize", {"content": marker})[1]["tokens"]
    as_text = plain.json("POST", "/tokenize", {"content": marker, "parse_special": False})[1]["tokens"]
    assert as_special[0] == tok.eos_id
    assert len(as_special) < len(as_text)
    assert tok.decode(as_text) == marker
    # add_special: the model's BOS first, when it has one.
    with_bos = plain.json("POST", "/tokenize", {"content": "x", "add_special": True})[1]["tokens"]
    assert with_bos == ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode("x", add_bos=False)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [3072]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ("/detokenize", {"tokens": [1.0]}, "tokens"),
])
def test_bad_tokenize_requests(plain, path, body, param):
    status, got = plain.json("POST", path, body)
    assert_openai_error(status, got, 400)
    assert got["error"]["param"] == param


@pytest.mark.parametrize(("path", "raw_body", "param"), [
    # JSON may escape half a surrogate pair; no tokenizer takes it (was a 500).
    ("/tokenize", b'{"content": "ok \\ud800"}', "content"),
    ("/v1/completions", b'{"prompt": "\\udfff", "max_tokens": 1}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}', "messages"),
    # A text part whose text is no string (was a 500).
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
     "messages[0].content"),
    # Template keyword arguments that name the renderer's own (was a 500).
    ("/v1/chat/completions", (b'{"messages": [{"role": "user", "content": "x"}], '
                              b'"chat_template_kwargs": {"add_generation_prompt": false}}'), "chat_template_kwargs"),
    ("/v1/chat/completions", (b'{"messages": [{"role": "user", "content": "x"}], '
                              b'"chat_template_kwargs": {"messages": []}}'), "chat_template_kwargs"),
])
def test_bad_text_is_a_400(plain, path, raw_body, param):
    status, got = plain.json("POST", path, raw_body)
    assert_openai_error(status, got, 400)
    assert got["error"]["param"] == param
    assert plain.json("GET", "/health") == (200, {"status": "ok"})


def test_reserved_template_kwargs_flag_is_refused(capsys):
    from sharpi.cli import main

    for command in ("serve", "chat"):
        with pytest.raises(SystemExit) as stop:
            main([command, "--chat-template-kwargs", '{"messages": [], "enable_thinking": true}'])
        assert stop.value.code == 2
        assert "may not set messages" in capsys.readouterr().err


# ------------------------------------------------------------------ /props


def test_props(secured):
    status, got = secured.json("GET", "/props", headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert status == 200
    assert got["model_path"] == default_model_path()
    assert got["model_alias"] == MODEL_ID
    assert got["n_ctx"] == N_CTX and got["default_generation_settings"]["n_ctx"] == N_CTX
    assert got["total_slots"] == 1
    # The shipped model has no template: the server renders ChatML, and says so.
    assert got["chat_template"] == CHATML_TEMPLATE and got["chat_template_fallback"] is True
    params = got["default_generation_settings"]["params"]
    assert params["temperature"] == 0.25  # --temp 0.25
    assert (params["top_k"], params["top_p"], params["min_p"], params["n_predict"]) == (0, 1.0, 0.0, -1)
    assert got["modalities"] == {"vision": False, "audio": False}


# ------------------------------------------------------------------ /openapi.json


def resolve(doc: dict, ref: str):
    assert ref.startswith("#/"), ref
    node = doc
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def refs(node):
    if isinstance(node, dict):
        if "$ref" in node:
            yield node["$ref"]
        for v in node.values():
            yield from refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from refs(v)


def test_openapi_document_matches_the_routes(plain, session):
    from sharpi.server.app import create_app
    from sharpi.server.scheduler import Engine
    from sharpi.server.served import ServedModel

    status, doc = plain.json("GET", "/openapi.json")
    assert status == 200
    assert doc["openapi"].startswith("3.") and doc["info"]["title"] and doc["info"]["version"]
    for ref in refs(doc):
        resolve(doc, ref)
    documented = {(path, method.upper()) for path, ops in doc["paths"].items() for method in ops}
    app = create_app(ServedModel(Engine(session), MODEL_ID, default_model_path()))
    routed = {(r.path, m) for r in app.routes for m in r.methods if m != "HEAD"}
    assert documented == routed
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert op["summary"] and "200" in op["responses"]
            error = "AnthropicError" if path.startswith("/v1/messages") else "Error"
            for code, answer in op["responses"].items():
                if code != "200":
                    assert answer["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{error}"}
            # Every documented operation exists: never 404 or 405.
            if method == "get":
                assert plain.request("GET", path)[0] == 200, path
            else:
                assert plain.request("POST", path, b"{}")[0] not in (404, 405), path
    # A method no operation documents is 405 in OpenAI's shape.
    status, got = plain.json("GET", "/v1/chat/completions")
    assert_openai_error(status, got, 405)


def test_openapi_limits_are_the_servers(plain):
    """Each documented numeric limit of the completion request: the value at the limit is taken,
    one step beyond it is a 400 naming the field."""
    doc = plain.json("GET", "/openapi.json")[1]
    props = resolve(doc, "#/components/schemas/CompletionRequest")["properties"]
    checked = 0
    for name, schema in props.items():
        if schema.get("type") not in ("number", "integer") or name in ("seed", "max_tokens", "n"):
            continue
        step = 1 if schema["type"] == "integer" else 0.5
        if "exclusiveMinimum" in schema:
            low = schema["exclusiveMinimum"]
            taken, refused = [low + step, schema["maximum"]], [low, schema["maximum"] + step]
        else:
            taken = [schema["minimum"], schema["maximum"]]
            refused = [schema["minimum"] - step, schema["maximum"] + step]
        for value in taken:
            status, got = plain.json("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1, name: value})
            assert status == 200, (name, value, got)
        for value in refused:
            status, got = plain.json("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1, name: value})
            assert status == 400 and got["error"]["param"] == name, (name, value, got)
        checked += 1
    assert checked >= 8
    assert set(props) >= {"temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty"}
