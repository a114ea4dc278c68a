"""`sharpi serve` (issue 20): the OpenAI-compatible server, run as a subprocess on 127.0.0.1 with the
shipped model and driven by the official `openai` client and by raw HTTP.

Oracle: the same Session API in this process. A greedy (or seeded) request must give exactly the
text and token counts that Session.generate gives for the same prompt ids and sampling values, and
the chat prompt is the ChatML text written out here by hand (the shipped model has no template).
"""

from __future__ import annotations

import collections
import http.client
import json
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import openai  # the test extra installs it and the serve extra: a missing one fails, never skips
import pytest
import sharpi
from sharpi.models import default_model_path
from sharpi.stop_text import StopText
from subprocess_env import child_env

N_CTX = 2048
MODEL_ID = "stdlib-moe-q8_0.gguf"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*extra: str):
    """Starts `sharpi serve` on a free port; yields the port once /health answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "sharpi.cli", "serve", "--port", str(port), "-t", "1", "-c", str(N_CTX), *extra]
    child = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300  # a loaded 2-core CI machine once needed more than 120 s
    while True:
        if child.poll() is not None:
            pytest.fail(f"sharpi serve exited with {child.returncode}: {child.stderr.read()}")
        try:
            if raw("GET", port, "/health")[0] == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            child.kill()
            pytest.fail("sharpi serve did not answer /health within 300 s")
        time.sleep(0.2)
    # Drain its stderr (one access-log line per request): a pipe nobody reads fills up after ~64 KiB
    # of lines and then blocks the server's event loop on its next log write.
    log: collections.deque = collections.deque(maxlen=200)
    threading.Thread(target=lambda: log.extend(child.stderr), daemon=True).start()
    try:
        yield port
    finally:
        child.terminate()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            pytest.fail("sharpi serve did not stop on SIGTERM; its last log lines:\n" + "".join(log))


@pytest.fixture(scope="module")
def server():
    yield from start_server()


@pytest.fixture(scope="module")
def session():
    s = sharpi.Session(default_model_path(), threads=1, n_ctx=N_CTX)
    yield s
    s.close()


def raw(method: str, port: int, path: str, body: bytes | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def client(port: int):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)


def expected(session, ids: list, **options) -> tuple[str, int]:
    """(text, completion tokens) from Session.generate on a fresh cache, OpenAI's sampling defaults."""
    session.reset()
    opts = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, **options}
    text = "".join(session.generate(ids, **opts))
    return text, len(session.last_tokens)


def chatml_ids(session, user: str) -> list:
    text = f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    return session.tokenize(text, special=True)


def test_models_and_health(server):
    assert raw("GET", server, "/health") == (200, {"status": "ok"})
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL_ID]


def test_completion_greedy_matches_session(server, session):
    prompt = "def fibonacci(n):"
    want, n_gen = expected(session, session.tokenize(prompt), max_tokens=24, temperature=0.0)
    r = client(server).completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == ("length" if n_gen == 24 else "stop")
    assert r.usage.prompt_tokens == len(session.tokenize(prompt))
    assert r.usage.completion_tokens == n_gen
    assert r.usage.total_tokens == r.usage.prompt_tokens + n_gen


def test_completion_streamed_equals_whole(server, session):
    prompt = "import os\n"
    want, n_gen = expected(session, session.tokenize(prompt), max_tokens=20, temperature=0.0)
    chunks = list(client(server).completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1, "the text came in one piece"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].usage.completion_tokens == n_gen


def test_chat_uses_template_and_streams(server, session):
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    ids = chatml_ids(session, messages[0]["content"])
    want, n_gen = expected(session, ids, max_tokens=16, temperature=0.0)
    c = client(server)
    r = c.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), n_gen)
    stream = c.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=16, temperature=0,
                                       stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want


def test_seeded_sampling_matches_session(server, session):
    prompt = "class "
    opts = {"max_tokens": 20, "temperature": 0.9, "top_p": 0.9, "top_k": 20, "seed": 1234}
    want, _ = expected(session, session.tokenize(prompt), **opts)
    c = client(server)
    extra = {"top_k": opts["top_k"]}
    got = [c.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=20, temperature=0.9, top_p=0.9,
                                seed=1234, extra_body=extra).choices[0].text for _ in range(2)]
    assert got == [want, want]


def test_stop_string_cuts_the_text(server, session):
    prompt = "def fibonacci(n):"
    full, _ = expected(session, session.tokenize(prompt), max_tokens=24, temperature=0.0)
    stop = full.strip().split()[1]  # a word from inside the greedy answer
    want = full[: full.index(stop)]
    c = client(server)
    r = c.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                    stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == want


def test_a_stop_string_counts_the_tokens_up_to_it_only(server, session):
    # The answer is the tokens whose text reaches the stop string; tokens the worker sampled before
    # the cancel reached it are not counted (server_parity found 8 or 9 where 7 was right, by race).
    prompt = "def fibonacci(n):"
    ids = session.tokenize(prompt)
    full, _ = expected(session, ids, max_tokens=24, temperature=0.0)
    stop = full.strip().split()[1]
    tokens = list(session.last_tokens)
    n_want = next(n for n in range(1, len(tokens) + 1) if stop in session.detokenize(tokens[:n]))
    c = client(server)
    for _ in range(4):  # the race went either way: every repeat must count exactly
        r = c.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
        assert r.usage.completion_tokens == n_want, (r.usage, n_want)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (json.dumps({"model": "gpt-4o", "prompt": "x"}).encode(), 404, "model"),
        (json.dumps({"prompt": "x " * (N_CTX + 10)}).encode(), 400, "prompt"),
        (json.dumps({"prompt": "x", "max_tokens": N_CTX}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "temperature": -1}).encode(), 400, "temperature"),
        (json.dumps({"prompt": "x", "top_p": 1.5}).encode(), 400, "top_p"),
        (json.dumps({"prompt": "x", "top_k": "many"}).encode(), 400, "top_k"),
        (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "seed": 1.5}).encode(), 400, "seed"),
        (json.dumps({"prompt": "x", "stop": [1]}).encode(), 400, "stop"),
        (json.dumps({"prompt": "x", "n": 17}).encode(), 400, "n"),
        (json.dumps({"prompt": ""}).encode(), 400, "prompt"),
        (json.dumps({"prompt": "x", "stream": "yes"}).encode(), 400, "stream"),
        (json.dumps({"prompt": "x", "stream": True, "stream_options": "all"}).encode(), 400, "stream_options"),
    ],
)
def test_bad_requests_get_openai_errors(server, session, body, status, param):
    got_status, got = raw("POST", server, "/v1/completions", body)
    assert got_status == status
    assert set(got) == {"error"} and set(got["error"]) == {"message", "type", "param", "code"}
    assert got["error"]["type"] == "invalid_request_error" and got["error"]["message"]
    assert got["error"]["param"] == param
    # Still healthy and still right.
    assert raw("GET", server, "/health")[0] == 200
    r = client(server).completions.create(model=MODEL_ID, prompt="def ", max_tokens=4, temperature=0)
    assert r.choices[0].text == expected(session, session.tokenize("def "), max_tokens=4, temperature=0.0)[0]


def test_bad_chat_messages_and_unknown_path(server):
    status, got = raw("POST", server, "/v1/chat/completions", json.dumps({"messages": "hi"}).encode())
    assert (status, got["error"]["param"]) == (400, "messages")
    body = json.dumps({"messages": [{"role": "user", "content": 7}]}).encode()
    status, got = raw("POST", server, "/v1/chat/completions", body)
    assert (status, got["error"]["param"]) == (400, "messages[0].content")
    status, got = raw("GET", server, "/v1/nothing")
    assert status == 404 and "error" in got
    with pytest.raises(openai.NotFoundError):
        client(server).chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_two_concurrent_clients_equal_sequential(server, session):
    prompts = ["def merge_sort(items):", "class Stack:"]
    want = [expected(session, session.tokenize(p), max_tokens=32, temperature=0.0)[0] for p in prompts]
    got = [None, None]

    def ask(i):
        r = client(server).completions.create(model=MODEL_ID, prompt=prompts[i], max_tokens=32, temperature=0)
        got[i] = r.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got == want


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_generation(server, session, stream):
    """A request dropped mid-generation is cancelled (it ends with far fewer tokens than asked
    for and counts as cancelled), and the next request gets the right answer."""
    max_tokens = N_CTX - 8
    before = raw("GET", server, "/v1/sharpi/stats")[1]
    body = json.dumps({"prompt": "def ", "max_tokens": max_tokens, "temperature": 0, "stream": stream})
    with socket.create_connection(("127.0.0.1", server), timeout=60) as sock:
        sock.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        if stream:
            seen = b""
            while b"data: " not in seen:
                seen += sock.recv(4096)
        else:
            time.sleep(0.3)
    deadline = time.monotonic() + 120
    while (after := raw("GET", server, "/v1/sharpi/stats")[1])["requests"] == before["requests"]:
        assert time.monotonic() < deadline, "the dropped request never finished"
        time.sleep(0.05)
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["completion_tokens"] - before["completion_tokens"] < max_tokens
    want = expected(session, session.tokenize("import "), max_tokens=8, temperature=0.0)[0]
    r = client(server).completions.create(model=MODEL_ID, prompt="import ", max_tokens=8, temperature=0)
    assert r.choices[0].text == want


def test_next_chat_turn_reuses_the_cache(server, session):
    """The second turn's prompt extends the first turn's prompt and answer: only its new tokens are
    decoded (the stats count the reused ones) and the answer equals a cold run's."""
    c = client(server)
    turn1 = [{"role": "user", "content": "Write a function that reverses a list."}]
    r1 = c.chat.completions.create(model=MODEL_ID, messages=turn1, max_tokens=20, temperature=0)
    answer = r1.choices[0].message.content
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "Now sort it."}]
    ids2 = session.tokenize(
        f"<|im_start|>user\n{turn1[0]['content']}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"
        "<|im_start|>user\nNow sort it.<|im_end|>\n<|im_start|>assistant\n", special=True)
    want, n_gen = expected(session, ids2, max_tokens=20, temperature=0.0)
    before = raw("GET", server, "/v1/sharpi/stats")[1]
    r2 = c.chat.completions.create(model=MODEL_ID, messages=turn2, max_tokens=20, temperature=0)
    after = raw("GET", server, "/v1/sharpi/stats")[1]
    assert r2.choices[0].message.content == want
    assert (r2.usage.prompt_tokens, r2.usage.completion_tokens) == (len(ids2), n_gen)
    reused = after["prompt_tokens_reused"] - before["prompt_tokens_reused"]
    # The first turn's prompt and every answer token the cache decoded (the last sampled one is not).
    assert reused >= r1.usage.prompt_tokens + r1.usage.completion_tokens - 1
    assert r2.model_extra["timings"]["cache_n"] == reused


def test_divergent_prompt_reuses_the_shared_prefix(server, session):
    """A prompt that shares only a prefix with the previous one (an edited question, another
    ending): the cache is cut back to the shared prefix and only the rest is prefilled; usage and
    the stats report both counts, and the answer equals a cold run's."""
    head = "import json\n\n\ndef load_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n\n"
    first, second = head + "def save_config(path, config):", head + "class ConfigError(Exception):"
    ids1, ids2 = session.tokenize(first), session.tokenize(second)
    shared = next(i for i, (a, b) in enumerate(zip(ids1, ids2)) if a != b)
    assert shared > 20
    want, n_gen = expected(session, ids2, max_tokens=12, temperature=0.0)
    c = client(server)
    c.completions.create(model=MODEL_ID, prompt=first, max_tokens=12, temperature=0)
    before = raw("GET", server, "/v1/sharpi/stats")[1]
    r = c.completions.create(model=MODEL_ID, prompt=second, max_tokens=12, temperature=0)
    after = raw("GET", server, "/v1/sharpi/stats")[1]
    assert (r.choices[0].text, r.usage.completion_tokens) == (want, n_gen)
    assert r.usage.prompt_tokens_details.cached_tokens == shared
    assert r.model_extra["timings"]["cache_n"] == shared
    assert after["prompt_tokens_reused"] - before["prompt_tokens_reused"] == shared
    assert after["prompt_tokens_prefilled"] - before["prompt_tokens_prefilled"] == len(ids2) - shared


def log_softmax(logits) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    return x - np.logaddexp.reduce(x)


def oracle_logprobs(session, ids: list, tokens: list | None = None, max_tokens: int = 0) -> list:
    """[(token, float64 log-softmax of the logits it was sampled from)] for each generated token,
    from Session.decode step by step: greedy (argmax) up to max_tokens, or replaying `tokens`."""
    session.reset()
    eog = set(session.tokenizer.eog_ids)
    logits, steps = session.decode(ids), []
    for i in range(len(tokens) if tokens is not None else max_tokens):
        t = tokens[i] if tokens is not None else int(np.argmax(logits))
        if t in eog:
            break
        steps.append((t, log_softmax(logits)))
        logits = session.decode([t])
    return steps


def check_entry(tok, entry, token: int, lp: np.ndarray, n_top: int) -> None:
    """One chat-shaped logprob entry against the oracle's token and log-probabilities."""
    assert bytes(entry.bytes) == tok.token_to_bytes(token)
    assert entry.logprob == pytest.approx(lp[token], abs=1e-9)
    top = np.argsort(-lp, kind="stable")[:n_top]
    assert [bytes(t.bytes) for t in entry.top_logprobs] == [tok.token_to_bytes(int(i)) for i in top]
    np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], lp[top], rtol=0, atol=1e-9)


def test_chat_logprobs_are_log_softmax_of_the_logits(server, session):
    messages = [{"role": "user", "content": "Write a function that checks for primes."}]
    steps = oracle_logprobs(session, chatml_ids(session, messages[0]["content"]), max_tokens=12)
    tok = session.tokenizer
    c = client(server)
    r = c.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=12, temperature=0, logprobs=True,
                                  top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == len(steps) == r.usage.completion_tokens
    for entry, (t, lp) in zip(content, steps):
        check_entry(tok, entry, t, lp, 5)
    assert b"".join(bytes(e.bytes) for e in content).decode() == r.choices[0].message.content
    # Streamed: the same entries, spread over the chunks that carry their text.
    chunks = list(c.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=5, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    # logprobs without top_logprobs: no alternatives; without logprobs: none at all.
    r = c.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=4, temperature=0, logprobs=True)
    assert [e.top_logprobs for e in r.choices[0].logprobs.content] == [[]] * len(r.choices[0].logprobs.content)
    r = c.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=4, temperature=0)
    assert r.choices[0].logprobs is None


def test_sampled_tokens_logprobs_ignore_temperature(server, session):
    """Log-probabilities are the model's raw distribution, whatever temperature and top-k sampled."""
    prompt = "def quicksort(items):"
    ids = session.tokenize(prompt)
    opts = {"max_tokens": 16, "temperature": 1.3, "top_p": 1.0, "top_k": 50, "seed": 77}
    want, _ = expected(session, ids, **opts)
    steps = oracle_logprobs(session, ids, tokens=list(session.last_tokens))
    r = client(server).completions.create(model=MODEL_ID, prompt=prompt, max_tokens=16, temperature=1.3, seed=77,
                                          logprobs=2, extra_body={"top_k": 50})
    assert r.choices[0].text == want
    lp = r.choices[0].logprobs
    tok = session.tokenizer
    assert len(lp.tokens) == len(steps)
    for i, (t, oracle) in enumerate(zip([t for t, _ in steps], [o for _, o in steps])):
        assert lp.tokens[i] == tok.token_to_piece(t)
        assert lp.token_logprobs[i] == pytest.approx(oracle[t], abs=1e-9)
        top = np.argsort(-oracle, kind="stable")[:2]
        want_top = {tok.token_to_piece(int(j)): oracle[j] for j in top}
        assert lp.top_logprobs[i].keys() == want_top.keys()
        assert all(lp.top_logprobs[i][k] == pytest.approx(v, abs=1e-9) for k, v in want_top.items())
    # text_offset: where each token's text starts in the answer (ASCII here, one byte per char).
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]


def test_logprobs_stop_at_a_stop_string(server, session):
    """Entries of tokens whose text begins at or after the stop string are dropped with it."""
    prompt = "def fibonacci(n):"
    full, _ = expected(session, session.tokenize(prompt), max_tokens=24, temperature=0.0)
    stop = full.strip().split()[1]
    r = client(server).completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                          logprobs=0)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert lp.tokens and all(off < len(text) for off in lp.text_offset)
    joined = "".join(lp.tokens)
    assert joined.startswith(text) and stop not in joined[: len(text)]
    assert len(joined) - len(text) < len(stop) + max(len(t) for t in lp.tokens)
    assert lp.top_logprobs == [{}] * len(lp.tokens)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
        ("/v1/completions", {"logprobs": 6}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"echo": "yes"}, "echo"),
    ],
)
def test_bad_logprob_requests(server, path, body, param):
    base = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    status, got = raw("POST", server, path, json.dumps({**base, **body}).encode())
    assert (status, got["error"]["param"], got["error"]["type"]) == (400, param, "invalid_request_error")
    assert raw("GET", server, "/health")[0] == 200


def test_stop_scanner_holds_back_partial_matches():
    scan = StopText(["END", "xyz"])
    assert scan.push("abc E") == ("abc ", False)
    assert scan.push("N") == ("", False)
    assert scan.push("Dmore") == ("", True)
    scan = StopText(["END"])
    assert scan.push("xE") == ("x", False)
    assert scan.push("q") == ("Eq", False)
    assert scan.flush() == ""


def test_chat_template_file(session, tmp_path):
    """--chat-template: the server renders messages with that Jinja file (system message, several
    turns, non-ASCII, tools, template keyword arguments from --chat-template-kwargs and from the
    request), written out here by hand as the prompt the model must see."""
    template = tmp_path / "t.jinja"
    template.write_text(
        "{% if tools %}[TOOLS] {{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
        "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[ASSISTANT] {% if enable_thinking %}<think>{% endif %}{% endif %}",
        encoding="utf-8",
    )
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
             for n in ("lookup", "run_code")]
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Größe?"},
        {"role": "assistant", "content": "def size():"},
        {"role": "user", "content": "again"},
    ]
    text = "[SYSTEM] You write Python.\n[USER] Größe?\n[ASSISTANT] def size():\n[USER] again\n[ASSISTANT] "
    ids = session.tokenize(text, special=True)
    want, n_gen = expected(session, ids, max_tokens=12, temperature=0.0)
    tool_ids = session.tokenize("[TOOLS] lookup,run_code\n" + text + "<think>", special=True)
    want_tools, _ = expected(session, tool_ids, max_tokens=12, temperature=0.0)
    # --chat-template-kwargs: the server's defaults, under each request's chat_template_kwargs.
    for port in start_server("--chat-template", str(template), "--alias", "coder",
                             "--chat-template-kwargs", '{"enable_thinking": true}'):
        c = client(port)
        r = c.chat.completions.create(model="coder", messages=messages, max_tokens=12, temperature=0,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert r.choices[0].message.content == want
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), n_gen)
        timings = r.model_extra["timings"]
        assert timings["prompt_n"] == len(ids) and timings["predicted_n"] == n_gen
        assert timings["ttft_ms"] > 0 and timings["predicted_per_second"] > 0
        r = c.chat.completions.create(model="coder", messages=messages, max_tokens=12, temperature=0, tools=tools)
        assert r.usage.prompt_tokens == len(tool_ids)
        # The prompt ends inside an open <think> block: the reply is reasoning (agents' split).
        assert r.choices[0].message.model_extra["reasoning_content"] == want_tools.strip()
        assert not r.choices[0].message.content


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_bad_template_kwargs_are_refused(command, capsys):
    from sharpi.cli import main

    for bad in ("[1]", "{not json"):
        with pytest.raises(SystemExit) as stop:
            main([command, "--chat-template-kwargs", bad])
        assert stop.value.code == 2
        assert "--chat-template-kwargs" in capsys.readouterr().err


def test_streamed_experts_answer_as_resident(session):
    """`serve --ram-budget`: experts streamed from the file through a cache of a few slots; the
    greedy answer is the all-resident Session's, bit for bit."""
    probe = sharpi.Session(default_model_path(), threads=1, n_ctx=N_CTX, ram_budget="8GiB", reader="pread")
    st, k = probe.expert_stats(), probe.info["n_expert_used"]
    probe.close()
    budget = st["fixed_bytes"] + 3 * k * st["slot_bytes"]
    prompt = "def parse_args(argv):"
    want, n_gen = expected(session, session.tokenize(prompt), max_tokens=24, temperature=0.0)
    for port in start_server("--ram-budget", str(budget), "--reader", "pread"):
        r = client(port).completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0)
        assert (r.choices[0].text, r.usage.completion_tokens) == (want, n_gen)


def test_stream_until_stop_trims_the_tokens_sampled_past_the_stop():
    # Deterministic form of the race above: the worker put two more pieces (and counted their
    # tokens) before the cancel reached it; the answer and the counts keep the first 3 tokens.
    import asyncio

    from sharpi.server.scheduler import END, Engine, Job
    from sharpi.server.stops import stream_until_stop

    async def run():
        engine = Engine.__new__(Engine)  # no Session: trim and cancel touch only the state below
        engine._state, engine._waiting = threading.Lock(), collections.deque()
        engine.counts = {"completion_tokens": 5}
        job = Job(asyncio.get_running_loop(), [1, 2], {"max_tokens": 16})
        for item in [("ab", [], 1), ("c", [], 2), ("dSTOPe", [], 3), ("f", [], 4), ("g", [], 5)]:
            job.queue.put_nowait(item)
        job.n_generated, job.tokens = 5, [10, 11, 12, 13, 14]
        job.queue.put_nowait(END)
        text = "".join([t async for t, _ in stream_until_stop(engine, job, ["STOP"])])
        return text, job, engine

    text, job, engine = asyncio.run(run())
    assert text == "abcd" and job.stop_sequence == "STOP" and job.stopped.is_set()
    assert job.n_generated == 3 and job.tokens == [10, 11, 12]
    assert engine.counts["completion_tokens"] == 3
