"""Drive an inference engine session through the three paths users hit, and hold each to an oracle:
  prefill      all positions of a prompt in one decode(all_logits=True) call,
  stepwise     the same prompt one token per decode() call (the KV-cache path), after reset(),
  greedy       prefill, then n_new greedy tokens, each decoded on its own.

The engine is reached only through `open_session(dump_activations: bool)`, a callable returning an
object with decode(tokens, all_logits) -> float32 logits, reset() and dump() -> {name: array}; this
module never imports sharpi, so the reference package stays independent of what it checks. The
oracle is `expected_for(tokens) -> ForwardResult` (the numpy reference, or HF logits and routing).

On a mismatch a second session with dump_activations=True is opened to read the engine's expert
choice ("ffn_moe_topk-<layer>" if recorded, else the top-k of "ffn_moe_probs-<layer>") and its named
activations, so the failure message says whether a router near-tie explains it (compare.py) and
where the computation first diverges.
"""

from __future__ import annotations

import numpy as np

from .compare import assert_greedy_match, assert_logits_match, first_divergent_activation


def greedy_logits(session, prompt, n_decode: int) -> np.ndarray:
    """All-position logits of the prompt (one prefill call), then n_decode greedy tokens decoded one
    by one: [len(prompt) + n_decode, n_vocab]. Two engines (or one engine in two configurations) that
    must agree bit for bit are compared on this."""
    rows = [session.decode(prompt, all_logits=True)]
    token = int(np.argmax(rows[0][-1]))
    for _ in range(n_decode):
        logits = session.decode([token])
        rows.append(logits[None, :])
        token = int(np.argmax(logits))
    return np.concatenate(rows)


def _rows(logits, n_rows: int) -> np.ndarray:
    return np.asarray(logits, dtype=np.float64).reshape(n_rows, -1)


def _router_scores_from_dumps(dumps: list, n_layer: int):
    """Per layer, [n_tokens, n_expert] scores whose top-k is the engine's expert choice, stacked over
    the decode() calls in dumps. Taken from the selected ids ("ffn_moe_topk-<layer>", [n_tokens, k])
    when the engine records them: they show a selection bug even where the probabilities are right.
    Otherwise from the router probabilities ("ffn_moe_probs-<layer>"). None if neither is recorded
    (mismatches are then reported without that help)."""
    scores = []
    # The MoE layers in order (deepseek2's leading dense layers record no router): the first n_layer.
    moe_layers = sorted(int(key.rsplit("-", 1)[1]) for key in dumps[0] if key.startswith("ffn_moe_probs-"))
    for il in moe_layers[:n_layer]:
        probs_key, topk_key = f"ffn_moe_probs-{il}", f"ffn_moe_topk-{il}"
        if not all(probs_key in d for d in dumps):
            return None
        per_call = []
        for d in dumps:
            probs = np.asarray(d[probs_key], dtype=np.float64)
            probs = probs.reshape(-1, probs.shape[-1])
            if topk_key in d:
                # 1 for the selected experts, 0 elsewhere: their top-k is exactly the selection.
                ids = np.asarray(d[topk_key]).reshape(probs.shape[0], -1).astype(np.int64)
                chosen = np.zeros_like(probs)
                np.put_along_axis(chosen, ids, 1.0, axis=1)
                per_call.append(chosen)
            else:
                per_call.append(probs)
        scores.append(np.concatenate(per_call))
    return scores or None


def prefill_router_scores(open_session, tokens, n_moe_layers: int):
    session = open_session(True)
    session.decode(list(tokens), True)
    return _router_scores_from_dumps([session.dump()], n_moe_layers)


def stepwise_router_scores(open_session, tokens, n_moe_layers: int):
    session = open_session(True)
    dumps = []
    for token in tokens:
        session.decode([int(token)], True)
        dumps.append(session.dump())
    return _router_scores_from_dumps(dumps, n_moe_layers)


def _activation_report(open_session, tokens, expected, budget):
    session = open_session(True)
    session.decode(list(tokens), True)
    return first_divergent_activation(session.dump(), expected, budget)


def check_prefill_and_stepwise(open_session, prompt, expected, budget: float, what: str, n_expert_used: int):
    """One session: prefill must match the oracle at every position; then reset() and token-by-token
    decoding of the same prompt must match too (which also proves reset() forgets the KV cache)."""
    prompt = [int(t) for t in prompt]
    n_moe_layers = len(expected.router_logits)
    session = open_session(False)

    prefill = _rows(session.decode(prompt, True), len(prompt))
    assert_logits_match(
        prefill,
        expected,
        budget,
        f"{what} prefill",
        n_expert_used,
        actual_router_scores=lambda: prefill_router_scores(open_session, prompt, n_moe_layers),
        diagnose=lambda: _activation_report(open_session, prompt, expected, budget),
    )

    session.reset()
    stepwise = np.stack([_rows(session.decode([t], True), 1)[0] for t in prompt])
    assert_logits_match(
        stepwise,
        expected,
        budget,
        f"{what} token-by-token",
        n_expert_used,
        actual_router_scores=lambda: stepwise_router_scores(open_session, prompt, n_moe_layers),
    )


def check_greedy(
    open_session, prompt, expected_for, n_new: int, budget: float, what: str, n_expert_used: int
):
    """Greedy decoding: the engine's n_new tokens must be the oracle's greedy tokens, and the logits
    it chose each one from (prefill's last row, then one decode per token) must match the oracle's
    at those positions. Returns the generated tokens."""
    prompt = [int(t) for t in prompt]
    session = open_session(False)
    logits = _rows(session.decode(prompt, False), 1)[0]
    tokens, rows = [], []
    for step in range(n_new):
        rows.append(logits)
        tokens.append(int(np.argmax(logits)))
        if step + 1 < n_new:
            logits = _rows(session.decode([tokens[-1]], False), 1)[0]

    sequence = prompt + tokens
    expected = expected_for(sequence)
    n_moe_layers = len(expected.router_logits)
    positions = np.arange(len(prompt) - 1, len(prompt) - 1 + n_new)
    flip = assert_logits_match(
        np.stack(rows),
        expected,
        budget,
        f"{what} greedy-decode logits",
        n_expert_used,
        actual_router_scores=lambda: stepwise_router_scores(open_session, sequence, n_moe_layers),
        positions=positions,
    )
    # After an accepted router near-tie flip at position p the sequences may legitimately part:
    # compare only the tokens chosen from positions before p.
    n_comparable = n_new if flip is None else max(0, flip.position - (len(prompt) - 1))
    assert_greedy_match(tokens[:n_comparable], expected.logits, len(prompt), f"{what} greedy tokens")
    return tokens


def session_opener(path, **options):
    """open_session for check_streams_like_resident: sharpi.Session(path, **options), under
    ram_budget unless it is None (resident)."""
    import sharpi

    def open_session(ram_budget):
        budget = {} if ram_budget is None else {"ram_budget": ram_budget}
        return sharpi.Session(path, **options, **budget)

    return open_session


def check_streams_like_resident(open_session, prompt, n_decode: int, what: str):
    """The lossless invariant at a quarter budget: with RAM for a quarter of all experts (at least
    top-k), the streamed engine's logits (greedy_logits) are bit-identical to the resident engine's,
    and the budget really forced expert reads and evictions. open_session(ram_budget) opens the
    engine, resident when ram_budget is None; it must have expert_stats() (fixed_bytes, slot_bytes,
    n_slots, per-layer misses and evictions) and info (n_layer, n_expert, n_expert_used) as
    sharpi.Session has. The budget is sized with the fixed bytes of a session opened the same way,
    so the slot count is exact (e.g. exact mode's f32 KV cache charges more fixed bytes)."""
    probe = open_session("4GiB")
    stats, info = probe.expert_stats(), probe.info
    total = info["n_layer"] * info["n_expert"]
    n_slots = max(info["n_expert_used"], total // 4)
    resident = greedy_logits(open_session(None), prompt, n_decode)
    streamed_session = open_session(stats["fixed_bytes"] + n_slots * stats["slot_bytes"])
    assert streamed_session.expert_stats()["n_slots"] == n_slots, what
    streamed = greedy_logits(streamed_session, prompt, n_decode)
    np.testing.assert_array_equal(streamed, resident, err_msg=f"{what}: streamed vs resident")
    layers = streamed_session.expert_stats()["layers"]
    misses = sum(layer["misses"] for layer in layers)
    assert misses > total // 4, f"{what}: a quarter budget must force reads ({misses} misses)"
    evictions = sum(layer["evictions"] for layer in layers)
    assert evictions > 0, f"{what}: a quarter budget must force evictions ({misses} misses, none evicted)"


def check_exact_file_against_reference(path, threads: int, seed: int, what: str, budget: float = 1e-4):
    """A file in exact mode against the float64 numpy reference on its own dequantized weights:
    prefill, token by token and 16 greedy tokens of a 12-token random prompt (seeded)."""
    import sharpi

    from . import hf_export
    from .numpy_forward import ReferenceModel, forward

    ref = ReferenceModel(path)
    hp = ref.hparams
    prompt = hf_export.random_prompt(hp.n_vocab, 12, seed=seed)

    def open_session(dump_activations):
        return sharpi.Session(path, threads=threads, n_ctx=0, exact=True, dump_activations=dump_activations)

    check_prefill_and_stepwise(open_session, prompt, forward(ref, prompt), budget, what, hp.n_expert_used)
    check_greedy(open_session, prompt, lambda tokens: forward(ref, tokens), 16, budget, what, hp.n_expert_used)
