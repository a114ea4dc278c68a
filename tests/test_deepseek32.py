"""deepseek32 (DeepSeek-V3.2 / V3.2-Exp: DeepSeek-V3 plus DeepSeek Sparse Attention) on files written
by llama.cpp's real converter from a tiny random transformers DeepseekV32ForCausalLM checkpoint
(tests/reference/hf_export.py "deepseek_v32": MLA with a q LoRA, YaRN, a leading dense layer, sigmoid
routing with a selection bias and groups, shared experts, and a lightning indexer of 16 heads of 32
with index_topk 5).

index_topk is 5 so that every prompt here is longer than it: from position 5 on each query attends
to a strict subset of its positions, the indexer's choice. The checks:
  - the file carries the converter's DSA keys and indexer tensors, and the MTP block the checkpoint
    holds (its drafts are checked against the reference in test_mtp.py); sharpi reads it as deepseek32;
  - exact mode on the f32 file matches transformers (float64) within 1e-4 at every position, prefill
    and token by token, and in greedy decoding;
  - the selection matters: the same checkpoint with index_topk >= the prompt length (dense MLA) gives
    logits that differ from the sparse ones by far more than the budget after position 5, and sharpi
    on the file rewritten to that top_k matches that dense transformers model;
  - token by token, batched beside another sequence, and a forked sequence all equal one-call
    prefill bit for bit (the indexer keys live in the KV row: they follow the fork's prefix copy);
  - the float64 numpy reference (tests/reference/numpy_forward.py, its own indexer) agrees with
    transformers on the f32 file, with clear margins at every top-k boundary; the converter's f16 and
    q8_0 files and llama-quantize's Q4_K_M (from a 256-wide checkpoint) match it in exact mode within
    1e-4 on their dequantized weights;
  - streamed == resident bit for bit at a quarter budget (f32, q8_0 and Q4_K_M files);
  - a file without the indexer keys or tensors is a typed error;
  - make-model's tiny deepseek32 carries the converter's keys and tensor names, and the
    deepseek-v3.2 preset plans DeepSeek-V3.2's published shapes (685B with the MTP block, 671B trunk);
  - llama.cpp's own deepseek32 graph (llama-cpp-python) agrees with sharpi on make-model's tiny
    deepseek32 where the selection is sparse.

Skips (never fails) without torch/transformers or when the converter cannot be fetched; the
llama-quantize and llama-cpp-python tests skip (fail under SHARPI_REQUIRE_ALL=1) without them.
"""

import json
import shutil

import gguf
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5.0")

import sharpi
from ci_policy import require_llama_cpp
from llama_quantize import llama_quantize
from model_files import rewrite_gguf
from reference import hf_export
from reference.engine_checks import (
    check_exact_file_against_reference,
    check_greedy,
    check_prefill_and_stepwise,
    check_streams_like_resident,
    session_opener,
)
from reference.numpy_forward import ReferenceModel, forward, relative_error_per_position
from sharpi import make_model as mm
from sharpi.inspect_model import inspect_report, inspect_summary

NAME = "deepseek_v32"
THREADS = 2
TOP_K = 5
N_PROMPT = 24
BUDGET = 1e-4


@pytest.fixture(scope="module")
def converter():
    try:
        return hf_export.converter_dir()
    except hf_export.ConverterUnavailable as error:
        pytest.skip(f"llama.cpp converter unavailable: {error}")


@pytest.fixture(scope="module")
def converted(converter, model_dir):
    return hf_export.prepare(NAME, model_dir, converter, outtypes=("f32", "f16", "q8_0"))


@pytest.fixture(scope="module")
def hf(converted):
    return hf_export.load_hf_model_f64(converted.exported.hf_dir)


def _prompt(converted, salt, n=N_PROMPT):
    return hf_export.random_prompt(converted.exported.vocab_size, n, 9100 + salt)


def _opener(path, **kwargs):
    def open_session(dump_activations):
        return sharpi.Session(
            str(path), threads=THREADS, n_ctx=128, exact=True, dump_activations=dump_activations, **kwargs
        )

    return open_session


def _logits(session, tokens):
    return np.asarray(session.decode(list(tokens), True), np.float64).reshape(len(tokens), -1)


def test_file_carries_the_dsa_parameters(converted):
    reader = gguf.GGUFReader(str(converted.gguf["f32"]))
    md = {name: f.contents() for name, f in reader.fields.items() if f.types}
    tensors = {t.name: t for t in reader.tensors}
    p = "deepseek32."
    assert md["general.architecture"] == "deepseek32"
    want = {
        "attention.indexer.head_count": 16,
        "attention.indexer.key_length": 32,
        "attention.indexer.top_k": TOP_K,
        "attention.q_lora_rank": 64,
        "attention.kv_lora_rank": 64,
        "rope.dimension_count": 16,
        "expert_gating_func": 2,
    }
    for key, value in want.items():
        assert md[p + key] == value, key
    # The MTP block the test checkpoint carries (model.layers.3, as DeepSeek's model.layers.61).
    assert md[p + "nextn_predict_layers"] == 1 and md[p + "block_count"] == 4
    assert tuple(tensors["blk.3.nextn.eh_proj.weight"].shape) == (256, 128)
    for il in range(4):
        assert tuple(tensors[f"blk.{il}.indexer.attn_q_b.weight"].shape) == (64, 16 * 32)
        assert tuple(tensors[f"blk.{il}.indexer.attn_k.weight"].shape) == (128, 32)
        assert tuple(tensors[f"blk.{il}.indexer.proj.weight"].shape) == (128, 16)
        assert tuple(tensors[f"blk.{il}.indexer.k_norm.weight"].shape) == (32,)
        assert tuple(tensors[f"blk.{il}.indexer.k_norm.bias"].shape) == (32,)
    attention = inspect_summary(converted.gguf["f32"])["attention"]
    assert (attention["kind"], attention["indexer_heads"], attention["indexer_top_k"]) == ("mla", 16, TOP_K)
    assert attention["kv_cache_floats_per_token_layer"] == 64 + 16 + 32  # latent + RoPE key + indexer key
    assert "lightning indexer of 16 heads x 32, each query attends to its top 5 positions" in inspect_report(
        converted.gguf["f32"]
    )
    info = sharpi.Session(str(converted.gguf["f32"]), threads=1, n_ctx=64).info
    assert (info["arch"], info["n_layer"], info["n_expert"], info["n_expert_used"]) == ("deepseek32", 3, 16, 4)


def test_sharpi_matches_transformers(converted, hf):
    prompt = _prompt(converted, 1)

    def expected_for(tokens):
        return hf_export.hf_forward_result(hf, tokens, 4)

    open_session = _opener(converted.gguf["f32"])
    what = "deepseek32 (converter f32) vs HF"
    check_prefill_and_stepwise(open_session, prompt, expected_for(prompt), BUDGET, what, 4)
    check_greedy(open_session, prompt[:12], expected_for, 16, BUDGET, what, 4)


def _dense_hf(converted, tmp_path_factory):
    """The same checkpoint with index_topk above every prompt length here: dense MLA."""
    config = json.loads((converted.exported.hf_dir / "config.json").read_text())
    config["index_topk"] = 4096
    copy = tmp_path_factory.mktemp("deepseek32_dense_hf")
    shutil.copytree(converted.exported.hf_dir, copy, dirs_exist_ok=True)
    (copy / "config.json").write_text(json.dumps(config))
    return hf_export.load_hf_model_f64(copy)


def test_the_indexer_selection_matters_and_dense_top_k_is_dense_mla(converted, hf, tmp_path_factory, tmp_path):
    prompt = _prompt(converted, 2, 40)
    sparse_ref = hf_export.hf_logits(hf, prompt)
    dense_ref = hf_export.hf_logits(_dense_hf(converted, tmp_path_factory), prompt)
    # Up to position TOP_K - 1 every position is selected: the two models agree there.
    np.testing.assert_allclose(dense_ref[:TOP_K], sparse_ref[:TOP_K], rtol=0, atol=1e-9 * np.abs(sparse_ref).max())
    after = relative_error_per_position(dense_ref[TOP_K + 2 :], sparse_ref[TOP_K + 2 :])
    assert np.median(after) > 100 * BUDGET, np.median(after)

    path = str(converted.gguf["f32"])
    sparse = _logits(sharpi.Session(path, threads=THREADS, n_ctx=64, exact=True), prompt)
    assert relative_error_per_position(sparse, sparse_ref).max() < BUDGET
    dense_path = str(tmp_path / "dense.gguf")
    rewrite_gguf(path, dense_path, set_kv={"deepseek32.attention.indexer.top_k": 4096})
    dense = _logits(sharpi.Session(dense_path, threads=THREADS, n_ctx=64, exact=True), prompt)
    assert relative_error_per_position(dense, dense_ref).max() < BUDGET


def test_token_by_token_batched_and_forked_equal_prefill(converted):
    prompt = _prompt(converted, 3, 32)
    path = str(converted.gguf["f32"])
    s = sharpi.Session(path, threads=THREADS, n_ctx=64, exact=True, n_seq=3)
    ours = _logits(s, prompt)
    s.reset()
    split = 10
    s.decode(prompt[:split])
    rows = [_logits(s, [t])[0] for t in prompt[split : split + 6]]
    np.testing.assert_array_equal(np.stack(rows), ours[split : split + 6])
    # The rest beside another sequence at other positions, then a fork of the main sequence.
    other = s.add_sequence()
    other_prompt = _prompt(converted, 4, 16)
    main = s.sequence(0)
    pos = split + 6
    for step in range(2):
        a, b = pos + 5 * step, pos + 5 * (step + 1)
        logits = s.decode_batch([(main, prompt[a:b]), (other, other_prompt[8 * step : 8 * (step + 1)])], all_logits=True)
        np.testing.assert_array_equal(np.asarray(logits[0], np.float64).reshape(5, -1), ours[a:b])
    fork = main.fork()
    tail = prompt[pos + 10 :]
    logits = s.decode_batch([(fork, tail)], all_logits=True)
    np.testing.assert_array_equal(np.asarray(logits[0], np.float64).reshape(len(tail), -1), ours[pos + 10 :])
    # A fork of a shorter prefix, and truncation: the rows past the kept positions are not read.
    fork.remove()
    short = main.fork(n_keep=12)
    logits = s.decode_batch([(short, prompt[12:20])], all_logits=True)
    np.testing.assert_array_equal(np.asarray(logits[0], np.float64).reshape(8, -1), ours[12:20])
    main.truncate(7)
    logits = s.decode_batch([(main, prompt[7:15])], all_logits=True)
    np.testing.assert_array_equal(np.asarray(logits[0], np.float64).reshape(8, -1), ours[7:15])


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_streamed_equals_resident_at_a_quarter_budget(converted, outtype):
    path = str(converted.gguf[outtype])
    prompt = _prompt(converted, 5, 16)

    open_session = session_opener(path, threads=THREADS, n_ctx=128)

    check_streams_like_resident(open_session, prompt, 16, f"deepseek32 {outtype}")


@pytest.mark.parametrize(
    "change, error",
    [
        ({"drop_kv": ("deepseek32.attention.indexer.top_k",)}, sharpi.SharpiError),
        ({"set_kv": {"deepseek32.attention.indexer.top_k": 0}}, sharpi.FormatError),
        ({"drop_tensors": ("blk.1.indexer.attn_k.weight",)}, sharpi.MissingTensorError),
    ],
)
def test_a_file_without_its_indexer_is_a_typed_error(converted, tmp_path, change, error):
    bad = str(tmp_path / "bad.gguf")
    rewrite_gguf(str(converted.gguf["f32"]), bad, **change)
    with pytest.raises(error):
        sharpi.Session(bad, threads=1, n_ctx=32)


def test_reference_matches_transformers_with_clear_selection_margins(converted, hf):
    prompt = _prompt(converted, 6, 32)
    result = forward(ReferenceModel(str(converted.gguf["f32"])), prompt)
    # ~1e-5 apart at every position, the dense ones too: HF computes the YaRN RoPE angles in float32.
    assert relative_error_per_position(result.logits, hf_export.hf_logits(hf, prompt)).max() < BUDGET
    # The engine selects in f32: a gap between the top_k-th and the next score far above f32
    # rounding means it cannot choose otherwise.
    margins = np.concatenate([result.intermediates[f"indexer_margin-{il}"] for il in range(3)])
    assert np.isinf(margins[:TOP_K]).all() and margins.min() > 1e-4, np.sort(margins)[:4]


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_converter_quantized_files_match_the_reference_in_exact_mode(converted, outtype):
    check_exact_file_against_reference(str(converted.gguf[outtype]), THREADS, 61, f"deepseek32 {outtype} vs reference")


@pytest.fixture(scope="module")
def q4_k_m_file(converter, model_dir) -> str:
    f16 = hf_export.prepare("deepseek_v32_256", model_dir, converter, outtypes=("f16",)).gguf["f16"]
    return str(llama_quantize(f16, f16.parent / "deepseek_v32_256-q4_k_m.gguf", "Q4_K_M", THREADS))


def test_q4_k_m_file_holds_a_mix_and_matches_the_reference(q4_k_m_file):
    reader = gguf.GGUFReader(q4_k_m_file)
    types = {t.name: gguf.GGMLQuantizationType(int(t.tensor_type)) for t in reader.tensors}
    assert types["blk.1.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.Q4_K
    assert types["blk.1.indexer.k_norm.bias"] == gguf.GGMLQuantizationType.F32
    assert {gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K} <= set(types.values())
    check_exact_file_against_reference(q4_k_m_file, THREADS, 62, "deepseek32 Q4_K_M (llama-quantize) vs reference")


@pytest.mark.parametrize("exact", [False, True])
def test_q4_k_m_streams_bit_identically_at_a_quarter_budget(q4_k_m_file, exact):
    prompt = hf_export.random_prompt(384, 16, seed=63)

    open_session = session_opener(q4_k_m_file, threads=THREADS, n_ctx=128, exact=exact)

    check_streams_like_resident(open_session, prompt, 16, f"deepseek32 Q4_K_M exact={exact}")


# ----------------------------------------------------------------------------------------------
# make-model: the tiny deepseek32 and the deepseek-v3.2 preset


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("deepseek32_tiny") / "deepseek32-tiny.gguf")
    # With YaRN and expert groups, as the converter's checkpoint has them (so the same keys exist).
    yarn_and_groups = {"yarn_factor": 4.0, "yarn_n_ctx_orig": 128, "yarn_mscale_all_dim": 0.707,
                       "n_expert_group": 4, "n_expert_group_used": 2}  # fmt: skip
    mm.write_model(path, arch="deepseek32", preset="tiny", quant="q8_0", seed=3, n_layer_nextn=1, **yarn_and_groups)
    return path


def test_make_model_writes_what_the_converter_writes(converted, tiny):
    """make-model's tiny deepseek32 against the converter's file: the same deepseek32.* keys with the
    same value types, and the same tensor names with the same ranks."""
    theirs, ours = gguf.GGUFReader(str(converted.gguf["f32"])), gguf.GGUFReader(tiny)
    keys = {k for k in theirs.fields if k.startswith("deepseek32.")}
    assert keys == {k for k in ours.fields if k.startswith("deepseek32.")}
    for key in keys:
        assert theirs.fields[key].types == ours.fields[key].types, key
    # DeepSeek's MTP block also holds copies of the embedding and the LM head, which make-model
    # writes; the test checkpoint's block (hf_export._add_glm_nextn_layer) leaves them out.
    copies = {"blk.3.nextn.embed_tokens.weight", "blk.3.nextn.shared_head_head.weight"}
    their_tensors = {t.name: len(t.shape) for t in theirs.tensors}
    assert their_tensors == {t.name: len(t.shape) for t in ours.tensors if t.name not in copies}
    assert copies <= {t.name for t in ours.tensors}
    # The tiny preset really selects: its top_k is below the prompts the shared arch tests decode.
    s = sharpi.Session(tiny, threads=1, n_ctx=64)
    assert s.info["arch"] == "deepseek32"
    assert inspect_summary(tiny)["attention"]["indexer_top_k"] == 8


def test_preset_plans_the_published_shapes():
    """deepseek-ai/DeepSeek-V3.2's config.json as DeepseekV32Model writes it, its MTP block included.
    Planned, not written (the Q4_K_M file is ~384 GiB)."""
    from sharpi.presets import resolve
    from sharpi.tensor_plan import plan_tensors

    hp = resolve(preset="deepseek-v3.2")
    assert (hp.arch, hp.n_layer, hp.n_layer_nextn, hp.n_embd, hp.n_head, hp.n_vocab) == (
        "deepseek32", 61, 1, 7168, 128, 129280
    )
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff_exp, hp.n_ff_shexp, hp.n_layer_dense_lead) == (256, 8, 2048, 2048, 3)
    assert (hp.indexer_n_head, hp.indexer_head_dim, hp.indexer_top_k) == (64, 128, 2048)
    specs = {s.name: s for s in plan_tensors(hp, "q4_k_m")}
    assert specs["blk.0.ffn_gate.weight"].ne == (7168, 18432)
    assert specs["blk.3.attn_q_a.weight"].ne == (7168, 1536) and specs["blk.3.attn_q_b.weight"].ne == (1536, 128 * 192)
    assert specs["blk.3.attn_kv_a_mqa.weight"].ne == (7168, 512 + 64)
    assert specs["blk.3.attn_k_b.weight"].ne == (128, 512, 128) and specs["blk.3.attn_v_b.weight"].ne == (512, 128, 128)
    assert specs["blk.3.indexer.attn_q_b.weight"].ne == (1536, 64 * 128)
    assert specs["blk.3.indexer.attn_k.weight"].ne == (7168, 128) and specs["blk.3.indexer.proj.weight"].ne == (7168, 64)
    assert specs["blk.3.indexer.k_norm.bias"].ne == (128,) and specs["blk.3.exp_probs_b.bias"].ne == (256,)
    assert specs["blk.60.ffn_down_exps.weight"].ne == (2048, 7168, 256)
    assert specs["blk.61.nextn.eh_proj.weight"].ne == (2 * 7168, 7168)
    total = sum(s.n_elements for s in specs.values())
    mtp = sum(s.n_elements for name, s in specs.items() if name.startswith("blk.61."))
    assert total == pytest.approx(685e9, rel=0.005)  # "685B": the checkpoint with its MTP block
    assert total - mtp == pytest.approx(671e9, rel=0.005)  # the trunk, DeepSeek-V3's 671B
    embeddings = 2 * 129280 * 7168
    active = total - mtp - 58 * (256 - 8) * 3 * 7168 * 2048 - embeddings
    assert active == pytest.approx(37e9, rel=0.02)  # "A37B"


def test_make_model_tiny_matches_llama_cpp(tmp_path):
    """A third, independent implementation: llama.cpp's own deepseek32 graph (llama-cpp-python) on
    make-model's tiny deepseek32 at small widths (f32 weights and KV cache, so only rounding differs:
    measured 8e-7), over 24 tokens with the indexer's top-8, so 16 positions attend sparsely. (The
    converter's test checkpoint has 32-wide indexer heads, which llama.cpp's 64-wide Hadamard
    rotation of the indexer cannot multiply; DeepSeek-V3.2's are 128.) The same file with top_k
    above the prompt length (dense MLA) differs from llama.cpp by far more."""
    llama_cpp = require_llama_cpp()
    small = {"n_vocab": 512, "n_embd": 128, "n_ff": 128, "n_ff_exp": 64, "n_ff_shexp": 128}
    path = str(tmp_path / "deepseek32-small.gguf")
    mm.write_model(path, arch="deepseek32", preset="tiny", quant="f32", seed=5, **small)
    tokens = [int(t) for t in np.random.default_rng(0).integers(5, 500, 24)]
    llm = llama_cpp.Llama(path, n_ctx=64, n_threads=2, logits_all=True, verbose=False, type_k=0, type_v=0)
    llm.eval(tokens)
    theirs = np.array(llm.scores[: len(tokens)], dtype=np.float64)
    ours = _logits(sharpi.Session(path, threads=THREADS, exact=True), tokens)
    rel = np.abs(ours - theirs).max(axis=1) / np.abs(theirs).max(axis=1)
    assert rel.max() <= 1e-5, rel
    dense_path = str(tmp_path / "dense.gguf")
    rewrite_gguf(path, dense_path, set_kv={"deepseek32.attention.indexer.top_k": 4096})
    dense = _logits(sharpi.Session(dense_path, threads=THREADS, exact=True), tokens)
    rel_dense = np.abs(dense - theirs).max(axis=1) / np.abs(theirs).max(axis=1)
    assert np.all(rel_dense[:8] <= 1e-5) and np.median(rel_dense[8:]) > 1e-3, rel_dense


@pytest.mark.parametrize("exact, bytes_per_element", [(True, 4), (False, 2)])
def test_the_budget_charges_the_indexer_keys_with_the_kv_cache(converted, exact, bytes_per_element):
    """Each layer's KV row holds the latent (64), the RoPE key (16) and the indexer's key (32), in
    cache_type_k (f32 in exact mode, f16 otherwise), for every position of every sequence."""
    n_ctx, n_seq = 96, 2
    s = sharpi.Session(str(converted.gguf["f32"]), threads=1, n_ctx=n_ctx, n_seq=n_seq, exact=exact)
    assert s.info["bytes_kv"] == n_seq * 3 * n_ctx * (64 + 16 + 32) * bytes_per_element
