"""Several sequences in one step (issue 39): Session.decode_batch must give every sequence the
logits it gets decoded alone, bit for bit, whatever else shares the step and wherever its tokens
sit in it; sequences added, cancelled or removed mid-batch leave the others unchanged; streamed
batches equal resident ones; and a step reads each expert it uses once for all its sequences.

The oracle is the same engine decoding each sequence alone with the same token groups (the
single-sequence path, which test_model_vs_reference.py ties to the float64 numpy reference and to
transformers). Inputs are fresh random tokens and schedules each run; the seed is in every message.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest
import sharpi
from reader_policy import uring_unavailable
from sharpi.make_model import write_model

ARCHS = ["llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "olmoe", "deepseek2", "qwen3next", "qwen35moe",
         "gpt-oss", "glm4moe", "llama4", "minimax-m2", "deepseek4",
         "deepseek32", "nemotron_h_moe"]
# deepseek4 keeps its sliding-window and compressor state in an f32 KV row and refuses other types.
F32_KV_ONLY = {"deepseek4"}
KV_TYPES = ["f32", "f16", "q8_0", "q4_0"]
HYBRID = {"qwen3next", "qwen35moe", "nemotron_h_moe"}  # recurrent state: forks only whole


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch_models")
    out = {}
    for arch in ARCHS:
        out[arch] = str(d / f"{arch}.gguf")
        write_model(out[arch], arch=arch, preset="tiny", quant="q4_k_m", seed=5)
    return out


def random_schedule(rng, n_vocab: int, lengths: list) -> tuple:
    """Token lists of the given lengths and a schedule: steps of [(sequence index, start, end,
    all_logits)], each step a random subset of the unfinished sequences in random order, each taking
    one token or a random chunk of what it has left."""
    tokens = [rng.integers(0, n_vocab, n).tolist() for n in lengths]
    done = [0] * len(lengths)
    steps = []
    while any(d < n for d, n in zip(done, lengths)):
        live = [i for i, n in enumerate(lengths) if done[i] < n]
        picked = rng.permutation(live)[: rng.integers(1, len(live) + 1)]
        step = []
        for i in picked:
            left = lengths[i] - done[i]
            take = 1 if rng.random() < 0.5 else int(rng.integers(1, left + 1))
            step.append((int(i), done[i], done[i] + take, bool(rng.random() < 0.5)))
            done[i] += take
        steps.append(step)
    return tokens, steps


def run_batched(session, tokens, steps) -> dict:
    """Runs the schedule with every sequence on its own session sequence (0 and added ones):
    {(sequence index, start): logits}."""
    seqs = [session.sequence(0)] + [session.add_sequence() for _ in range(len(tokens) - 1)]
    out = {}
    for step in steps:
        # One call per step; all_logits is per call, so entries that want only their last row are
        # compared on it.
        want_all = any(a for _, _, _, a in step)
        logits = session.decode_batch([(seqs[i], tokens[i][a:b]) for i, a, b, _ in step], all_logits=want_all)
        for (i, a, _, all_rows), rows in zip(step, logits):
            out[(i, a)] = rows if all_rows or not want_all else rows[-1]
    for seq in seqs[1:]:
        seq.remove()
    return out


def run_alone(session, tokens, steps, all_rows_of) -> dict:
    """Each sequence alone on sequence 0, with the token groups the schedule gave it."""
    out = {}
    for i, seq_tokens in enumerate(tokens):
        session.reset()
        for step in steps:
            for j, a, b, _ in step:
                if j == i:
                    out[(i, a)] = session.decode(seq_tokens[a:b], all_logits=all_rows_of[(i, a)])
    session.reset()
    return out


def check_schedule(session, tokens, steps, what: str) -> None:
    batched = run_batched(session, tokens, steps)
    all_rows_of = {key: value.ndim == 2 for key, value in batched.items()}
    alone = run_alone(session, tokens, steps, all_rows_of)
    for key in alone:
        np.testing.assert_array_equal(batched[key], alone[key],
                                      err_msg=f"{what}: sequence {key[0]}, tokens from {key[1]}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv", KV_TYPES)
@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
def test_batch_equals_alone(models, arch, kv, exact):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    n_seq = int(rng.integers(2, 6))
    if arch in F32_KV_ONLY and kv != "f32":
        with pytest.raises(sharpi.InvalidArgument, match="f32 cache row"):
            sharpi.Session(models[arch], threads=2, n_ctx=96, n_seq=n_seq, exact=exact, cache_type_k=kv,
                           cache_type_v=kv)
        return
    s = sharpi.Session(models[arch], threads=2, n_ctx=96, n_seq=n_seq, exact=exact, cache_type_k=kv,
                       cache_type_v=kv)
    lengths = [int(n) for n in rng.integers(1, 40, n_seq)]
    tokens, steps = random_schedule(rng, s.info["n_vocab"], lengths)
    check_schedule(s, tokens, steps, f"{arch} kv {kv} {'exact' if exact else 'fast'} seed {seed}")


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2", "qwen35moe", "deepseek4"])
def test_long_prompt_beside_decoding_sequences(models, arch):
    # A prompt longer than the engine's 256-row chunk shares steps with one-token decodes: it is
    # cut into the same 256-token pieces as alone, and no piece straddles two chunks.
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    s = sharpi.Session(models[arch], threads=2, n_ctx=400, n_seq=3)
    V = s.info["n_vocab"]
    tokens = [rng.integers(0, V, n).tolist() for n in (20, 300, 24)]
    steps = [[(0, 0, 10, False), (2, 0, 5, True)],
             [(2, 5, 6, False), (1, 0, 300, True), (0, 10, 11, False)],
             [(0, 11, 20, True), (2, 6, 24, False)]]
    check_schedule(s, tokens, steps, f"{arch} seed {seed}")


def test_added_cancelled_and_removed_sequences_leave_the_others_unchanged(models):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    s = sharpi.Session(models["qwen3moe"], threads=2, n_ctx=64, n_seq=4)
    V = s.info["n_vocab"]
    a_tokens, b_tokens, c_tokens, d_tokens = (rng.integers(0, V, 12).tolist() for _ in range(4))

    def alone(tokens, groups):
        s.reset()
        return [s.decode(tokens[x:y]) for x, y in groups]

    groups = [(0, 6), (6, 7), (7, 8), (8, 12)]
    want_a, want_b = alone(a_tokens, groups), alone(b_tokens, groups)
    want_c = alone(c_tokens, [(0, 6), (6, 7)])
    want_d = alone(d_tokens, [(0, 5), (5, 9)])
    s.reset()
    a, b, c = s.sequence(0), s.add_sequence(), s.add_sequence()
    got = s.decode_batch([(a, a_tokens[0:6]), (b, b_tokens[0:6]), (c, c_tokens[0:6])])
    for g, w in zip(got, [want_a[0], want_b[0], want_c[0]]):
        np.testing.assert_array_equal(g, w, err_msg=f"seed {seed}")
    # c is cancelled before the step that holds it: its entry is empty and nothing is appended.
    c.cancel()
    got = s.decode_batch([(c, c_tokens[6:7]), (a, a_tokens[6:7]), (b, b_tokens[6:7])])
    assert got[0].shape == (0, V) and c.n_past == 6
    np.testing.assert_array_equal(got[1], want_a[1], err_msg=f"seed {seed}")
    np.testing.assert_array_equal(got[2], want_b[1], err_msg=f"seed {seed}")
    # The cancel was consumed: the same token again gives what c alone gives.
    np.testing.assert_array_equal(s.decode_batch([(c, c_tokens[6:7])])[0], want_c[1], err_msg=f"seed {seed}")
    # c leaves, d arrives mid-batch with its prompt beside a's and b's next tokens.
    c.remove()
    d = s.add_sequence()
    got = s.decode_batch([(a, a_tokens[7:8]), (d, d_tokens[0:5]), (b, b_tokens[7:8])])
    np.testing.assert_array_equal(got[0], want_a[2], err_msg=f"seed {seed}")
    np.testing.assert_array_equal(got[1], want_d[0], err_msg=f"seed {seed}")
    np.testing.assert_array_equal(got[2], want_b[2], err_msg=f"seed {seed}")
    got = s.decode_batch([(d, d_tokens[5:9]), (b, b_tokens[8:12]), (a, a_tokens[8:12])])
    np.testing.assert_array_equal(got[0], want_d[1], err_msg=f"seed {seed}")
    np.testing.assert_array_equal(got[1], want_b[3], err_msg=f"seed {seed}")
    np.testing.assert_array_equal(got[2], want_a[3], err_msg=f"seed {seed}")
    assert [q.n_past for q in (a, b, d)] == [12, 12, 9]
    # The removed handle is refused, not aliased to the sequence now in its slot.
    with pytest.raises(sharpi.InvalidArgument, match="does not exist"):
        s.decode_batch([(c, [1])])


def test_fork_shares_a_prefix(models):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    for arch in ("qwen3moe", "deepseek2", "qwen35moe", "deepseek4"):
        s = sharpi.Session(models[arch], threads=2, n_ctx=64, n_seq=3)
        V = s.info["n_vocab"]
        prefix, tail_a, tail_b = (rng.integers(0, V, n).tolist() for n in (10, 4, 6))
        want_a = s.decode(prefix + tail_a)
        s.reset()
        want_b = s.decode(prefix + tail_b)
        s.reset()
        s.decode(prefix)
        base = s.sequence(0)
        fork = base.fork()
        assert fork.n_past == 10
        got = s.decode_batch([(base, tail_a), (fork, tail_b)])
        np.testing.assert_array_equal(got[0], want_a, err_msg=f"{arch} seed {seed}")
        np.testing.assert_array_equal(got[1], want_b, err_msg=f"{arch} seed {seed}")
        if arch in HYBRID:
            with pytest.raises(sharpi.UnsupportedError, match="recurrent"):
                base.fork(5)
        else:
            part = base.fork(10)  # the prefix only: decoding tail_b after it gives want_b again
            np.testing.assert_array_equal(s.decode_batch([(part, tail_b)])[0], want_b, err_msg=f"{arch}")


@pytest.mark.parametrize("reader", ["pread", "uring"])
def test_streamed_batches_equal_resident(models, reader):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    for arch in ("qwen3moe", "deepseek2"):
        path = models[arch]
        probe = sharpi.Session(path, threads=1, n_ctx=96, n_seq=4, ram_budget="4GiB", reader="pread")
        st, info = probe.expert_stats(), probe.info
        fixed, slot, k = st["fixed_bytes"], st["slot_bytes"], info["n_expert_used"]
        total = (info["n_layer"] - info["n_layer_dense_lead"]) * info["n_expert"]
        tokens, steps = random_schedule(rng, info["n_vocab"], [int(n) for n in rng.integers(1, 30, 4)])
        resident = sharpi.Session(path, threads=2, n_ctx=96, n_seq=4)
        want = run_batched(resident, tokens, steps)
        for n_slots in (k, k + 3, total):
            for predictor in ("none", "prev_token", "next_gate"):
                staging = k if predictor != "none" else 0
                try:
                    s = sharpi.Session(path, threads=2, n_ctx=96, n_seq=4, reader=reader, predictor=predictor,
                                       ram_budget=fixed + (n_slots + staging) * slot)
                except (sharpi.UnsupportedError, sharpi.IoError) as e:
                    uring_unavailable(str(e))
                    pytest.skip(f"{reader} reader unavailable here: {e}")
                got = run_batched(s, tokens, steps)
                what = f"{arch} {reader} {n_slots} slots {predictor} seed {seed}"
                for key in want:
                    np.testing.assert_array_equal(got[key], want[key], err_msg=f"{what}: {key}")
                layers = s.expert_stats()["layers"]
                if n_slots == k:  # the minimum budget must have evicted
                    assert sum(lay["evictions"] for lay in layers) > 0, what


def test_a_step_reads_the_union_of_its_experts_once(models):
    # With room for every expert, the first step's reads per layer are exactly the distinct experts
    # its tokens selected, whichever sequences they belong to; decoded one sequence after the other
    # (each alone, from a cold cache) the same tokens read the sum of each sequence's own sets.
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    path = models["qwen3moe"]
    probe = sharpi.Session(path, threads=1, n_ctx=32, n_seq=8, ram_budget="4GiB", reader="pread")
    st, info = probe.expert_stats(), probe.info
    total = info["n_layer"] * info["n_expert"]
    budget = st["fixed_bytes"] + total * st["slot_bytes"]
    s = sharpi.Session(path, threads=2, n_ctx=32, n_seq=8, ram_budget=budget, reader="pread")
    seqs = [s.sequence(0)] + [s.add_sequence() for _ in range(7)]
    tokens = [[int(t)] for t in rng.integers(0, info["n_vocab"], 8)]
    s.decode_batch(list(zip(seqs, tokens)))
    layers = s.expert_stats()["layers"]
    union = [len(np.unique(ids)) for ids in s.last_routing()]
    reads = [lay["misses"] + lay["prefetch_used"] for lay in layers]
    assert reads == union, f"seed {seed}"
    per_sequence = [0] * info["n_layer"]
    for t in tokens:
        alone = sharpi.Session(path, threads=2, n_ctx=32, ram_budget=budget, reader="pread")
        alone.decode(t)
        for il, lay in enumerate(alone.expert_stats()["layers"]):
            per_sequence[il] += lay["misses"] + lay["prefetch_used"]
    assert sum(reads) < sum(per_sequence), f"seed {seed}: 8 random tokens of 2-of-8 experts share some"


def test_bad_batches_are_clear_errors_and_change_nothing(models):
    path = models["qwen3moe"]
    for bad in (0, -1, 257):
        with pytest.raises(sharpi.InvalidArgument, match="n_seq"):
            sharpi.Session(path, n_seq=bad)
    s = sharpi.Session(path, threads=2, n_ctx=16, n_seq=2)
    a, b = s.sequence(0), s.add_sequence()
    s.decode_batch([(a, [1, 2, 3]), (b, [4, 5])])
    with pytest.raises(sharpi.InvalidArgument, match="n_seq"):
        s.add_sequence()
    with pytest.raises(sharpi.InvalidArgument, match="twice"):
        s.decode_batch([(a, [1]), (a, [2])])
    with pytest.raises(sharpi.InvalidArgument, match="no tokens"):
        s.decode_batch([(a, [1]), (b, [])])
    with pytest.raises(sharpi.InvalidArgument, match="vocabulary"):
        s.decode_batch([(a, [1]), (b, [10**6])])
    with pytest.raises(sharpi.ContextOverflowError, match="sequence"):
        s.decode_batch([(a, [1]), (b, list(range(1, 16)))])
    with pytest.raises(sharpi.InvalidArgument, match="does not exist"):
        s.decode_batch([(a, [1]), (12345, [1])])
    with pytest.raises(sharpi.InvalidArgument, match="cannot be removed"):
        a.remove()
    with pytest.raises(sharpi.InvalidArgument):
        s.decode_batch([])
    assert (a.n_past, b.n_past) == (3, 2)  # every refused step appended nothing


def test_the_budget_charges_every_sequence(models):
    path = models["qwen3moe"]
    one = sharpi.Session(path, n_ctx=256, n_seq=1).info["bytes_kv"]
    four = sharpi.Session(path, n_ctx=256, n_seq=4).info["bytes_kv"]
    assert four == 4 * one
    probe = sharpi.Session(path, n_ctx=256, n_seq=1, ram_budget="4GiB", reader="pread")
    st = probe.expert_stats()
    fits_one = st["fixed_bytes"] + probe.info["n_expert_used"] * st["slot_bytes"]
    sharpi.Session(path, n_ctx=256, n_seq=1, ram_budget=fits_one, reader="pread")
    with pytest.raises(sharpi.InvalidArgument, match="4 sequences.*need at least"):
        sharpi.Session(path, n_ctx=256, n_seq=4, ram_budget=fits_one, reader="pread")


def test_a_step_may_hold_more_sequences_than_one_context(models):
    # One token each from more sequences than n_ctx positions: a step takes up to max(n_ctx, 256)
    # tokens (the residual rows the budget charges), whatever each sequence's context is.
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    s = sharpi.Session(models["olmoe"], threads=2, n_ctx=8, n_seq=20)
    assert s.info["max_step_tokens"] == 256
    seqs = [s.sequence(0)] + [s.add_sequence() for _ in range(19)]
    tokens = [[int(t)] for t in rng.integers(0, s.info["n_vocab"], 20)]
    got = s.decode_batch(list(zip(seqs, tokens)))
    for t, g in zip(tokens, got):
        s.reset()
        np.testing.assert_array_equal(g, s.decode(t), err_msg=f"seed {seed}")
    with pytest.raises(sharpi.InvalidArgument, match="at most 256 per step"):
        big = sharpi.Session(models["olmoe"], threads=2, n_ctx=200, n_seq=2)
        big.decode_batch([(big.sequence(0), [1] * 150), (big.add_sequence(), [1] * 150)])
