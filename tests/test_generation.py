"""sharpi.generation.Generation, the per-sequence sampling state machine, driven by hand over
Session.decode: greedy picks the argmax of the model's logits (numpy, the oracle), each way of
finishing (end-of-generation token, max_tokens, a full context) is reported, and the text pieces
join to the tokenizer's decode of the ids."""

from __future__ import annotations

import numpy as np
import pytest
import sharpi
from sharpi import InvalidArgument
from sharpi.generation import CONTEXT, EOS, LENGTH, Generation
from sharpi.models import default_model_path

N_CTX = 48


@pytest.fixture(scope="module")
def session():
    return sharpi.Session(default_model_path(), threads=1, n_ctx=N_CTX)


def drive(session, gen: Generation) -> tuple[str, list]:
    """Runs gen to its end over session (reset first); returns its text and the logits of each step."""
    session.reset()
    logits = session.decode(gen.prompt_ids)
    gen.prefilled()
    text, seen = "", []
    while gen.finished is None:
        seen.append(logits)
        text += gen.step(logits, session.n_past)
        if gen.finished is None:
            logits = session.decode([gen.next_token])
    return text + gen.flush(), seen


def test_greedy_is_the_argmax_and_text_is_the_decode(session):
    ids = session.tokenize("def fib(n):")
    gen = Generation(session.tokenizer, session.info["n_vocab"], N_CTX, ids, max_tokens=12, temperature=0)
    text, seen = drive(session, gen)
    assert gen.finished == LENGTH and len(gen.generated) == 12
    assert gen.generated == [int(np.argmax(row)) for row in seen]
    assert text == session.tokenizer.decode(gen.generated)
    stats = gen.stats()
    assert stats["n_prompt"] == len(ids) and stats["n_generated"] == 12
    assert 0 <= stats["prefill_s"] <= stats["ttft_s"]


def test_finishes_on_an_end_of_generation_token(session):
    eos = min(session.tokenizer.eog_ids)
    ids = session.tokenize("x = 1")
    gen = Generation(session.tokenizer, session.info["n_vocab"], N_CTX, ids, max_tokens=8, temperature=0,
                     logit_bias={eos: 100.0})
    text, seen = drive(session, gen)
    assert gen.finished == EOS and gen.generated == [] and text == "" and len(seen) == 1
    # stop_at_eos=False appends it like any other token.
    gen = Generation(session.tokenizer, session.info["n_vocab"], N_CTX, ids, max_tokens=3, temperature=0,
                     logit_bias={eos: 100.0}, stop_at_eos=False)
    drive(session, gen)
    assert gen.finished == LENGTH and gen.generated == [eos] * 3


def test_finishes_when_the_context_is_full(session):
    ids = session.tokenize("import os")
    gen = Generation(session.tokenizer, session.info["n_vocab"], N_CTX, ids, max_tokens=-1, temperature=0,
                     stop_at_eos=False)
    drive(session, gen)
    # The last sampled token is not decoded: the context holds the prompt and all but it.
    assert gen.finished == CONTEXT and session.n_past == N_CTX
    assert len(gen.generated) == N_CTX - len(ids) + 1


def test_zero_tokens_and_stepping_past_the_end(session):
    gen = Generation(session.tokenizer, session.info["n_vocab"], N_CTX, [1, 2], max_tokens=0)
    assert gen.finished == LENGTH
    with pytest.raises(InvalidArgument, match="already finished"):
        gen.step(np.zeros(session.info["n_vocab"], dtype=np.float32), 2)


@pytest.mark.parametrize("kw, match", [
    ({"max_tokens": -2}, "max_tokens"),
    ({"prompt_ids": []}, "empty prompt"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
])
def test_bad_values(session, kw, match):
    args = {"prompt_ids": [1, 2], **kw}
    with pytest.raises(InvalidArgument, match=match):
        Generation(session.tokenizer, session.info["n_vocab"], N_CTX, **args)


def test_generate_batch_equals_generate_one_at_a_time():
    """Prompts of different lengths decoded together, greedy and seeded: each answer is what
    generate() gives for its prompt alone from an empty cache; the added sequences are removed."""
    s = sharpi.Session(default_model_path(), threads=1, n_ctx=128, n_seq=4)
    prompts = ["def fib(n):", "import os\n", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "class Stack:"]
    for options in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 5, "repeat_penalty": 1.2}):
        got = s.generate_batch(prompts, max_tokens=24, **options)
        want = []
        for p in prompts:
            s.reset()
            want.append("".join(s.generate(p, max_tokens=24, **options)))
        assert got == want
        assert [q.id for q in s.sequences()] == [0]
    with pytest.raises(InvalidArgument, match="n_seq"):
        s.generate_batch(prompts + ["x"])
