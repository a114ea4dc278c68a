"""`sharpi serve --parallel N` (issue 39): the slot scheduler's continuous batching, driven by the
official `openai` client and raw HTTP against a server subprocess on the shipped model, and the
Engine in-process where a property needs the worker's own counts.

Oracles: Session.generate in this process, one prompt at a time from an empty cache (a greedy
answer must not depend on what else the step held); the scheduler's contract (a full queue is a
503 in the protocol's error shape, a cancelled Job frees its slot at the next step boundary); the
requests' own usage for the step counts /metrics reports.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import openai
import pytest
import sharpi
from prometheus_client.parser import text_string_to_metric_families
from sharpi.models import default_model_path
from test_serve import MODEL_ID, N_CTX, chatml_ids, client, expected, raw, start_server

# Prompts of different lengths (the steps mix prefill chunks and single tokens).
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def __init__(self):", "# sort a list of numbers\n",
           "def parse_args(argv):\n    \"\"\"Parse the command line.\"\"\"\n", "for i in range(10):",
           "with open(path) as f:", "import json\n\n\ndef load(path):\n    with open(path) as f:\n        return"]


@pytest.fixture(scope="module")
def session():
    s = sharpi.Session(default_model_path(), threads=1, n_ctx=N_CTX)
    yield s
    s.close()


@pytest.fixture(scope="module")
def server8():
    yield from start_server("--parallel", "8")


def stats(port: int) -> dict:
    return raw("GET", port, "/v1/sharpi/stats")[1]


def wait_for(port: int, condition, what: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while not condition(st := stats(port)):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {st}"
        time.sleep(0.02)
    return st


def metrics(port: int) -> dict:
    """/metrics parsed by prometheus_client's own text parser: {family name: family}."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(families: dict, name: str, **labels) -> float:
    base = name.removesuffix("_total").removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
    for s in families[base].samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError(name)


def open_stream(port: int, body: dict) -> socket.socket:
    """A streamed completion sent over a raw socket, returned once its first event arrived."""
    data = json.dumps({**body, "stream": True})
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n{data}").encode())
    seen = b""
    while b"data: " not in seen:
        more = sock.recv(4096)
        if not more:
            sock.close()
            pytest.fail(f"the server closed the stream before its first event: {seen!r}")
        seen += more
    return sock


def test_eight_streaming_clients_equal_sequential_greedy_runs(server8, session):
    want = [expected(session, session.tokenize(p), max_tokens=32, temperature=0.0) for p in PROMPTS]
    c = client(server8)
    before = metrics(server8)
    got: list = [None] * len(PROMPTS)
    start = threading.Barrier(len(PROMPTS))

    def run(i: int) -> None:
        start.wait()
        chunks = list(c.completions.create(model=MODEL_ID, prompt=PROMPTS[i], max_tokens=32, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        got[i] = (text, chunks[-1].usage.completion_tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got == want
    after = metrics(server8)
    # They were decoded together: some step held more than one sequence.
    steps = sample(after, "sharpi_steps_total") - sample(before, "sharpi_steps_total")
    single = (sample(after, "sharpi_step_sequences_bucket", le="1.0")
              - sample(before, "sharpi_step_sequences_bucket", le="1.0"))
    assert single < steps
    st = stats(server8)
    assert st["slots"] == 8 and st["active"] == 0 and st["waiting"] == 0


def test_metrics_parse_and_count_the_steps(server8, session):
    """Every family parses; the step histograms agree with what the answers report: a greedy
    answer cut by max_tokens is one step per token (its prompt's step samples the first, its last
    is never decoded), and the steps decoded each prompt's uncached tokens and all but the last
    generated token."""
    before = metrics(server8)
    c = client(server8)
    answers = []

    def run(prompt: str) -> None:
        answers.append(c.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=12, temperature=0,
                                            logit_bias={str(session.tokenizer.eos_id): -100}))

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS[:4]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    after = metrics(server8)
    for name in ("sharpi_slots", "sharpi_requests_waiting", "sharpi_requests_processing", "sharpi_queue_size",
                 "sharpi_steps", "sharpi_step_tokens", "sharpi_step_sequences", "sharpi_expert_read_bytes",
                 "sharpi_expert_hit_rate", "sharpi_expert_read_bytes_per_step", "sharpi_expert_read_bytes_per_token",
                 "sharpi_generations_cancelled_queued", "sharpi_requests_rejected"):
        assert name in after, name
    assert after["sharpi_step_sequences"].type == "histogram"
    assert sample(after, "sharpi_slots") == 8

    def delta(name: str, **labels) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert all(a.choices[0].finish_reason == "length" for a in answers)
    generated = sum(a.usage.completion_tokens for a in answers)
    uncached = sum(a.usage.prompt_tokens - a.usage.prompt_tokens_details.cached_tokens for a in answers)
    assert delta("sharpi_step_sequences_sum") == generated
    assert delta("sharpi_step_tokens_sum") == uncached + generated - len(answers)
    assert delta("sharpi_step_sequences_count") == delta("sharpi_steps_total")
    assert delta("sharpi_step_tokens_bucket", le="+Inf") == delta("sharpi_steps_total")
    assert sample(after, "sharpi_expert_hit_rate") == 1.0  # every expert resident
    assert sample(after, "sharpi_expert_read_bytes_total") == 0


def test_queue_full_is_503_in_each_protocols_shape(session):
    for port in start_server("--parallel", "1", "--queue-size", "1"):
        # One running (its client never reads; it holds the slot), one waiting: the queue is full.
        body = {"prompt": "def ", "max_tokens": N_CTX - 8, "temperature": 0,
                "logit_bias": {str(session.tokenizer.eos_id): -100}}
        running = open_stream(port, body)
        waiting = socket.create_connection(("127.0.0.1", port), timeout=60)
        data = json.dumps(body)
        waiting.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(data)}\r\n\r\n{data}").encode())
        wait_for(port, lambda st: st["active"] == 1 and st["waiting"] == 1, "one running and one waiting")
        with pytest.raises(openai.APIStatusError) as refused:
            client(port).completions.create(model=MODEL_ID, prompt="x", max_tokens=4)
        assert refused.value.status_code == 503
        assert refused.value.response.headers["retry-after"] == "1"
        error = refused.value.response.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "queue_full" and "--queue-size 1" in error["message"]
        status, got = raw("POST", port, "/v1/messages", json.dumps({
            "model": MODEL_ID, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).encode())
        assert status == 503 and got["type"] == "error" and got["error"]["type"] == "overloaded_error"
        # A request is taken whole or not at all: its queued choices leave the queue with it.
        status, got = raw("POST", port, "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 4, "n": 2}).encode())
        assert status == 503
        running.close()
        waiting.close()
        st = wait_for(port, lambda st: st["active"] == 0 and st["waiting"] == 0, "the slot and the queue to empty")
        assert st["rejected"] == 3
        # The waiting request left before a slot took it: counted among the cancelled.
        assert st["cancelled"] == 2 and st["cancelled_queued"] in (0, 1)
        assert sample(metrics(port), "sharpi_requests_rejected_total") == 3
        # Serving goes on.
        want = expected(session, session.tokenize("import "), max_tokens=8, temperature=0.0)[0]
        assert client(port).completions.create(model=MODEL_ID, prompt="import ", max_tokens=8,
                                               temperature=0).choices[0].text == want


def test_disconnect_frees_the_slot_and_others_go_on(server8, session):
    """A streamed client that leaves frees its slot (the stats show it) while another slot's answer
    streams on, unchanged."""
    body = {"prompt": "def ", "max_tokens": N_CTX - 8, "temperature": 0,
            "logit_bias": {str(session.tokenizer.eos_id): -100}}
    wait_for(server8, lambda st: st["active"] == 0, "an idle server")
    before = stats(server8)
    leaving = open_stream(server8, body)
    wait_for(server8, lambda st: st["active"] == 1, "the request to run")
    want = expected(session, session.tokenize(PROMPTS[0]), max_tokens=64, temperature=0.0)
    other: list = []
    t = threading.Thread(target=lambda: other.append(client(server8).completions.create(
        model=MODEL_ID, prompt=PROMPTS[0], max_tokens=64, temperature=0)))
    t.start()
    leaving.close()
    st = wait_for(server8, lambda st: st["cancelled"] == before["cancelled"] + 1, "the cancel")
    assert st["completion_tokens"] - before["completion_tokens"] < N_CTX - 8
    t.join(timeout=300)
    assert (other[0].choices[0].text, other[0].usage.completion_tokens) == want
    wait_for(server8, lambda st: st["active"] == 0, "every slot free")


def test_cancel_frees_the_slot_within_one_step():
    """In-process: Engine.cancel of a running Job ends it at the next step boundary (at most the
    step in flight runs on), and the other slot's answer is the one it gives alone."""
    from sharpi.server.scheduler import END, Engine

    s = sharpi.Session(default_model_path(), threads=1, n_ctx=256, n_seq=2)
    want = expected(s, s.tokenize(PROMPTS[1]), max_tokens=40, temperature=0.0)
    engine = Engine(s)
    options = {"max_tokens": 200, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}

    async def run():
        eos = s.tokenizer.eos_id
        doomed = engine.submit(s.tokenize(PROMPTS[0]), {**options, "logit_bias": {eos: -100.0}})
        kept = engine.submit(s.tokenize(PROMPTS[1]), {**options, "max_tokens": 40})
        for _ in range(3):  # a few of its pieces: it is decoding
            assert await doomed.queue.get() is not END
        steps_at_cancel = engine.snapshot()["steps"]
        engine.cancel(doomed)
        while await doomed.queue.get() is not END:
            pass
        steps_at_end = engine.snapshot()["steps"]
        text = ""
        while (item := await kept.queue.get()) is not END:
            text += item[0]
        return steps_at_cancel, steps_at_end, doomed, kept, text

    try:
        steps_at_cancel, steps_at_end, doomed, kept, text = asyncio.run(run())
    finally:
        engine.close()
    assert steps_at_end - steps_at_cancel <= 1
    assert doomed.n_generated < 200 and engine.snapshot()["cancelled"] == 1
    assert (text, kept.n_generated) == want


def test_each_conversation_keeps_its_slot(session):
    """Two conversations on two slots: each next turn goes to the slot that holds its first turn
    (its prompt and answer are cached), though both share the template's first tokens."""
    for port in start_server("--parallel", "2"):
        c = client(port)
        turns = {}
        for name, question in (("a", "Write a function that reverses a list."), ("b", "Explain decorators.")):
            messages = [{"role": "user", "content": question}]
            r = c.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=12, temperature=0)
            turns[name] = (messages, r)
        for name, (messages, r1) in turns.items():
            more = [*messages, {"role": "assistant", "content": r1.choices[0].message.content},
                    {"role": "user", "content": "Shorter."}]
            r2 = c.chat.completions.create(model=MODEL_ID, messages=more, max_tokens=12, temperature=0)
            cached = r2.usage.prompt_tokens_details.cached_tokens
            assert cached >= r1.usage.prompt_tokens + r1.usage.completion_tokens - 1, name
            ids = chatml_ids(session, messages[0]["content"])
            assert cached >= len(ids)


@pytest.mark.parametrize("value", ["0", "-1", "257", "1000", "two"])
def test_bad_parallel_is_a_cli_error(value, capsys):
    from sharpi.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["serve", "--parallel", value])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "-np/--parallel" in err and ("1 to 256" in err or "integer" in err)


def _answers(port: int, requests: list, together: bool) -> list:
    """The choices and usage of each (path, body) request, sent all at once or one by one."""
    out: list = [None] * len(requests)

    def run(i: int) -> None:
        path, body = requests[i]
        status, got = raw("POST", port, path, json.dumps(body).encode())
        assert status == 200, got
        out[i] = (got["choices"], got["usage"]["completion_tokens"], got["usage"]["prompt_tokens"])

    if not together:
        for i in range(len(requests)):
            run(i)
        return out
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out


def test_chunked_prefill_logprobs_and_stops_match_one_slot(session):
    """-b 16: a long prompt is prefilled 16 tokens a step (fewer while others decode) beside
    requests that decode; echo with logprobs (the prompt's own entries from rows of several steps),
    top logprobs, a stop string, seeded sampling, a JSON schema's grammar on two choices at once
    and a streamed-experts cache each answer exactly what the one-slot server gives them one at a
    time, and the experts' reads show in /metrics."""
    long_prompt = PROMPTS[7] + " json.load(f)\n\n\ndef save(path, data):\n    with open(path, 'w') as f:"
    assert len(session.tokenize(long_prompt)) > 40
    stop = expected(session, session.tokenize(PROMPTS[0]), max_tokens=24, temperature=0.0)[0].split()[1]
    requests = [
        ("/v1/completions", {"prompt": long_prompt, "max_tokens": 16, "temperature": 0, "echo": True, "logprobs": 2}),
        ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "stop": [stop]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Write hello world."}], "max_tokens": 12,
                                  "temperature": 0, "logprobs": True, "top_logprobs": 2}),
        ("/v1/completions", {"prompt": PROMPTS[4], "max_tokens": 20, "temperature": 0.8, "seed": 7}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "A point as JSON."}], "max_tokens": 24,
                                  "temperature": 0, "n": 2, "response_format": {"type": "json_schema", "json_schema": {
                                      "name": "point", "schema": {"type": "object", "properties": {
                                          "x": {"type": "integer"}, "y": {"type": "integer"}},
                                          "required": ["x", "y"]}}}}),
    ]
    probe = sharpi.Session(default_model_path(), threads=1, n_ctx=N_CTX, ram_budget="8GiB", reader="pread")
    st, k = probe.expert_stats(), probe.info["n_expert_used"]
    probe.close()
    budget = str(st["fixed_bytes"] + 6 * k * st["slot_bytes"] + 4 * N_CTX * 4096)
    for port in start_server("--parallel", "1"):
        want = _answers(port, requests, together=False)
    for port in start_server("--parallel", "4", "-b", "16", "--ram-budget", budget, "--reader", "pread"):
        got = _answers(port, requests, together=True)
        m = metrics(port)
    assert got == want
    assert want[1][0][0]["finish_reason"] == "stop" and stop not in want[1][0][0]["text"]
    assert sample(m, "sharpi_step_tokens_bucket", le="16.0") == sample(m, "sharpi_steps_total")
    assert sample(m, "sharpi_expert_read_bytes_total") > 0
    assert 0 <= sample(m, "sharpi_expert_hit_rate") < 1
    assert sample(m, "sharpi_expert_read_bytes_per_token") > 0


def test_cli_repeats_the_schedulers_default():
    from sharpi.server import cli, scheduler

    assert cli.DEFAULT_BATCH_SIZE == scheduler.DEFAULT_BATCH_SIZE


def test_churn_leaks_no_slot_and_answers_stay_right(server8, session):
    """Requests that finish, leave mid-stream or stop at a stop string, from more clients than
    slots, in a fresh random order each run: every answer that completes is its sequential run's,
    and afterwards no slot is busy and nothing waits."""
    import random

    seed = random.randrange(2**32)
    rng = random.Random(seed)
    want = {p: expected(session, session.tokenize(p), max_tokens=24, temperature=0.0) for p in PROMPTS}
    plan = [(rng.choice(PROMPTS), rng.choice(["whole", "stream", "leave"])) for _ in range(24)]
    before = stats(server8)
    failures: list = []

    def run(prompt: str, how: str) -> None:
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
        if how == "leave":
            open_stream(server8, {**body, "max_tokens": N_CTX // 2}).close()
            return
        r = client(server8).completions.create(model=MODEL_ID, stream=how == "stream", **body)
        text = "".join(c.choices[0].text for c in r if c.choices) if how == "stream" else r.choices[0].text
        if text != want[prompt][0]:
            failures.append((prompt, how, text))

    threads = [threading.Thread(target=run, args=item) for item in plan]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not failures, (seed, failures)
    st = wait_for(server8, lambda st: st["requests"] - before["requests"] == len(plan), "every request to end")
    assert st["active"] == 0 and st["waiting"] == 0, seed
    assert st["cancelled"] - before["cancelled"] == sum(how == "leave" for _, how in plan), seed


def test_a_tiny_batch_size_still_prefills_and_answers_right():
    """In-process, -b 2 with 4 slots: the decoding slots alone fill each step, yet the waiting
    prompt is prefilled (a token a step) and every answer is its sequential run's."""
    from sharpi.server.scheduler import END, Engine

    s = sharpi.Session(default_model_path(), threads=1, n_ctx=256, n_seq=4)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[5], PROMPTS[7]]
    want = [expected(s, s.tokenize(p), max_tokens=12, temperature=0.0) for p in prompts]
    engine = Engine(s, batch_size=2)
    options = {"max_tokens": 12, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}

    async def run():
        jobs = [engine.submit(s.tokenize(p), dict(options)) for p in prompts]
        texts = []
        for job in jobs:
            text = ""
            while (item := await job.queue.get()) is not END:
                text += item[0]
            texts.append((text, job.n_generated))
        return texts

    try:
        got = asyncio.run(run())
        snap = engine.snapshot()
    finally:
        engine.close()
    assert got == want
    # A step held at most the 3 other slots' tokens and one prompt token beyond -b.
    buckets, _ = engine.step_histogram_values()["tokens"]
    assert dict(buckets)["4.0"] == snap["steps"]


def test_parallel_on_the_device_path_is_refused_up_front(capsys):
    from sharpi.cli import main

    assert main(["serve", "--parallel", "2", "--device", "cuda"]) == 1
    assert "--parallel 2 with --device cuda" in capsys.readouterr().err


def test_one_prompt_asked_several_times_is_prefilled_once(session):
    """A request's n choices (seeded sampling and greedy) and clients sending the same prompt at once
    prefill it once: the followers fork the leader's sequence and sample from its last prompt logits,
    and every answer is the one-slot server's (which prefills each choice itself)."""
    prompt = PROMPTS[7] + " json.load(f)\n\n\ndef save(path, data):\n    with open(path, 'w') as f:"
    n_prompt = len(session.tokenize(prompt))
    requests = [
        ("/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0.9, "seed": 11, "n": 4}),
        ("/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0}),
        ("/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0}),
    ]
    for port in start_server("--parallel", "1"):
        want = _answers(port, requests, together=False)
    for port in start_server("--parallel", "8", "-b", "16"):
        got = [_answers(port, [r], together=False)[0] for r in requests[:1]]
        first = stats(port)
        got += _answers(port, requests[1:], together=True)
    assert got == want
    assert len({c["text"] for c in want[0][0]}) > 1  # the seeded choices differ: each sampled its own
    # The four choices: one prefill of the prompt (-b 16: several steps), three forks.
    assert first["prompt_tokens_prefilled"] == n_prompt, first
    assert first["prompt_tokens_reused"] == 3 * n_prompt, first


def test_a_fault_in_the_scheduler_answers_its_requests_instead_of_hanging():
    """An exception inside the worker's own step planning (here a draft source that breaks) must
    end the running requests with that error, not leave them waiting on a dead worker thread; the
    worker goes on serving."""
    import asyncio

    from sharpi.server.scheduler import END, Engine

    class BrokenDraft:
        def draft(self, context, room, key=0):
            raise RuntimeError("the draft source broke")

        def observe(self, n_drafted, seconds):
            pass

        def record(self, n_drafted, n_accepted):
            pass

        def forget(self, key):
            pass

    s = sharpi.Session(default_model_path(), threads=1, n_ctx=N_CTX, n_seq=2)
    engine = Engine(s, speculation=BrokenDraft())
    options = {"max_tokens": 4, "temperature": 0.0}

    async def run():
        jobs = [engine.submit(s.tokenize(p), dict(options)) for p in PROMPTS[:3]]
        for job in jobs:
            while await asyncio.wait_for(job.queue.get(), timeout=120) is not END:
                pass
        return jobs

    try:
        jobs = asyncio.run(run())
    finally:
        engine.close()
        s.close()
    assert all(isinstance(job.error, RuntimeError) and "draft source broke" in str(job.error) for job in jobs)
