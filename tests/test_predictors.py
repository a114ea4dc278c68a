"""Predictive prefetch in the engine (issue 4, docs/predictors.md).

The oracle for losslessness is the resident engine: with any predictor, lookahead and budget the
streamed engine must give exactly its tokens and bit-identical logits. Prediction metrics are
checked against the routing the engine itself reports (Session.last_routing), which is tied to the
numpy reference and transformers elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest
import sharpi
from model_files import rewrite_gguf
from reader_policy import uring_unavailable
from sharpi import _core, _internal
from sharpi.make_model import write_model
from test_streaming import run_tokens  # prompt logits, then greedy token-by-token logits

N_LAYER = 5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("predictor_models")
    out = {}
    for arch in ("qwen3moe", "qwen2moe", "olmoe"):
        path = str(d / f"{arch}.gguf")
        write_model(path, arch=arch, preset="tiny", quant="q4_k_m", seed=5, n_layer=N_LAYER)
        out[arch] = path
    # A model that ships pre-gate weights (docs/predictors.md): blk.N.ffn_pregate_inp.weight for
    # N = 0..n_layer-2, here a perturbed copy of layer N+1's router.
    from gguf import GGUFReader
    from gguf.quants import dequantize

    src = out["qwen3moe"]
    reader = GGUFReader(src)
    routers = {t.name: dequantize(t.data, t.tensor_type).reshape(t.shape[::-1].tolist()) for t in reader.tensors
               if t.name.endswith("ffn_gate_inp.weight")}
    rng = np.random.default_rng(0)
    pregate = {}
    for n in range(N_LAYER - 1):
        w = routers[f"blk.{n + 1}.ffn_gate_inp.weight"].astype(np.float32)
        pregate[f"blk.{n}.ffn_pregate_inp.weight"] = w + 0.3 * np.std(w) * rng.standard_normal(w.shape).astype(np.float32)
    out["pregate"] = str(d / "pregate.gguf")
    rewrite_gguf(src, out["pregate"], add_tensors=pregate)
    return out


def plan(path: str):
    s = sharpi.Session(path, threads=1, n_ctx=128, ram_budget="4GiB", reader="pread")
    st = s.expert_stats()
    return st["fixed_bytes"], st["slot_bytes"], s.info["n_expert_used"]


PROMPT = list(range(40, 52))


def streamed(path, n_slots, lookahead, **kw):
    fixed, slot, k = plan(path)
    return sharpi.Session(path, threads=2, n_ctx=128, ram_budget=fixed + (n_slots + lookahead * k) * slot,
                          reader="pread", lookahead=lookahead, **kw)


class OraclePredictor(sharpi.Predictor):
    """Hints exactly the experts a recorded run selected (by position), and records its inputs."""

    def __init__(self, routing_by_step, k):
        self.routing = routing_by_step  # [step][layer] -> ids
        self.k = k
        self.step = 0
        self.calls = []

    def observe(self, layer, hidden, router_logits, history, prev):
        self.calls.append((layer, hidden.dtype, hidden.shape, router_logits.dtype, router_logits.shape,
                           history.dtype, history.shape, prev.shape, hidden.flags.writeable,
                           history.copy(), prev.copy(), float(np.abs(hidden).sum())))
        step_routing = self.routing[self.step] if self.step < len(self.routing) else None
        if layer == len(step_routing) - 1:
            self.step += 1
        if step_routing is None or layer + 1 >= len(step_routing):
            return []
        return [(layer + 1, int(e), 1.0) for e in step_routing[layer + 1]]


def recorded_routing(path, n_decode):
    """Per decoded step, the experts each layer selected (resident run)."""
    s = sharpi.Session(path, threads=1, n_ctx=128)
    logits = s.decode(PROMPT)
    steps = []
    for _ in range(n_decode):
        logits = s.decode([int(np.argmax(logits))])
        steps.append([r[0].tolist() for r in s.last_routing()])
    return steps


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "olmoe"])
@pytest.mark.parametrize("predictor", ["prev_token", "next_gate"])
@pytest.mark.parametrize("lookahead", [1, 2, 3])
@pytest.mark.parametrize("sizing", ["topk", "bytes"])
def test_builtin_predictors_are_lossless(models, arch, predictor, lookahead, sizing):
    path = models[arch]
    resident = run_tokens(sharpi.Session(path, threads=2, n_ctx=128), PROMPT, 20)
    _, _, k = plan(path)
    for n_slots in (k, 3 * k):
        s = streamed(path, n_slots, lookahead, predictor=predictor, prefetch_sizing=sizing)
        np.testing.assert_array_equal(run_tokens(s, PROMPT, 20), resident,
                                      err_msg=f"{predictor} {sizing} {n_slots}")
        st = s.expert_stats()
        assert st["n_staging"] == lookahead * k
        layers = st["layers"]
        # Every decoded token scores one prediction set per (target layer, distance) it was made for.
        n_sets = sum(lay["predictions"] for lay in layers)
        expected_per_token = sum(min(lookahead, t) for t in range(1, N_LAYER))
        if predictor == "next_gate" and sizing == "topk":
            assert n_sets == 20 * expected_per_token
        assert n_sets <= 20 * expected_per_token  # "bytes": a set with no p > 1/2 is not made
        assert st["predictor_calls"] == 20 * N_LAYER
        assert sum(lay["hints_dropped"] for lay in layers) == 0
        issued = sum(lay["prefetch_issued"] for lay in layers)
        used = sum(lay["prefetch_used"] for lay in layers)
        assert used <= issued and used == sum(lay["prefetch_timely"] + lay["prefetch_late"] for lay in layers)
        if n_slots == k and (sizing == "topk" or predictor == "prev_token"):  # ranks: p = 1 for the first
            assert issued > 0


def test_pregate_predictor_is_lossless_and_predicts_one_layer(models):
    path = models["pregate"]
    resident = run_tokens(sharpi.Session(path, threads=2, n_ctx=128), PROMPT, 20)
    _, _, k = plan(path)
    s = streamed(path, k, 1, predictor="pregate")
    np.testing.assert_array_equal(run_tokens(s, PROMPT, 20), resident)
    layers = s.expert_stats()["layers"]
    assert [lay["predictions"] for lay in layers] == [0] + [20] * (N_LAYER - 1)
    # The pre-gate is a noisy copy of the next router: clearly better than chance (k / n_expert).
    recall = sum(lay["predicted_correct"] for lay in layers) / (20 * (N_LAYER - 1) * k)
    assert recall > 0.5
    with pytest.raises(sharpi.InvalidArgument, match="no pre-gate tensors"):
        streamed(models["qwen3moe"], k, 1, predictor="pregate")


def test_next_gate_metrics_match_the_engines_routing(models):
    # Recall and precision recomputed here from what next_gate must predict (layer t's router on
    # ffn_norm_t of layer t-1's residual, via the numpy dump of the same run) and what was selected.
    path = models["qwen3moe"]
    _, _, k = plan(path)
    s = streamed(path, k, 1, predictor="next_gate", dump_activations=True)
    s.decode(PROMPT)
    from gguf import GGUFReader
    from gguf.quants import dequantize

    r = GGUFReader(path)
    w = {t.name: dequantize(t.data, t.tensor_type).reshape(t.shape[::-1].tolist()).astype(np.float64)
         for t in r.tensors if "ffn_gate_inp" in t.name or "ffn_norm" in t.name}
    eps = float(r.fields["qwen3moe.attention.layer_norm_rms_epsilon"].contents())
    logits = s.decode([7])
    s.reset_stats()
    correct = 0
    for _ in range(8):
        token = int(np.argmax(logits))
        logits = s.decode([token])
        dump = s.dump()
        sel = [set(x[0].tolist()) for x in s.last_routing()]
        for t in range(1, N_LAYER):
            h = dump[f"ffn_inp-{t - 1}"][0].astype(np.float64)
            x = h / np.sqrt(np.mean(h * h) + eps) * w[f"blk.{t}.ffn_norm.weight"]
            scores = w[f"blk.{t}.ffn_gate_inp.weight"] @ x
            order = np.argsort(-scores, kind="stable")
            if scores[order[k - 1]] - scores[order[k]] < 1e-4:
                pytest.skip("near-tie in the numpy scores")
            correct += len(set(order[:k].tolist()) & sel[t])
    layers = s.expert_stats()["layers"]
    assert sum(lay["predictions"] for lay in layers) == 8 * (N_LAYER - 1)
    assert sum(lay["predicted_correct"] for lay in layers) == correct
    assert sum(lay["predicted_experts"] for lay in layers) == 8 * (N_LAYER - 1) * k


def test_python_plugin_gets_documented_inputs_and_its_hints_drive_reads(models):
    path = models["olmoe"]
    _, _, k = plan(path)
    info = sharpi.Session(path, threads=1, n_ctx=16).info
    n_decode = 12
    routing = recorded_routing(path, n_decode)
    resident = run_tokens(sharpi.Session(path, threads=2, n_ctx=128), PROMPT, n_decode)

    oracle = OraclePredictor(routing, k)
    s = streamed(path, k, 1, predictor=oracle)
    np.testing.assert_array_equal(run_tokens(s, PROMPT, n_decode), resident)
    assert len(oracle.calls) == n_decode * N_LAYER  # decoded tokens only, never the prompt batch
    for i, (layer, hd, hs, ld, ls, histd, hists, prevs, writeable, hist, prev, hsum) in enumerate(oracle.calls):
        assert layer == i % N_LAYER
        assert (hd, hs, ld, ls) == (np.float32, (info["n_embd"],), np.float32, (info["n_expert"],))
        assert (histd, hists, prevs) == (np.int32, (N_LAYER, k), (N_LAYER, k))
        assert not writeable and hsum > 0
        step = i // N_LAYER
        # history: this token's selections up to `layer`, -1 after; prev: the previous token's.
        np.testing.assert_array_equal(np.sort(hist[: layer + 1], axis=1), np.sort(routing[step][: layer + 1], axis=1))
        assert (hist[layer + 1:] == -1).all()
        if step > 0:
            np.testing.assert_array_equal(np.sort(prev, axis=1), np.sort(routing[step - 1], axis=1))
    layers = s.expert_stats()["layers"]
    issued = sum(lay["prefetch_issued"] for lay in layers)
    used = sum(lay["prefetch_used"] for lay in layers)
    # A perfect predictor: every prediction set is exactly right, and every issued read is used.
    assert sum(lay["predicted_correct"] for lay in layers) == n_decode * (N_LAYER - 1) * k
    assert issued > 0 and used == issued
    assert sum(lay["prefetch_wasted_bytes"] for lay in layers) == 0

    # The same run with a predictor that hints nothing reads nothing early: hints change the reads.
    class Silent(sharpi.Predictor):
        def observe(self, layer, hidden, router_logits, history, prev):
            return None

    s2 = streamed(path, k, 1, predictor=Silent())
    np.testing.assert_array_equal(run_tokens(s2, PROMPT, n_decode), resident)
    layers2 = s2.expert_stats()["layers"]
    assert sum(lay["prefetch_issued"] for lay in layers2) == 0
    assert sum(lay["misses"] for lay in layers2) > sum(lay["misses"] for lay in layers)


def test_failing_or_wrong_plugins_lose_hints_not_tokens(models):
    path = models["qwen3moe"]
    _, _, k = plan(path)
    resident = run_tokens(sharpi.Session(path, threads=2, n_ctx=128), PROMPT, 10)

    class Raises(sharpi.Predictor):
        def observe(self, layer, hidden, router_logits, history, prev):
            if layer == 2:
                raise RuntimeError("boom at two")
            return [(layer + 1, 0, 1.0)] if layer + 1 < N_LAYER else []

    class OutOfRange(sharpi.Predictor):
        def observe(self, layer, hidden, router_logits, history, prev):
            return [(layer + 1, 999, 1.0), (layer, 0, 1.0), (layer + 5, 1, 1.0), (layer + 1, -3, 1.0),
                    (layer + 1, 1.5, 1.0)]

    class BadShape(sharpi.Predictor):
        def observe(self, layer, hidden, router_logits, history, prev):
            return [[1, 2]]

    class Mutates(sharpi.Predictor):
        def observe(self, layer, hidden, router_logits, history, prev):
            hidden[0] = 1e9  # read-only view: raises, never corrupts the engine

    for plugin, dropped_per_call in ((Raises(), None), (OutOfRange(), 5), (BadShape(), None), (Mutates(), None)):
        s = streamed(path, k, 2, predictor=plugin)
        np.testing.assert_array_equal(run_tokens(s, PROMPT, 10), resident, err_msg=type(plugin).__name__)
        st = s.expert_stats()
        dropped = sum(lay["hints_dropped"] for lay in st["layers"])
        if dropped_per_call is not None:
            assert dropped == dropped_per_call * 10 * N_LAYER
            assert st["predictor_failures"] == 0
        else:
            assert st["predictor_failures"] > 0 and dropped == st["predictor_failures"]
            errors = s.predictor_errors()
            assert errors and type(plugin).__name__ in errors[-1]


class ContextRecorder(sharpi.Predictor):
    """Hints nothing; records every observe_context call and each token's complete selections as
    observe() sees them at the last layer."""

    def __init__(self):
        self.contexts = []  # (selections [n, n_layer, top_k], new_sequence)
        self.tokens = []  # [n_layer, top_k] per token observe() saw

    def observe(self, layer, hidden, router_logits, history, prev):
        if layer == N_LAYER - 1:
            self.tokens.append(history.copy())

    def observe_context(self, selections, new_sequence):
        assert selections.dtype == np.int32 and not selections.flags.writeable
        self.contexts.append((selections.copy(), new_sequence))


def test_plugin_observe_context_gets_a_prompt_as_if_decoded_alone(models):
    """A plug-in's observe_context receives a batched prompt's tokens (all but the last) with exactly
    the selections observe() reports when the same tokens are decoded one at a time (the engine's
    batch path against its single-token path). A later turn's batch is led by the token decoded
    before it; reset() starts a new sequence and truncate() rewinds it (the kept tokens are handed
    over again). A method that raises costs nothing but its error message."""
    path = models["qwen3moe"]
    _, _, k = plan(path)
    second, third = [7, 8, 9, 10, 11], [20, 21, 22]
    alone = ContextRecorder()
    s = streamed(path, k, 1, predictor=alone)
    for tok in PROMPT + [3] + second:
        s.decode([tok])
    assert alone.contexts == [] and len(alone.tokens) == len(PROMPT) + 1 + len(second)
    rows = np.stack(alone.tokens)
    assert (rows >= 0).all()

    batched = ContextRecorder()
    s = streamed(path, k, 1, predictor=batched)
    s.decode(PROMPT)
    s.decode([3])
    s.decode(second)
    n = len(PROMPT)
    assert [new for _, new in batched.contexts] == [True, False]
    np.testing.assert_array_equal(batched.contexts[0][0], rows[: n - 1])
    np.testing.assert_array_equal(batched.contexts[1][0], rows[n : n + len(second)])  # token 3 leads
    np.testing.assert_array_equal(np.stack(batched.tokens), rows[n : n + 1])

    # truncate() rewinds the history: a single token after it gets the kept tokens but the last
    # (its `prev`), a batch all of them and then its own; reset() starts from nothing.
    s.truncate(n)
    s.decode([3])
    assert batched.contexts[2][1] is True
    np.testing.assert_array_equal(batched.contexts[2][0], rows[: n - 1])
    np.testing.assert_array_equal(batched.tokens[-1], rows[n])  # the same token at the same position
    s.truncate(n)
    s.decode(third)
    assert batched.contexts[3][1] is True and batched.contexts[3][0].shape == (n + len(third) - 1, N_LAYER, k)
    np.testing.assert_array_equal(batched.contexts[3][0][:n], rows[:n])
    s.reset()
    s.decode(third)
    assert batched.contexts[4][1] is True and batched.contexts[4][0].shape == (len(third) - 1, N_LAYER, k)
    assert len(batched.contexts) == 5 and s.predictor_errors() == []

    class RaisesOnContext(ContextRecorder):
        def observe_context(self, selections, new_sequence):
            raise ValueError(f"context of {len(selections)}")

    resident = run_tokens(sharpi.Session(path, threads=2, n_ctx=128), PROMPT, 6)
    s = streamed(path, k, 1, predictor=RaisesOnContext())
    np.testing.assert_array_equal(run_tokens(s, PROMPT, 6), resident)
    errors = s.predictor_errors()
    assert len(errors) == 1 and "RaisesOnContext on the context of a batch" in errors[0]
    assert f"ValueError: context of {len(PROMPT) - 1}" in errors[0]
    assert s.expert_stats()["predictor_failures"] == 1


def test_raising_plugin_message_is_kept(models):
    path = models["qwen3moe"]
    _, _, k = plan(path)

    class Raises(sharpi.Predictor):
        def observe(self, layer, hidden, router_logits, history, prev):
            raise ValueError(f"boom at layer {layer}")

    s = streamed(path, k, 1, predictor=Raises())
    s.decode(PROMPT)
    assert s.predictor_errors() == []  # prompt batches call no predictor
    s.decode([3])
    errors = s.predictor_errors()
    assert len(errors) == N_LAYER
    assert "Raises at layer 0" in errors[0] and "ValueError: boom at layer 0" in errors[0]


def test_predictor_argument_errors(models):
    path = models["qwen3moe"]
    _, _, k = plan(path)
    with pytest.raises(sharpi.InvalidArgument, match="needs a RAM budget"):
        sharpi.Session(path, n_ctx=64, predictor="prev_token")
    with pytest.raises(sharpi.InvalidArgument, match="unknown predictor 'psychic'"):
        streamed(path, k, 1, predictor="psychic")
    for name in ("cooc", "learned", "trajectory"):
        with pytest.raises(sharpi.InvalidArgument, match="needs a predictor file"):
            streamed(path, k, 1, predictor=name)
    with pytest.raises(sharpi.InvalidArgument, match="takes no predictor file"):
        streamed(path, k, 1, predictor="next_gate:/tmp/x.gguf")
    for bad in (0, 4):
        with pytest.raises(sharpi.InvalidArgument, match="lookahead must be 1, 2 or 3"):
            sharpi.Session(path, n_ctx=128, ram_budget="1GiB", predictor="next_gate", lookahead=bad)
    with pytest.raises(sharpi.InvalidArgument, match="observe"):
        streamed(path, k, 1, predictor="custom")._core.set_predictor(object())
    s = streamed(path, k, 1, predictor="next_gate")
    with pytest.raises(sharpi.InvalidArgument, match="custom"):
        s._core.set_predictor(sharpi.Predictor())
    with pytest.raises(sharpi.InvalidArgument, match="predictor must be a name"):
        streamed(path, k, 1, predictor=3)


def test_budget_counts_staging_slots(models):
    path = models["qwen3moe"]
    fixed, slot, k = plan(path)
    for lookahead in (1, 3):
        with pytest.raises(sharpi.InvalidArgument, match=rf"\+{lookahead * k} staging"):
            sharpi.Session(path, n_ctx=128, ram_budget=fixed + (k + lookahead * k) * slot - 1, predictor="next_gate",
                           lookahead=lookahead)
        s = sharpi.Session(path, n_ctx=128, ram_budget=fixed + (k + lookahead * k) * slot, predictor="next_gate",
                           lookahead=lookahead)
        assert (s.expert_stats()["n_slots"], s.expert_stats()["n_staging"]) == (k, lookahead * k)


# ------------------------------------------------------------------------------------------------
# Trained sidecar predictors end to end: harvest a trace from the model, train each kind on it
# (sharpi.predict.train), stream with it. The oracle is still the resident engine.


@pytest.fixture(scope="module")
def sidecars(models, tmp_path_factory):
    from sharpi.harvest import harvest
    from sharpi.predict import train
    from sharpi.predict.sidecar import write_sidecar
    from sharpi.predict.traces import load_trace

    d = tmp_path_factory.mktemp("sidecars")
    path = models["qwen3moe"]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 1000, 24).tolist() for _ in range(6)]
    harvest(path, prompts, str(d / "trace.npz"), hidden=True, threads=2)
    trace = load_trace(str(d / "trace.npz"))
    idx = np.arange(trace.n_tokens, dtype=np.int64)
    out = {"trace": str(d / "trace.npz")}
    kinds = {"cooc": lambda: train.train_cooc(trace, idx, quiet=True)}
    try:
        import torch  # noqa: F401
        from sharpi.predict.reference import ModelRouters
        from sharpi.predict.regression import train_depthtime

        kinds["depthtime"] = lambda: train_depthtime(trace, idx, epochs=2, quiet=True)
        # The gate feature: the model's routers on the trace's hidden states.
        routers = ModelRouters(path, trace.moe_layer_ids)
        kinds["depthtime_gate"] = lambda: train_depthtime(trace, idx, epochs=2, quiet=True, routers=routers)
        kinds["learned"] = lambda: train.train_learned(trace, idx, epochs=3, rank=8, hidden=16, quiet=True)
        kinds["trajectory"] = lambda: train.train_trajectory(trace, idx, epochs=1, d_model=32, d_ff=64, quiet=True)
    except ImportError:
        pass  # torch is the optional extra the neural predictors train with; cooc still runs
    for kind, fit in kinds.items():
        out[kind] = str(d / f"{kind}.gguf")
        write_sidecar(out[kind], fit())
    return out


@pytest.mark.parametrize("kind", ["cooc", "depthtime", "depthtime_gate", "learned", "trajectory"])
@pytest.mark.parametrize("sizing", ["topk", "bytes"])
def test_trained_sidecar_predictors_are_lossless(models, sidecars, kind, sizing):
    if kind not in sidecars:
        pytest.skip("torch (the optional extra) is not installed: cannot train " + kind)
    path = models["qwen3moe"]
    resident = run_tokens(sharpi.Session(path, threads=2, n_ctx=128), PROMPT, 16)
    _, _, k = plan(path)
    name = kind.removesuffix("_gate")
    if name == "depthtime":
        from sharpi.predict.sidecar import read_sidecar

        sc = read_sidecar(sidecars[kind])
        stack = sc.tensors["dt.stack"]
        # 33 features, the 9 pool votes (the pool: every training token but the stacker's), 2 gate features
        assert sc.params["depthtime.pool"] > 0 and sc.tensors["dt.pool"].shape[0] == sc.params["depthtime.pool"]
        assert stack.shape[-1] == 33 + 9 + 2 * (kind == "depthtime_gate")
        assert np.count_nonzero(stack[..., 33:42]) > 0, "the stacker weighs the pool votes"
        if kind == "depthtime_gate":
            assert np.count_nonzero(stack[..., -2:]) > 0, "the stacker weighs the gate"
    for lookahead in (1, 2, 3):
        s = streamed(path, k, lookahead, predictor=f"{name}:{sidecars[kind]}", prefetch_sizing=sizing)
        np.testing.assert_array_equal(run_tokens(s, PROMPT, 16), resident, err_msg=f"{kind} {sizing} d={lookahead}")
        layers = s.expert_stats()["layers"]
        n_sets = sum(lay["predictions"] for lay in layers)
        if sizing == "topk":
            assert n_sets == 16 * sum(min(lookahead, t) for t in range(1, N_LAYER))
        assert sum(lay["hints_dropped"] for lay in layers) == 0
        if sizing == "topk":
            assert sum(lay["prefetch_issued"] for lay in layers) > 0


def test_a_batched_prompt_reaches_the_predictor_as_history(models, sidecars):
    """depthtime's time features (votes, decayed counts) cover the prompt: decoding a prompt as one
    batch and then token by token predicts exactly what decoding every prompt token alone does (the
    batch's tokens reach the predictor through observe_context). A second turn's batch carries the
    token decoded before it. Compared through the engine's own prediction counters."""
    if "depthtime" not in sidecars:
        pytest.skip("torch (the optional extra) is not installed: cannot train depthtime")
    path = models["qwen3moe"]
    _, _, k = plan(path)

    def run(batched):
        s = streamed(path, k, 2, predictor=f"depthtime:{sidecars['depthtime']}")
        counters = []
        for prompt in (PROMPT, [7, 8, 9, 10, 11]):
            if batched:
                s.decode(prompt)
            else:
                for tok in prompt:
                    s.decode([tok])
            s.reset_stats()
            tokens = [int(np.argmax(s.decode([3])))]
            for _ in range(8):
                tokens.append(int(np.argmax(s.decode([tokens[-1]]))))
            layers = s.expert_stats()["layers"]
            counters.append([(lay["predictions"], lay["predicted_experts"], lay["predicted_correct"]) for lay in layers])
        return counters

    batched, alone = run(True), run(False)
    assert batched == alone
    assert sum(c for turn in batched for _, _, c in turn) > 0


def test_truncate_rewinds_the_predictor_history(models, sidecars):
    """After truncate(n_keep) depthtime predicts exactly what a session that only ever decoded the
    kept tokens predicts (its votes, decayed counts and frequencies cover the kept prefix, not the
    dropped tokens and not nothing), for a single token and for a batch after the truncate.
    Compared through the engine's prediction counters."""
    if "depthtime" not in sidecars:
        pytest.skip("torch (the optional extra) is not installed: cannot train depthtime")
    path = models["qwen3moe"]
    _, _, k = plan(path)
    dropped, follow = [30, 31, 32, 33, 34, 35], [[3], [7, 8, 9, 10]]

    def counters(s, first):
        s.reset_stats()
        tokens = [int(np.argmax(s.decode(first)))]
        for _ in range(8):
            tokens.append(int(np.argmax(s.decode([tokens[-1]]))))
        return tokens, [(lay["predictions"], lay["predicted_experts"], lay["predicted_correct"])
                        for lay in s.expert_stats()["layers"]]

    for first in follow:
        rewound = streamed(path, k, 2, predictor=f"depthtime:{sidecars['depthtime']}")
        rewound.decode(PROMPT)
        for tok in dropped:
            rewound.decode([tok])
        rewound.truncate(len(PROMPT))
        fresh = streamed(path, k, 2, predictor=f"depthtime:{sidecars['depthtime']}")
        fresh.decode(PROMPT)
        got, want = counters(rewound, first), counters(fresh, first)
        assert got == want, first
        assert sum(c for _, _, c in want[1]) > 0


def test_a_failed_single_token_decode_leaves_nothing_in_the_predictor(models, sidecars, monkeypatch):
    """A single-token decode that fails after the predictor saw its first gate (a read error at layer 0)
    appends nothing to the session, and must leave nothing in the predictor either: depthtime folds the
    previous token into its state at the first gate, so the retried token would fold it a second time.
    The engine hands the kept tokens over again at the next decode (as after truncate), so the retry
    predicts what a session where the read never failed predicts. Compared through the prediction
    counters; the logits are the resident ones."""
    if "depthtime" not in sidecars:
        pytest.skip("torch (the optional extra) is not installed: cannot train depthtime")
    path = models["qwen3moe"]
    fixed, slot, k = plan(path)
    # Two tokens where the second selects an expert at layer 0 that the first does not: at the minimum
    # budget that expert's first read is the second token's demand read (predictions never target
    # layer 0, the first layer of a token).
    probe = sharpi.Session(path, threads=1, n_ctx=128, dump_activations=True)
    first = PROMPT[0]

    def layer0(tokens):
        probe.reset()
        for t in tokens:
            probe.decode([t])
        return set(probe.dump()["ffn_moe_topk-0"].astype(int).ravel().tolist())

    seen = layer0([first])
    second, expert = next((t, min(layer0([first, t]) - seen)) for t in range(1, 300) if layer0([first, t]) - seen)
    offset, _ = _core.GgufFile(path).expert_range("blk.0.ffn_gate_exps.weight", expert)
    resident = sharpi.Session(path, threads=2, n_ctx=128)

    def session(fault):
        if fault:
            monkeypatch.setenv("SHARPI_FAULT_URING_RES", f"EIO@{offset}")  # one completion, read at open
        try:
            s = sharpi.Session(path, threads=2, n_ctx=128, ram_budget=fixed + 3 * k * slot, reader="io_uring",
                               lookahead=2, predictor=f"depthtime:{sidecars['depthtime']}")
        except sharpi.UnsupportedError as e:
            uring_unavailable(str(e))
        monkeypatch.delenv("SHARPI_FAULT_URING_RES", raising=False)
        return s

    def counters(s):
        s.reset_stats()
        tokens, logits = [second], []
        for _ in range(8):
            logits.append(np.asarray(s.decode([tokens[-1]])))
            tokens.append(int(np.argmax(logits[-1])))
        return logits, [(lay["predictions"], lay["predicted_experts"], lay["predicted_correct"])
                        for lay in s.expert_stats()["layers"]]

    failed = session(fault=True)
    failed.decode([first])
    with pytest.raises(sharpi.IoError):
        failed.decode([second])
    assert failed.n_past == 1
    fresh = session(fault=False)
    fresh.decode([first])
    got, want = counters(failed), counters(fresh)
    assert got[1] == want[1]
    assert sum(c for _, _, c in want[1]) > 0
    resident.decode([first])
    for step, logits in enumerate(got[0]):
        np.testing.assert_array_equal(logits, want[0][step])
    np.testing.assert_array_equal(got[0][0], np.asarray(resident.decode([second])))


def test_sidecar_for_another_model_or_corrupt_is_a_clear_error(models, sidecars, tmp_path):
    k = plan(models["qwen3moe"])[2]
    other = models["olmoe"]  # same preset shape but a different architecture file: n_layer etc. match
    # A different shape: a 3-layer model.
    small = str(tmp_path / "small.gguf")
    write_model(small, arch="qwen3moe", preset="tiny", quant="q4_0", seed=1, n_layer=3)
    with pytest.raises(sharpi.InvalidArgument, match="n_layer"):
        streamed(small, k, 1, predictor=f"cooc:{sidecars['cooc']}")
    s = streamed(other, k, 1, predictor=f"cooc:{sidecars['cooc']}")  # shapes match: accepted
    assert s.expert_stats()["n_staging"] == k
    with open(sidecars["cooc"], "rb") as f:
        data = f.read()
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(data[: len(data) // 2])
    with pytest.raises(sharpi.FormatError):
        streamed(models["qwen3moe"], k, 1, predictor=f"cooc:{corrupt}")
    with pytest.raises(sharpi.InvalidArgument):
        streamed(models["qwen3moe"], k, 1, predictor=f"trajectory:{tmp_path / 'missing.gguf'}")
    with pytest.raises(sharpi.InvalidArgument, match="kind|cooc"):
        streamed(models["qwen3moe"], k, 1, predictor=f"trajectory:{sidecars['cooc']}")


def test_late_predictions_are_not_issued(models, monkeypatch):
    # Slow prefetch reads (the pread reader's test hook delays every prefetch-priority read by 20 ms)
    # make the measured bandwidth low: the scheduler must stop issuing reads that could only start
    # after their layer's gate, and issue them all when told not to skip. Tokens never change.
    path = models["olmoe"]
    _, _, k = plan(path)
    resident = run_tokens(sharpi.Session(path, threads=2, n_ctx=128), PROMPT, 12)
    monkeypatch.setenv("SHARPI_FAULT_PREFETCH_DELAY_US", "20000")
    skipped = {}
    for skip in (True, False):
        s = streamed(path, k, 2, predictor="next_gate", skip_late_prefetch=skip)
        np.testing.assert_array_equal(run_tokens(s, PROMPT, 12), resident)
        layers = s.expert_stats()["layers"]
        skipped[skip] = sum(lay["prefetch_skipped"] for lay in layers)
        issued = sum(lay["prefetch_issued"] for lay in layers)
        assert issued > 0
    assert skipped[True] > skipped[False]


def test_moe_tracing_end_to_end(models, tmp_path, monkeypatch, capsys):
    # Session(trace=DIR): the table goes to stderr, moe_trace.json and a Perfetto timeline to DIR, and
    # the JSON's counters are the engine's own (recall recomputed here from them).
    import json

    path = models["qwen3moe"]
    _, _, k = plan(path)
    out = tmp_path / "trace"
    s = streamed(path, k, 2, predictor="next_gate", trace=str(out))
    text = "".join(s.generate(list(range(5, 15)), max_tokens=12, temperature=0.0))
    assert isinstance(text, str)
    stats = s.expert_stats()
    summary = s.close()
    err = capsys.readouterr().err
    assert "recall@k" in err and "moe_trace.json" in err
    doc = json.loads((out / "moe_trace.json").read_text())
    events = json.loads((out / "moe_trace_timeline.json").read_text())
    assert any(e.get("ph") == "X" for e in (events["traceEvents"] if isinstance(events, dict) else events))
    for il, lay in enumerate(stats["layers"]):
        row = doc["layers"][il]
        assert row["predictions"] == lay["predictions"] and row["hits"] == lay["hits"]
        if lay["predictions"]:
            assert row["recall_at_k"] == pytest.approx(lay["predicted_correct"] / (lay["predictions"] * k))
    assert doc["requests"] and summary["total"]["hits"] == sum(lay["hits"] for lay in stats["layers"])
    assert s.close() is None  # once

    # SHARPI_TRACE_MOE=DIR does the same without code changes.
    env_dir = tmp_path / "env-trace"
    monkeypatch.setenv("SHARPI_TRACE_MOE", str(env_dir))
    s2 = streamed(path, k, 1, predictor="prev_token")
    s2.decode(PROMPT)
    s2.decode([3])
    s2.close()
    assert (env_dir / "moe_trace.json").is_file()


@pytest.fixture(scope="module")
def routing_rule_models(tmp_path_factory):
    """Three routers that do not rank experts by their plain logits: gpt-oss (a router bias),
    deepseek2 rewritten to DeepSeek-V3's rule (sigmoid scores plus a per-expert selection bias,
    8 experts in 4 groups of which the 2 best may be chosen), glm4moe (sigmoid scores plus a
    selection bias, no groups, post_attention_norm before the router) and minimax-m2 (sigmoid scores
    plus a selection bias, every layer MoE), each with 5 layers."""
    d = tmp_path_factory.mktemp("routing_rule_models")
    rng = np.random.default_rng(1)
    small_bias = str(d / "gpt-oss-small-bias.gguf")
    write_model(small_bias, arch="gpt-oss", preset="tiny", quant="q8_0", seed=9, n_layer=N_LAYER)

    def larger_router_bias(name, raw, ttype, shape):
        # make-model's router biases barely move the choice; a trained router's do.
        if not name.endswith("ffn_gate_inp.bias"):
            return None
        return rng.normal(0.0, 1.0, shape[0]).astype(np.float32).view(np.uint8), ttype, shape

    gpt_oss = str(d / "gpt-oss.gguf")
    rewrite_gguf(small_bias, gpt_oss, tensor_edit=larger_router_bias)
    v2 = str(d / "deepseek2-v2.gguf")
    write_model(v2, arch="deepseek2", preset="tiny", quant="q8_0", seed=9, n_layer=N_LAYER)
    # Selection biases as large as the sigmoid scores' spread, so the biased choice differs from
    # the unbiased one on most tokens (checked below).
    biases = {f"blk.{il}.exp_probs_b.bias": rng.uniform(-0.3, 0.3, 8).astype(np.float32) for il in range(1, N_LAYER)}
    v3 = str(d / "deepseek2-v3.gguf")
    rewrite_gguf(v2, v3, set_kv={"deepseek2.expert_gating_func": 2, "deepseek2.expert_group_count": 4,
                                 "deepseek2.expert_group_used_count": 2}, add_tensors=biases)
    glm_small_bias = str(d / "glm4moe-small-bias.gguf")
    write_model(glm_small_bias, arch="glm4moe", preset="tiny", quant="q8_0", seed=9, n_layer=N_LAYER)

    def larger_selection_bias(name, raw, ttype, shape):
        if not name.endswith("exp_probs_b.bias"):
            return None
        return rng.uniform(-0.3, 0.3, shape[0]).astype(np.float32).view(np.uint8), ttype, shape

    glm = str(d / "glm4moe.gguf")
    rewrite_gguf(glm_small_bias, glm, tensor_edit=larger_selection_bias)
    minimax_small_bias = str(d / "minimax-m2-small-bias.gguf")
    write_model(minimax_small_bias, arch="minimax-m2", preset="tiny", quant="q8_0", seed=9, n_layer=N_LAYER)
    minimax = str(d / "minimax-m2.gguf")
    rewrite_gguf(minimax_small_bias, minimax, tensor_edit=larger_selection_bias)
    return {"gpt-oss": gpt_oss, "deepseek-v3": v3, "glm4moe": glm, "minimax-m2": minimax}


@pytest.mark.parametrize("label", ["gpt-oss", "deepseek-v3", "glm4moe", "minimax-m2"])
def test_next_gate_ranks_experts_by_the_target_routers_rule(routing_rule_models, label):
    # next_gate's scores for layer t must rank experts as layer t's own routing rule does: the
    # router bias (gpt-oss: softmax top-k of logits + bias, so the biased logits themselves), and
    # sigmoid + selection bias with the group limit (V3: the float64 numpy reference's
    # select_experts, experts of groups it cannot choose at -inf). Router and norm weights are
    # dequantized by the gguf package; hidden states are fresh random vectors each run.
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from reference.numpy_forward import ReferenceModel, select_experts

    path = routing_rule_models[label]
    reader = GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())
    eps = float(reader.fields[f"{arch}.attention.layer_norm_rms_epsilon"].contents())
    w = {t.name: dequantize(t.data, t.tensor_type).reshape(t.shape[::-1].tolist()).astype(np.float64)
         for t in reader.tensors if "ffn_gate_inp" in t.name or "norm" in t.name}
    moe_layers = [il for il in range(N_LAYER) if f"blk.{il}.ffn_gate_inp.weight" in w]
    norm_name = "post_attention_norm" if arch in ("gpt-oss", "glm4moe") else "ffn_norm"
    ref = ReferenceModel(path) if arch in ("deepseek2", "glm4moe", "minimax-m2") else None
    info = sharpi.Session(path, threads=1, n_ctx=16).info
    n_embd, n_expert, k = info["n_embd"], info["n_expert"], info["n_expert_used"]
    handle = _internal.load_predictor("next_gate", "", path, 1)
    history = np.full((N_LAYER, k), -1, np.int32)
    rng = np.random.default_rng()
    n_checked = n_differs_from_logits = 0
    for _ in range(40):
        hidden = rng.standard_normal(n_embd).astype(np.float32)
        for t in (il for il in moe_layers if il - 1 in moe_layers):  # gate events come from MoE layers only
            got = handle.scores(t - 1, 1, hidden, np.zeros(n_expert, np.float32), history, history)
            h = hidden.astype(np.float64)
            x = h / np.sqrt(np.mean(h * h) + eps) * w[f"blk.{t}.{norm_name}.weight"]
            plain = w[f"blk.{t}.ffn_gate_inp.weight"] @ x
            router = plain + w.get(f"blk.{t}.ffn_gate_inp.bias", 0.0)
            if ref is None:
                want = router
            else:
                _, _, choice = select_experts(ref, t, router[None, :])
                want = np.where(choice[0] == -1e9, -np.inf, choice[0])  # select_experts writes -1e9 for -inf
            np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
            finite = np.isfinite(want)
            np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5 * np.abs(want[finite]).max())
            ranked = np.sort(want[finite])[::-1]
            if ranked[k - 1] - ranked[k] < 1e-4:
                continue  # near-tie: the f32 ranking may differ
            top = set(np.argsort(-got, kind="stable")[:k].tolist())
            assert top == set(np.argsort(-want, kind="stable")[:k].tolist())
            n_differs_from_logits += top != set(np.argsort(-plain, kind="stable")[:k].tolist())
            n_checked += 1
    assert n_checked >= 40
    # The models are built so that the rule matters: ranking by the plain router logits would miss.
    assert n_differs_from_logits > n_checked // 4, (n_differs_from_logits, n_checked)
