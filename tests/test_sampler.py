"""sharpi._core.Sampler against an exact float64 numpy model of the same sampling pipeline.

The oracle below is written from the llama.cpp definitions (penalty -> top-k -> softmax -> top-p ->
min-p -> temperature), independently of sampler.cpp, and gives the exact probability of every
token. Empirical frequencies of many seeded draws are checked against it with a chi-square bound,
and every draw must lie in the oracle's support.
"""

import math

import numpy as np
import pytest
from sharpi import InvalidArgument, _core


def reference_distribution(
    logits,
    recent=(),
    temperature=0.8,
    top_k=40,
    top_p=0.95,
    min_p=0.05,
    repeat_penalty=1.0,
    repeat_last_n=64,
):
    """Exact probabilities (float64 [n_vocab]) of the pipeline, in llama.cpp's order."""
    work = np.array(logits, dtype=np.float32)
    if repeat_penalty != 1.0 and repeat_last_n != 0 and len(recent) > 0:
        window = list(recent) if repeat_last_n < 0 else list(recent)[-repeat_last_n:]
        for t in set(window):
            # The penalty is a float32 operation in the spec (as in llama.cpp), so do it in float32.
            if work[t] > 0:
                work[t] = work[t] / np.float32(repeat_penalty)
            else:
                work[t] = work[t] * np.float32(repeat_penalty)
    n_vocab = work.shape[0]
    if temperature == 0:
        out = np.zeros(n_vocab)
        out[int(np.argmax(work))] = 1.0  # np.argmax returns the first maximum
        return out
    lg = work.astype(np.float64)
    ids = np.arange(n_vocab)
    finite = np.isfinite(lg)
    ids, lg = ids[finite], lg[finite]
    order = np.lexsort((ids, -lg))  # descending logit, ties by ascending id
    ids, lg = ids[order], lg[order]
    if 0 < top_k < len(ids):
        ids, lg = ids[:top_k], lg[:top_k]
    p = np.exp(lg - lg[0])
    p /= p.sum()
    if top_p < 1.0:
        cum = np.cumsum(p)
        last = int(np.argmax(cum >= top_p)) + 1 if np.any(cum >= top_p) else len(p)
        ids, lg, p = ids[:last], lg[:last], p[:last]
    if min_p > 0.0:
        keep = p >= min_p * p[0]
        ids, lg = ids[keep], lg[keep]
    w = np.exp((lg - lg[0]) / temperature)
    out = np.zeros(n_vocab)
    out[ids] = w / w.sum()
    return out


def chi2_sf(stat, dof):
    """P(X >= stat) for X ~ chi2(dof); scipy when present, else Wilson-Hilferty (ample for 1e-6)."""
    try:
        from scipy.stats import chi2

        return float(chi2.sf(stat, dof))
    except ImportError:
        z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        return 0.5 * math.erfc(z / math.sqrt(2))


def draw(sampler, logits, recent, n):
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    return np.array([sampler.sample(logits, recent) for _ in range(n)])


def chi2_pvalue(samples, probs):
    """Pearson chi-square p-value of samples against probs; bins with tiny expectation are pooled."""
    n = len(samples)
    counts = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token the oracle gives probability 0"
    exp = probs[support] * n
    obs = counts[support]
    big = exp >= 5
    exp_b, obs_b = list(exp[big]), list(obs[big])
    if (~big).any():
        exp_b.append(exp[~big].sum())
        obs_b.append(obs[~big].sum())
    exp_b, obs_b = np.array(exp_b), np.array(obs_b)
    if len(exp_b) < 2:
        return 1.0
    stat = float(((obs_b - exp_b) ** 2 / exp_b).sum())
    return chi2_sf(stat, len(exp_b) - 1)


CONFIGS = [
    {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
    {"temperature": 0.7, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
    {"temperature": 1.3, "top_k": 5, "top_p": 1.0, "min_p": 0.0},
    {"temperature": 1.0, "top_k": 0, "top_p": 0.6, "min_p": 0.0},
    {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.2},
    {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},  # the defaults
    {"temperature": 0.9, "top_k": 12, "top_p": 0.8, "min_p": 0.1, "repeat_penalty": 1.3, "repeat_last_n": 4},
    {"temperature": 1.1, "top_k": 0, "top_p": 0.9, "min_p": 0.0, "repeat_penalty": 0.7, "repeat_last_n": -1},
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[str(i) for i in range(len(CONFIGS))])
def test_empirical_distribution_matches_exact(cfg):
    rng = np.random.default_rng(1234 + len(str(cfg)))
    n_vocab = 48
    logits = (rng.standard_normal(n_vocab) * 1.5).astype(np.float32)
    recent = [int(t) for t in rng.integers(0, n_vocab, size=10)]
    probs = reference_distribution(logits, recent, **cfg)
    sampler = _core.Sampler(seed=int(rng.integers(1 << 62)), **cfg)
    samples = draw(sampler, logits, recent, 20000)
    assert chi2_pvalue(samples, probs) > 1e-6


def test_chi_square_check_has_power():
    # The same check must reject a slightly wrong distribution (temperature 1 instead of 0.7),
    # otherwise the distribution tests above could not fail.
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal(48) * 1.5).astype(np.float32)
    sampler = _core.Sampler(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    samples = draw(sampler, logits, [], 20000)
    wrong = reference_distribution(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    right = reference_distribution(logits, temperature=0.7, top_k=0, top_p=1.0, min_p=0.0)
    assert chi2_pvalue(samples, wrong) < 1e-12
    assert chi2_pvalue(samples, right) > 1e-6


@pytest.mark.parametrize("n_vocab", [1, 2, 17, 1000, 32000])
def test_greedy_is_argmax(n_vocab):
    rng = np.random.default_rng(n_vocab)
    sampler = _core.Sampler(temperature=0.0)
    for _ in range(20):
        logits = rng.standard_normal(n_vocab).astype(np.float32) * 4
        assert sampler.sample(logits, []) == int(np.argmax(logits))


def test_greedy_ties_go_to_lowest_id():
    rng = np.random.default_rng(5)
    sampler = _core.Sampler(temperature=0.0)
    for _ in range(20):
        logits = rng.standard_normal(300).astype(np.float32)
        tied = np.sort(rng.choice(300, size=4, replace=False))
        logits[tied] = logits.max() + 1.0
        assert sampler.sample(logits, []) == int(tied[0])


def test_greedy_applies_repetition_penalty():
    rng = np.random.default_rng(11)
    for trial in range(50):
        logits = rng.standard_normal(64).astype(np.float32)
        recent = [int(t) for t in rng.integers(0, 64, size=20)]
        penalty = float(rng.uniform(0.5, 3.0))
        last_n = int(rng.integers(-1, 25))
        sampler = _core.Sampler(temperature=0.0, repeat_penalty=penalty, repeat_last_n=last_n)
        want = reference_distribution(
            logits, recent, temperature=0.0, repeat_penalty=penalty, repeat_last_n=last_n
        )
        assert sampler.sample(logits, recent) == int(np.argmax(want)), trial


def test_penalty_changes_the_argmax():
    # A concrete case worked by hand: token 0 leads (2.0) but was seen; 2.0 / 2.5 = 0.8 < 1.5.
    logits = np.array([2.0, 1.5, -1.0], dtype=np.float32)
    assert _core.Sampler(temperature=0).sample(logits, [0]) == 0
    assert _core.Sampler(temperature=0, repeat_penalty=2.5).sample(logits, [0]) == 1
    # Outside the window (repeat_last_n=1 only sees the last token) token 0 is not penalized.
    assert _core.Sampler(temperature=0, repeat_penalty=2.5, repeat_last_n=1).sample(logits, [0, 2]) == 0


@pytest.mark.parametrize(
    "cfg",
    [
        {"temperature": 1.5, "top_k": 3, "top_p": 1.0, "min_p": 0.0},
        {"temperature": 2.0, "top_k": 0, "top_p": 0.3, "min_p": 0.0},
        {"temperature": 2.0, "top_k": 0, "top_p": 1.0, "min_p": 0.3},
        {"temperature": 3.0, "top_k": 50, "top_p": 0.5, "min_p": 0.02},
    ],
)
def test_filters_never_return_filtered_tokens(cfg):
    rng = np.random.default_rng(99)
    sampler = _core.Sampler(seed=17, **cfg)
    for _ in range(30):
        logits = (rng.standard_normal(2000) * 2).astype(np.float32)
        allowed = reference_distribution(logits, **cfg) > 0
        samples = draw(sampler, logits, [], 100)
        assert allowed[samples].all()


def test_wide_nucleus_is_cut_at_the_exact_token():
    # A nucleus of several hundred tokens (wider than the sampler's first partial sort of 256):
    # with nearly flat probabilities every survivor is drawn ~30 times in 20000 draws, so the
    # set of drawn tokens must be exactly the oracle's nucleus, no token more, no token less.
    rng = np.random.default_rng(12)
    logits = rng.uniform(0.0, 0.5, 1000).astype(np.float32)
    cfg = {"temperature": 1.0, "top_k": 0, "top_p": 0.5, "min_p": 0.0}
    allowed = np.flatnonzero(reference_distribution(logits, **cfg) > 0)
    assert 400 < len(allowed) < 800
    samples = draw(_core.Sampler(seed=99, **cfg), logits, [], 20000)
    assert set(samples.tolist()) == set(allowed.tolist())


def test_top_k_one_is_argmax_at_any_temperature():
    rng = np.random.default_rng(3)
    sampler = _core.Sampler(temperature=5.0, top_k=1, top_p=1.0, min_p=0.0, seed=1)
    for _ in range(50):
        logits = rng.standard_normal(500).astype(np.float32)
        assert sampler.sample(logits, []) == int(np.argmax(logits))


def test_negative_infinity_is_never_sampled():
    rng = np.random.default_rng(8)
    logits = rng.standard_normal(100).astype(np.float32)
    masked = rng.choice(100, size=95, replace=False)
    logits[masked] = -np.inf
    sampler = _core.Sampler(temperature=10.0, top_k=0, top_p=1.0, min_p=0.0, seed=2)
    samples = draw(sampler, logits, [], 2000)
    assert not np.isin(samples, masked).any()
    assert len(set(samples.tolist())) == 5


def test_same_seed_same_sequence_and_seeds_differ():
    rng = np.random.default_rng(21)
    logits = rng.standard_normal(1000).astype(np.float32)
    a = draw(_core.Sampler(temperature=1.5, seed=42, top_k=0, top_p=1.0, min_p=0.0), logits, [], 200)
    b = draw(_core.Sampler(temperature=1.5, seed=42, top_k=0, top_p=1.0, min_p=0.0), logits, [], 200)
    c = draw(_core.Sampler(temperature=1.5, seed=43, top_k=0, top_p=1.0, min_p=0.0), logits, [], 200)
    assert (a == b).all()
    assert (a != c).any()


def test_parameters_round_trip_and_defaults():
    s = _core.Sampler()
    assert (s.temperature, s.top_k, s.repeat_last_n) == (pytest.approx(0.8), 40, 64)
    s = _core.Sampler(
        temperature=0.5, top_k=7, top_p=0.5, min_p=0.25, repeat_penalty=1.5, repeat_last_n=9, seed=5
    )
    assert (s.top_k, s.repeat_last_n, s.seed) == (7, 9, 5)
    assert (s.temperature, s.top_p, s.min_p, s.repeat_penalty) == (0.5, 0.5, 0.25, 1.5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"top_p": float("nan")},
        {"min_p": -0.01},
        {"min_p": 1.5},
        {"min_p": float("nan")},
        {"repeat_penalty": 0.0},
        {"repeat_penalty": -1.0},
        {"repeat_penalty": float("nan")},
        {"repeat_last_n": -2},
    ],
)
def test_invalid_parameters_raise(kwargs):
    with pytest.raises(InvalidArgument):
        _core.Sampler(**kwargs)


def test_invalid_logits_raise():
    s = _core.Sampler()
    bad = np.zeros(10, dtype=np.float32)
    bad[3] = np.nan
    with pytest.raises(InvalidArgument, match="token 3"):
        s.sample(bad, [])
    bad[3] = np.inf
    with pytest.raises(InvalidArgument):
        s.sample(bad, [])
    with pytest.raises(InvalidArgument, match="n_vocab"):
        s.sample(np.zeros(0, dtype=np.float32), [])
    with pytest.raises(InvalidArgument, match="1-D"):
        s.sample(np.zeros((2, 5), dtype=np.float32), [])
    with pytest.raises(InvalidArgument, match="-inf"):
        s.sample(np.full(5, -np.inf, dtype=np.float32), [])
    with pytest.raises(InvalidArgument, match="recent token 12"):
        _core.Sampler(repeat_penalty=1.2).sample(np.zeros(10, dtype=np.float32), [1, 12])
