"""sharpi's C++ engine on files written by llama.cpp's real converter, against Hugging Face
transformers on the same tiny random models (tests/reference/hf_export.py).

f32 files: sharpi's logits vs HF's (float64 on the same float32 weights) within 1e-4 on every
position, for prefill, token-by-token decode and 32 greedy tokens (which must be HF's greedy tokens).
f16 / q8_0 files: sharpi vs the float64 reference on the same file within 1e-4 (the weights are
identical after dequantization), and vs HF within the quantization budget of hf_export (a top-k
flip is accepted there only at a router margin quantization can explain, and only if every
position before it matches).

Skips (never fails) without torch/transformers or when the converter cannot be fetched.
"""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5.0")  # rope_parameters, experts_implementation

import sharpi
from reference import hf_export
from reference.compare import assert_logits_match
from reference.engine_checks import check_greedy, check_prefill_and_stepwise, prefill_router_scores
from reference.numpy_forward import ReferenceModel, forward

if not hasattr(sharpi, "Session"):
    pytest.skip("this build of sharpi has no Session (engine not merged yet)", allow_module_level=True)

F32_BUDGET = 1e-4
SAME_FILE_BUDGET = 1e-4  # sharpi vs the reference on one quantized file: see test_model_vs_reference
N_PROMPT = 16
N_GREEDY = 32
THREADS = 2


@pytest.fixture(scope="module")
def converter():
    try:
        return hf_export.converter_dir()
    except hf_export.ConverterUnavailable as error:
        pytest.skip(f"llama.cpp converter unavailable: {error}")


def _prompt(name: str, vocab_size: int, salt: int):
    return hf_export.random_prompt(vocab_size, N_PROMPT, sum(map(ord, name)) * 1000 + salt)


def _session_opener(path):
    def open_session(dump_activations):
        # Exact mode: transformers computes in f32 on the same dequantized weights.
        return sharpi.Session(path, threads=THREADS, n_ctx=0, exact=True, dump_activations=dump_activations)

    return open_session


@pytest.mark.parametrize("name", sorted(hf_export.HF_ARCHS))
def test_sharpi_matches_transformers(name, converter, model_dir):
    converted = hf_export.prepare(name, model_dir, converter, outtypes=("f32",))
    path = converted.gguf["f32"]
    hf = hf_export.load_hf_model_f64(converted.exported.hf_dir)
    n_expert_used = int(getattr(hf.config, "num_experts_per_tok", 0) or 0)
    prompt = _prompt(name, converted.exported.vocab_size, salt=11)
    what = f"{name} (converter f32) vs HF"

    def expected_for(tokens):
        return hf_export.hf_forward_result(hf, tokens, n_expert_used)

    open_session = _session_opener(path)
    check_prefill_and_stepwise(open_session, prompt, expected_for(prompt), F32_BUDGET, what, n_expert_used)
    check_greedy(open_session, prompt, expected_for, N_GREEDY, F32_BUDGET, what, n_expert_used)


@pytest.mark.parametrize("outtype", sorted(hf_export.QUANTIZED_VS_HF_BUDGET))
@pytest.mark.parametrize("name", sorted(hf_export.MOE_MODELS))
def test_sharpi_on_converter_quantized_files(name, outtype, converter, model_dir):
    converted = hf_export.prepare(name, model_dir, converter, outtypes=(outtype,))
    path = converted.gguf[outtype]
    ref = ReferenceModel(path)
    k = ref.hparams.n_expert_used
    prompt = _prompt(name, converted.exported.vocab_size, salt=12)
    what = f"{name} (converter {outtype}) vs reference"

    open_session = _session_opener(path)
    check_prefill_and_stepwise(open_session, prompt, forward(ref, prompt), SAME_FILE_BUDGET, what, k)
    check_greedy(
        open_session, prompt, lambda tokens: forward(ref, tokens), N_GREEDY, SAME_FILE_BUDGET, what, k
    )

    if name in hf_export.RECURRENT_MODELS:
        return  # no HF budget for them: see test_reference_on_converter_quantized_files
    # And against HF, with the quantization budget; a top-k flip is accepted only where the router
    # margin is within what quantization moves router logits by (hf_export).
    hf = hf_export.load_hf_model_f64(converted.exported.hf_dir)
    logits = np.asarray(open_session(False).decode(prompt, True), dtype=np.float64).reshape(len(prompt), -1)
    assert_logits_match(
        logits,
        hf_export.hf_forward_result(hf, prompt, k),
        hf_export.QUANTIZED_VS_HF_BUDGET[outtype],
        f"{name} (converter {outtype}) vs HF",
        k,
        actual_router_scores=lambda: prefill_router_scores(open_session, prompt, ref.hparams.n_layer),
        near_tie=hf_export.QUANTIZED_VS_HF_NEAR_TIE[outtype],
    )
