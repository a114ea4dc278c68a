"""The float64 numpy reference, run on files written by llama.cpp's real converter, against
Hugging Face transformers on the same (tiny, random) weights.

This validates the oracle itself: architecture semantics (RoPE flavour, q/k norms, biases, routing
and renormalisation, shared expert, tied embeddings, linear RoPE scaling) and the facts about real
files (tensor names, expert stacking, the q/k row reordering for llama, shapes such as qwen2moe's
[n_embd, 1] shared-expert gate). HF runs in float64 on the float32 weights the f32 file holds, so
the two agree to ~2e-7 (HF computes RoPE angles in float32); the budget is 1e-4.

Skips (never fails) without torch/transformers or when the converter cannot be fetched.
"""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5.0")  # rope_parameters, experts_implementation

from reference import hf_export
from reference.compare import assert_greedy_match, assert_logits_match
from reference.numpy_forward import ReferenceModel, forward, greedy_generate, relative_error

F32_BUDGET = 1e-4
N_PROMPT = 16
N_GREEDY = 32
QUANTIZED_BUDGET = hf_export.QUANTIZED_VS_HF_BUDGET  # see its comment: quantization error only


@pytest.fixture(scope="module")
def converter():
    try:
        return hf_export.converter_dir()
    except hf_export.ConverterUnavailable as error:
        pytest.skip(f"llama.cpp converter unavailable: {error}")


def _prompt(exported, salt: int):
    # Fresh tokens per model, reproducible: the seed mixes the model name and a per-test salt.
    seed = sum(map(ord, exported.name)) * 1000 + salt
    return hf_export.random_prompt(exported.vocab_size, N_PROMPT, seed)


def _assert_not_degenerate(ref: ReferenceModel, result):
    """A comparison on near-constant logits or on a router that always picks the same experts would
    prove little; the weight scale in hf_export is chosen so that neither happens."""
    assert np.std(result.logits) > 0.1, "logits are nearly constant: the comparison would be vacuous"
    assert np.min(np.std(result.logits, axis=1)) > 0.05
    hp = ref.hparams
    for il, selected in enumerate(result.selected_experts):
        used = np.unique(selected)
        assert used.size >= hp.n_expert // 2, (
            f"layer {il} routes {N_PROMPT} tokens to only experts {used.tolist()}"
        )


@pytest.mark.parametrize("name", sorted(hf_export.HF_ARCHS))
def test_reference_matches_transformers(name, converter, model_dir):
    converted = hf_export.prepare(name, model_dir, converter, outtypes=("f32",))
    exported = converted.exported
    ref = ReferenceModel(converted.gguf["f32"])
    assert ref.hparams.arch == exported.gguf_arch
    assert (ref.hparams.n_expert > 0) == (name in hf_export.MOE_MODELS)
    assert {t.name for t in ref.tensor_types.values()} == {"F32"}

    hf = hf_export.load_hf_model_f64(exported.hf_dir)
    prompt = _prompt(exported, salt=1)
    result = forward(ref, prompt)
    _assert_not_degenerate(ref, result)

    def layer_report():
        hidden = hf_export.hf_hidden_states(hf, prompt)
        lines = [
            f"  l_out-{il} vs HF hidden_states[{il + 1}]: {relative_error(result.intermediates[f'l_out-{il}'], hidden[il + 1]):.3e}"
            for il in range(ref.hparams.n_layer - 1)  # HF's last entry is after the final norm
        ]
        return "per-layer agreement:\n" + "\n".join(lines)

    assert_logits_match(
        hf_export.hf_logits(hf, prompt),
        result,
        F32_BUDGET,
        f"{name}: HF logits vs reference",
        n_expert_used=ref.hparams.n_expert_used,
        actual_router_scores=lambda: hf_export.hf_router_logits(hf, prompt),
        diagnose=layer_report,
    )

    reference_tokens = greedy_generate(ref, prompt, N_GREEDY)
    hf_tokens = hf_export.hf_greedy(hf, prompt, N_GREEDY)
    if hf_tokens != reference_tokens:
        # Explain the first difference (fails unless it is an output-logit near-tie).
        along_hf = forward(ref, prompt + hf_tokens).logits
        diverged_at = assert_greedy_match(hf_tokens, along_hf, len(prompt), f"{name}: HF greedy vs reference")
        assert diverged_at is not None and hf_tokens[:diverged_at] == reference_tokens[:diverged_at]


# Each row breaks one convention the reference must get right; the reference so altered must then
# disagree with HF by far more than the budget. This is what shows the test above can fail, and
# that the converter's llama q/k row reordering and the per-arch routing rules are really exercised.
BROKEN_CONVENTIONS = [
    ("mixtral", "neox_rope", True),  # llama files need normal RoPE (rows reordered by the converter)
    ("llama", "neox_rope", True),
    ("qwen3moe", "neox_rope", False),  # qwen/olmoe need NeoX RoPE
    ("olmoe", "neox_rope", False),
    ("mixtral", "renormalise_topk", False),  # Mixtral renormalises its top-k weights
    ("qwen3moe", "renormalise_topk", False),
    ("qwen2moe", "renormalise_topk", True),  # Qwen1.5-MoE and OLMoE do not
    ("olmoe", "renormalise_topk", True),
    ("qwen2moe", "rope_freq_scale", 1.0),  # linear RoPE scaling (factor 2) must be applied
]


@pytest.mark.parametrize("name,field,wrong_value", BROKEN_CONVENTIONS)
def test_reference_with_a_broken_convention_disagrees(name, field, wrong_value, converter, model_dir):
    converted = hf_export.prepare(name, model_dir, converter, outtypes=("f32",))
    ref = ReferenceModel(converted.gguf["f32"])
    assert getattr(ref.hparams, field) != wrong_value
    prompt = _prompt(converted.exported, salt=2)
    hf = hf_export.load_hf_model_f64(converted.exported.hf_dir)
    expected = hf_export.hf_logits(hf, prompt)
    assert relative_error(forward(ref, prompt).logits, expected) <= F32_BUDGET

    ref.hparams = dataclasses.replace(ref.hparams, **{field: wrong_value})
    broken_error = relative_error(forward(ref, prompt).logits, expected)
    assert broken_error > 100 * F32_BUDGET, (
        f"{name} with {field}={wrong_value} still matches HF ({broken_error:.2e})"
    )


def _is_kept_f32(tensor_name: str) -> bool:
    """Tensors llama.cpp's converter keeps in f32 whatever --outtype says: 1-D ones (norms, biases)
    and the routers."""
    return tensor_name.endswith(("_norm.weight", ".bias")) or ".ffn_gate_inp" in tensor_name


# The hybrid models (and nemotron_h's Mamba-2, hf_export.RECURRENT_MODELS) are left out here: their DeltaNet recurrence carries weight rounding from position
# to position (measured on the f16 file: 1.6e-3 at position 0 growing to 6.4e-3 by position 6, then a
# top-k flip), so a budget loose enough for them would no longer catch layout errors. Their quantized
# files are checked where it is exact: sharpi vs this reference on the same file
# (test_model_vs_transformers.py, test_model_vs_reference.py).
@pytest.mark.parametrize("outtype", sorted(QUANTIZED_BUDGET))
@pytest.mark.parametrize("name", sorted(set(hf_export.MOE_MODELS) - hf_export.RECURRENT_MODELS))
def test_reference_on_converter_quantized_files(name, outtype, converter, model_dir):
    converted = hf_export.prepare(name, model_dir, converter, outtypes=(outtype,))
    ref = ReferenceModel(converted.gguf[outtype])
    types = {tensor: t.name for tensor, t in ref.tensor_types.items()}
    expected_type = outtype.upper()
    for tensor, type_name in types.items():
        if _is_kept_f32(tensor):
            assert type_name == "F32", f"{tensor} is {type_name}; routers, norms and biases stay f32"
    # The last block is a MoE block in every model (deepseek2's leading blocks are dense); deepseek2
    # has no attn_q when q goes through a LoRA (attn_q_a / attn_q_b).
    last = f"blk.{ref.hparams.n_layer - 1}"
    for kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "attn_q", "attn_output"):
        if kind == "attn_q" and not ref.has(f"{last}.attn_q.weight"):
            kind = "attn_q_b"
        assert types[f"{last}.{kind}.weight"] == expected_type, (
            f"{last}.{kind}.weight is {types[f'{last}.{kind}.weight']}"
        )
    if name == "qwen2moe":
        # The converter writes the shared-expert gate as ggml [n_embd, 1] (numpy [1, n_embd]).
        assert ref.get("blk.0.ffn_gate_inp_shexp.weight").shape == (1, ref.hparams.n_embd)

    prompt = _prompt(converted.exported, salt=3)
    hf = hf_export.load_hf_model_f64(converted.exported.hf_dir)
    on_file = forward(ref, prompt)
    assert_logits_match(
        on_file.logits,
        hf_export.hf_forward_result(hf, prompt, ref.hparams.n_expert_used),
        QUANTIZED_BUDGET[outtype],
        f"{name}: reference on the converter's {outtype} file vs HF",
        ref.hparams.n_expert_used,
        actual_router_scores=on_file.router_logits,
        near_tie=hf_export.QUANTIZED_VS_HF_NEAR_TIE[outtype],
    )
