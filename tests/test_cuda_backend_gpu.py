"""The CUDA backend (cuda/cuda_backend.cuh) on a device: the layer builders run on the GPU through the
backend interface, the one forward pass of issue 38 (marker `gpu`; skipped without a device).

- every architecture of presets.ARCHES whose op sequence the support table allows (judged on the
  host from the CPU's recorded calls, as tests/test_backend_ops.py does), for q8_0 and f32 weights:
  the CUDA backend's logits of every prompt row in exact mode equal the CPU backend's within the
  exact-mode budget below;
- every architecture the table refuses raises UnsupportedError whose text is "[cuda] " + the
  table's reason for the first refused call, and that call is one of the ops test_backend_ops
  expects to block the architecture (written there from what the architecture computes);
- prefill == token by token on the device, bit for bit (exact and fast mode, an f32 KV cache; fast
  mode's default f16 cache is refused by name);
- for the plain MoE architectures the old device forward pass (Session(device="cuda"),
  cuda/device_forward.cu) also runs: the same kernels in the same order, so the same bits.

Budget (exact mode): both backends dequantize the same weights to the same f32 (block_math.cuh is
checked bit for bit against the gguf package in test_cuda_gpu) and multiply f32 activations, so they
differ only in f32 summation order (warp trees on the device, SIMD lanes on the CPU) and expf. A dot
of n terms then differs by at most ~n u sum|w x| (u = 2^-24; n <= 1024 in the tiny models, so below
1e-4 relative per product even in the worst case), and test_cuda_gpu measured the same kernels
end to end against the CPU at a worst 4.9e-7 relative error. The budget is that file's 1e-4 on
max|gpu - cpu| / max|cpu| over all rows. A router near-tie flipped by such an error would change a
token's experts and exceed the budget: the fixed seed's models have none (the CPU and the device
route alike, as test_cuda_gpu also asserts for the same kernels).
"""

from __future__ import annotations

import numpy as np
import pytest
import sharpi
from sharpi import _internal, presets
from sharpi.make_model import write_model
from test_backend_ops import EXPECTED_BLOCKERS, MAY_ALSO_BLOCK

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not sharpi.cuda_available(), reason="no CUDA device"),
]

QUANTS = ("q8_0", "f32")
EXACT_BUDGET = 1e-4  # relative, see the module docstring
PLAIN_MOE = ("qwen3moe", "qwen2moe", "olmoe", "llama")  # what device_forward.cu also runs
PROMPT = [5, 17, 300, 2, 999, 41, 7, 123, 64]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda_backend")
    cache = {}

    def get(arch, quant):
        if (arch, quant) not in cache:
            path = root / f"{arch}-{quant}.gguf"
            write_model(path, arch=arch, preset="tiny", quant=quant, seed=5)
            cache[arch, quant] = str(path)
        return cache[arch, quant]

    return get


def first_refusal(path, exact):
    """The table's reason for the first call of the recorded forward pass it refuses, or None."""
    for op, type_, variant in _internal.record_forward_ops(path, PROMPT, exact=exact):
        why = _internal.cuda_unsupported_op(op, type_, variant)
        if why:
            return op, why
    return None


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", presets.ARCHES)
def test_gpu_backend_matches_the_cpu_backend_or_names_the_op_it_lacks(model_file, arch, quant):
    path = model_file(arch, quant)
    refusal = first_refusal(path, exact=True)
    if refusal is not None:
        op, why = refusal
        assert op in EXPECTED_BLOCKERS[arch] | MAY_ALSO_BLOCK.get(arch, set()), (arch, op, why)
        with pytest.raises(sharpi.UnsupportedError) as e:
            _internal.forward_logits(path, PROMPT, backend="cuda", exact=True)
        assert str(e.value) == "[cuda] " + why
        return
    assert not EXPECTED_BLOCKERS[arch], f"{arch}: the table allows an arch expected to be blocked"
    want = _internal.forward_logits(path, PROMPT, backend="cpu", exact=True)
    got = _internal.forward_logits(path, PROMPT, backend="cuda", exact=True)
    assert got.shape == want.shape == (len(PROMPT), presets.resolve(arch, "tiny").n_vocab)
    assert np.isfinite(got).all()
    err = rel_err(got, want)
    assert err <= EXACT_BUDGET, f"{arch} {quant}: relative error {err:.2e}"


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
@pytest.mark.parametrize("arch", [a for a in presets.ARCHES if not EXPECTED_BLOCKERS[a]])
def test_gpu_backend_prefill_equals_token_by_token(model_file, arch, exact):
    # An f32 KV cache in both modes: the device cache is f32 (fast mode's default f16 is refused, below).
    path = model_file(arch, "q8_0")
    run = {b: _internal.forward_logits(path, PROMPT, "cuda", exact, b, cache_type="f32") for b in (0, 1, 3)}
    assert np.isfinite(run[0]).all()
    assert np.array_equal(run[0].view(np.uint32), run[1].view(np.uint32))
    assert np.array_equal(run[0].view(np.uint32), run[3].view(np.uint32))


def test_gpu_backend_refuses_fast_modes_f16_cache_by_name(model_file):
    path = model_file("qwen3moe", "q8_0")
    op, why = first_refusal(path, exact=False)  # recorded with the session default: f16 in fast mode
    assert op == "kv_store" and why.startswith("kv_store (f16)"), why
    with pytest.raises(sharpi.UnsupportedError) as e:
        _internal.forward_logits(path, PROMPT, backend="cuda", exact=False)
    assert str(e.value) == "[cuda] " + why


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", PLAIN_MOE)
def test_gpu_backend_equals_the_old_device_forward_pass(model_file, arch, quant, exact):
    path = model_file(arch, quant)
    old = sharpi.Session(path, exact=exact, device="cuda", n_ctx=64)  # its KV cache is f32 in both modes
    want = np.asarray(old.decode(PROMPT, all_logits=True), np.float32).reshape(len(PROMPT), -1)
    got = _internal.forward_logits(path, PROMPT, backend="cuda", exact=exact, cache_type="f32")
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), rel_err(got, want)
