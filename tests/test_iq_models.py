"""Whole models in the IQ quant types (issue 19), written by `sharpi make-model`: each decodes in
exact mode against the float64 numpy reference on the same file's dequantized weights (the gguf
package dequantizes, tests/reference), and streams bit-identically to resident at a 25% budget.

The files: a dynamic mix (`iq2_xxs_mix`: IQ2_XXS expert gate/up, IQ3_S expert down, Q4_K / Q6_K
dense parts) and one file per IQ type (every weight matrix in that type). make-model's IQ tensors
are random blocks with valid f16 scales (no numpy IQ quantizer exists); the kernels are checked
against gguf's dequantize block by block in test_quant.py / test_qdot.py, and here the writer's
blocks go through the same oracle, so the writer is never its own reference.
"""

import gguf
import numpy as np
import pytest
import sharpi
from reference.engine_checks import (
    check_greedy,
    check_prefill_and_stepwise,
    check_streams_like_resident,
    session_opener,
)
from reference.numpy_forward import ReferenceModel, forward
from sharpi.make_model import write_model

QT = gguf.GGMLQuantizationType
IQ_TYPES = ["iq4_nl", "iq4_xs", "iq3_s", "iq3_xxs", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_s", "iq1_m"]
BUDGET = 1e-4  # exact mode: f32 vs float64 arithmetic on identical weights (test_model_vs_reference)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("iq_models")
    cache = {}

    def get(quant, arch="qwen3moe"):
        if (quant, arch) not in cache:
            path = str(d / f"{arch}-{quant}.gguf")
            write_model(path, arch=arch, preset="tiny", quant=quant, seed=19)
            cache[quant, arch] = path
        return cache[quant, arch]

    return get


def _types(path):
    return {t.name: QT(int(t.tensor_type)) for t in gguf.GGUFReader(path).tensors}


def test_mix_has_the_recipe_types(model_path):
    types = _types(model_path("iq2_xxs_mix"))
    assert {t for n, t in types.items() if ".ffn_gate_exps." in n or ".ffn_up_exps." in n} == {QT.IQ2_XXS}
    assert {t for n, t in types.items() if ".ffn_down_exps." in n} == {QT.IQ3_S}
    assert {t for n, t in types.items() if ".attn_v." in n} == {QT.Q6_K}
    assert types["output.weight"] == QT.Q6_K
    assert {t for n, t in types.items() if ".attn_q." in n or ".attn_output." in n} == {QT.Q4_K}


@pytest.mark.parametrize("quant", ["iq2_xxs_mix"] + IQ_TYPES)
def test_writer_blocks_dequantize_finite_with_calibrated_std(model_path, quant):
    # gguf's dequantize (the oracle, not the writer) on every IQ tensor: finite, centred, the std the
    # float weights would have.
    path = model_path(quant)
    for t in gguf.GGUFReader(path).tensors:
        if QT(int(t.tensor_type)).name.startswith("IQ"):
            x = gguf.quants.dequantize(np.asarray(t.data), QT(int(t.tensor_type))).astype(np.float64)
            assert np.isfinite(x).all(), t.name
            if not any(k in t.name for k in ("attn_q.", "ffn_up", "ffn_gate_exps", "ffn_down_exps")):
                continue  # other roles have other target stds (tensor_plan.TensorSpec.init_std)
            want = 1 / np.sqrt(int(t.shape[0]))
            assert abs(x.std() / want - 1) < 0.15, (t.name, x.std(), want)
            assert abs(x.mean()) < 0.1 * want, (t.name, x.mean())


def _check_exact(path):
    ref = ReferenceModel(path)
    hp = ref.hparams
    prompt = [int(t) for t in np.random.default_rng(7).integers(0, hp.n_vocab, size=12)]

    def open_session(dump_activations):
        return sharpi.Session(path, threads=2, n_ctx=0, exact=True, dump_activations=dump_activations)

    what = f"{path}/exact"
    check_prefill_and_stepwise(open_session, prompt, forward(ref, prompt), BUDGET, what, hp.n_expert_used)
    check_greedy(open_session, prompt, lambda tokens: forward(ref, tokens), 16, BUDGET, what, hp.n_expert_used)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_mix_matches_reference_in_exact_mode(model_path, arch):
    _check_exact(model_path("iq2_xxs_mix", arch))


@pytest.mark.parametrize("quant", IQ_TYPES)
def test_each_iq_type_matches_reference_in_exact_mode(model_path, quant):
    path = model_path(quant)
    assert QT[quant.upper()] in set(_types(path).values())
    _check_exact(path)


@pytest.mark.parametrize("exact", [True, False])
def test_mix_streams_bit_identically_at_a_quarter_budget(model_path, exact):
    path = model_path("iq2_xxs_mix")

    open_session = session_opener(path, threads=2, n_ctx=128, exact=exact)

    check_streams_like_resident(open_session, list(range(5, 25)), 24, f"iq2_xxs_mix exact={exact}")
