"""Session.generate's presence_penalty, frequency_penalty and logit_bias against a float64 numpy model.

The model is written here from llama.cpp's definitions (llama_sampler_logit_bias, then
llama_sampler_penalties: repeat_penalty over the distinct ids of the last repeat_last_n, then
logit -= presence * (count > 0) + frequency * count), independently of session.py:
- greedy: the tokens of a numpy argmax loop over Session.decode on the shipped model;
- seeded: the empirical distribution of many draws against the exact probabilities of
  test_sampler.reference_distribution applied to the penalized logits (chi-square);
- off: the output is what it was before these options, bit for bit, and with the extra terms at
  zero the Python path equals the C++ sampler's own repetition penalty draw for draw.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import sharpi
from sharpi import InvalidArgument, _core
from sharpi.generation import _penalized_sampler
from sharpi.models import default_model_path
from test_sampler import chi2_pvalue, reference_distribution


@pytest.fixture(scope="module")
def session():
    return sharpi.Session(default_model_path(), threads=1, n_ctx=256)


def penalize64(logits, window, repeat=1.0, presence=0.0, frequency=0.0, bias=None):
    """llama.cpp's logit bias and penalties, in float64."""
    lg = np.asarray(logits, dtype=np.float64).copy()
    for t, b in (bias or {}).items():
        lg[t] = -np.inf if b <= -100 else lg[t] + b
    for t, c in Counter(window).items():
        lg[t] = lg[t] * repeat if lg[t] <= 0 else lg[t] / repeat
        lg[t] -= presence + c * frequency
    return lg


def generate_ids(session, prompt_ids, **kw):
    session.reset()
    ids = []
    for _ in session.generate(prompt_ids, on_token=lambda t, _logits: ids.append(t), stop_at_eos=False, **kw):
        pass
    return ids


def greedy_oracle(session, prompt_ids, n, repeat_last_n=64, **pen):
    session.reset()
    logits = session.decode(prompt_ids)
    recent, out = list(prompt_ids), []
    for _ in range(n):
        window = recent[-repeat_last_n:] if repeat_last_n > 0 else recent
        t = int(np.argmax(penalize64(logits, window, **pen)))
        out.append(t)
        recent.append(t)
        if len(out) < n:
            logits = session.decode([t])
    return out


CASES = [
    {"frequency": 1.5},
    {"presence": 2.0},
    {"presence": 0.7, "frequency": 0.9, "repeat": 1.2},
    {"frequency": -0.5, "presence": 1.0},  # negative: encourages repeats
    {"bias": {0: -100, 1: 3.0}, "frequency": 0.5},
]


@pytest.mark.parametrize("pen", CASES, ids=[str(i) for i in range(len(CASES))])
def test_greedy_matches_float64_model(session, pen):
    prompt = session.tokenize("def fib(n):\n    return fib(n - 1) + fib(n - 2)\n\ndef fib(")
    n = 32
    expected = greedy_oracle(session, prompt, n, **pen)
    got = generate_ids(session, prompt, max_tokens=n, temperature=0.0, repeat_penalty=pen.get("repeat", 1.0),
                       presence_penalty=pen.get("presence", 0.0), frequency_penalty=pen.get("frequency", 0.0),
                       logit_bias=pen.get("bias"))
    assert got == expected
    # The penalties change the text here, so the comparison above could fail.
    assert got != greedy_oracle(session, prompt, n)


def test_logit_bias_bans_and_favours(session):
    prompt = session.tokenize("import ")
    base = generate_ids(session, prompt, max_tokens=8, temperature=0.0)
    banned = generate_ids(session, prompt, max_tokens=8, temperature=0.0, logit_bias={base[0]: -100})
    assert banned[0] != base[0] and base[0] not in banned
    also = generate_ids(session, prompt, max_tokens=8, temperature=0.0, logit_bias={base[0]: -math.inf})
    assert also == banned
    favoured = generate_ids(session, prompt, max_tokens=4, temperature=1.0, seed=1, logit_bias={42: 100})
    assert favoured == [42] * 4


@pytest.mark.parametrize(
    "pen",
    [
        {"presence": 1.0, "frequency": 0.4},
        {"presence": -1.5, "frequency": 0.0, "repeat": 1.3},
        {"frequency": 2.0, "bias": {3: 1.0, 5: -100, 7: -2.5}},
    ],
)
def test_seeded_distribution_matches_float64_model(pen):
    rng = np.random.default_rng(11 + len(str(pen)))
    n_vocab = 48
    logits = (rng.standard_normal(n_vocab) * 1.5).astype(np.float32)
    recent = [int(t) for t in rng.integers(0, 12, size=20)]  # repeats: counts of 1..5
    cfg = {"temperature": 0.9, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    sampler = _core.Sampler(seed=int(rng.integers(1 << 62)), repeat_penalty=pen.get("repeat", 1.0), **cfg)
    sample = _penalized_sampler(sampler, n_vocab, pen.get("repeat", 1.0), 64, pen.get("presence", 0.0),
                                pen.get("frequency", 0.0), pen.get("bias"))
    draws = np.array([sample(logits, recent) for _ in range(20000)])
    penalized = penalize64(logits, recent, pen.get("repeat", 1.0), pen.get("presence", 0.0),
                           pen.get("frequency", 0.0), pen.get("bias"))
    probs = reference_distribution(penalized, **cfg)
    assert chi2_pvalue(draws, probs) > 1e-6
    # The check has power: the unpenalized distribution is rejected.
    assert chi2_pvalue(draws, reference_distribution(logits, **cfg)) < 1e-12


def test_off_is_bit_identical(session):
    prompt = session.tokenize("class ")
    kw = {"max_tokens": 24, "temperature": 1.0, "seed": 5, "repeat_penalty": 1.3}
    base = generate_ids(session, prompt, **kw)
    assert generate_ids(session, prompt, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None, **kw) == base
    assert generate_ids(session, prompt, logit_bias={}, **kw) == base
    # Zero terms force the Python path: its repeat penalty is the C++ one, draw for draw.
    assert generate_ids(session, prompt, logit_bias={0: 0.0}, **kw) == base


@pytest.mark.parametrize(
    "kw",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.01},
        {"presence_penalty": float("nan")},
        {"frequency_penalty": float("inf")},
        {"presence_penalty": "1"},
        {"logit_bias": {-1: 1.0}},
        {"logit_bias": {10**9: 1.0}},
        {"logit_bias": {True: 1.0}},
        {"logit_bias": {"5": 1.0}},
        {"logit_bias": {5: 100.5}},
        {"logit_bias": {5: float("nan")}},
        {"logit_bias": {5: float("inf")}},
        {"logit_bias": [(5, 1.0)]},
        {"max_tokens": -2},
    ],
)
def test_bad_values_are_invalid_argument(session, kw):
    with pytest.raises(InvalidArgument):
        next(session.generate("x", **kw))


def test_no_limit_and_stats_after_an_early_close(session):
    session.reset()
    prompt = session.tokenize("def ")
    n_ctx = session.info["n_ctx"]
    for _ in session.generate(prompt, max_tokens=-1, temperature=0.0, stop_at_eos=False):
        pass
    assert session.last_stats["n_generated"] == n_ctx - len(prompt) + 1
    session.reset()
    pieces = session.generate(prompt, max_tokens=50, temperature=0.0, stop_at_eos=False)
    for i, _ in enumerate(pieces):
        if i == 4:
            break
    pieces.close()
    assert session.last_stats["n_prompt"] == len(prompt)
    assert session.last_stats["n_generated"] == len(session.last_tokens) >= 5
