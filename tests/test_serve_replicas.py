"""Several `sharpi serve` replicas behind nginx (issue 39, "Beyond one machine"; docs/replicas.md).

Two replicas of the shipped model and Debian's nginx run on 127.0.0.1 with the nginx configuration
docs/replicas.md gives, read from that file with only its addresses and ports replaced, so the
documented file is the tested one. The official `openai` client talks to nginx only.

Oracles: Session.generate in this process for every greedy answer (whichever replica served it);
each replica's own request count (/v1/sharpi/stats) for where nginx sent what; the usage's
cached_tokens against the first turn's prompt length for prefix reuse on one replica. The queue-full
503 comes from a stand-in replica written here (it answers every request with the 503 in OpenAI's
shape that a full `sharpi serve` queue gives), since what is tested is nginx's retry of it.

nginx is a system package (apt-get install nginx): without it these tests skip saying so, and fail
under SHARPI_REQUIRE_ALL=1, which .ci/run sets after installing it (ci_policy.py).
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import sharpi
from ci_policy import prerequisite_missing
from sharpi.models import default_model_path
from subprocess_env import child_env
from test_serve import MODEL_ID, N_CTX, chatml_ids, expected, free_port, raw

DOC = Path(__file__).resolve().parent.parent / "docs" / "replicas.md"
# The addresses the documented configuration uses, replaced by free ports here.
DOC_LISTEN = "listen 127.0.0.1:8080;"
DOC_SERVERS = ("server 127.0.0.1:8081 ", "server 127.0.0.1:8082 ")
MAX_TOKENS = 16
# Every replica runs with --ignore-eos: each answer is exactly MAX_TOKENS tokens long, and a long
# stream stays long enough to be cut (test_a_replica_that_dies_mid_stream...).
REPLICA_FLAGS = ("--ignore-eos",)
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "stop_at_eos": False}


def nginx_binary() -> str:
    # /usr/sbin is not on every user's PATH, and Debian installs nginx there.
    found = shutil.which("nginx", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    if found is None:
        prerequisite_missing("replica routing test: nginx is not installed "
                             "(apt-get install nginx; .ci/run installs it)")
    return found


def documented_config(listen_port: int, upstream_ports: list) -> str:
    """The ```nginx block of docs/replicas.md with its listen port and the two replicas' ports
    replaced; each replaced line must occur exactly once, so a change to the document that this
    test would no longer cover fails here."""
    blocks = re.findall(r"^```nginx\n(.*?)^```", DOC.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE)
    assert len(blocks) == 1, f"{DOC} must hold exactly one ```nginx block, found {len(blocks)}"
    conf = blocks[0]
    for old, new in zip((DOC_LISTEN, *DOC_SERVERS),
                        (f"listen 127.0.0.1:{listen_port};", *(f"server 127.0.0.1:{p} " for p in upstream_ports))):
        assert conf.count(old) == 1, f"{DOC}: the nginx block must contain {old!r} once"
        conf = conf.replace(old, new)
    return conf


class Nginx:
    """nginx in the foreground from a prefix directory of its own, with the documented
    configuration in front of `upstream_ports`; every path it writes is under `prefix`."""

    def __init__(self, prefix: Path, upstream_ports: list):
        binary = nginx_binary()
        self.prefix = prefix
        (prefix / "logs").mkdir(parents=True)
        (prefix / "tmp").mkdir()
        self.port = free_port()
        (prefix / "sharpi-router.conf").write_text(documented_config(self.port, upstream_ports), encoding="utf-8")
        self.child = subprocess.Popen([binary, "-p", str(prefix), "-c", "sharpi-router.conf", "-g", "daemon off;"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while True:
            if self.child.poll() is not None:
                pytest.fail(f"nginx exited with {self.child.returncode}: {self.child.stderr.read()}{self.error_log()}")
            try:
                if raw("GET", self.port, "/health")[0] == 200:
                    break
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"nginx did not answer /health within 30 s{self.error_log()}")
            time.sleep(0.05)

    def error_log(self) -> str:
        log = self.prefix / "logs" / "error.log"
        return f"\nerror.log:\n{log.read_text()}" if log.exists() else ""

    def client(self, **headers) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                             timeout=60, default_headers=headers or None)

    def stop(self) -> None:
        if self.child.poll() is None:
            self.child.send_signal(signal.SIGQUIT)  # nginx's graceful shutdown
            try:
                self.child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()


class Replica:
    """`sharpi serve` on a free port; started without waiting, so that both replicas load at once."""

    def __init__(self):
        self.port = free_port()
        cmd = [sys.executable, "-m", "sharpi.cli", "serve", "--port", str(self.port), "-t", "1", "-c", str(N_CTX),
               *REPLICA_FLAGS]
        self.child = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True)

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + 300  # as test_serve.start_server: a loaded CI machine is slow
        while True:
            if self.child.poll() is not None:
                pytest.fail(f"sharpi serve exited with {self.child.returncode}: {self.child.stderr.read()}")
            try:
                if raw("GET", self.port, "/health")[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("sharpi serve did not answer /health within 300 s")
            time.sleep(0.1)

    def served(self) -> int:
        """Generations this replica finished (its own count, not nginx's)."""
        return raw("GET", self.port, "/v1/sharpi/stats")[1]["requests"]

    def stop(self) -> None:
        if self.child.poll() is None:
            self.child.terminate()
            try:
                self.child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()


@pytest.fixture(scope="module")
def replicas():
    nginx_binary()  # before two model loads, which a machine without nginx need not pay for
    pair = [Replica(), Replica()]
    try:
        for r in pair:
            r.wait_healthy()
        yield pair
    finally:
        for r in pair:
            r.stop()


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    nginx = Nginx(tmp_path_factory.mktemp("nginx"), [r.port for r in replicas])
    yield nginx
    nginx.stop()


@pytest.fixture(scope="module")
def session():
    s = sharpi.Session(default_model_path(), threads=1, n_ctx=N_CTX)
    yield s
    s.close()


def chat(client: openai.OpenAI, user: str, **extra):
    return client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": user}],
                                          max_tokens=MAX_TOKENS, temperature=0, **extra)


def streamed_text(client: openai.OpenAI, user: str) -> str:
    chunks = list(chat(client, user, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


PROMPTS = ["Write a function that adds two numbers.", "Sort a list in Python.",
           "What is a hash map?", "Reverse a string."]


def test_requests_spread_over_both_replicas_and_answer_as_one_session(router, replicas, session):
    """Eight requests without a session id: round-robin over both replicas (their own counts add up
    to eight, each served some), and each answer is the in-process Session's, whichever replica."""
    want = {p: expected(session, chatml_ids(session, p), **GREEDY)[0] for p in PROMPTS}
    before = [r.served() for r in replicas]
    client = router.client()
    for p in [p for p in PROMPTS for _ in range(2)]:  # each prompt twice in a row: once per replica
        r = chat(client, p)
        assert r.choices[0].message.content == want[p]
        assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", MAX_TOKENS)
    served = [r.served() - b for r, b in zip(replicas, before)]
    assert sum(served) == 8, served
    assert min(served) > 0, f"nginx sent every request to one replica: {served}"


def test_streamed_answers_through_nginx_equal_the_whole_ones(router, session):
    client = router.client()
    for p in PROMPTS[:2]:
        whole = chat(client, p).choices[0].message.content
        assert streamed_text(client, p) == whole == expected(session, chatml_ids(session, p), **GREEDY)[0]


def test_a_session_id_keeps_a_chat_on_one_replica_that_reuses_its_prefix(router, replicas, session):
    """Two turns with one X-Session-Id: both on the same replica, whose KV cache still holds the
    first turn, so the second reuses at least the first turn's whole prompt."""
    client = router.client(**{"X-Session-Id": "chat-reuse"})
    before = [r.served() for r in replicas]
    first = [{"role": "user", "content": PROMPTS[0]}]
    r1 = client.chat.completions.create(model=MODEL_ID, messages=first, max_tokens=MAX_TOKENS, temperature=0)
    second = [*first, {"role": "assistant", "content": r1.choices[0].message.content},
              {"role": "user", "content": "Now make it subtract."}]
    r2 = client.chat.completions.create(model=MODEL_ID, messages=second, max_tokens=MAX_TOKENS, temperature=0)
    assert sorted(r.served() - b for r, b in zip(replicas, before)) == [0, 2]
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    # And a cold run agrees with the answer built on the reused prefix.
    text = (f"<|im_start|>user\n{PROMPTS[0]}<|im_end|>\n<|im_start|>assistant\n{r1.choices[0].message.content}"
            "<|im_end|>\n<|im_start|>user\nNow make it subtract.<|im_end|>\n<|im_start|>assistant\n")
    assert r2.choices[0].message.content == expected(session, session.tokenize(text, special=True), **GREEDY)[0]


class FullQueueHandler(http.server.BaseHTTPRequestHandler):
    """A replica whose queue is full: every request gets a 503 in OpenAI's error shape, as a full
    `sharpi serve` queue answers (nginx decides on the status alone, not the body)."""

    protocol_version = "HTTP/1.1"  # keep-alive, as nginx's upstream connections are
    hits: list

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.hits.append(self.path)
        body = json.dumps({"error": {"message": "the server is busy: the request queue is full",
                                     "type": "server_error", "param": None, "code": "queue_full"}}).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_full_replicas_503_is_retried_on_the_other(replicas, tmp_path, session):
    """nginx in front of one real replica and one whose queue is full: every request, streamed or
    not, succeeds on the real one, and the full one was tried (a POST is retried only because the
    configuration says non_idempotent)."""
    hits: list = []
    handler = type("Handler", (FullQueueHandler,), {"hits": hits})
    full = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=full.serve_forever, daemon=True).start()
    nginx = Nginx(tmp_path / "nginx", [replicas[0].port, full.server_address[1]])
    try:
        client = nginx.client()
        want = expected(session, chatml_ids(session, PROMPTS[1]), **GREEDY)[0]
        before = replicas[0].served()
        for _ in range(4):
            assert chat(client, PROMPTS[1]).choices[0].message.content == want
        for _ in range(2):
            assert streamed_text(client, PROMPTS[1]) == want
        assert replicas[0].served() - before == 6
        assert hits and set(hits) == {"/v1/chat/completions"}, hits
    finally:
        nginx.stop()
        full.shutdown()
        full.server_close()


def owner_of(client: openai.OpenAI, replicas) -> int:
    """The index of the replica nginx sends the requests of `client` (its X-Session-Id) to."""
    before = [r.served() for r in replicas]
    chat(client, PROMPTS[3])
    moved = [r.served() - b for r, b in zip(replicas, before)]
    assert sorted(moved) == [0, 1], moved
    return moved.index(1)


def test_a_replica_that_dies_cuts_its_stream_and_moves_its_queued_request(router, replicas, session):
    """Last in this file: it kills a replica. A stream that already began is not retried (the
    client sees the stream cut); a non-streamed request waiting in the dead replica's queue had
    received nothing, so nginx sends it to the other replica and its client never notices; every
    request after, that session's included, succeeds on the survivor."""
    client = router.client(**{"X-Session-Id": "chat-failover"})
    victim_index = owner_of(client, replicas)
    victim, survivor = replicas[victim_index], replicas[1 - victim_index]
    want = {p: expected(session, chatml_ids(session, p), **GREEDY)[0] for p in PROMPTS[:2]}

    stream = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": PROMPTS[2]}],
                                            max_tokens=N_CTX - 64, temperature=0, stream=True)
    pieces = iter(stream)
    while not (chunk := next(pieces)).choices or not chunk.choices[0].delta.content:
        pass
    queued: list = []
    waiter = threading.Thread(target=lambda: queued.append(chat(client, PROMPTS[1]).choices[0].message.content))
    waiter.start()
    deadline = time.monotonic() + 30
    while raw("GET", victim.port, "/v1/sharpi/stats")[1]["waiting"] == 0:
        assert time.monotonic() < deadline, "the second request never reached the busy replica's queue"
        time.sleep(0.01)
    before = survivor.served()
    victim.child.kill()  # dies mid-answer: SIGTERM would let uvicorn finish the stream first
    victim.child.wait()
    with pytest.raises((httpx.RemoteProtocolError, openai.APIConnectionError)):
        for chunk in pieces:
            assert not (chunk.choices and chunk.choices[0].finish_reason), "the stream finished after its replica died"
    waiter.join(timeout=60)
    assert queued == [want[PROMPTS[1]]]
    assert survivor.served() - before == 1

    for p in PROMPTS[:2]:
        assert chat(client, p).choices[0].message.content == want[p]  # the dead replica's session
        assert chat(router.client(), p).choices[0].message.content == want[p]  # round-robin
    assert streamed_text(client, PROMPTS[0]) == want[PROMPTS[0]]
    assert survivor.served() - before == 6
