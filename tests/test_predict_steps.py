"""Predictors in steps of several rows (issues 39 and 40, docs/predictors.md "Steps of several rows").

A step of a few decode rows (sequences decoding together, a speculative verify step) shows every
row's gates to the predictor, each with its own history, `prev`, sequence and row; prompt rows are
not shown. The predictor's cross-token history follows one sequence at a time. The oracles are the
engine's own reported routing (Session.last_routing, tied to the numpy reference and transformers
elsewhere) and the resident engine for losslessness; schedules are fresh random each run, the seed in
every message.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest
import sharpi
from sharpi.make_model import write_model

N_LAYER = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("predict_steps") / "qwen3moe.gguf")
    write_model(path, arch="qwen3moe", preset="tiny", quant="q4_k_m", seed=11, n_layer=N_LAYER)
    return path


def streamed(path, n_seq, predictor, slots_per_layer=None, **kw):
    probe = sharpi.Session(path, threads=1, n_ctx=96, n_seq=n_seq, ram_budget="4GiB", reader="pread")
    st, k = probe.expert_stats(), probe.info["n_expert_used"]
    n_slots = slots_per_layer or k
    return sharpi.Session(path, threads=2, n_ctx=96, n_seq=n_seq, reader="pread", lookahead=2,
                          predictor=predictor, ram_budget=st["fixed_bytes"] + (n_slots + 2 * k) * st["slot_bytes"],
                          **kw)


def step_rows(s, n_tokens_per_entry):
    """Per entry of the last step, its tokens' selections [n, n_layer, top_k] from last_routing."""
    routing = np.stack(s.last_routing(), axis=1)  # [n_tokens, n_layer, top_k]
    out, row0 = [], 0
    for n in n_tokens_per_entry:
        out.append(routing[row0:row0 + n])
        row0 += n
    return out


class StepRecorder(sharpi.Predictor):
    """Hints nothing; records every observe() with its step row."""

    def __init__(self):
        self.calls = []

    def observe(self, layer, hidden, router_logits, history, prev, step):
        self.calls.append((layer, step, history.copy(), prev.copy(), router_logits.copy(),
                           bool(np.isfinite(hidden).all())))
        return []


def test_each_sequence_of_a_step_reaches_the_predictor_as_its_own_row(model):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    rec = StepRecorder()
    s = streamed(model, 3, rec)
    seqs = [s.sequence(0), s.add_sequence(), s.add_sequence()]
    lengths = [int(n) for n in rng.integers(2, 9, 3)]
    prompts = [[int(t) for t in rng.integers(5, 200, n)] for n in lengths]
    s.decode_batch([(q, p) for q, p in zip(seqs, prompts)])
    assert rec.calls == [], f"prompt rows are not shown to the predictor (seed {seed})"
    last = [rows[-1] for rows in step_rows(s, lengths)]

    order = [int(i) for i in rng.permutation(3)]
    nxt = [int(t) for t in rng.integers(5, 200, 3)]
    s.decode_batch([(seqs[i], [nxt[i]]) for i in order])
    now = step_rows(s, [1, 1, 1])
    k = s.info["n_expert_used"]
    assert len(rec.calls) == 3 * N_LAYER, seed
    for c, (layer, step, history, prev, logits, finite) in enumerate(rec.calls):
        r = c % 3
        i = order[r]
        what = f"seed {seed} layer {layer} row {r}"
        assert layer == c // 3 and finite, what
        assert (step.sequence, step.row, step.n_rows) == (seqs[i].id, r, 3), what
        # The sequence the predictor follows: the step's first decode entry (no sequence was followed).
        assert step.updates_state == (r == 0), what
        np.testing.assert_array_equal(history[: layer + 1], now[r][0][: layer + 1], err_msg=what)
        assert (history[layer + 1:] == -1).all(), what
        np.testing.assert_array_equal(prev, last[i], err_msg=what)
        # The router logits are this row's: its top-k (softmax routing ranks by the logits) is the
        # set the layer selected for the row.
        assert set(np.argsort(-logits, kind="stable")[:k].tolist()) == set(history[layer].tolist()), what


def test_a_verify_step_shows_its_draft_rows_with_the_earlier_row_as_prev(model):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    rec = StepRecorder()
    s = streamed(model, 1, rec)
    prompt = [int(t) for t in rng.integers(5, 200, 6)]
    s.decode(prompt)
    s.decode([int(t) for t in rng.integers(5, 200, 3)], all_logits=True)  # a prompt chunk: not shown
    assert rec.calls == [], seed
    before = np.stack(s.last_routing(), axis=1)[-1]
    n = int(rng.integers(2, 6))
    s.decode([int(t) for t in rng.integers(5, 200, n)], all_logits=True, rewindable=True)
    rows = np.stack(s.last_routing(), axis=1)
    assert len(rec.calls) == n * N_LAYER, seed
    for c, (layer, step, history, prev, _, _) in enumerate(rec.calls):
        r = c % n
        what = f"seed {seed} layer {layer} row {r}"
        assert layer == c // n and (step.sequence, step.row, step.n_rows) == (0, r, n), what
        assert step.updates_state == (r == 0), what
        np.testing.assert_array_equal(history[: layer + 1], rows[r][: layer + 1], err_msg=what)
        if r == 0:
            np.testing.assert_array_equal(prev, before, err_msg=what)
        else:  # the previous draft row, known up to this layer
            np.testing.assert_array_equal(prev[: layer + 1], rows[r - 1][: layer + 1], err_msg=what)
            assert (prev[layer + 1:] == -1).all(), what


class FollowedHistory(sharpi.Predictor):
    """Keeps one history as the contract says (observe_context, and `prev` folded at layer 0 when
    updates_state) and records it each time it folds, with the sequence it belongs to."""

    def __init__(self):
        self.state, self.folds = [], []

    def observe_context(self, selections, new_sequence):
        if new_sequence:
            self.state = []
        self.state.extend(x.copy() for x in selections)

    def observe(self, layer, hidden, router_logits, history, prev, step):
        if layer == 0 and step.updates_state:
            if (prev < 0).all():
                self.state = []  # a sequence's first token
            else:
                self.state.append(prev.copy())
            self.folds.append((step.sequence, list(self.state)))
        return []


def test_the_followed_history_is_always_the_sequences_own(model):
    """Across a random mix of steps (several sequences one token each, a rewindable verify step
    then a truncate, prompt chunks, a sequence alone), each time the predictor folds `prev` its
    history is exactly the selections of the tokens that sequence kept before the current one."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    pred = FollowedHistory()
    s = streamed(model, 3, pred)
    seqs = [s.sequence(0), s.add_sequence(), s.add_sequence()]
    kept = {q.id: [] for q in seqs}  # selections [n_layer, top_k] of each kept token
    n_folds = 0
    for step in range(30):
        members = [seqs[i] for i in rng.permutation(3)[: int(rng.integers(1, 4))]]
        entries, lengths = [], []
        for q in members:
            kind = rng.choice(["token", "token", "verify", "prompt"])
            room = 90 - q.n_past
            n = 1 if kind == "token" else int(rng.integers(2, 5))
            n = min(n, room)
            if n < 1:
                continue
            entries.append((q, [int(t) for t in rng.integers(5, 200, n)], True, kind == "verify"))
            lengths.append(n)
        if not entries:
            continue
        snapshot = {q: list(v) for q, v in kept.items()}
        s.decode_batch(entries)
        for (q, _, _, verify), rows in zip(entries, step_rows(s, lengths)):
            kept[q.id].extend(rows)
            if verify and rng.random() < 0.7:  # rejected drafts: cut back inside the step
                keep = q.n_past - int(rng.integers(1, len(rows) + 1))
                q.truncate(keep)
                del kept[q.id][keep:]
        for seq_id, state in pred.folds[n_folds:]:
            what = f"seed {seed} step {step} sequence {seq_id}"
            assert len(state) == len(snapshot[seq_id]), what
            for got, want in zip(state, snapshot[seq_id]):
                np.testing.assert_array_equal(got, want, err_msg=what)
        n_folds = len(pred.folds)
    assert n_folds > 10, seed


@pytest.mark.parametrize("predictor", ["prev_token", "next_gate"])
def test_multi_sequence_steps_are_predicted_and_stay_lossless(model, predictor):
    """Built-in predictors make and score predictions for every row of a multi-sequence step, their
    reads are used, and the logits equal the resident engine's bit for bit."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    n_seq = 4
    prompts = [[int(t) for t in rng.integers(5, 200, int(n))] for n in rng.integers(2, 9, n_seq)]

    def run(s):
        seqs = [s.sequence(0)] + [s.add_sequence() for _ in range(n_seq - 1)]
        logits = s.decode_batch([(q, p) for q, p in zip(seqs, prompts)])
        s.reset_stats()
        out = []
        for _ in range(12):
            logits = s.decode_batch([(q, [int(np.argmax(lg))]) for q, lg in zip(seqs, logits)])
            out.append(np.stack(logits))
        return np.stack(out)

    want = run(sharpi.Session(model, threads=2, n_ctx=96, n_seq=n_seq))
    s = streamed(model, n_seq, predictor)
    np.testing.assert_array_equal(run(s), want, err_msg=f"{predictor} seed {seed}")
    st = s.expert_stats()
    assert st["predictor_calls"] == 12 * n_seq * N_LAYER, seed
    layers = st["layers"]
    assert sum(lay["predictions"] for lay in layers) > 0, seed
    assert sum(lay["prefetch_issued"] for lay in layers) > 0, seed
    assert sum(lay["prefetch_used"] for lay in layers) > 0, seed
