"""`sharpi serve`'s request fields beyond one prompt and one answer (issue 43): `n` choices, the
prompt as token ids or as a list of prompts, `echo` (with the prompt's own logprobs), `suffix`
(fill-in-the-middle on a model with FIM tokens), `logit_bias`, and a 400 naming each OpenAI field
sharpi does not implement.

Oracles: Session.generate / Session.decode in this process on prompt ids built here, by hand, from
the tokenizer (and, for fill-in-the-middle, the FIM token ids read from the GGUF with the `gguf`
package); a seeded choice k must equal the single-choice request with seed + k; float64
log-softmax of the logits for logprobs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import sharpi
from sharpi.models import default_model_path
from test_serve import N_CTX, expected, log_softmax
from test_serve_api import Server, assert_openai_error


@pytest.fixture(scope="module")
def plain():
    s = Server()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def session():
    s = sharpi.Session(default_model_path(), threads=1, n_ctx=N_CTX)
    yield s
    s.close()


def stream_choices(server: Server, path: str, body: dict) -> tuple[dict, list]:
    """A streamed answer reassembled: {index: text (completions) or content (chat)}, and the events."""
    status, _, data = server.request("POST", path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200, data
    events = [json.loads(line[6:]) for line in data.decode().split("\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    texts: dict = {}
    for ev in events:
        for c in ev.get("choices", []):
            piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
    return texts, events


# -- n ----------------------------------------------------------------------------------------------

SAMPLED = {"max_tokens": 10, "temperature": 1.0, "top_p": 0.95}


def test_n_seeded_completions_equal_separate_requests(plain, session):
    prompt = "def parse("
    status, got = plain.json("POST", "/v1/completions", {"prompt": prompt, "n": 3, "seed": 41, **SAMPLED})
    assert status == 200, got
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    ids = session.tokenize(prompt)
    wants = [expected(session, ids, seed=41 + k, **SAMPLED) for k in range(3)]
    assert [c["text"] for c in got["choices"]] == [w for w, _ in wants]
    assert len({w for w, _ in wants}) > 1, "three seeds gave one text: the check cannot tell choices apart"
    assert got["usage"]["prompt_tokens"] == len(ids)  # counted once, as OpenAI counts it
    assert got["usage"]["completion_tokens"] == sum(n for _, n in wants)
    # The documented derivation: choice k is the single request with seed + k.
    for k in range(3):
        single = plain.json("POST", "/v1/completions", {"prompt": prompt, "seed": 41 + k, **SAMPLED})[1]
        assert single["choices"][0]["text"] == wants[k][0]
    texts, events = stream_choices(plain, "/v1/completions", {"prompt": prompt, "n": 3, "seed": 41, **SAMPLED})
    assert texts == {k: w for k, (w, _) in enumerate(wants)}
    assert events[-1]["usage"]["completion_tokens"] == sum(n for _, n in wants)


def test_n_seeded_chat_and_seed_wraps(plain, session):
    messages = [{"role": "user", "content": "Sort a list."}]
    ids = session.tokenize("<|im_start|>user\nSort a list.<|im_end|>\n<|im_start|>assistant\n", special=True)
    seed = 2**32 - 1  # choice 1 wraps to seed 0
    status, got = plain.json("POST", "/v1/chat/completions", {"messages": messages, "n": 2, "seed": seed, **SAMPLED})
    assert status == 200, got
    wants = [expected(session, ids, seed=s, **SAMPLED)[0] for s in (seed, 0)]
    assert [c["message"]["content"] for c in got["choices"]] == wants
    assert [c["index"] for c in got["choices"]] == [0, 1]
    texts, events = stream_choices(plain, "/v1/chat/completions", {"messages": messages, "n": 2, "seed": seed, **SAMPLED})
    assert texts == {0: wants[0], 1: wants[1]}
    roles = [c["index"] for ev in events for c in ev.get("choices", []) if c.get("delta", {}).get("role")]
    assert roles == [0, 1]


def test_n_greedy_choices_are_identical(plain, session):
    prompt = "import "
    want, _ = expected(session, session.tokenize(prompt), max_tokens=12, temperature=0.0)
    got = plain.json("POST", "/v1/completions", {"prompt": prompt, "n": 4, "max_tokens": 12, "temperature": 0})[1]
    assert [c["text"] for c in got["choices"]] == [want] * 4


@pytest.mark.parametrize("body", [{"prompt": "x", "n": 0}, {"prompt": "x", "n": 17}, {"prompt": "x", "n": "2"},
                                  {"prompt": ["a", "b", "c"], "n": 6}])
def test_n_bounds(plain, body):
    status, got = plain.json("POST", "/v1/completions", {**body, "max_tokens": 1})
    assert_openai_error(status, got, 400)
    assert got["error"]["param"] == "n"


# -- prompt forms -------------------------------------------------------------------------------------


def test_prompt_as_tokens_and_lists(plain, session):
    tok = session.tokenizer
    a, b = "def read(", "class Node"
    ids_a, ids_b = session.tokenize(a), session.tokenize(b)
    greedy = {"max_tokens": 8, "temperature": 0}
    want_a = expected(session, ids_a, max_tokens=8, temperature=0.0)[0]
    want_b = expected(session, ids_b, max_tokens=8, temperature=0.0)[0]
    got = plain.json("POST", "/v1/completions", {"prompt": ids_a, **greedy})[1]
    assert [c["text"] for c in got["choices"]] == [want_a]
    assert got["usage"]["prompt_tokens"] == len(ids_a)
    for prompt in ([a, b], [ids_a, ids_b]):
        got = plain.json("POST", "/v1/completions", {"prompt": prompt, **greedy})[1]
        assert [(c["index"], c["text"]) for c in got["choices"]] == [(0, want_a), (1, want_b)]
        assert got["usage"]["prompt_tokens"] == len(ids_a) + len(ids_b)
    # index = prompt_index * n + sample, each prompt's samples seeded seed + sample.
    got = plain.json("POST", "/v1/completions", {"prompt": [a, ids_b], "n": 2, "seed": 7, **SAMPLED})[1]
    wants = [expected(session, ids, seed=7 + k, **SAMPLED)[0] for ids in (ids_a, ids_b) for k in range(2)]
    assert [(c["index"], c["text"]) for c in got["choices"]] == list(enumerate(wants))
    assert tok.n_vocab > 5


@pytest.mark.parametrize("prompt", [[1, 2, 10**6], [[3], [4, -1]], [[]], [1.5], [["x"]], [None]])
def test_bad_token_prompts(plain, session, prompt):
    status, got = plain.json("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert_openai_error(status, got, 400)
    assert got["error"]["param"] == "prompt"
    for bad in (10**6, -1):
        if bad in prompt or any(isinstance(p, list) and bad in p for p in prompt):
            assert str(bad) in got["error"]["message"]


# -- echo ---------------------------------------------------------------------------------------------


def test_echo_prepends_the_prompt(plain, session):
    prompt = "for item in "
    want, _ = expected(session, session.tokenize(prompt), max_tokens=8, temperature=0.0)
    got = plain.json("POST", "/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 8, "temperature": 0})[1]
    assert got["choices"][0]["text"] == prompt + want
    ids = session.tokenize(prompt)
    got = plain.json("POST", "/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 8, "temperature": 0})[1]
    assert got["choices"][0]["text"] == session.detokenize(ids) + want
    texts, _ = stream_choices(plain, "/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 8,
                                                         "temperature": 0})
    assert texts == {0: prompt + want}


def test_echo_logprobs_are_the_prompts_own(plain, session):
    prompt = "def merge(left, right):"
    ids = session.tokenize(prompt)
    tok = session.tokenizer
    session.reset()
    rows = session.decode(ids[:-1], all_logits=True)
    got = plain.json("POST", "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 4,
                                                 "temperature": 0})[1]
    lp = got["choices"][0]["logprobs"]
    n_gen = got["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(ids) + n_gen
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(ids)):
        want = log_softmax(rows[i - 1])
        assert lp["tokens"][i] == tok.token_to_bytes(ids[i]).decode("utf-8", errors="replace")
        assert lp["token_logprobs"][i] == pytest.approx(want[ids[i]], abs=1e-9)
        top = np.argsort(-want, kind="stable")[:2]
        assert sorted(lp["top_logprobs"][i].values(), reverse=True) == pytest.approx(list(want[top]), abs=1e-9)
    # Offsets index the echoed text: each token's text starts where its offset says (a control
    # token, the BOS this model adds, writes no text).
    text = got["choices"][0]["text"]
    full = ids + [None] * n_gen
    for off, token, token_id in zip(lp["text_offset"], lp["tokens"], full):
        if token_id is None or not tok.is_special(token_id):
            assert text[off:off + len(token)] == token
    # Token ids echo as their text with control tokens written (as /detokenize writes them), and
    # every token, the BOS too, sits at its offset.
    got_ids = plain.json("POST", "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 4,
                                                     "temperature": 0})[1]
    id_text, id_lp = got_ids["choices"][0]["text"], got_ids["choices"][0]["logprobs"]
    assert id_text == session.detokenize(ids) + text[len(prompt):]
    assert id_lp["token_logprobs"][0] is None
    assert id_lp["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-9)
    for off, token, token_id in zip(id_lp["text_offset"], id_lp["tokens"], full):
        if token_id is not None:
            assert id_text[off:off + len(token)] == token
    streamed, events = stream_choices(plain, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 2,
                                                                 "max_tokens": 4, "temperature": 0})
    assert streamed == {0: text}
    offsets = [o for ev in events for c in ev["choices"] if c.get("logprobs") for o in c["logprobs"]["text_offset"]]
    assert offsets == lp["text_offset"]


# -- logit_bias ---------------------------------------------------------------------------------------


def test_logit_bias_changes_the_greedy_answer(plain, session):
    prompt = "while "
    ids = session.tokenize(prompt)
    session.reset()
    first = int(np.argmax(session.decode(ids)))
    want, _ = expected(session, ids, max_tokens=6, temperature=0.0, logit_bias={first: -100})
    got = plain.json("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                 "logit_bias": {str(first): -100}})[1]
    assert got["choices"][0]["text"] == want
    assert not want.startswith(session.detokenize([first]))
    for bad in ({"abc": 1}, {str(10**7): 1}, {"5": 101}, [1]):
        status, err = plain.json("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 1, "logit_bias": bad})
        assert_openai_error(status, err, 400)
        assert err["error"]["param"] == "logit_bias"


# -- fields sharpi does not implement ---------------------------------------------------------------------

MSG = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(("path", "field", "value"), [
    ("/v1/chat/completions", "store", True),
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
    ("/v1/chat/completions", "service_tier", "priority"),
    ("/v1/chat/completions", "parallel_tool_calls", "no"),
    ("/v1/chat/completions", "verbosity", "low"),
    ("/v1/chat/completions", "web_search_options", {}),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/chat/completions", "stream_options", {"include_usage": True}),  # without stream
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "stream_options", {"include_usage": True}),
    ("/v1/completions", "echo", 1),
])
def test_unimplemented_fields_are_refused(plain, path, field, value):
    base = {"messages": MSG} if "chat" in path else {"prompt": "x"}
    status, got = plain.json("POST", path, {**base, "max_tokens": 1, field: value})
    assert_openai_error(status, got, 400)
    assert got["error"]["param"] == field


def test_annotation_fields_are_accepted(plain):
    extra = {"user": "u1", "metadata": {"k": "v"}, "safety_identifier": "s", "prompt_cache_key": "c",
             "store": False, "service_tier": "auto", "modalities": ["text"]}
    status, got = plain.json("POST", "/v1/chat/completions", {"messages": MSG, "max_tokens": 1, **extra})
    assert status == 200, got
    status, got = plain.json("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1, "user": "u1", "best_of": 1})
    assert status == 200, got


# -- suffix: fill-in-the-middle -------------------------------------------------------------------------


def test_suffix_needs_fim_tokens(plain):
    status, got = plain.json("POST", "/v1/completions", {"prompt": "def f(", "suffix": "    return x", "max_tokens": 1})
    assert_openai_error(status, got, 400)
    assert got["error"]["param"] == "suffix" and "fill-in-the-middle" in got["error"]["message"]


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory):
    import subprocess
    import sys

    from subprocess_env import child_env

    path = tmp_path_factory.mktemp("fim") / "fim.gguf"
    subprocess.run([sys.executable, "-m", "sharpi.cli", "make-model", "--fim", "--seed", "3", str(path)], check=True,
                   env=child_env(), stdout=subprocess.DEVNULL, timeout=300)
    return path


def test_suffix_fills_in_the_middle(fim_model):
    import gguf

    reader = gguf.GGUFReader(str(fim_model))

    def key(name):
        field = reader.fields[name]
        return int(field.parts[field.data[0]][0])

    pre, suf, mid = (key(f"tokenizer.ggml.fim_{k}_token_id") for k in ("pre", "suf", "mid"))
    tokens = [bytes(reader.fields["tokenizer.ggml.tokens"].parts[i]).decode()
              for i in reader.fields["tokenizer.ggml.tokens"].data]
    assert (tokens[pre], tokens[suf], tokens[mid]) == ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
    prefix, suffix = "def total(items):\n    ", "\n    return result\n"
    server = Server("-m", str(fim_model))
    try:
        with sharpi.Session(str(fim_model), threads=1, n_ctx=N_CTX) as session:
            # llama.cpp's PSM order, no BOS (the synthetic vocabulary adds none).
            ids = [pre, *session.tokenize(prefix), suf, *session.tokenize(suffix), mid]
            want, _ = expected(session, ids, max_tokens=8, temperature=0.0)
            session.reset()
            first = log_softmax(session.decode(ids))
        status, got = server.json("POST", "/v1/completions", {"model": "fim.gguf", "prompt": prefix, "suffix": suffix,
                                                              "max_tokens": 8, "temperature": 0, "logprobs": 5})
        assert status == 200, got
        assert got["usage"]["prompt_tokens"] == len(ids)
        assert got["choices"][0]["text"] == want
        # The first token's distribution is the one after exactly these ids.
        top = np.argsort(-first, kind="stable")[:5]
        assert sorted(got["choices"][0]["logprobs"]["top_logprobs"][0].values(), reverse=True) == \
            pytest.approx(list(first[top]), abs=1e-9)
        status, got = server.json("POST", "/v1/completions", {"prompt": prefix, "suffix": suffix, "echo": True,
                                                              "max_tokens": 1})
        assert_openai_error(status, got, 400)
    finally:
        server.stop()


def test_n_constrained_choices_each_follow_the_grammar(plain):
    """Each choice has its own grammar mask (a mask follows one generation's tokens): n seeded
    json_object replies are each JSON, and choice k equals the single request with seed + k."""
    body = {"messages": [{"role": "user", "content": "A JSON object, please."}], "max_tokens": 40, "temperature": 1.0,
            "response_format": {"type": "json_object"}, "seed": 11}
    status, got = plain.json("POST", "/v1/chat/completions", {**body, "n": 3})
    assert status == 200, got
    texts = [c["message"]["content"] for c in got["choices"]]
    for k, text in enumerate(texts):
        if got["choices"][k]["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict), text
        single = plain.json("POST", "/v1/chat/completions", {**body, "seed": 11 + k})[1]
        assert single["choices"][0]["message"]["content"] == text
    assert len(set(texts)) > 1
    assert any(c["finish_reason"] == "stop" for c in got["choices"]), "no reply was complete: nothing was checked"


def test_parallel_tool_calls_false_keeps_the_first_call():
    from sharpi.server.openai_api import _single_call

    calls = [{"id": f"c{i}", "type": "function", "function": {"name": f"f{i}", "arguments": "{}"}} for i in range(3)]
    msg, finish = _single_call({"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls")
    assert (msg["tool_calls"], finish) == (calls[:1], "tool_calls")
    plain_reply = {"role": "assistant", "content": "hi"}
    assert _single_call(plain_reply, "stop") == (plain_reply, "stop")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_every_openai_create_parameter_is_documented_or_refused(plain, path):
    """The audit, kept true as the official client grows: each parameter of openai-python's
    create() is in /openapi.json's request schema (taken or documented as ignored) or refused
    with a 400 naming it."""
    import inspect

    import openai

    resource = openai.OpenAI(api_key="none").chat.completions if "chat" in path else openai.OpenAI(api_key="none").completions
    params = [p for p in inspect.signature(resource.create).parameters
              if p not in ("extra_headers", "extra_query", "extra_body", "timeout")]
    doc = plain.json("GET", "/openapi.json")[1]
    name = "ChatCompletionRequest" if "chat" in path else "CompletionRequest"
    documented = set(doc["components"]["schemas"][name]["properties"])
    base = {"messages": MSG} if "chat" in path else {"prompt": "x"}
    refused = []
    for param in params:
        if param in documented:
            continue
        status, got = plain.json("POST", path, {**base, "max_tokens": 1, param: "x"})
        assert status == 400 and got["error"]["param"] == param, (param, status, got)
        refused.append(param)
    assert len(params) > len(refused)
    if "chat" in path:
        assert {"audio", "prediction", "functions"} <= set(refused)


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        {"type": "file", "file": {"file_id": "file-1"}},
        {"text": "no type"},
    ],
)
def test_a_content_part_no_model_can_read_is_a_400_naming_it(plain, part):
    # Found by benchmarks/server_parity.py: an image part used to be dropped and the text answered.
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}],
            "max_tokens": 2}
    status, _, data = plain.request("POST", "/v1/chat/completions", body)
    answer = json.loads(data)
    assert_openai_error(status, answer, 400)
    assert answer["error"]["param"] == "messages[0].content[1]"
    assert (part.get("type") or "type") in answer["error"]["message"]
