"""`sharpi trace` (sharpi.harvest) against independent oracles.

- The shipped stdlib-moe model against tests/data/stdlib_moe_trace.npz, which the training recipe
  (tools/train_moe, PyTorch on the shipped file's dequantized weights) recorded: same tokens in,
  the same experts, gate probabilities, router logits and hidden states must come out.
- Tiny random-weight models (f32) against the float64 numpy reference forward (tests/reference):
  router logits, selected experts, gate probabilities, the residual entering each MoE block and the
  greedy continuation, position by position. Random routers have near-ties; a selection may differ
  only where the reference's k-th / (k+1)-th router-logit gap is a rounding-level tie, and the
  comparison stops at the first such flip (everything after it legitimately diverges).
- Token strings against the prompt text itself (the bytes of the prompt's tokens are its UTF-8).
- Bad input: every error is typed and names the thing at fault.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
from reference.numpy_forward import ReferenceModel, forward, router_margins, softmax
from sharpi import _core
from sharpi.harvest import HIDDEN_KIND, add_trace_parser, harvest, read_prompts, run_trace_command
from sharpi.make_model import write_model

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "python" / "sharpi" / "models" / "stdlib-moe-q8_0.gguf"
RECORDED = REPO / "tests" / "data" / "stdlib_moe_trace.npz"

TIE_MARGIN = 1e-4  # router-logit gap below which f32 vs float64 may pick a different top-k


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("harvest-models")
    paths = {}
    for arch in ("qwen3moe", "qwen2moe", "olmoe", "llama", "qwen3"):
        path = root / f"tiny-{arch}.gguf"
        write_model(path, arch=arch, preset="tiny", quant="f32", seed=11)
        paths[arch] = str(path)
    return paths


def _load(path) -> dict:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def check_format(t: dict, hidden: bool) -> None:
    """The array names, dtypes and shapes of shared/traces/README.md (and the harvest extras)."""
    n_tok, n_layer, k = t["experts"].shape
    assert t["experts"].dtype == np.int16
    assert t["seq_start"].dtype == np.int64 and t["seq_start"][0] == 0
    assert np.all(np.diff(t["seq_start"]) > 0) and t["seq_start"][-1] < n_tok
    assert (
        int(t["top_k"]) == k
        and t["moe_layer_ids"].dtype == np.int16
        and t["moe_layer_ids"].shape == (n_layer,)
    )
    assert t["scores"].dtype == np.float16 and t["scores"].shape == (n_tok, n_layer, k)
    assert t["tokens"].dtype == np.int32 and t["tokens"].shape == (n_tok,)
    assert t["token_str_utf8"].dtype == np.uint8
    assert t["token_str_offsets"].dtype == np.int64 and t["token_str_offsets"].shape == (n_tok + 1,)
    assert t["token_str_offsets"][-1] == t["token_str_utf8"].size
    assert t["prompt_id"].shape == t["seq_start"].shape
    assert t["generated"].dtype == bool and t["generated"].shape == (n_tok,)
    E = int(t["num_experts"])
    assert t["experts"].min() >= 0 and t["experts"].max() < E
    for row in t["experts"].reshape(-1, k):
        assert len(set(row.tolist())) == k, "an expert appears twice in one token's selection"
    if hidden:
        assert t["hidden"].dtype == np.float16 and t["hidden"].shape[:2] == (n_tok, n_layer)
        assert t["router_logits"].dtype == np.float16 and t["router_logits"].shape == (n_tok, n_layer, E)
        assert str(t["hidden_kind"]) == HIDDEN_KIND
    else:
        assert "hidden" not in t and "router_logits" not in t


# ------------------------------------------------------------------------------------------ real routing


@pytest.mark.skipif(
    not SHIPPED.is_file() or not RECORDED.is_file(), reason="shipped model or its trace absent"
)
def test_shipped_model_reproduces_the_recorded_trace(tmp_path):
    rec = _load(RECORDED)
    rng = np.random.default_rng(2024)
    n = 80
    starts = rec["seq_start"]
    chosen = sorted(rng.choice(len(starts), size=2, replace=False).tolist())
    prompts = [rec["tokens"][starts[s] : starts[s] + n].tolist() for s in chosen]
    out = tmp_path / "shipped.npz"
    # Exact mode: the recorded trace is transformers' routing (f32 math on the same weights).
    summary = harvest(str(SHIPPED), prompts, out, hidden=True, threads=1, exact=True)
    t = _load(out)
    check_format(t, hidden=True)
    assert summary["tokens"] == 2 * n and summary["sequences"] == 2 and summary["generated_tokens"] == 0
    assert str(rec["hidden_kind"]) == str(t["hidden_kind"])
    np.testing.assert_array_equal(t["moe_layer_ids"], rec["moe_layer_ids"])
    assert int(t["num_experts"]) == int(rec["num_experts"]) and int(t["top_k"]) == int(rec["top_k"])
    np.testing.assert_array_equal(t["prompt_id"], [0, 1])
    for j, s in enumerate(chosen):
        mine = slice(int(t["seq_start"][j]), int(t["seq_start"][j]) + n)
        theirs = slice(int(starts[s]), int(starts[s]) + n)
        np.testing.assert_array_equal(t["tokens"][mine], rec["tokens"][theirs])
        # Token bytes: the recorded file's own strings.
        off_a, off_b = t["token_str_offsets"], rec["token_str_offsets"]
        assert bytes(t["token_str_utf8"][off_a[mine.start] : off_a[mine.stop]]) == bytes(
            rec["token_str_utf8"][off_b[theirs.start] : off_b[theirs.stop]]
        )
        # A trained router has clear margins: the same experts, in the same rank order.
        np.testing.assert_array_equal(t["experts"][mine], rec["experts"][theirs])
        np.testing.assert_allclose(
            t["scores"][mine].astype(np.float32), rec["scores"][theirs].astype(np.float32), atol=2e-3
        )
        np.testing.assert_allclose(
            t["router_logits"][mine].astype(np.float32),
            rec["router_logits"][theirs].astype(np.float32),
            atol=2e-2,
        )
        h_a = t["hidden"][mine].astype(np.float32)
        h_b = rec["hidden"][theirs].astype(np.float32)
        scale = np.abs(h_b).max(axis=-1, keepdims=True)
        assert np.max(np.abs(h_a - h_b) / scale) < 5e-3


# ------------------------------------------------------------------------------------------ reference


def _first_flip(t: dict, ref, lo: int, hi: int, k: int):
    """(position, layer, margin) of the first token in [lo, hi) whose selected set differs from the
    reference's, or None."""
    margins = router_margins(ref, k)
    for p in range(lo, hi):
        for j in range(t["experts"].shape[1]):
            if set(t["experts"][p, j].tolist()) != set(ref.selected_experts[j][p - lo].tolist()):
                return p, j, float(margins[j, p - lo])
    return None


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "olmoe", "llama"])
def test_tiny_model_trace_matches_numpy_reference(tiny_models, arch, tmp_path):
    rng = np.random.default_rng(sum(map(ord, arch)))
    words = ["import", "os", "def", "return", "self", "value", "for", "in", "range", "(", ")", ":", "print"]
    # The second prompt is longer than one prefill chunk (256 tokens): its trace joins the chunks.
    prompts = [" ".join(rng.choice(words, size=n)) for n in (rng.integers(4, 9), rng.integers(290, 320))]
    out = tmp_path / f"{arch}.npz"
    n_gen = 4
    summary = harvest(tiny_models[arch], prompts, out, hidden=True, generate=n_gen, threads=1)
    t = _load(out)
    check_format(t, hidden=True)
    ref_model = ReferenceModel(tiny_models[arch])
    hp = ref_model.hparams
    k = hp.n_expert_used
    np.testing.assert_array_equal(t["moe_layer_ids"], np.arange(hp.n_layer))
    assert int(t["num_experts"]) == hp.n_expert and t["hidden"].shape[2] == hp.n_embd
    bounds = list(t["seq_start"]) + [t["tokens"].size]
    assert summary["sequences"] == len(prompts) == len(bounds) - 1
    compared = 0
    for s, prompt in enumerate(prompts):
        lo, hi = int(bounds[s]), int(bounds[s + 1])
        gen = t["generated"][lo:hi]
        n_prompt = int((~gen).sum())
        assert not gen[:n_prompt].any() and gen[n_prompt:].all(), "prompt tokens first, then generated ones"
        assert hi - lo - n_prompt <= n_gen
        # The prompt's token bytes spell the prompt (after a BOS piece, if the model adds one).
        off = t["token_str_offsets"]
        text = bytes(t["token_str_utf8"][off[lo] : off[lo + n_prompt]]).decode("utf-8")
        assert text.endswith(prompt)

        ref = forward(ref_model, t["tokens"][lo:hi])
        flip = _first_flip(t, ref, lo, hi, k)
        end = hi if flip is None else flip[0]
        if flip is not None:
            assert flip[2] < TIE_MARGIN, (
                f"sequence {s}: selection differs at position {flip[0]}, layer {flip[1]} "
                f"where the reference router margin is {flip[2]:.2e} (not a tie)"
            )
        n = end - lo
        for j in range(hp.n_layer):
            ref_logits = ref.router_logits[j][:n]
            np.testing.assert_allclose(
                t["router_logits"][lo:end, j].astype(np.float64), ref_logits, atol=2e-2, rtol=2e-3
            )
            ref_probs = softmax(ref.router_logits[j][:n])
            got_scores = t["scores"][lo:end, j].astype(np.float64)
            np.testing.assert_allclose(
                got_scores,
                np.take_along_axis(ref_probs, t["experts"][lo:end, j].astype(np.int64), axis=1),
                atol=2e-3,
            )
            # Rank order: descending gate probability.
            assert np.all(np.diff(got_scores, axis=1) <= 1e-3)
            h_ref = ref.intermediates[f"ffn_inp-{j}"][:n]
            h_got = t["hidden"][lo:end, j].astype(np.float64)
            assert np.max(np.abs(h_got - h_ref) / np.abs(h_ref).max(axis=1, keepdims=True)) < 5e-3
        # Greedy: each generated token is the reference's argmax at the position before it (unless
        # the top two logits tie at rounding level).
        for p in range(lo + n_prompt, end):
            logits = ref.logits[p - 1 - lo]
            top2 = np.sort(logits)[-2:]
            if top2[1] - top2[0] > 1e-4:
                assert int(t["tokens"][p]) == int(np.argmax(logits)), f"generated token at position {p}"
        compared += n
    assert compared >= 0.5 * t["tokens"].size, "a near-tie flip cut the comparison too short to mean anything"


def test_generation_stops_at_the_context_and_without_hidden(tiny_models, tmp_path):
    out = tmp_path / "ctx.npz"
    prompt = list(range(5, 15))
    summary = harvest(tiny_models["qwen3moe"], [prompt], out, generate=20, n_ctx=16, threads=1)
    t = _load(out)
    check_format(t, hidden=False)
    assert t["tokens"].size == 16 and summary["generated_tokens"] == 6
    np.testing.assert_array_equal(t["tokens"][:10], prompt)


# ------------------------------------------------------------------------------------------ prompts


def test_read_prompts_plain_and_jsonl(tmp_path):
    plain = tmp_path / "p.txt"
    plain.write_text("first prompt\n\n  second one  \nthird\n", encoding="utf-8")
    assert read_prompts(str(plain)) == ["first prompt", "  second one  ", "third"]
    jl = tmp_path / "p.jsonl"
    rows = [{"prompt": "a \u00e9 b"}, {"text": "line\nbreak", "meta": 3}, {"tokens": [1, 2, 3]}]
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    assert read_prompts(str(jl)) == ["a \u00e9 b", "line\nbreak", [1, 2, 3]]


@pytest.mark.parametrize(
    "content, match",
    [
        ("", "no prompts"),
        ("\n  \n", "no prompts"),
        ('{"prompt": "ok"}\n{"prompt": "x"\n', "line 2: not valid JSON"),
        ('{"prompt": "ok"}\n{"other": 1}\n', 'line 2: an object needs a "prompt"'),
        ('{"prompt": 5}\n', "line 1: .*must be a string"),
        ('{"tokens": [1, "a"]}\n', 'line 1: "tokens" must be a list of integers'),
        ('{"prompt": "ok"}\n[1, 2]\n', "line 2: expected a JSON object"),
    ],
)
def test_read_prompts_rejects_bad_files(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(_core.InvalidArgument, match=match) as e:
        read_prompts(str(path))
    assert str(path) in str(e.value)


def test_bad_inputs_are_typed_errors(tiny_models, tmp_path):
    out = tmp_path / "x.npz"
    with pytest.raises(_core.InvalidArgument, match="without experts"):
        harvest(tiny_models["qwen3"], ["hello"], out)
    with pytest.raises(_core.InvalidArgument, match="no prompts"):
        harvest(tiny_models["qwen3moe"], [], out)
    with pytest.raises(_core.InvalidArgument, match="prompt 1: token id 99999 outside the vocabulary"):
        harvest(tiny_models["qwen3moe"], [[1, 2], [3, 99999]], out)
    with pytest.raises(_core.InvalidArgument, match="prompt 0: empty prompt"):
        harvest(tiny_models["qwen3moe"], [[]], out)
    with pytest.raises(_core.ContextOverflowError, match="prompt 0: 40 tokens do not fit the context of 32"):
        harvest(tiny_models["qwen3moe"], [list(range(1, 41))], out, n_ctx=32)
    with pytest.raises(_core.InvalidArgument, match="generate must be >= 0"):
        harvest(tiny_models["qwen3moe"], ["x"], out, generate=-1)
    assert not out.exists(), "a failed harvest writes nothing"
    assert not list(tmp_path.glob("*.tmp*")), "no temporary file is left behind"


# ------------------------------------------------------------------------------------------ command line


def _parser():
    p = argparse.ArgumentParser(prog="sharpi")
    add_trace_parser(p.add_subparsers(dest="command"))
    return p


def test_trace_command_writes_the_trace(tiny_models, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n{"tokens": [3, 4, 5, 6]}\n', encoding="utf-8")
    out = tmp_path / "cli.npz"
    args = _parser().parse_args(
        [
            "trace",
            "-m",
            tiny_models["olmoe"],
            "--prompts",
            str(prompts),
            "-o",
            str(out),
            "--hidden",
            "--generate",
            "2",
            "-t",
            "1",
        ]
    )
    assert run_trace_command(args) == 0
    t = _load(out)
    check_format(t, hidden=True)
    assert len(t["seq_start"]) == 2 and t["generated"].sum() <= 4
    np.testing.assert_array_equal(t["tokens"][t["seq_start"][1] : t["seq_start"][1] + 4], [3, 4, 5, 6])
    assert "wrote" in capsys.readouterr().err
    # Usage errors are argparse's (exit 2); a missing prompts file is an OSError naming it.
    with pytest.raises(SystemExit):
        _parser().parse_args(["trace", "--prompts", str(prompts), "-o", str(out), "--generate", "-1"])
    args = _parser().parse_args(
        ["trace", "-m", tiny_models["olmoe"], "--prompts", str(tmp_path / "nope"), "-o", str(out)]
    )
    with pytest.raises(FileNotFoundError, match="nope"):
        run_trace_command(args)


def test_streamed_harvest_records_the_same_routing(tiny_models, tmp_path):
    # Streaming experts under a small RAM budget must not change what is recorded (lossless).
    import sharpi

    path = tiny_models["qwen2moe"]
    probe = sharpi.Session(path, n_ctx=64, ram_budget="1GiB").expert_stats()
    k = 2
    budget = probe["fixed_bytes"] + (k + 1) * probe["slot_bytes"]
    rng = np.random.default_rng(77)
    prompts = [rng.integers(1, 1000, size=12).tolist(), rng.integers(1, 1000, size=7).tolist()]
    resident, streamed = tmp_path / "resident.npz", tmp_path / "streamed.npz"
    harvest(path, prompts, resident, hidden=True, generate=3, n_ctx=64, threads=1)
    harvest(path, prompts, streamed, hidden=True, generate=3, n_ctx=64, threads=1, ram_budget=budget)
    a, b = _load(resident), _load(streamed)
    for key in ("experts", "tokens", "seq_start", "scores", "hidden", "router_logits", "generated"):
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
