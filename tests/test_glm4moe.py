"""glm4moe (GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7) beyond the logits checks every MoE family gets
in test_model_vs_transformers.py (f32 vs transformers, f16 / q8_0 vs the float64 reference and
transformers), test_reference_vs_transformers.py, test_model_vs_reference.py and test_streaming.py
(make-model's tiny glm4moe with q/k norms and an MTP block).

Here, on tiny random transformers Glm4MoeForCausalLM checkpoints converted by llama.cpp's converter
(tests/reference/hf_export.py):
  - the file carries what GLM-4.5 routes and rotates by (the oracle: the converter's own keys, read
    with the gguf package), and the trunk sharpi loads is the checkpoint's;
  - the MTP (nextn) block: a file with it and the same checkpoint converted with --no-mtp give
    bit-identical logits, the nextn tensors stay listed and addressable in the file, and a file that
    declares a nextn block without its tensors (llama.cpp's trunk-only case) loads as well;
  - Q4_K_M by llama.cpp's own llama-quantize: exact mode within 1e-4 of the float64 reference on
    the dequantized weights, and streamed == resident bit for bit at a quarter budget;
  - prefetch predictors (prev_token, next_gate) keep a quarter-budget stream bit-identical;
  - llama.cpp's defaults and refusals: gating is sigmoid when the file does not say, GLM-4.5V's
    M-RoPE files and files missing a glm4moe tensor are typed errors;
  - llama.cpp's own glm4moe graph (llama-cpp-python) on the converter's f32 files and on make-model's
    glm-4.5-air and glm-4.6 presets at small widths: a third implementation;
  - the glm-4.5-air and glm-4.6 presets plan GLM-4.5-Air's and GLM-4.6's published shapes.

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
    greedy_logits,
    session_opener,
)
from sharpi import _core
from sharpi import make_model as mm
from sharpi.inspect_model import inspect_report, inspect_summary

QT = gguf.GGMLQuantizationType
THREADS = 2
PROMPT = hf_export.random_prompt(384, 16, seed=41)


@pytest.fixture(scope="module")
def converter():
    try:
        return hf_export.converter_dir()
    except hf_export.ConverterUnavailable as error:
        pytest.skip(f"llama.cpp converter unavailable: {error}")


@pytest.fixture(scope="module")
def files(converter, model_dir):
    return {
        name: hf_export.prepare(name, model_dir, converter, outtypes=("f32",)).gguf["f32"]
        for name in ("glm4moe", "glm4moe_qknorm")
    }


def _metadata(path) -> dict:
    reader = gguf.GGUFReader(str(path))
    md = {name: f.contents() for name, f in reader.fields.items() if f.types}
    return md, {t.name: t for t in reader.tensors}


@pytest.mark.parametrize("name", ["glm4moe", "glm4moe_qknorm"])
def test_converter_file_carries_the_glm4moe_parameters(files, name):
    md, tensors = _metadata(files[name])
    p = "glm4moe."
    want = {
        "block_count": 4,  # 3 trunk layers + the nextn block
        "nextn_predict_layers": 1,
        "attention.key_length": 48,
        "rope.dimension_count": 24,  # partial_rotary_factor 0.5 of head_dim 48
        "leading_dense_block_count": 1,
        "expert_count": 16,
        "expert_used_count": 4,
        "expert_shared_count": 1,
        "expert_gating_func": 2,  # sigmoid
        "expert_weights_norm": True,
    }
    for key, value in want.items():
        assert md[p + key] == value, key
    assert md[p + "expert_weights_scale"] == pytest.approx(2.5)
    assert "blk.0.ffn_gate.weight" in tensors and "blk.0.ffn_gate_inp.weight" not in tensors  # dense lead
    assert "blk.1.exp_probs_b.bias" in tensors and "blk.1.ffn_gate_inp_shexp.weight" not in tensors
    assert ("blk.1.attn_q_norm.weight" in tensors) == (name == "glm4moe_qknorm")
    assert ("blk.3.nextn.eh_proj.weight" in tensors) == (name == "glm4moe")
    info = sharpi.Session(str(files[name]), threads=1, n_ctx=64).info
    assert (info["arch"], info["n_layer"], info["n_layer_dense_lead"]) == ("glm4moe", 3, 1)


def test_inspect_describes_glm4moe(files):
    summary = inspect_summary(files["glm4moe_qknorm"])
    assert summary["attention"]["rope_dims"] == 24 and summary["attention"]["qk_norm"] == "per head"
    routing = summary["routing"]
    assert routing["gating"] == "sigmoid" and routing["selection_bias"] and routing["weights_norm"]
    assert routing["weights_scale"] == pytest.approx(2.5)
    assert (routing["shared_experts"], routing["shared_gate"], routing["leading_dense_layers"]) == (1, False, 1)
    report = inspect_report(files["glm4moe"])
    assert "partial RoPE: the first 24 of 48 dimensions of each head" in report
    assert "routing: sigmoid + selection bias (exp_probs_b), top-k weights renormalised, scale 2.5" in report
    assert "q/k RMSNorm" not in report  # GLM-4.5-Air has none


def test_nextn_block_does_not_change_the_trunk(files, converter):
    with_mtp = files["glm4moe"]
    without = hf_export.convert(
        with_mtp.parent / "hf", with_mtp.parent / "glm4moe-f32-no-mtp.gguf", "f32", converter, ["--no-mtp"]
    )
    md, tensors = _metadata(without)
    assert md["glm4moe.block_count"] == 3 and "glm4moe.nextn_predict_layers" not in md
    assert not any(name.startswith("blk.3.") for name in tensors)
    logits = {}
    for label, path in (("with", with_mtp), ("without", without)):
        session = sharpi.Session(str(path), threads=THREADS, n_ctx=64, exact=True)
        assert session.info["n_layer"] == 3
        logits[label] = greedy_logits(session, PROMPT, 8)
    np.testing.assert_array_equal(logits["with"], logits["without"])

    # The nextn block stays in the file, listed with its offsets, for the speculative-decoding work:
    # its bytes read through sharpi's reader are the gguf package's.
    summary = inspect_summary(with_mtp)
    assert summary["nextn"]["n_layer"] == 1 and summary["nextn"]["blocks"] == [3]
    assert summary["nextn"]["tensors"] >= 19  # a MoE decoder layer + eh_proj, enorm, hnorm, shared_head_norm
    ours = {t["name"]: t for t in _core.GgufFile(str(with_mtp), map_data=False).tensors()}
    _, theirs = _metadata(with_mtp)
    for name in ("blk.3.nextn.eh_proj.weight", "blk.3.nextn.enorm.weight", "blk.3.ffn_up_exps.weight"):
        t = ours[name]
        assert t["file_offset"] == int(theirs[name].data_offset) and t["nbytes"] == int(theirs[name].n_bytes)
        with open(with_mtp, "rb") as f:
            f.seek(t["file_offset"])
            raw = np.frombuffer(f.read(t["nbytes"]), dtype=np.float32)
        np.testing.assert_array_equal(raw, np.asarray(theirs[name].data, dtype=np.float32).reshape(-1))


def test_declared_nextn_block_without_tensors_loads(files):
    # glm4moe_qknorm's checkpoint has no MTP layer: block_count 4, nextn_predict_layers 1, no blk.3.
    md, tensors = _metadata(files["glm4moe_qknorm"])
    assert md["glm4moe.block_count"] == 4 and not any(name.startswith("blk.3.") for name in tensors)
    session = sharpi.Session(str(files["glm4moe_qknorm"]), threads=1, n_ctx=64)
    assert session.info["n_layer"] == 3
    assert np.all(np.isfinite(np.asarray(session.decode(PROMPT, True))))
    assert inspect_summary(files["glm4moe_qknorm"])["nextn"]["tensors"] == 0


@pytest.mark.parametrize("name", ["glm4moe", "glm4moe_qknorm"])
def test_streamed_equals_resident_at_a_quarter_budget(files, name):
    path = str(files[name])

    open_session = session_opener(path, threads=THREADS, n_ctx=128)

    check_streams_like_resident(open_session, PROMPT, 24, f"{name} f32")


@pytest.mark.parametrize("predictor", ["prev_token", "next_gate"])
def test_predictors_stream_bit_identically(files, predictor):
    """Prefetch hints (next_gate ranks by glm4moe's own rule: sigmoid + selection bias after
    post_attention_norm) change what is read when, never the logits."""
    path = str(files["glm4moe"])
    resident = greedy_logits(sharpi.Session(path, threads=THREADS, n_ctx=64), PROMPT, 12)
    probe = sharpi.Session(path, threads=1, n_ctx=64, ram_budget="4GiB", reader="pread")
    st, info = probe.expert_stats(), probe.info
    k = info["n_expert_used"]
    n_moe_slots = (info["n_layer"] - info["n_layer_dense_lead"]) * info["n_expert"]
    budget = st["fixed_bytes"] + (max(k, n_moe_slots // 4) + k) * st["slot_bytes"]  # + lookahead-1 staging
    s = sharpi.Session(path, threads=THREADS, n_ctx=64, ram_budget=budget, reader="pread", predictor=predictor,
                       lookahead=1)
    np.testing.assert_array_equal(greedy_logits(s, PROMPT, 12), resident)
    layers = s.expert_stats()["layers"]
    assert sum(lay["prefetch_issued"] for lay in layers) > 0
    assert sum(lay["evictions"] for lay in layers) > 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("glm4moe_tiny") / "glm4moe-tiny.gguf")
    mm.write_model(path, arch="glm4moe", preset="tiny", quant="q8_0", seed=3)
    return path


def test_gating_defaults_to_sigmoid_as_llama_cpp(tiny, tmp_path):
    # llama.cpp's glm4moe loader takes sigmoid when expert_gating_func is absent.
    bare = str(tmp_path / "no-gating-key.gguf")
    softmax = str(tmp_path / "softmax.gguf")
    rewrite_gguf(tiny, bare, drop_kv=("glm4moe.expert_gating_func",))
    rewrite_gguf(tiny, softmax, set_kv={"glm4moe.expert_gating_func": 1})
    logits = {p: np.asarray(sharpi.Session(p, threads=1, n_ctx=32).decode(PROMPT[:8], True)) for p in (tiny, bare, softmax)}
    np.testing.assert_array_equal(logits[bare], logits[tiny])
    assert not np.array_equal(logits[softmax], logits[tiny])


def test_multimodal_mrope_files_are_refused(tiny, tmp_path):
    # GLM-4.5V's text model: llama.cpp runs M-RoPE when rope.dimension_sections has two sections.
    mrope = str(tmp_path / "mrope.gguf")
    rewrite_gguf(tiny, mrope, set_kv={"glm4moe.rope.dimension_sections": [8, 8, 0, 0]})
    with pytest.raises(sharpi.UnsupportedError, match=r"rope\.dimension_sections \(multimodal M-RoPE"):
        sharpi.Session(mrope, threads=1, n_ctx=32)
    # Sections that do not make M-RoPE (llama.cpp's use_mrope needs the first two) are plain RoPE.
    plain = str(tmp_path / "plain.gguf")
    rewrite_gguf(tiny, plain, set_kv={"glm4moe.rope.dimension_sections": [0, 0, 0, 0]})
    assert sharpi.Session(plain, threads=1, n_ctx=32).info["arch"] == "glm4moe"


@pytest.mark.parametrize("dropped, error, message", [
    (("blk.1.attn_k_norm.weight",), sharpi.MissingTensorError, r"layer 1 has only one of attn_q_norm / attn_k_norm"),
    (("blk.2.exp_probs_b.bias",), sharpi.MissingTensorError, r"blk\.2\.exp_probs_b\.bias"),
    (("blk.0.post_attention_norm.weight",), sharpi.MissingTensorError, r"blk\.0\.post_attention_norm\.weight"),
])  # fmt: skip
def test_incomplete_files_are_typed_errors(tiny, tmp_path, dropped, error, message):
    bad = str(tmp_path / "bad.gguf")
    rewrite_gguf(tiny, bad, drop_tensors=dropped)
    with pytest.raises(error, match=message):
        sharpi.Session(bad, threads=1, n_ctx=32)


# ----------------------------------------------------------------------------------------------
# Q4_K_M by llama.cpp's own quantizer


@pytest.fixture(scope="module")
def q4_k_m_file(converter, model_dir) -> str:
    f16 = hf_export.prepare("glm4moe_256", model_dir, converter, outtypes=("f16",)).gguf["f16"]
    return str(llama_quantize(f16, f16.parent / "glm4moe_256-q4_k_m.gguf", "Q4_K_M", THREADS))


def test_q4_k_m_file_holds_a_mix(q4_k_m_file):
    _, tensors = _metadata(q4_k_m_file)
    types = {name: QT(int(t.tensor_type)) for name, t in tensors.items()}
    assert types["blk.1.ffn_gate_exps.weight"] == QT.Q4_K and types["blk.1.exp_probs_b.bias"] == QT.F32
    assert types["blk.1.ffn_gate_inp.weight"] == QT.F32 and types["blk.1.attn_q_norm.weight"] == QT.F32
    assert {QT.Q4_K, QT.Q6_K} <= set(types.values()), sorted((n, t.name) for n, t in types.items())
    assert "blk.3.nextn.eh_proj.weight" in types  # the MTP block went through the quantizer too


def test_q4_k_m_exact_mode_matches_reference(q4_k_m_file):
    check_exact_file_against_reference(q4_k_m_file, THREADS, 43, "glm4moe Q4_K_M (llama-quantize) vs reference")


@pytest.mark.parametrize("exact", [False, True])
def test_q4_k_m_streams_bit_identically_at_a_quarter_budget(q4_k_m_file, exact):
    open_session = session_opener(q4_k_m_file, threads=THREADS, n_ctx=128, exact=exact)

    check_streams_like_resident(open_session, PROMPT, 24, f"glm4moe Q4_K_M exact={exact}")


# ----------------------------------------------------------------------------------------------
# llama.cpp's own glm4moe graph


def _llama_cpp_logits(path, tokens) -> np.ndarray:
    llama_cpp = require_llama_cpp()
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=THREADS, logits_all=True, verbose=False, type_k=0, type_v=0)
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float64)


def _sharpi_logits(path, tokens) -> np.ndarray:
    ours = sharpi.Session(str(path), threads=THREADS, exact=True).decode(tokens, True)
    return np.asarray(ours, dtype=np.float64).reshape(len(tokens), -1)


@pytest.mark.parametrize("name", ["glm4moe", "glm4moe_qknorm"])
def test_converter_file_matches_llama_cpp(files, name):
    """llama.cpp in f32 with an f32 KV cache: only rounding differs (measured <= 7.2e-7; a wrong
    RoPE pairing or routing rule gives errors of order 1)."""
    theirs = _llama_cpp_logits(files[name], PROMPT)
    ours = _sharpi_logits(files[name], PROMPT)
    rel = np.abs(ours - theirs).max(axis=1) / np.abs(theirs).max(axis=1)
    assert rel.max() <= 1e-5, rel


@pytest.mark.parametrize("preset", ["glm-4.5-air", "glm-4.6"])
def test_glm_presets_at_small_widths_match_llama_cpp(tmp_path, preset):
    """make-model's glm-4.5-air file (the first layer dense; 8 of 128 experts with a shared one; no
    q/k norm) and glm-4.6 file (3 dense layers; 8 of 160 experts; q/k norms; routed scale 2.5), each
    with its MTP block, at small widths, as llama.cpp's glm4moe loader and graph take them."""
    small = {"n_vocab": 512, "n_embd": 128, "n_head": 4, "n_head_kv": 2, "head_dim": 64, "n_rot": 32,
             "n_ff": 128, "n_ff_exp": 32, "n_ff_shexp": 32, "n_layer": 5}  # fmt: skip
    path = tmp_path / f"{preset}-small.gguf"
    mm.write_model(path, preset=preset, quant="f32", seed=5, **small)
    tokens = [int(t) for t in np.random.default_rng(0).integers(5, 500, 16)]
    theirs = _llama_cpp_logits(path, tokens)
    ours = _sharpi_logits(path, tokens)
    rel = np.abs(ours - theirs).max(axis=1) / np.abs(theirs).max(axis=1)
    assert rel.max() <= 1e-5, rel


# ----------------------------------------------------------------------------------------------
# Presets


def test_glm_presets_plan_the_published_shapes():
    """zai-org/GLM-4.5-Air's and GLM-4.6's config.json as Glm4MoeModel writes them. Planned, not
    written (the Q4_K_M files are ~67 and ~200 GiB)."""
    from sharpi.presets import resolve
    from sharpi.tensor_plan import plan_tensors

    for preset, n_layer, n_embd, n_expert, n_ff_exp, dense, qk_norm, total in (
        ("glm-4.5-air", 46, 4096, 128, 1408, 1, False, 106.9e9),
        ("glm-4.6", 92, 5120, 160, 1536, 3, True, 352.8e9),
    ):
        hp = resolve(preset=preset)
        specs = {s.name: s for s in plan_tensors(hp, "q4_k_m")}
        assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_rot) == (
            "glm4moe", n_layer, n_embd, 96, 8, 128, 64
        )
        assert specs["blk.0.attn_q.weight"].ne == (n_embd, 96 * 128) and specs["blk.0.attn_q.bias"].ne == (96 * 128,)
        assert specs["blk.0.attn_k.weight"].ne == (n_embd, 8 * 128)
        assert specs[f"blk.{dense - 1}.ffn_gate.weight"].ne[0] == n_embd
        assert f"blk.{dense}.ffn_gate.weight" not in specs
        assert specs[f"blk.{dense}.ffn_down_exps.weight"].ne == (n_ff_exp, n_embd, n_expert)
        assert specs[f"blk.{dense}.ffn_up_shexp.weight"].ne == (n_embd, n_ff_exp)
        assert specs[f"blk.{dense}.exp_probs_b.bias"].ne == (n_expert,)
        assert (f"blk.{dense}.attn_q_norm.weight" in specs) == qk_norm
        assert specs[f"blk.{n_layer}.nextn.eh_proj.weight"].ne == (2 * n_embd, n_embd)  # the MTP block
        trunk = sum(s.n_elements for s in specs.values() if s.layer is None or s.layer < n_layer)
        assert trunk == pytest.approx(total, rel=0.01)
