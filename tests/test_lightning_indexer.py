"""DeepSeek Sparse Attention's two CPU ops (deepseek32) against float64 numpy models: the lightning
indexer (cpu/ops/lightning_indexer.h) over indexer keys stored after the MLA latent in each KV row,
in every KV cache type (rows decoded by the gguf package, independent of sharpi), its tie rule, and
MLA attention restricted to a selection (cpu/ops/mla_attention.h).
"""

import numpy as np
import pytest
from gguf import quants
from sharpi import _internal
from sharpi._core import InvalidArgument
from test_kv_cache import GGML, TYPES, mla_attention_model, store

N_LORA, N_ROT, N_HEAD, HEAD = 64, 32, 8, 64
WIDTH = N_LORA + N_ROT + HEAD  # one KV row: latent, RoPE key, indexer key
KEY_OFFSET = N_LORA + N_ROT
SCALE = 1.0 / np.sqrt(N_HEAD * HEAD)


def decode(kind, stored):
    return np.stack([quants.dequantize(r, GGML[kind]).reshape(WIDTH) for r in stored]).astype(np.float64)


def indexer_model(q, w, keys, pos0, top_k):
    """Per query t (position pos0 + t): scores over keys j <= pos0 + t, sum_h w_h * SCALE *
    relu(q_h . k_j); the top_k (all while there are no more), equal scores to the earlier position.
    Returns the kept positions (ascending) and each query's gap between its top_k-th and next score."""
    kept, gaps = [], []
    for t in range(q.shape[0]):
        n = pos0 + t + 1
        if n <= top_k:
            kept.append(list(range(n)))
            gaps.append(np.inf)
            continue
        qk = q[t].astype(np.float64).reshape(N_HEAD, HEAD) @ keys[:n].T  # [heads, n]
        scores = (w[t].astype(np.float64) * SCALE) @ np.maximum(qk, 0.0)
        order = np.argsort(-scores, kind="stable")
        kept.append(sorted(order[:top_k].tolist()))
        gaps.append(scores[order[top_k - 1]] - scores[order[top_k]])
    return kept, np.array(gaps)


def run(q, w, stored, kind, pos0, top_k, threads=1):
    positions, count = _internal.lightning_indexer(q, w, stored, kind, WIDTH, KEY_OFFSET, pos0, N_HEAD, HEAD,
                                                    top_k, SCALE, threads=threads)
    return [positions[t, : count[t]].tolist() for t in range(q.shape[0])], positions, count


@pytest.mark.parametrize("kind", TYPES)
def test_the_indexer_selects_the_float64_models_top_k(kind):
    rng = np.random.default_rng(3)
    n, pos0, top_k = 90, 10, 16
    stored = store(kind, rng.standard_normal((n, WIDTH)).astype(np.float32))
    q = rng.standard_normal((n - pos0, N_HEAD * HEAD)).astype(np.float32)
    w = rng.standard_normal((n - pos0, N_HEAD)).astype(np.float32)
    want, gaps = indexer_model(q, w, decode(kind, stored)[:, KEY_OFFSET:], pos0, top_k)
    assert np.isinf(gaps[: top_k - pos0 - 1]).all()
    results = [run(q, w, stored, kind, pos0, top_k, threads) for threads in (1, 3)]
    # Where the top_k-th and the next score lie further apart than f32 rounding can move them (1e-4;
    # the scores are O(1)), the selection is the float64 model's; a closer pair may go either way.
    clear = [t for t in range(len(want)) if gaps[t] > 1e-4]
    assert len(clear) >= 0.9 * len(want)
    assert [results[0][0][t] for t in clear] == [want[t] for t in clear]
    np.testing.assert_array_equal(results[1][1], results[0][1])
    # Prefill equals one query at a time (a token's selection does not depend on its batch).
    for t in (0, 7, 79):
        _, positions, _ = run(q[t : t + 1], w[t : t + 1], stored, kind, pos0 + t, top_k)
        np.testing.assert_array_equal(positions[0], results[0][1][t])


def test_equal_scores_go_to_the_earlier_position():
    rng = np.random.default_rng(4)
    rows = rng.standard_normal((6, WIDTH)).astype(np.float32)
    q = rng.standard_normal((1, N_HEAD * HEAD)).astype(np.float32)
    w = np.abs(rng.standard_normal((1, N_HEAD))).astype(np.float32)
    qh = q[0].reshape(N_HEAD, HEAD)
    direction = qh.sum(axis=0) / np.linalg.norm(qh.sum(axis=0))
    # Positions 0 and 1 score high, 2 and 4 hold the same key (an exact tie), 3 and 5 score 0 (their
    # q.k is negative in every head). top_k 3 ends inside the tie: position 2 is kept, 4 is not.
    for j, key in ((0, 9 * direction), (1, 8 * direction), (2, 3 * direction), (4, 3 * direction),
                   (3, -qh.mean(axis=0) * 50), (5, -qh.mean(axis=0) * 60)):  # fmt: skip
        rows[j, KEY_OFFSET:] = key
    keys = rows[:, KEY_OFFSET:].astype(np.float64)
    assert (qh.astype(np.float64) @ keys[[3, 5]].T < 0).all()
    kept, _, count = run(q, w, store("f32", rows), "f32", 5, 3)
    assert kept == [[0, 1, 2]] and count.tolist() == [3]
    # top_k 5 ends inside the tie of the two zeros (3 and 5): 3 is kept.
    kept, _, _ = run(q, w, store("f32", rows), "f32", 5, 5)
    assert kept == [[0, 1, 2, 3, 4]]


def test_a_short_sequence_keeps_every_position_in_order():
    rng = np.random.default_rng(5)
    stored = store("f32", rng.standard_normal((8, WIDTH)).astype(np.float32))
    q = rng.standard_normal((8, N_HEAD * HEAD)).astype(np.float32)
    w = rng.standard_normal((8, N_HEAD)).astype(np.float32)
    kept, positions, count = run(q, w, stored, "f32", 0, 8)
    assert kept == [list(range(t + 1)) for t in range(8)]
    assert (positions[0, 1:] == -1).all() and count.tolist() == list(range(1, 9))


@pytest.mark.parametrize("kind", TYPES)
def test_mla_attention_over_a_selection(kind):
    rng = np.random.default_rng(6)
    n_head, n, pos0, k = 4, 40, 30, 6
    width = N_LORA + N_ROT
    stored = store(kind, rng.standard_normal((n, width)).astype(np.float32))
    latent = np.stack([quants.dequantize(r, GGML[kind]).reshape(width) for r in stored]).astype(np.float64)
    q_abs = rng.standard_normal((n - pos0, n_head * width)).astype(np.float32)
    # Every position selected: dense attention, bit for bit.
    every = np.tile(np.arange(n, dtype=np.int32), (n - pos0, 1))
    count = np.arange(pos0 + 1, n + 1, dtype=np.int32)
    dense = _internal.mla_attention(q_abs, stored, kind, pos0, n_head, N_LORA, N_ROT, 0.1, threads=2)
    np.testing.assert_array_equal(
        _internal.mla_attention(q_abs, stored, kind, pos0, n_head, N_LORA, N_ROT, 0.1, threads=2, positions=every,
                                count=count),
        dense,
    )
    # k positions per query: attention over those rows only.
    chosen = np.stack([np.sort(rng.choice(pos0 + t + 1, k, replace=False)) for t in range(n - pos0)]).astype(np.int32)
    got = _internal.mla_attention(q_abs, stored, kind, pos0, n_head, N_LORA, N_ROT, 0.1, threads=2, positions=chosen,
                                  count=np.full(n - pos0, k, np.int32))
    for t in range(n - pos0):
        want = mla_attention_model(q_abs[t : t + 1], latent[chosen[t]], k - 1, n_head, N_LORA, N_ROT, 0.1)
        assert np.abs(got[t] - want[0]).max() / np.abs(want).max() < 1e-5, t
    with pytest.raises(InvalidArgument, match="not causal"):
        _internal.mla_attention(q_abs, stored, kind, pos0, n_head, N_LORA, N_ROT, 0.1, positions=chosen + 40,
                                count=np.full(n - pos0, k, np.int32))
