"""Echo guesses (cpp/src/predict/echo_guess.h) and what they drive.

A step's rows are guessed to choose the experts their tokens chose at their latest earlier
occurrences in the sequence. Two consumers: the prefetcher stages the guessed experts of a step's
first MoE layers before its first gate (which no predictor can reach), and
Session.predict_step_reads prices a step by the guessed experts the cache does not hold (the
residency-aware draft length, sharpi.speculative.DraftLength.trim).

Oracles: a numpy implementation of the rule on random histories; the expert bytes of a layer from
the gguf package's tensor sizes and the held experts from the engine's own routing record
(last_routing) under a budget that never evicts; plain resident decoding for losslessness.
"""

from __future__ import annotations

import secrets

import gguf
import numpy as np
import pytest
import sharpi
from sharpi import _internal
from sharpi.make_model import write_model
from sharpi.speculative import DraftLength, NgramDraft, Speculation


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("echo") / "qwen3moe-q4_k_m.gguf")
    write_model(path, arch="qwen3moe", preset="tiny", quant="q4_k_m", seed=21)
    return path


def numpy_echo(history: list, selections: np.ndarray, step: list) -> np.ndarray:
    out = np.full((len(step), selections.shape[1]), -1, dtype=np.int32)
    for r, token in enumerate(step):
        before = step[r - 1] if r > 0 else (history[-1] if history else -1)
        same = [p for p in range(len(history)) if history[p] == token]
        pair = [p for p in same if p > 0 and before >= 0 and history[p - 1] == before]
        at = pair[-1] if pair else (same[-1] if same else None)
        if at is not None:
            out[r] = selections[at]
    return out


def test_echo_guess_follows_the_rule():
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    kinds = {"pair": 0, "alone": 0, "none": 0}
    for _ in range(300):
        n_vocab = int(rng.integers(2, 12))  # a small vocabulary: tokens repeat
        history = [int(t) for t in rng.integers(-1, n_vocab, int(rng.integers(0, 30)))]  # -1: unknown
        row = int(rng.integers(1, 10))
        selections = rng.integers(-1, 16, (len(history), row)).astype(np.int32)
        step = [int(t) for t in rng.integers(0, n_vocab, int(rng.integers(1, 6)))]
        got = _internal.echo_guess(history, selections, step)
        np.testing.assert_array_equal(got, numpy_echo(history, selections, step), err_msg=f"seed {seed}")
        before = history[-1] if history else -1
        same = [p for p in range(len(history)) if history[p] == step[0]]
        kinds["pair" if any(p > 0 and before >= 0 and history[p - 1] == before for p in same)
              else "alone" if same else "none"] += 1
    assert min(kinds.values()) > 0, kinds  # every branch ran
    with pytest.raises(sharpi.InvalidArgument, match="selections"):
        _internal.echo_guess([1, 2], np.zeros((3, 4), np.int32), [1])


def expert_bytes_per_layer(path: str, n_layer: int, n_expert: int) -> list:
    """Bytes of one routed expert (gate, up, down) per layer, from the file's tensor sizes."""
    sizes = [0] * n_layer
    for t in gguf.GGUFReader(path).tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[2] in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            sizes[int(parts[1])] += int(t.n_bytes) // n_expert
    return sizes


def test_predicted_reads_count_the_guessed_experts_the_cache_lacks(model):
    probe = sharpi.Session(model, threads=1, n_ctx=128, ram_budget="4GiB", reader="pread")
    st, info = probe.expert_stats(), probe.info
    n_layer, n_expert, k = info["n_layer"], info["n_expert"], info["n_expert_used"]
    # Resident: nothing to read.
    resident = sharpi.Session(model, threads=1, n_ctx=128)
    got = resident.predict_step_reads([5, 6, 7])
    assert got == {"bytes": [0.0, 0.0, 0.0], "bytes_per_ms": 0.0}
    # Room for every expert: nothing is evicted, so the cache holds exactly the experts chosen.
    budget = st["fixed_bytes"] + (n_layer * n_expert + k) * st["slot_bytes"]
    s = sharpi.Session(model, threads=2, n_ctx=128, ram_budget=budget, reader="pread", predictor="prev_token")
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    # Three tokens: some experts of each layer stay unread (the tiny model has few).
    prompt = [int(t) for t in rng.choice(np.arange(3, info["n_vocab"]), 3, replace=False)]
    s.decode(prompt)  # one step of prompt rows: no prefetch, no read-ahead (< 32 rows)
    routing = s.last_routing()
    held = [len(np.unique(routing[il])) for il in range(n_layer)]
    sizes = expert_bytes_per_layer(model, n_layer, n_expert)
    unseen = sum(k * (1 - held[il] / n_expert) * sizes[il] for il in range(n_layer))
    novel = next(t for t in range(3, info["n_vocab"]) if t not in prompt)
    # Seen tokens (one after its own previous token, one alone): their experts are held.
    got = s.predict_step_reads([prompt[1], prompt[2], novel, novel])
    assert got["bytes_per_ms"] > 0
    np.testing.assert_allclose(got["bytes"], [0.0, 0.0, unseen, 2 * unseen], rtol=1e-12, err_msg=f"seed {seed}")
    assert unseen > 0
    # Without a predictor there is no history: every token counts as unseen.
    plain = sharpi.Session(model, threads=2, n_ctx=128, ram_budget=budget, reader="pread")
    plain.decode(prompt)
    got = plain.predict_step_reads([prompt[1], prompt[2]])
    np.testing.assert_allclose(got["bytes"], [unseen, 2 * unseen], rtol=1e-12, err_msg=f"seed {seed}")
    for bad in ([info["n_vocab"]], [-1]):
        with pytest.raises(sharpi.InvalidArgument, match="outside the vocabulary"):
            s.predict_step_reads(bad)
    with pytest.raises(sharpi.InvalidArgument):
        s.predict_step_reads([1], seq=7)


def generate_ids(session, prompt, spec) -> tuple:
    session.reset()
    ids, rows = [], []

    def on_token(token, row):
        ids.append(token)
        rows.append(row.copy())

    for _ in session.generate(prompt, max_tokens=32, temperature=0.0, stop_at_eos=False, on_token=on_token,
                              speculative=spec):
        pass
    return ids, rows


def speculate_streamed(s, prompt, want, spec, what: str) -> list:
    """Generates with `spec` on the streamed session s; asserts plain decoding's tokens and logits
    bit for bit and that the budget evicted; returns the per-layer expert stats."""
    got = generate_ids(s, prompt, spec)
    assert got[0] == want[0], f"{what}: tokens differ"
    for i, (a, b) in enumerate(zip(got[1], want[1])):
        np.testing.assert_array_equal(a, b, err_msg=f"{what}: logits of token {i}")
    layers = s.expert_stats()["layers"]
    assert sum(la["evictions"] for la in layers) > 0, what
    return layers


def repeating_prompt(model: str, seed: int) -> tuple:
    """(prompt, plain greedy generation) of a repeated phrase whose continuation repeats tokens:
    prompt lookup drafts from the start, and echo guesses need tokens that occurred before."""
    session = sharpi.Session(model, threads=2, n_ctx=128)
    rng = np.random.default_rng(seed)
    while True:
        phrase = [int(t) for t in rng.integers(3, session.info["n_vocab"], 6)]
        prompt = phrase * 3 + phrase[:2]
        want = generate_ids(session, prompt, None)
        seen = prompt + want[0]
        if sum(seen[i] in seen[:i] for i in range(len(prompt), len(seen))) >= 8:
            return prompt, want


def test_a_verify_step_stages_its_first_moe_layer_and_stays_lossless(model, monkeypatch):
    seed = secrets.randbits(32)
    prompt, want = repeating_prompt(model, seed)
    probe = sharpi.Session(model, threads=1, n_ctx=128, ram_budget="4GiB", reader="pread")
    st, k = probe.expert_stats(), probe.info["n_expert_used"]
    # k cache slots (each layer evicts the last one's experts) and k staging slots.
    budget = st["fixed_bytes"] + (k + k) * st["slot_bytes"]
    first = {}
    for echo in ("1", "0"):
        monkeypatch.setenv("SHARPI_ECHO_PREFETCH", echo)
        s = sharpi.Session(model, threads=2, n_ctx=128, ram_budget=budget, reader="pread", predictor="prev_token")
        spec = Speculation(NgramDraft(size_n=2), n_max=3)
        first[echo] = speculate_streamed(s, prompt, want, spec, f"seed {seed} echo {echo}")[0]
    # The predictor reaches only layers after a gate: layer 0 is staged by echo guesses alone.
    assert first["0"]["prefetch_issued"] == 0
    assert first["1"]["prefetch_issued"] > 0 and first["1"]["prefetch_used"] > 0, (seed, first["1"])


class FakeTarget:
    """predict_step_reads of a step: 1 MB per unheld draft row, at 1 MB/ms (1 ms per row)."""

    def __init__(self, held_rows: int):
        self.held_rows = held_rows

    def predict_step_reads(self, tokens, seq=0):
        per_row = [0.0 if r <= self.held_rows else 1e6 for r in range(len(tokens))]
        return {"bytes": list(np.cumsum(per_row)), "bytes_per_ms": 1e3}


class FixedDraft:
    name = "fixed"

    def draft(self, context, n, key=0):
        return [1] * n

    def close(self):
        pass


def test_the_draft_is_trimmed_by_its_predicted_reads():
    def settled(held_rows: int) -> Speculation:
        spec = Speculation(FixedDraft(), n_max=4, auto=True, target=FakeTarget(held_rows))
        spec.length.explore = 0
        for _ in range(200):  # every draft position kept 90% of the time
            spec.length.record(4, 4 if np.random.default_rng(_).random() < 0.9 else 3)
        for j in range(5):  # compute: 1 ms + 0.1 ms per draft
            spec.length.observe(j, 1e-3 + 1e-4 * j)
        return spec

    # a = 0.9, c(j) = 1 + 0.1 j ms + 1 ms per draft row past the held ones.
    def best(held_rows: int) -> int:
        a = settled(held_rows).length.expected_tokens
        return max(range(5), key=lambda j: a(j) / (1 + 0.1 * j + max(0, j - held_rows)))

    for held in (0, 2, 4):
        spec = settled(held)
        draft = spec.draft([9, 9, 9], room=10)
        assert len(draft) == best(held), (held, len(draft))
    assert best(4) == 4 and best(0) < 4  # held rows keep the whole draft; unheld ones shrink it
    # The step's predicted read is charged to reads, not to compute.
    spec = settled(0)
    draft = spec.draft([9], room=10)
    before = spec.length.compute(len(draft))
    n = spec.length.cost_n[len(draft)]
    spec.observe(len(draft), 1e-3 + 1e-4 * len(draft) + 1e-3 * len(draft))
    after = spec.length.compute(len(draft))
    assert abs(after - before) < 1e-9 * (n + 1), (before, after)
    # Nothing measured by the reader (resident): the draft is the chosen length, untrimmed.
    spec = Speculation(FixedDraft(), n_max=4, auto=True, target=FakeTarget(0))
    spec.target.predict_step_reads = lambda tokens, seq=0: {"bytes": [0.0] * len(tokens), "bytes_per_ms": 0.0}
    assert len(spec.draft([9], room=10)) == 4


def test_draft_length_trim_is_argmax_of_its_model():
    length = DraftLength(n_max=3, explore=0)
    for j, c in enumerate((1.0, 1.2, 1.4, 1.6)):
        length.observe(j, c)
    reads = [0.0, 0.0, 5.0, 5.0]
    want = max(range(4), key=lambda j: length.expected_tokens(j) / (1.0 + 0.2 * j + reads[j]))
    assert length.trim(reads) == want
    assert length.trim(reads[:2]) <= 1 and length.trim([0.0]) == 0


def test_mtp_drafts_stage_their_rows_and_stay_lossless(monkeypatch):
    """The shipped model with its MTP head: draft_mtp stages each chained row's guesses while the
    rest of the draft is computed; the output stays plain decoding's bit for bit."""
    from sharpi.models import default_model_path, default_mtp_path
    from sharpi.speculative import open_speculation

    path = str(default_model_path())
    resident = sharpi.Session(path, threads=2, n_ctx=256)
    prompt = resident.tokenize("import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n        print(")
    want = generate_ids(resident, prompt, None)
    probe = sharpi.Session(path, threads=1, n_ctx=256, ram_budget="4GiB", reader="pread", mtp=default_mtp_path())
    st, k = probe.expert_stats(), probe.info["n_expert_used"]
    budget = st["fixed_bytes"] + (4 * k + k) * st["slot_bytes"]
    issued = {}
    for echo in ("1", "0"):
        monkeypatch.setenv("SHARPI_ECHO_PREFETCH", echo)
        s = sharpi.Session(path, threads=2, n_ctx=256, ram_budget=budget, reader="pread", predictor="next_gate",
                           mtp=default_mtp_path())
        layers = speculate_streamed(s, prompt, want, open_speculation(s, "draft-mtp", n_max=3), f"echo {echo}")
        assert s.last_stats.get("spec_drafted", 0) > 0
        issued[echo] = layers[0]["prefetch_issued"]
    assert issued["0"] == 0 and issued["1"] > 0, issued


class EchoRecorder(sharpi.Predictor):
    """A plug-in that keeps each observed row's step.echo (at layer 0) and hints nothing."""

    def __init__(self):
        self.seen = []

    def observe(self, layer, hidden, router_logits, history, prev, step=None):
        if layer == 0:
            self.seen.append((step.row, step.n_rows, None if step.echo is None else np.array(step.echo)))
        return []


def test_predictors_see_each_rows_echo(model):
    probe = sharpi.Session(model, threads=1, n_ctx=128, ram_budget="4GiB", reader="pread")
    st, info = probe.expert_stats(), probe.info
    n_layer, k = info["n_layer"], info["n_expert_used"]
    rec = EchoRecorder()
    s = sharpi.Session(model, threads=2, n_ctx=128, ram_budget=st["fixed_bytes"] + 3 * k * st["slot_bytes"],
                       reader="pread", predictor=rec)
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    vocab = [int(t) for t in rng.integers(3, info["n_vocab"], 5)]  # few tokens: they recur
    tokens, selections = [], []

    def decode(step, rewindable=False):
        rec.seen.clear()
        s.decode(step, all_logits=rewindable, rewindable=rewindable)
        routing = s.last_routing()
        want = numpy_echo(tokens, np.array(selections, np.int32).reshape(len(tokens), n_layer * k), step)
        tokens.extend(step)
        selections.extend(np.stack([routing[il] for il in range(n_layer)], 1).reshape(len(step), -1))
        return want

    decode([int(t) for t in rng.choice(vocab, 6)])  # a prompt: not observed
    assert rec.seen == []
    checked = 0
    for _ in range(12):
        step = [int(t) for t in rng.choice(vocab, int(rng.integers(1, 4)))]
        want = decode(step, rewindable=len(step) > 1)
        assert [(r, n) for r, n, _ in rec.seen] == [(r, len(step)) for r in range(len(step))], f"seed {seed}"
        for r, _, echo in rec.seen:
            if (want[r] < 0).all():
                assert echo is None, f"seed {seed}"
            else:
                np.testing.assert_array_equal(echo.reshape(-1), want[r], err_msg=f"seed {seed} row {r}")
                checked += 1
    assert checked > 0


def test_the_echo_predictor_reads_the_echo_and_stays_lossless(model):
    seed = secrets.randbits(32)
    prompt, want = repeating_prompt(model, seed)
    probe = sharpi.Session(model, threads=1, n_ctx=128, ram_budget="4GiB", reader="pread")
    st, k = probe.expert_stats(), probe.info["n_expert_used"]
    s = sharpi.Session(model, threads=2, n_ctx=128, ram_budget=st["fixed_bytes"] + 2 * k * st["slot_bytes"],
                       reader="pread", predictor="echo")
    layers = speculate_streamed(s, prompt, want, Speculation(NgramDraft(size_n=2), n_max=3), f"seed {seed}")
    # Layer 1 is predicted by the predictor from layer 0's gate (its echo's layer-1 experts).
    assert layers[1]["predictions"] > 0 and layers[1]["prefetch_issued"] > 0
    assert layers[1]["predicted_correct"] > 0, f"seed {seed}"
