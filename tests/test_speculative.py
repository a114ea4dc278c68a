"""Speculative decoding (sharpi.speculative): verify steps, rollback and the draft sources.

The oracle is plain decoding on the same file: a speculative generate() must produce the same
tokens and, for every token it keeps, the same logits bit for bit (the engine's multi-token step
gives each row what a one-token decode gives it, and the rejected tail is rolled back exactly). The
draft sources are driven so that every path runs: a draft that is always right (the target as its
own draft model), one that is wrong at a chosen position (an oracle draft corrupted there), prompt
lookup, and a different draft model. Sampling is checked twice: with a seed the text equals plain
decoding's, and over many seeds the sampled tokens follow the target's own softmax (chi-square).
"""

from __future__ import annotations

import math
import re
import secrets

import numpy as np
import pytest
import sharpi
from sharpi.make_model import write_model
from sharpi.speculative import NgramDraft, Speculation, open_speculation

ARCHS = ["llama", "qwen2moe", "qwen3moe", "olmoe", "deepseek2", "gpt-oss", "qwen3next", "qwen35moe"]
HYBRID = ("qwen3next", "qwen35moe")
N_DRAFT = 4
N_GEN = 40


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("speculative_models")
    out = {}
    for arch in ARCHS:
        path = str(d / f"{arch}-q4_k_m.gguf")
        write_model(path, arch=arch, preset="tiny", quant="q4_k_m", seed=11)
        out[arch] = path
    out["draft"] = str(d / "draft-qwen3moe-q8_0.gguf")  # same synthetic tokenizer, other weights
    write_model(out["draft"], arch="qwen3moe", preset="tiny", quant="q8_0", seed=12)
    return out


class OracleDraft:
    """Drafts the plain-decoding continuation (known in advance), with the token at draft index
    `wrong_at` of every draft replaced, so verification rejects exactly there."""

    name = "oracle"

    def __init__(self, n_prompt: int, continuation: list, wrong_at: int | None, n_vocab: int):
        self.n_prompt, self.continuation, self.wrong_at, self.n_vocab = n_prompt, continuation, wrong_at, n_vocab

    def draft(self, context: list, n: int, key: int = 0) -> list:
        i = len(context) - self.n_prompt  # context ends with the next token, continuation[i - 1]
        out = list(self.continuation[i:i + n])
        if self.wrong_at is not None and self.wrong_at < len(out):
            out[self.wrong_at] = (out[self.wrong_at] + 1) % self.n_vocab
        return out

    def close(self) -> None:
        pass


def generate(session, prompt, speculative=None, **kw) -> tuple:
    """(ids, logits of each sampled token) of one greedy (or kw) generation from an empty cache."""
    session.reset()
    ids, logits = [], []

    def on_token(token, row):
        ids.append(token)
        logits.append(row.copy())

    kw.setdefault("temperature", 0.0)
    for _ in session.generate(prompt, max_tokens=N_GEN, stop_at_eos=False, on_token=on_token,
                              speculative=speculative, **kw):
        pass
    return ids, logits


def assert_same_run(got, want, what: str) -> None:
    assert got[0] == want[0], f"{what}: tokens differ"
    assert len(got[1]) == len(want[1]), what
    for i, (a, b) in enumerate(zip(got[1], want[1])):
        np.testing.assert_array_equal(a, b, err_msg=f"{what}: logits of token {i}")


def prompt_for(rng, n_vocab: int) -> list:
    # A repeated phrase, so prompt lookup finds n-grams from the start.
    phrase = [int(t) for t in rng.integers(3, n_vocab, 5)]
    return phrase * 3 + phrase[:2]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("exact", [False, True])
def test_every_draft_source_gives_plain_decodings_tokens_and_logits(models, arch, exact):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    s = sharpi.Session(models[arch], threads=2, exact=exact, max_draft_tokens=N_DRAFT)
    n_vocab = s.info["n_vocab"]
    prompt = prompt_for(rng, n_vocab)
    want = generate(s, prompt)
    sources = [OracleDraft(len(prompt), want[0], wrong, n_vocab) for wrong in (None, 0, 1, N_DRAFT - 1)]
    sources.append(NgramDraft(size_n=2))
    for source in sources:
        spec = Speculation(source, n_max=N_DRAFT)
        got = generate(s, prompt, spec)
        what = f"{arch} exact={exact} {source.name} wrong_at={getattr(source, 'wrong_at', '-')} seed {seed}"
        assert_same_run(got, want, what)
        st = s.last_stats
        assert st["spec_steps"] > 0 or isinstance(source, NgramDraft), what  # lookup may find nothing
        if isinstance(source, OracleDraft) and source.wrong_at is None:
            assert st["spec_accepted"] == st["spec_drafted"], what  # a right draft is always kept
            assert st["spec_steps"] <= -(-N_GEN // (N_DRAFT + 1)) + 1, what  # k + 1 tokens per step
        if isinstance(source, OracleDraft) and source.wrong_at is not None:
            # Every draft position before the wrong one is kept, none from it on.
            at = st["spec_acceptance_at"]
            assert at[:source.wrong_at] == [1.0] * min(source.wrong_at, len(at)), what
            assert all(a == 0.0 for a in at[source.wrong_at:]), what
    auto = Speculation(OracleDraft(len(prompt), want[0], 2, n_vocab), n_max=N_DRAFT, auto=True)
    assert_same_run(generate(s, prompt, auto), want, f"{arch} exact={exact} automatic draft length seed {seed}")


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2", "qwen35moe"])
def test_a_draft_model_gives_plain_decodings_tokens(models, arch):
    s = sharpi.Session(models[arch], threads=2, max_draft_tokens=N_DRAFT)
    prompt = prompt_for(np.random.default_rng(3), s.info["n_vocab"])
    want = generate(s, prompt)
    for draft_path, all_accepted in ((models[arch], True), (models["draft"], False)):
        if arch in HYBRID and draft_path == models[arch]:
            continue  # a recurrent draft model is refused (test_bad_speculation_is_a_clear_error)
        spec = open_speculation(s, "draft-simple", n_max=N_DRAFT, draft_model=draft_path)
        try:
            got = generate(s, prompt, spec)
        finally:
            spec.close()
        assert_same_run(got, want, f"{arch} draft {draft_path}")
        if all_accepted:  # the target drafting for itself is always right
            assert s.last_stats["spec_accepted"] == s.last_stats["spec_drafted"] > 0


def test_rollback_leaves_later_logits_as_if_the_rejected_tokens_never_came(models):
    """Decode a rewindable step, cut it back to each position inside it, go on with other tokens:
    the logits equal a fresh sequence that decoded only the kept tokens and the new ones."""
    rng = np.random.default_rng(secrets.randbits(32))
    for arch in ("qwen3moe", "deepseek2", "gpt-oss", "qwen3next", "qwen35moe"):
        s = sharpi.Session(models[arch], threads=2, max_draft_tokens=N_DRAFT)
        fresh = sharpi.Session(models[arch], threads=2)
        n_vocab = s.info["n_vocab"]
        prefix = [int(t) for t in rng.integers(0, n_vocab, 7)]
        step = [int(t) for t in rng.integers(0, n_vocab, N_DRAFT + 1)]
        after = [int(t) for t in rng.integers(0, n_vocab, 3)]
        for keep in range(1, N_DRAFT + 2):
            s.reset()
            s.decode(prefix)
            s.decode(step, all_logits=True, rewindable=True)
            s.truncate(len(prefix) + keep)
            got = s.decode(after, all_logits=True)
            # The fresh sequence decodes the kept step tokens one at a time: a rewindable step runs
            # a recurrent layer token by token, and a one-call prefill of a hybrid would group them
            # in a chunk (the same math, other rounding).
            fresh.reset()
            fresh.decode(prefix)
            for t in step[:keep]:
                fresh.decode([t])
            want = fresh.decode(after, all_logits=True)
            np.testing.assert_array_equal(got, want, err_msg=f"{arch} keep {keep}")


def test_a_recurrent_state_rewinds_only_inside_its_last_rewindable_step(models):
    s = sharpi.Session(models["qwen35moe"], threads=1, max_draft_tokens=2)
    s.decode([5, 6, 7])
    with pytest.raises(sharpi.UnsupportedError, match="cannot be rewound to position 2"):
        s.truncate(2)  # a plain step keeps no points
    s.decode([8, 9, 10], rewindable=True)
    with pytest.raises(sharpi.UnsupportedError, match="cannot be rewound to position 3"):
        s.truncate(3)  # before the step: not held
    s.truncate(5)
    assert s.n_past == 5
    with pytest.raises(sharpi.UnsupportedError):
        s.truncate(4)  # the rewind used the points up
    s.decode([11, 12, 13], rewindable=True)
    s.decode([14])  # a later step drops them
    with pytest.raises(sharpi.UnsupportedError):
        s.truncate(6)
    with pytest.raises(sharpi.InvalidArgument, match="max_draft_tokens.*at most 3 tokens"):
        s.decode([1, 2, 3, 4], rewindable=True)
    assert s.n_past == 9  # the refused step appended nothing
    attention_only = sharpi.Session(models["qwen3moe"], threads=1)  # no copies needed, no limit
    attention_only.decode(list(range(3, 40)), rewindable=True)
    attention_only.truncate(4)


def recurrent_state_bytes(meta: dict, arch: str, n_layer: int) -> int:
    """Bytes of one DeltaNet state, from the file's hyper-parameters (docs: conv state of
    d_conv - 1 rows of the conv channels, delta-rule state [dt_rank, d_state, head_v_dim])."""
    key = lambda name: meta[f"{arch}.ssm.{name}"]
    d_conv, d_state, n_group = key("conv_kernel"), key("state_size"), key("group_count")
    dt_rank, d_inner = key("time_step_rank"), key("inner_size")
    interval = meta[f"{arch}.full_attention_interval"]
    n_recurrent = sum(1 for il in range(n_layer) if (il + 1) % interval != 0)
    channels = d_inner + 2 * n_group * d_state
    return n_recurrent * 4 * ((d_conv - 1) * channels + dt_rank * d_state * (d_inner // dt_rank))


def test_the_budget_charges_the_rewind_copies(models):
    for arch in HYBRID:
        fixed = {}
        for k in (0, 6):
            probe = sharpi.Session(models[arch], n_ctx=64, max_draft_tokens=k, ram_budget="4GiB", reader="pread")
            fixed[k] = probe.expert_stats()["fixed_bytes"]
        expected = 6 * recurrent_state_bytes(probe.metadata, arch, probe.info["n_layer"])
        assert expected > 0 and fixed[6] - fixed[0] == expected, arch
    plain = sharpi.Session(models["qwen3moe"], n_ctx=64, ram_budget="4GiB", reader="pread").expert_stats()
    more = sharpi.Session(models["qwen3moe"], n_ctx=64, max_draft_tokens=6, ram_budget="4GiB",
                          reader="pread").expert_stats()
    assert plain["fixed_bytes"] == more["fixed_bytes"]  # attention-only: nothing to copy


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen35moe"])
def test_streamed_speculation_equals_resident_plain_decoding(models, arch):
    resident = sharpi.Session(models[arch], threads=2, max_draft_tokens=N_DRAFT)
    prompt = prompt_for(np.random.default_rng(5), resident.info["n_vocab"])
    want = generate(resident, prompt)
    probe = sharpi.Session(models[arch], threads=1, max_draft_tokens=N_DRAFT, ram_budget="4GiB", reader="pread")
    st = probe.expert_stats()
    for predictor in ("none", "prev_token"):
        staging = probe.info["n_expert_used"] if predictor != "none" else 0
        budget = st["fixed_bytes"] + (probe.info["n_expert_used"] + staging) * st["slot_bytes"]
        s = sharpi.Session(models[arch], threads=2, max_draft_tokens=N_DRAFT, ram_budget=budget, reader="pread",
                           predictor=predictor)
        for source in (OracleDraft(len(prompt), want[0], 2, s.info["n_vocab"]), NgramDraft(size_n=2)):
            got = generate(s, prompt, Speculation(source, n_max=N_DRAFT))
            assert_same_run(got, want, f"{arch} streamed {predictor} {source.name}")
        assert sum(lay["evictions"] for lay in s.expert_stats()["layers"]) > 0


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen35moe"])
def test_sampling_with_a_seed_gives_plain_decodings_text(models, arch):
    s = sharpi.Session(models[arch], threads=2, max_draft_tokens=N_DRAFT)
    prompt = prompt_for(np.random.default_rng(8), s.info["n_vocab"])
    for seed in (1, 2, 3):
        kw = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": seed, "repeat_penalty": 1.1}
        want = generate(s, prompt, **kw)
        got = generate(s, prompt, Speculation(NgramDraft(size_n=1), n_max=N_DRAFT), **kw)
        assert_same_run(got, want, f"{arch} seed {seed}")


def chi_square_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df), by the Wilson-Hilferty normal approximation (within a
    few per cent of the exact tail for df >= 10, ample for a 1e-4 threshold)."""
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampled_tokens_follow_the_targets_distribution(models):
    """Over many seeds, the token sampled from a verify row (after the first, forced, token) and
    the one after an accepted draft follow softmax(logits / T) of the target, computed here in
    float64 from plain decodes: chi-square over the likeliest tokens and the rest pooled."""
    s = sharpi.Session(models["qwen3moe"], threads=2)
    n_vocab = s.info["n_vocab"]
    prompt, t1, temperature = [7, 8, 9, 10], 42, 0.5
    s.reset()
    row1 = s.decode(prompt + [t1]).astype(np.float64)
    p2 = np.exp((row1 - row1.max()) / temperature)
    p2 /= p2.sum()
    d = int(np.argmax(p2))  # the draft: the likeliest next token, accepted often
    row2 = s.decode([d]).astype(np.float64)
    p3 = np.exp((row2 - row2.max()) / temperature)
    p3 /= p3.sum()

    class FixedDraft:
        name = "fixed"

        def draft(self, context, n, key=0):
            return [d, 1][:n]

        def close(self):
            pass

    def force_first(generated, logits):
        if generated:
            return logits
        out = np.full_like(logits, -np.inf)
        out[t1] = 0.0
        return out

    second, third = [], []
    base = secrets.randbits(30)
    ids: list = []
    for i in range(3000):
        s.reset()
        ids.clear()
        for _ in s.generate(prompt, max_tokens=3, temperature=temperature, top_k=0, top_p=1.0, min_p=0.0,
                            seed=base + i, stop_at_eos=False, logits_processor=force_first,
                            speculative=Speculation(FixedDraft(), n_max=2),
                            on_token=lambda t, _row: ids.append(t)):
            pass
        assert ids[0] == t1
        second.append(ids[1])
        if ids[1] == d:
            third.append(ids[2])

    def chi_square(samples, p, what):
        counts = np.bincount(samples, minlength=n_vocab).astype(np.float64)
        order = np.argsort(-p)
        n = len(samples)
        bins = [i for i in order if p[i] * n >= 10][:30]
        rest = np.setdiff1d(np.arange(n_vocab), bins)
        observed = np.append(counts[bins], counts[rest].sum())
        expected = np.append(p[bins] * n, p[rest].sum() * n)
        stat = float(((observed - expected) ** 2 / expected).sum())
        pvalue = chi_square_sf(stat, len(observed) - 1)
        assert pvalue > 1e-4, f"{what}: chi-square {stat:.1f}, p = {pvalue:.2e} (base seed {base})"

    chi_square(second, p2, "token after the forced one")
    assert len(third) > 200
    chi_square(third, p3, "token after an accepted draft")


def test_bad_speculation_is_a_clear_error(models, tmp_path):
    s = sharpi.Session(models["qwen3moe"], threads=1, n_ctx=64)
    with pytest.raises(sharpi.InvalidArgument, match="n_max must be an integer >= 1"):
        open_speculation(s, "ngram-simple", n_max=0)
    with pytest.raises(sharpi.InvalidArgument, match="does not fit the context"):
        open_speculation(s, "ngram-simple", n_max=64)
    with pytest.raises(sharpi.InvalidArgument, match="unknown speculative type 'eagle'"):
        open_speculation(s, "eagle")
    with pytest.raises(sharpi.InvalidArgument, match="no MTP layers"):
        open_speculation(s, "draft-mtp")
    with pytest.raises(sharpi.InvalidArgument, match="needs a draft model"):
        open_speculation(s, "draft-simple")
    with pytest.raises(sharpi.IoError, match="no such file"):
        open_speculation(s, "draft-simple", draft_model=str(tmp_path / "missing.gguf"))
    with pytest.raises(sharpi.InvalidArgument, match="ngram size|size_n"):
        open_speculation(s, "ngram-simple", ngram_size_n=0)
    other = str(tmp_path / "other-vocab.gguf")
    write_model(other, arch="llama", preset="tiny", quant="f32", seed=1, vocab_size=512)
    with pytest.raises(sharpi.InvalidArgument, match="vocabulary of 512 tokens.*1024"):
        open_speculation(s, "draft-simple", draft_model=other)
    with pytest.raises(sharpi.UnsupportedError, match="recurrent"):
        open_speculation(s, "draft-simple", draft_model=models["qwen35moe"])
    hybrid = sharpi.Session(models["qwen35moe"], threads=1, max_draft_tokens=2)
    with pytest.raises(sharpi.InvalidArgument, match=re.escape("max_draft_tokens >= 3")):
        open_speculation(hybrid, "ngram-simple", n_max=3)
    with pytest.raises(sharpi.InvalidArgument, match="max_draft_tokens must be in"):
        sharpi.Session(models["qwen3moe"], max_draft_tokens=65)


# ---- the CLI and the server, on the shipped model (trained on code: prompt lookup finds n-grams) ----

CODE_PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Entry point.\"\"\"\n    args = parse(argv)\n",
                "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
                ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n"
                 "def factorial(n):\n")]


@pytest.fixture(scope="module")
def shipped():
    from sharpi.models import default_model_path

    s = sharpi.Session(default_model_path(), threads=1, n_ctx=1024)
    yield s
    s.close()


def test_run_with_prompt_lookup_prints_plain_decodings_text(shipped):
    import subprocess
    import sys

    from subprocess_env import child_env

    prompt = CODE_PROMPTS[2]
    shipped.reset()
    want = "".join(shipped.generate(prompt, max_tokens=48, temperature=0.0))
    cmd = [sys.executable, "-m", "sharpi.cli", "run", "-t", "1", "-c", "1024", "-n", "48", "--temp", "0",
           "--no-escape", "-p", prompt, "--spec-type", "ngram-simple", "--spec-draft-n-max", "6",
           "--spec-ngram-simple-size-n", "2"]
    out = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout == want + "\n"
    accepted = re.search(r"draft accepted (\d+)/(\d+)", out.stderr)
    assert accepted and int(accepted.group(2)) > 0, out.stderr
    # The shipped model's trained MTP head (python/sharpi/models/MTP_CARD.md) drafts for it.
    mtp = subprocess.run([*cmd[:-6], "--spec-type", "draft-mtp", "--spec-draft-n-max", "3"], env=child_env(),
                         capture_output=True, text=True, timeout=300, check=False)
    assert mtp.returncode == 0, mtp.stderr
    assert mtp.stdout == want + "\n"
    accepted = re.search(r"draft accepted (\d+)/(\d+)", mtp.stderr)
    assert accepted and int(accepted.group(1)) > 0, mtp.stderr


# The last: streamed under a budget that evicts, each draft's length priced by its predicted reads
# (--spec-draft-auto with the session's predict_step_reads), the echo predictor on.
@pytest.mark.parametrize("extra", [("--parallel", "1"), ("--parallel", "3"),
                                   ("--parallel", "2", "--spec-draft-auto", "--ram-budget", "48MiB",
                                    "--predictor", "echo")])
def test_serve_speculates_per_slot_and_answers_as_plain_decoding(shipped, extra):
    from concurrent.futures import ThreadPoolExecutor

    from test_serve import MODEL_ID, client, raw, start_server

    server = start_server(*extra, "--spec-type", "ngram-simple", "--spec-draft-n-max", "5",
                          "--spec-ngram-simple-size-n", "2")
    port = next(server)
    try:
        wants = []
        for prompt in CODE_PROMPTS:
            shipped.reset()
            wants.append("".join(shipped.generate(prompt, max_tokens=40, temperature=0.0)))

        def ask(prompt):
            r = client(port).completions.create(model=MODEL_ID, prompt=prompt, max_tokens=40, temperature=0)
            return r.choices[0].text

        with ThreadPoolExecutor(len(CODE_PROMPTS)) as pool:
            got = list(pool.map(ask, CODE_PROMPTS))
        assert got == wants
        st = raw("GET", port, "/v1/sharpi/stats")[1]
        assert 0 < st["draft_tokens_accepted"] <= st["draft_tokens"], st
        if "--ram-budget" in extra:  # streamed: the budget misses
            assert st["expert_hits"] < st["expert_accesses"], st
    finally:
        server.close()


def test_the_automatic_draft_length_maximises_tokens_per_second():
    """DraftLength against its own model computed here: with measured costs c(k) and acceptance a
    per position, the choice is argmax_k E(k) / c(k), E(k) = 1 + a + a^2 + ... + a^k."""
    from sharpi.speculative import DraftLength

    def settle(accept_rate: float, cost_per_draft: float) -> int:
        length = DraftLength(n_max=6, explore=0, decay=0.999)  # a long memory: little sampling noise
        rng = np.random.default_rng(0)
        for _ in range(3000):  # a long history: the prior no longer matters
            k = 6
            kept = 0
            while kept < k and rng.random() < accept_rate:
                kept += 1
            length.record(k, kept)
        for k in range(7):
            length.observe(k, 1.0 + cost_per_draft * k)
        return length.choose(room=100)

    def rate(k: int, a: float, c: float) -> float:
        return sum(a ** j for j in range(k + 1)) / (1 + c * k)

    def best(a: float, c: float) -> int:
        return max(range(7), key=lambda k: rate(k, a, c))

    # The acceptance is estimated from sampled steps, so a near-tie may go
    # either way: the choice must be within 3% of the best rate, and the clear cases exact.
    for a, c in ((0.9, 0.05), (0.9, 0.6), (0.5, 0.3), (0.2, 0.3), (0.7, 0.15)):
        k = settle(a, c)
        assert rate(k, a, c) >= 0.97 * rate(best(a, c), a, c), (a, c, k)
    assert best(0.2, 0.3) == settle(0.2, 0.3) == 0  # not worth drafting
    assert settle(0.95, 0.02) == 6  # always worth the longest
    length = DraftLength(n_max=4, explore=0)
    assert length.choose(room=2) == 2  # nothing measured: the longest draft that fits
    length.observe(0, 1.0)
    length.observe(1, 1.4)
    assert abs(length.cost(3) - 2.2) < 1e-9  # extrapolated with the measured slope (0.4 per draft)
    length.observe(1, 1.0)  # the mean of step 1 is now 1.2: slope 0.2, below the prior 0.25 x c(0)
    assert abs(length.cost(3) - 1.7) < 1e-9
    assert length.choose(room=0) == 0
