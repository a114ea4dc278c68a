"""nemotron_h_moe (NVIDIA Nemotron-H MoE: Nemotron 3 Nano 30B-A3B) beyond the logits checks every MoE
family gets in test_model_vs_transformers.py (f32 vs transformers exactly: prefill, token by token,
32 greedy tokens; f16 / q8_0 vs the float64 reference) and test_reference_vs_transformers.py.

Here, on a tiny random transformers NemotronHForCausalLM checkpoint (6 blocks: Mamba-2, MoE, NoPE
attention, MoE, Mamba-2, MoE) converted by llama.cpp's converter (tests/reference/hf_export.py):
  - the file carries the block pattern as per-layer arrays, the Mamba-2 shape and the relu^2 MoE
    layout (the converter's own keys and tensor shapes, read with the gguf package), and inspect
    describes it;
  - the Mamba-2 state: prefill == token-by-token decode bit for bit (the scan is sequential in both),
    reset() clears it, a fork keeps it only whole, and a rewindable (speculative) step rolls back to
    any position inside it exactly as if the rejected tokens had never been decoded;
  - streamed == resident bit for bit at a quarter budget, for the pread and io_uring readers
    (f32 and q8_0 converter files);
  - Q4_K_M by llama.cpp's own llama-quantize (from a 256-wide checkpoint): exact mode within 1e-4
    of the float64 reference on the dequantized weights, and streamed == resident bit for bit;
  - make-model's tiny nemotron_h_moe carries the converter's keys (and value types) and tensor names;
  - Nemotron 3 Super's latent MoE (moe_latent_size): the converter's tensors, slots of the latent
    width, streamed == resident (its logits vs transformers: test_model_vs_transformers.py);
  - refusals: group-limited routing, latent tensors without their width, incomplete files;
  - the nemotron-3-nano-30b-a3b preset plans the published shapes (planned, not written).

Skips (never fails) without torch/transformers or when the converter cannot be fetched; the
llama-quantize tests skip (fail under SHARPI_REQUIRE_ALL=1) without it.
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
from reference.numpy_forward import ReferenceModel, forward
from sharpi import make_model as mm
from sharpi.inspect_model import inspect_report, inspect_summary

QT = gguf.GGMLQuantizationType
THREADS = 2
PROMPT = hf_export.random_prompt(384, 16, seed=42)
ARCH = "nemotron_h_moe"


@pytest.fixture(scope="module")
def converter():
    try:
        return hf_export.converter_dir()
    except hf_export.ConverterUnavailable as error:
        pytest.skip(f"llama.cpp converter unavailable: {error}")


@pytest.fixture(scope="module")
def files(converter, model_dir):
    return hf_export.prepare("nemotron_h", model_dir, converter, outtypes=("f32", "q8_0")).gguf


def _metadata(path):
    reader = gguf.GGUFReader(str(path))
    md = {name: f.contents() for name, f in reader.fields.items() if f.types}
    return md, {t.name: t for t in reader.tensors}


def _session(path, **kw):
    return sharpi.Session(str(path), threads=THREADS, n_ctx=kw.pop("n_ctx", 128), **kw)


def test_converter_file_carries_the_nemotron_h_parameters(files):
    md, tensors = _metadata(files["f32"])
    p = ARCH + "."
    assert md[p + "attention.head_count_kv"] == [0, 0, 2, 0, 0, 0]  # attention only on block 2
    assert md[p + "feed_forward_length"] == [0, 64, 0, 64, 0, 64]  # MoE on blocks 1, 3, 5
    want = {
        "block_count": 6,
        "ssm.conv_kernel": 4,
        "ssm.state_size": 16,
        "ssm.group_count": 2,
        "ssm.time_step_rank": 4,  # Mamba-2 heads
        "ssm.inner_size": 128,  # heads * head_dim
        "expert_count": 16,
        "expert_used_count": 4,
        "expert_shared_feed_forward_length": 96,
        "expert_weights_norm": True,
    }
    for key, value in want.items():
        assert md[p + key] == value, key
    assert md[p + "expert_weights_scale"] == pytest.approx(2.5)
    assert p + "expert_gating_func" not in md and p + "attention.layer_norm_rms_epsilon" not in md
    assert tuple(tensors["blk.0.ssm_in.weight"].shape) == (128, 2 * 128 + 2 * 2 * 16 + 4)
    assert tuple(tensors["blk.0.ssm_norm.weight"].shape) == (64, 2)  # one row per group
    assert tuple(tensors["blk.0.ssm_a"].shape) == (1, 4)
    assert "blk.1.ffn_up_exps.weight" in tensors and "blk.1.ffn_gate_exps.weight" not in tensors
    assert "blk.1.ffn_up_shexp.weight" in tensors and "blk.1.ffn_gate_shexp.weight" not in tensors
    assert not any(name.startswith("blk.2.") and "rope" in name for name in tensors)
    info = _session(files["f32"]).info
    assert (info["arch"], info["n_layer"], info["n_expert"], info["n_expert_used"]) == (ARCH, 6, 16, 4)
    assert info["recurrent"]


def test_inspect_describes_nemotron_h(files):
    summary = inspect_summary(files["f32"])
    assert summary["layer_kinds"] == "ME*EME"
    attention = summary["attention"]
    assert (attention["kind"], attention["head_dim"], attention["rope"]) == ("gqa", 48, "none (NoPE)")
    routing = summary["routing"]
    assert routing["gating"] == "sigmoid" and routing["selection_bias"] and routing["weights_norm"]
    assert (routing["weights_scale"], routing["shared_experts"], routing["shared_gate"]) == (2.5, 1, False)
    assert routing["expert_ffn"] == "down(relu(up x)^2), no gate"
    report = inspect_report(files["f32"])
    assert "blocks (M = Mamba-2, E = MoE, * = attention without RoPE): ME*EME" in report


# ----------------------------------------------------------------------------------------------
# The Mamba-2 state


def test_prefill_equals_token_by_token_bit_for_bit(files):
    prefill = np.asarray(_session(files["f32"], exact=True).decode(PROMPT, True)).reshape(len(PROMPT), -1)
    s = _session(files["f32"], exact=True)
    stepwise = np.stack([np.asarray(s.decode([t], True)).reshape(-1) for t in PROMPT])
    np.testing.assert_array_equal(stepwise, prefill)
    # And both are the float64 reference's (an independent oracle, not the engine against itself).
    ref = forward(ReferenceModel(files["f32"]), PROMPT).logits
    rel = np.abs(prefill - ref).max() / np.abs(ref).max()
    assert rel <= 1e-4, rel


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_fast_mode_prefill_equals_token_by_token_bit_for_bit(files, outtype):
    """Fast mode (quantized activations) too. Fast vs exact is not held to test_fast_mode's budgets
    here, as for the DeltaNet hybrids: the recurrence carries the activation rounding along the
    sequence (measured on the q8_0 file, 60 random 48-token prompts: median error up to 6.3e-2,
    argmax agreement down to 0.75)."""
    s = _session(files[outtype])
    prefill = np.asarray(s.decode(PROMPT, True)).reshape(len(PROMPT), -1)
    s.reset()
    stepwise = np.stack([np.asarray(s.decode([t])).reshape(-1) for t in PROMPT])
    np.testing.assert_array_equal(stepwise, prefill)


def test_reset_clears_the_recurrent_state(files):
    s = _session(files["f32"], n_ctx=64)
    first = np.asarray(s.decode(PROMPT, True))
    continued = np.asarray(s.decode(PROMPT[:3]))
    s.reset()
    np.testing.assert_array_equal(np.asarray(s.decode(PROMPT, True)), first)
    fresh = np.asarray(_session(files["f32"], n_ctx=64).decode(PROMPT[:3]))
    assert not np.array_equal(continued, fresh)


def test_the_budget_charges_the_state_and_its_rewind_copies(files):
    """The per-sequence Mamba-2 state, from the file's shape (independent of the engine): per Mamba-2
    block (2) a conv state of (d_conv - 1) x (d_inner + 2 n_group d_state) floats and an SSM state of
    heads x head_dim x d_state floats; a session that may verify 6 drafted tokens keeps 6 copies."""
    state = 2 * 4 * ((4 - 1) * (128 + 2 * 2 * 16) + 4 * 32 * 16)
    fixed = {}
    for k in (0, 6):
        probe = _session(files["f32"], n_ctx=64, max_draft_tokens=k, ram_budget="4GiB", reader="pread")
        fixed[k] = probe.expert_stats()["fixed_bytes"]
    assert fixed[6] - fixed[0] == 6 * state


def test_fork_keeps_the_state_only_whole(files):
    s = _session(files["f32"], n_ctx=64, n_seq=2)
    s.decode(PROMPT[:8])
    with pytest.raises(sharpi.UnsupportedError, match="recurrent"):
        s.sequence(0).fork(4)
    child = s.sequence(0).fork()  # whole: the conv and SSM states go with it
    want = np.asarray(_session(files["f32"], n_ctx=64).decode(PROMPT[:9]))
    got = np.asarray(s.decode_batch([(child, PROMPT[8:9])])[0])
    np.testing.assert_array_equal(got, want)


def test_truncate_outside_the_last_rewindable_step_is_refused(files):
    """Prefix reuse follows the DeltaNet archs' rule: the state cannot go back to a position it
    holds no copy of (a typed error; the sequence is left as it was)."""
    s = _session(files["f32"], n_ctx=64)
    s.decode(PROMPT[:8])
    with pytest.raises(sharpi.UnsupportedError, match="cannot be rewound to position 4"):
        s.truncate(4)
    assert s.n_past == 8
    np.testing.assert_array_equal(
        np.asarray(s.decode(PROMPT[8:10])), np.asarray(_session(files["f32"], n_ctx=64).decode(PROMPT[:10]))
    )


def test_rewindable_step_rolls_back_exactly(files):
    """A speculative verify step (rewindable) of 5 tokens, cut back to 2 of them: the next logits
    are those of a session that only ever decoded the 2 accepted tokens, bit for bit."""
    s = _session(files["f32"], n_ctx=64, max_draft_tokens=4)
    s.decode(PROMPT[:6])
    s.decode(PROMPT[6:11], all_logits=True, rewindable=True)
    s.truncate(8)
    got = np.asarray(s.decode(PROMPT[11:13], True))
    plain = _session(files["f32"], n_ctx=64)
    plain.decode(PROMPT[:8])
    np.testing.assert_array_equal(got, np.asarray(plain.decode(PROMPT[11:13], True)))


# ----------------------------------------------------------------------------------------------
# llama.cpp's own nemotron_h_moe graph


def _llama_cpp_logits(path, tokens) -> np.ndarray:
    llama_cpp = require_llama_cpp()
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=THREADS, logits_all=True, verbose=False, type_k=0, type_v=0)
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float64)


def _sharpi_logits(path, tokens) -> np.ndarray:
    ours = sharpi.Session(str(path), threads=THREADS, exact=True).decode(tokens, True)
    return np.asarray(ours, dtype=np.float64).reshape(len(tokens), -1)


def test_converter_file_matches_llama_cpp(files):
    """llama.cpp in f32 with an f32 KV cache, a third implementation: only rounding differs (a wrong
    scan, gate order, group norm or routing rule gives errors of order 1)."""
    theirs = _llama_cpp_logits(files["f32"], PROMPT)
    ours = _sharpi_logits(files["f32"], PROMPT)
    rel = np.abs(ours - theirs).max(axis=1) / np.abs(theirs).max(axis=1)
    assert rel.max() <= 1e-5, rel


def test_preset_at_small_widths_matches_llama_cpp(tmp_path):
    """make-model's nemotron_h_moe file with the real model's block pattern (52 blocks) at small
    widths, as llama.cpp's loader and graph take it."""
    small = {"n_vocab": 512, "n_embd": 128, "n_head": 4, "n_head_kv": 2, "head_dim": 32, "n_expert": 16,
             "n_expert_used": 4, "n_ff_exp": 32, "n_ff_shexp": 64, "ssm_d_state": 16, "ssm_n_group": 2,
             "ssm_dt_rank": 4, "ssm_d_inner": 128}  # fmt: skip
    path = tmp_path / "nemotron-small.gguf"
    mm.write_model(path, preset="nemotron-3-nano-30b-a3b", quant="f32", seed=5, **small)
    tokens = [int(t) for t in np.random.default_rng(0).integers(5, 500, 16)]
    theirs = _llama_cpp_logits(path, tokens)
    ours = _sharpi_logits(path, tokens)
    rel = np.abs(ours - theirs).max(axis=1) / np.abs(theirs).max(axis=1)
    assert rel.max() <= 1e-5, rel


# ----------------------------------------------------------------------------------------------
# Streaming


@pytest.mark.parametrize("reader", ["pread", "io_uring"])
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_streamed_equals_resident_at_a_quarter_budget(files, outtype, reader):
    path = str(files[outtype])

    def open_session(ram_budget):
        budget = {} if ram_budget is None else {"ram_budget": ram_budget, "reader": reader}
        return sharpi.Session(path, threads=THREADS, n_ctx=128, **budget)

    check_streams_like_resident(open_session, PROMPT, 24, f"nemotron_h {outtype} {reader}")


def _slot_region(n_bytes):
    """A slot region of the expert cache: the part's bytes rounded up to 4 KiB plus one 4 KiB block
    of alignment slack (moe/expert_cache.cpp)."""
    return -(-n_bytes // 4096) * 4096 + 4096


def test_cache_slots_hold_no_gate(files):
    """An expert slot holds up and down only (nothing is read or cached for the missing gate): each
    region is the part's bytes rounded up to 4 KiB plus one 4 KiB block of alignment slack
    (moe/expert_cache.cpp), the gate region that slack alone. q8_0: 34 bytes per 32 values."""
    up = down = 64 * 128 // 32 * 34  # [64 x 128] either way
    slot = _session(files["q8_0"], ram_budget="4GiB", reader="pread").expert_stats()["slot_bytes"]
    assert slot == _slot_region(0) + _slot_region(up) + _slot_region(down)


@pytest.fixture(scope="module")
def latent_files(converter, model_dir):
    return hf_export.prepare("nemotron_h_latent", model_dir, converter, outtypes=("f32", "q8_0")).gguf


def test_latent_moe_file_and_its_slots(latent_files):
    """Nemotron 3 Super's latent MoE (moe_latent_size 64 of hidden 128): the converter's tensors,
    and expert slots sized by the latent width (up [64 -> 64], down [64 -> 64], no gate). The logits
    against transformers are test_model_vs_transformers.py's (nemotron_h_latent)."""
    md, tensors = _metadata(latent_files["f32"])
    assert md[ARCH + ".moe_latent_size"] == 64
    assert tuple(tensors["blk.1.ffn_latent_down.weight"].shape) == (128, 64)
    assert tuple(tensors["blk.1.ffn_latent_up.weight"].shape) == (64, 128)
    assert tuple(tensors["blk.1.ffn_up_exps.weight"].shape) == (64, 64, 16)
    slot = _session(latent_files["q8_0"], ram_budget="4GiB", reader="pread").expert_stats()["slot_bytes"]
    part = 64 * 64 // 32 * 34  # up and down: 64 x 64 in q8_0
    assert slot == _slot_region(0) + 2 * _slot_region(part)


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_latent_moe_streams_like_resident(latent_files, outtype):
    path = str(latent_files[outtype])

    def open_session(ram_budget):
        budget = {} if ram_budget is None else {"ram_budget": ram_budget, "reader": "pread"}
        return sharpi.Session(path, threads=THREADS, n_ctx=128, **budget)

    check_streams_like_resident(open_session, PROMPT, 24, f"nemotron_h latent {outtype}")


@pytest.mark.parametrize("predictor", ["prev_token", "next_gate"])
def test_streamed_with_prefetch_equals_resident(files, predictor):
    """Prefetch across the non-MoE blocks: lookahead counts blocks, so lookahead 2 takes a gate
    event of MoE block 1 to block 3 (an attention block between) and of 3 to 5 (as Nemotron 3 Nano's
    MoE blocks alternate with Mamba-2 ones). Lossless whatever the hints."""
    path = str(files["f32"])
    resident = greedy_logits(_session(path), PROMPT, 12)
    probe = _session(path, ram_budget="4GiB", reader="pread")
    st, info = probe.expert_stats(), probe.info
    k, n_moe = info["n_expert_used"], 3
    budget = st["fixed_bytes"] + (n_moe * info["n_expert"] // 4 + 2 * k) * st["slot_bytes"]
    s = _session(path, ram_budget=budget, reader="pread", predictor=predictor, lookahead=2)
    np.testing.assert_array_equal(greedy_logits(s, PROMPT, 12), resident)
    assert sum(lay["prefetch_issued"] for lay in s.expert_stats()["layers"]) > 0


# ----------------------------------------------------------------------------------------------
# make-model and refusals


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("nemotron_tiny") / "nemotron-tiny.gguf")
    mm.write_model(path, arch=ARCH, preset="tiny", quant="q8_0", seed=3)
    return path


def test_make_model_writes_what_the_converter_writes(files, tiny):
    theirs_md, theirs = _metadata(files["f32"])
    ours_md, ours = _metadata(tiny)
    reader_t, reader_o = gguf.GGUFReader(str(files["f32"])), gguf.GGUFReader(tiny)
    arch_keys = {k for k in theirs_md if k.startswith(ARCH + ".")}
    assert arch_keys == {k for k in ours_md if k.startswith(ARCH + ".")}
    for key in arch_keys:
        assert reader_t.fields[key].types == reader_o.fields[key].types, key
    # The same tensor names (both have two Mamba-2 blocks, one attention block and MoE blocks,
    # though in another order) with the same ranks.
    def kinds(names):
        return {name.split(".", 2)[-1] for name in names if name.startswith("blk.")}

    assert kinds(theirs) == kinds(ours)
    for name in set(theirs) & set(ours):
        assert len(theirs[name].shape) == len(ours[name].shape), name


def test_tiny_preset_matches_the_reference(tiny):
    check_exact_file_against_reference(tiny, THREADS, 45, "nemotron_h_moe tiny (make-model q8_0) vs reference")


def test_latent_tensors_without_their_width_are_refused(tiny, tmp_path):
    bad = str(tmp_path / "latent.gguf")
    latent = np.zeros((32, 256), dtype=np.float32)
    rewrite_gguf(tiny, bad, add_tensors={"blk.1.ffn_latent_down.weight": latent})
    with pytest.raises(sharpi.FormatError, match="no moe_latent_size"):
        sharpi.Session(bad, threads=1, n_ctx=32)


def test_group_limited_routing_is_refused(tiny, tmp_path):
    bad = str(tmp_path / "groups.gguf")
    rewrite_gguf(tiny, bad, set_kv={f"{ARCH}.expert_group_count": 2, f"{ARCH}.expert_group_used_count": 1})
    with pytest.raises(sharpi.UnsupportedError, match="expert_group_count"):
        sharpi.Session(bad, threads=1, n_ctx=32)


@pytest.mark.parametrize("dropped, message", [
    (("blk.0.ssm_conv1d.weight",), r"blk\.0\.ssm_conv1d\.weight"),
    (("blk.0.ssm_d",), r"blk\.0\.ssm_d"),
    (("blk.1.exp_probs_b.bias",), r"blk\.1\.exp_probs_b\.bias"),
    (("blk.1.ffn_up_shexp.weight",), r"blk\.1\.ffn_up_shexp\.weight"),
])  # fmt: skip
def test_incomplete_files_are_typed_errors(tiny, tmp_path, dropped, message):
    bad = str(tmp_path / "bad.gguf")
    rewrite_gguf(tiny, bad, drop_tensors=dropped)
    with pytest.raises(sharpi.MissingTensorError, match=message):
        sharpi.Session(bad, threads=1, n_ctx=32)


def test_pattern_arrays_must_cover_every_block(tiny, tmp_path):
    bad = str(tmp_path / "short.gguf")
    rewrite_gguf(tiny, bad, set_kv={f"{ARCH}.feed_forward_length": [0, 256, 0]})
    with pytest.raises(sharpi.FormatError, match="one entry per block"):
        sharpi.Session(bad, threads=1, n_ctx=32)


# ----------------------------------------------------------------------------------------------
# Preset


def test_preset_plans_the_published_shapes():
    """nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16's config.json as NemotronHModel writes it.
    Planned, not written."""
    from sharpi.presets import resolve
    from sharpi.tensor_plan import plan_tensors

    hp = resolve(preset="nemotron-3-nano-30b-a3b")
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim) == (ARCH, 52, 2688, 32, 2, 128)
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff_exp, hp.n_ff_shexp, hp.n_vocab) == (128, 6, 1856, 3712, 131072)
    pattern = hp.layer_pattern
    assert (pattern.count("M"), pattern.count("E"), pattern.count("*")) == (23, 23, 6)
    specs = {s.name: s for s in plan_tensors(hp, "q4_k_m")}
    assert specs["blk.0.ssm_in.weight"].ne == (2688, 2 * 4096 + 2 * 8 * 128 + 64)
    assert specs["blk.0.ssm_conv1d.weight"].ne == (4, 4096 + 2 * 8 * 128)
    assert specs["blk.1.ffn_up_exps.weight"].ne == (2688, 1856, 128)
    assert specs["blk.5.attn_k.weight"].ne == (2688, 2 * 128)
    assert not any("ffn_gate_exps" in name or "rope" in name for name in specs)
    total = sum(s.n_elements for s in specs.values())
    assert total == pytest.approx(31.6e9, rel=0.01)  # the card's 31.6B parameters
    expert = 2 * 2688 * 1856  # up and down, no gate
    active = total - 23 * (128 - 6) * expert
    # The report's "3.2B active (3.6B including embeddings)": the lookup table is not compute.
    assert active == pytest.approx(3.6e9, rel=0.01)
    assert active - 131072 * 2688 == pytest.approx(3.2e9, rel=0.01)


# ----------------------------------------------------------------------------------------------
# Q4_K_M by llama.cpp's own quantizer


@pytest.fixture(scope="module")
def q4_k_m_file(converter, model_dir) -> str:
    f16 = hf_export.prepare("nemotron_h_256", model_dir, converter, outtypes=("f16",)).gguf["f16"]
    return str(llama_quantize(f16, f16.parent / "nemotron_h_256-q4_k_m.gguf", "Q4_K_M", THREADS))


def test_q4_k_m_file_holds_a_mix(q4_k_m_file):
    _, tensors = _metadata(q4_k_m_file)
    types = {name: QT(int(t.tensor_type)) for name, t in tensors.items()}
    assert types["blk.1.ffn_up_exps.weight"] == QT.Q4_K and types["blk.1.exp_probs_b.bias"] == QT.F32
    assert {QT.Q4_K, QT.Q6_K} <= set(types.values()), sorted((n, t.name) for n, t in types.items())


def test_q4_k_m_exact_mode_matches_reference(q4_k_m_file):
    check_exact_file_against_reference(q4_k_m_file, THREADS, 44, "nemotron_h Q4_K_M (llama-quantize) vs reference")


@pytest.mark.parametrize("exact", [False, True])
def test_q4_k_m_streams_bit_identically_at_a_quarter_budget(q4_k_m_file, exact):
    open_session = session_opener(q4_k_m_file, threads=THREADS, n_ctx=128, exact=exact)

    check_streams_like_resident(open_session, PROMPT, 24, f"nemotron_h Q4_K_M exact={exact}")
