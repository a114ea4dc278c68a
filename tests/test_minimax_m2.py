"""minimax-m2 (MiniMax-M2, MiniMax-M2.1) beyond the logits checks every MoE family gets in
test_model_vs_transformers.py (f32 vs transformers exactly: prefill, token by token, 32 greedy
tokens; f16 / q8_0 vs the float64 reference and transformers), test_reference_vs_transformers.py,
test_model_vs_reference.py (make-model's tiny minimax-m2 in five weight types), test_streaming.py
and test_predictors.py (next_gate ranks by sigmoid + selection bias).

Here, on a tiny random transformers MiniMaxM2ForCausalLM checkpoint converted by llama.cpp's
converter (tests/reference/hf_export.py):
  - the file carries what MiniMax-M2 rotates and routes by (the converter's own keys and tensor
    shapes, read with the gguf package: whole-projection q/k norms, rotary_dim, sigmoid gating, the
    selection bias, no shared expert, no biases, no MTP block), and inspect describes it;
  - make-model's tiny minimax-m2 carries the converter's keys (and value types) and tensor names;
  - streamed == resident bit for bit at a quarter budget (f32 and q8_0 converter files);
  - Q4_K_M by llama.cpp's own llama-quantize (from a 256-wide checkpoint): exact mode within 1e-4 of
    the float64 reference on the dequantized weights, and streamed == resident bit for bit;
  - llama.cpp's defaults and refusals: a file without expert_gating_func routes with sigmoid (the
    only router transformers has), softmax when the file says so; files missing a minimax-m2 tensor
    are typed errors;
  - llama.cpp's own minimax-m2 graph (llama-cpp-python) on the converter's f32 file and on
    make-model's minimax-m2 preset at small widths: a third implementation;
  - the minimax-m2 preset plans MiniMax-M2's published shapes (230B-A10B).

Skips (never fails) without torch/transformers or when the converter cannot be fetched; the
llama-quantize and llama-cpp-python tests skip (fail under SHARPI_REQUIRE_ALL=1) without them.
"""


import gguf
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5.0")

import sharpi
from ci_policy import require_llama_cpp
from llama_quantize import llama_quantize
from model_files import rewrite_gguf
from reference import hf_export
from reference.engine_checks import (
    check_exact_file_against_reference,
    check_streams_like_resident,
    session_opener,
)
from sharpi import make_model as mm
from sharpi.inspect_model import inspect_report, inspect_summary

QT = gguf.GGMLQuantizationType
THREADS = 2
PROMPT = hf_export.random_prompt(384, 16, seed=42)


@pytest.fixture(scope="module")
def converter():
    try:
        return hf_export.converter_dir()
    except hf_export.ConverterUnavailable as error:
        pytest.skip(f"llama.cpp converter unavailable: {error}")


@pytest.fixture(scope="module")
def files(converter, model_dir):
    return hf_export.prepare("minimax_m2", model_dir, converter, outtypes=("f32", "q8_0")).gguf


def _metadata(path):
    reader = gguf.GGUFReader(str(path))
    md = {name: f.contents() for name, f in reader.fields.items() if f.types}
    return md, {t.name: t for t in reader.tensors}


def test_converter_file_carries_the_minimax_m2_parameters(files):
    md, tensors = _metadata(files["f32"])
    p = "minimax-m2."
    want = {
        "block_count": 2,  # no MTP block: the converter does not carry MiniMax-M2's MTP modules
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "attention.key_length": 48,
        "rope.dimension_count": 24,  # the config's rotary_dim
        "expert_count": 16,
        "expert_used_count": 4,
        "expert_feed_forward_length": 64,
        "expert_gating_func": 2,  # sigmoid, from scoring_func
    }
    for key, value in want.items():
        assert md[p + key] == value, key
    assert p + "nextn_predict_layers" not in md and p + "expert_weights_norm" not in md
    # Whole-projection q/k norms: n_head * head_dim and n_head_kv * head_dim wide, not head_dim.
    assert tuple(tensors["blk.0.attn_q_norm.weight"].shape) == (4 * 48,)
    assert tuple(tensors["blk.0.attn_k_norm.weight"].shape) == (2 * 48,)
    assert tuple(tensors["blk.1.exp_probs_b.bias"].shape) == (16,)
    assert tuple(tensors["blk.1.ffn_down_exps.weight"].shape) == (64, 128, 16)
    assert not any(name.endswith((".attn_q.bias", "_shexp.weight")) for name in tensors)
    assert "blk.0.ffn_norm.weight" in tensors and "blk.0.post_attention_norm.weight" not in tensors
    info = sharpi.Session(str(files["f32"]), threads=1, n_ctx=64).info
    assert (info["arch"], info["n_layer"], info["n_expert"], info["n_expert_used"]) == ("minimax-m2", 2, 16, 4)


def test_inspect_describes_minimax_m2(files):
    summary = inspect_summary(files["f32"])
    attention = summary["attention"]
    assert (attention["kind"], attention["head_dim"], attention["rope_dims"]) == ("gqa", 48, 24)
    assert attention["qk_norm"] == "whole projection"
    routing = summary["routing"]
    assert routing["gating"] == "sigmoid" and routing["selection_bias"] and routing["weights_norm"]
    assert (routing["shared_experts"], routing["shared_gate"], routing["leading_dense_layers"]) == (0, False, 0)
    report = inspect_report(files["f32"])
    assert "partial RoPE: the first 24 of 48 dimensions of each head" in report
    assert "routing: sigmoid + selection bias (exp_probs_b), top-k weights renormalised" in report


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_streamed_equals_resident_at_a_quarter_budget(files, outtype):
    path = str(files[outtype])

    open_session = session_opener(path, threads=THREADS, n_ctx=128)

    check_streams_like_resident(open_session, PROMPT, 24, f"minimax-m2 {outtype}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("minimax_m2_tiny") / "minimax-m2-tiny.gguf")
    mm.write_model(path, arch="minimax-m2", preset="tiny", quant="q8_0", seed=3)
    return path


def test_make_model_writes_what_the_converter_writes(files, tiny):
    """make-model's tiny minimax-m2 against the converter's file: the same minimax-m2.* keys with
    the same value types, and the same tensor names with the same ranks."""
    theirs_md, theirs = _metadata(files["f32"])
    ours_md, ours = _metadata(tiny)
    reader_t, reader_o = gguf.GGUFReader(str(files["f32"])), gguf.GGUFReader(tiny)
    arch_keys = {k for k in theirs_md if k.startswith("minimax-m2.")}
    assert arch_keys == {k for k in ours_md if k.startswith("minimax-m2.")}
    for key in arch_keys:
        assert reader_t.fields[key].types == reader_o.fields[key].types, key
    assert set(theirs) == set(ours)
    for name in theirs:
        assert len(theirs[name].shape) == len(ours[name].shape), name


def test_gating_defaults_to_sigmoid(tiny, tmp_path):
    # transformers' MiniMax-M2 router is always sigmoid (llama.cpp aborts on a file without the key).
    bare = str(tmp_path / "no-gating-key.gguf")
    softmax = str(tmp_path / "softmax.gguf")
    rewrite_gguf(tiny, bare, drop_kv=("minimax-m2.expert_gating_func",))
    rewrite_gguf(tiny, softmax, set_kv={"minimax-m2.expert_gating_func": 1})
    logits = {p: np.asarray(sharpi.Session(p, threads=1, n_ctx=32).decode(PROMPT[:8], True)) for p in (tiny, bare, softmax)}
    np.testing.assert_array_equal(logits[bare], logits[tiny])
    assert not np.array_equal(logits[softmax], logits[tiny])


@pytest.mark.parametrize("dropped, message", [
    (("blk.1.attn_k_norm.weight",), r"blk\.1\.attn_k_norm\.weight"),
    (("blk.1.exp_probs_b.bias",), r"blk\.1\.exp_probs_b\.bias"),
    (("blk.0.ffn_gate_inp.weight",), r"blk\.0\.ffn_gate_inp\.weight"),
])  # fmt: skip
def test_incomplete_files_are_typed_errors(tiny, tmp_path, dropped, message):
    bad = str(tmp_path / "bad.gguf")
    rewrite_gguf(tiny, bad, drop_tensors=dropped)
    with pytest.raises(sharpi.MissingTensorError, match=message):
        sharpi.Session(bad, threads=1, n_ctx=32)


# ----------------------------------------------------------------------------------------------
# llama.cpp's own minimax-m2 graph


def _llama_cpp_logits(path, tokens) -> np.ndarray:
    llama_cpp = require_llama_cpp()
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=THREADS, logits_all=True, verbose=False, type_k=0, type_v=0)
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float64)


def _sharpi_logits(path, tokens) -> np.ndarray:
    ours = sharpi.Session(str(path), threads=THREADS, exact=True).decode(tokens, True)
    return np.asarray(ours, dtype=np.float64).reshape(len(tokens), -1)


def test_converter_file_matches_llama_cpp(files):
    """llama.cpp in f32 with an f32 KV cache: only rounding differs (a wrong q/k norm width, RoPE
    pairing or routing rule gives errors of order 1)."""
    theirs = _llama_cpp_logits(files["f32"], PROMPT)
    ours = _sharpi_logits(files["f32"], PROMPT)
    rel = np.abs(ours - theirs).max(axis=1) / np.abs(theirs).max(axis=1)
    assert rel.max() <= 1e-5, rel


def test_preset_at_small_widths_matches_llama_cpp(tmp_path):
    """make-model's minimax-m2 file (all layers MoE, 8 of 256 experts, whole-projection q/k norms,
    RoPE on half of each head, head_dim != n_embd / n_head) at small widths, as llama.cpp's
    minimax-m2 loader and graph take it."""
    small = {"n_vocab": 512, "n_embd": 128, "n_head": 4, "n_head_kv": 2, "head_dim": 64, "n_rot": 32,
             "n_ff": 32, "n_ff_exp": 32, "n_layer": 3}  # fmt: skip
    path = tmp_path / "minimax-m2-small.gguf"
    mm.write_model(path, preset="minimax-m2", quant="f32", seed=5, **small)
    tokens = [int(t) for t in np.random.default_rng(0).integers(5, 500, 16)]
    theirs = _llama_cpp_logits(path, tokens)
    ours = _sharpi_logits(path, tokens)
    rel = np.abs(ours - theirs).max(axis=1) / np.abs(theirs).max(axis=1)
    assert rel.max() <= 1e-5, rel


# ----------------------------------------------------------------------------------------------
# Preset


def test_preset_plans_the_published_shapes():
    """MiniMaxAI/MiniMax-M2's config.json as MiniMaxM2Model writes it. Planned, not written (the
    Q4_K_M file is ~130 GiB)."""
    from sharpi.presets import resolve
    from sharpi.tensor_plan import plan_tensors

    hp = resolve(preset="minimax-m2")
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_rot) == (
        "minimax-m2", 62, 3072, 48, 8, 128, 64
    )
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff_exp, hp.n_ff_shexp, hp.n_vocab) == (256, 8, 1536, 0, 200064)
    specs = {s.name: s for s in plan_tensors(hp, "q4_k_m")}
    assert specs["blk.0.attn_q.weight"].ne == (3072, 48 * 128)
    assert specs["blk.0.attn_q_norm.weight"].ne == (48 * 128,) and specs["blk.0.attn_k_norm.weight"].ne == (8 * 128,)
    assert specs["blk.0.exp_probs_b.bias"].ne == (256,)
    assert specs["blk.61.ffn_down_exps.weight"].ne == (1536, 3072, 256)
    assert not any(".attn_q.bias" in name or "shexp" in name or "nextn" in name for name in specs)
    total = sum(s.n_elements for s in specs.values())
    assert total == pytest.approx(228.7e9, rel=0.01)  # "230B": the checkpoint's 228.7B parameters
    expert = 3 * 3072 * 1536
    embeddings = 2 * 200064 * 3072  # token_embd and output
    active = total - 62 * (256 - 8) * expert - embeddings
    assert active == pytest.approx(10e9, rel=0.05)  # "A10B": 9.8B active outside the embeddings


# ----------------------------------------------------------------------------------------------
# Q4_K_M by llama.cpp's own quantizer


@pytest.fixture(scope="module")
def q4_k_m_file(converter, model_dir) -> str:
    f16 = hf_export.prepare("minimax_m2_256", model_dir, converter, outtypes=("f16",)).gguf["f16"]
    return str(llama_quantize(f16, f16.parent / "minimax_m2_256-q4_k_m.gguf", "Q4_K_M", THREADS))


def test_q4_k_m_file_holds_a_mix(q4_k_m_file):
    _, tensors = _metadata(q4_k_m_file)
    types = {name: QT(int(t.tensor_type)) for name, t in tensors.items()}
    assert types["blk.1.ffn_gate_exps.weight"] == QT.Q4_K and types["blk.1.exp_probs_b.bias"] == QT.F32
    assert types["blk.1.ffn_gate_inp.weight"] == QT.F32 and types["blk.1.attn_q_norm.weight"] == QT.F32
    assert {QT.Q4_K, QT.Q6_K} <= set(types.values()), sorted((n, t.name) for n, t in types.items())


def test_q4_k_m_exact_mode_matches_reference(q4_k_m_file):
    check_exact_file_against_reference(q4_k_m_file, THREADS, 44, "minimax-m2 Q4_K_M (llama-quantize) vs reference")


@pytest.mark.parametrize("exact", [False, True])
def test_q4_k_m_streams_bit_identically_at_a_quarter_budget(q4_k_m_file, exact):
    open_session = session_opener(q4_k_m_file, threads=THREADS, n_ctx=128, exact=exact)

    check_streams_like_resident(open_session, PROMPT, 24, f"minimax-m2 Q4_K_M exact={exact}")
