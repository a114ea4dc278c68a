"""The CUDA backend's arithmetic, checked on the host in every build (GPU or not).

cuda/block_math.cuh holds the per-block math of every quant type once, as __host__ __device__
functions; the host compiler builds the same header into _core (cuda_block_math_*). Here it is
checked against independent oracles:
- dequantize: the gguf package's numpy `dequantize`, bit for bit, on fresh random blocks, and every
  f16 / bf16 bit pattern against numpy's own widening;
- q8 activation quantization: test_qdot's numpy model (amax / 127, round half to even), bit for bit;
- the int8 block dot: a numpy float32 replay of the per-block arithmetic the header states, on the
  integer unpacking test_qdot checks against gguf, bit for bit; and its float64 value within the
  f32 rounding bound of the float64 dot of the gguf-dequantized weights with the q8 activations.
Plus the device entry points' behaviour without a device: typed errors, never a crash.
"""

import os

import numpy as np
import pytest
import sharpi
from gguf import GGMLQuantizationType as Q
from sharpi import DeviceError, InvalidArgument, UnsupportedError, _internal
from test_qdot import (
    FAST_TYPES,
    FORMAT,
    K_TYPES,
    np_act_blocks,
    np_quantize,
    random_activations,
    unpack_b32,
    unpack_k,
)
from test_quant import ALL_TYPES, bits, oracle_dequantize, random_rows
from test_session import models  # noqa: F401  (fixture: tiny files of every plain MoE arch)

F32 = np.float32

# The types the device block math implements (issue 21's list). MXFP4 and the IQ types came to the
# CPU later and are not on the device yet: the block math refuses them (test_cuda_host checks that).
NOT_ON_DEVICE = {Q.MXFP4, Q.IQ4_NL, Q.IQ4_XS, Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_S, Q.IQ2_XS, Q.IQ2_XXS, Q.IQ1_S, Q.IQ1_M}
DEVICE_TYPES = [t for t in ALL_TYPES if t not in NOT_ON_DEVICE]
DEVICE_FAST_TYPES = [t for t in FAST_TYPES if t not in NOT_ON_DEVICE]


@pytest.fixture
def rng(request):
    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"seed {seed}")
    return np.random.default_rng(seed)


# ---- dequantize ----------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", DEVICE_TYPES, ids=lambda t: t.name)
def test_block_math_dequantize_bitwise_equals_gguf(qtype, rng):
    for n_blocks in (1, 5, 64):
        n = n_blocks * (256 if qtype in K_TYPES else 32)
        data = random_rows(qtype, 1, n, rng)
        got = _internal.cuda_block_math_dequantize(int(qtype), data)
        want = oracle_dequantize(qtype, data, 1, n)[0]
        assert got.shape == (n,) and got.dtype == np.float32
        bad = np.flatnonzero(bits(got) != bits(want))
        assert bad.size == 0, f"{qtype.name} n={n}: first differing elements {bad[:8]}"


def test_block_math_half_and_bfloat16_every_bit_pattern():
    every = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
    got = _internal.cuda_block_math_dequantize(int(Q.F16), every.view(np.uint8))
    np.testing.assert_array_equal(bits(got), bits(every.view(np.float16).astype(np.float32)))
    got = _internal.cuda_block_math_dequantize(int(Q.BF16), every.view(np.uint8))
    np.testing.assert_array_equal(bits(got), every.astype(np.uint32) << 16)


# ---- int8 path: activation quantization ----------------------------------------------------------


@pytest.mark.parametrize("qtype", DEVICE_FAST_TYPES, ids=lambda t: t.name)
def test_block_math_quantize_act_bitwise_equals_numpy(qtype, rng):
    fmt = FORMAT[qtype]
    for n in (256, 1024):
        x = random_activations(rng, n)
        got = _internal.cuda_block_math_quantize_act(int(qtype), x)
        want = np_quantize(fmt, x)
        assert got.dtype == np.uint8 and got.shape == want.shape
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, f"{qtype.name} ({fmt}) n={n}: first differing bytes {bad[:8]}"
    # Ties round to even (random_activations puts x * id on .5 in elements 64..71).
    qs = np_act_blocks(fmt, _internal.cuda_block_math_quantize_act(int(qtype), random_activations(rng, 256)))["qs"]
    assert list(qs.reshape(-1)[64:72]) == [127, 0, 2, 2, 0, -2, -2, 4]


# ---- int8 path: one weight block . one activation block ------------------------------------------


def model_block_partials(qtype, data, xq_raw):
    """(f32 partial per block replayed op by op as block_math.cuh states, float64 value of each)."""
    xb = np_act_blocks(FORMAT[qtype], xq_raw)
    q = xb["qs"].astype(np.int64)
    dx = xb["d"].astype(F32)
    if qtype in K_TYPES:
        k = unpack_k(qtype, data)
        bsums = xb["bsums"].astype(np.int64)
        dots = (k["u"] * q).reshape(len(q), 16, 16).sum(axis=2)
        isum = (k["sc"] * dots).sum(axis=1) - k["offset"] * (k["sc"] * bsums).sum(axis=1)
        imin = (k["mn"] * bsums).sum(axis=1)
        scaled = (dx * k["d"]).astype(F32) * isum.astype(F32)
        mins = (dx * k["dmin"]).astype(F32) * imin.astype(F32)
        f32 = (scaled.astype(F32) - mins.astype(F32)).astype(F32)
        f64 = dx.astype(np.float64) * k["d"] * isum - dx.astype(np.float64) * k["dmin"] * imin
        return f32, f64
    b = unpack_b32(qtype, data)
    isum = (b["q"] * q).sum(axis=1)
    f32 = ((b["d"] * dx).astype(F32) * isum.astype(F32)).astype(F32)
    f64 = b["d"].astype(np.float64) * dx * isum
    if qtype in (Q.Q4_1, Q.Q5_1):
        s = xb["s"].astype(F32)
        f32 = (f32 + (b["m"] * s).astype(F32)).astype(F32)
        f64 = f64 + b["m"].astype(np.float64) * s
    return f32, f64


@pytest.mark.parametrize("qtype", DEVICE_FAST_TYPES, ids=lambda t: t.name)
def test_block_math_dot_q8_bitwise_equals_numpy_model(qtype, rng):
    n = 16 * 256
    data = random_rows(qtype, 1, n, rng)
    x = random_activations(rng, n)
    xq = _internal.cuda_block_math_quantize_act(int(qtype), x)
    got = _internal.cuda_block_math_dot_q8(int(qtype), data, xq)
    want, want64 = model_block_partials(qtype, data, xq)
    assert got.shape == want.shape and got.dtype == np.float32
    bad = np.flatnonzero(bits(got) != bits(want))
    assert bad.size == 0, f"{qtype.name}: first differing blocks {bad[:8]}: {got[bad[:4]]} vs {want[bad[:4]]}"
    # The partials are the dot of the real weights with the q8 activations: against the gguf
    # package's weights in float64, each block within a few f32 roundings of its terms. Q4_1 / Q5_1
    # take their min term through q8_1's s = f16(sum(qs) * d) with d before its own f16 rounding (as
    # llama.cpp): the min term may differ from m * sum(qs) * f16(d) by |m| times the two f16
    # roundings, of d (times |sum|) and of s (half an ulp each; subnormal halves have 2^-25).
    xb = np_act_blocks(FORMAT[qtype], xq)
    xd = np.repeat(xb["d"].astype(np.float64), xb["qs"].shape[1]) * xb["qs"].reshape(-1)
    w = oracle_dequantize(qtype, data, 1, n)[0].astype(np.float64)
    per_block = (w * xd).reshape(len(got), -1)
    scale = np.abs(per_block).sum(axis=1) + np.abs(want64)
    slack = np.zeros(len(got))
    if qtype in (Q.Q4_1, Q.Q5_1):
        def half_ulp(v):
            return np.maximum(np.abs(v) * 2.0**-11, 2.0**-25)

        d, s = xb["d"].astype(np.float64), xb["s"].astype(np.float64)
        total = np.abs(xb["qs"].astype(np.int64).sum(axis=1))
        slack = np.abs(unpack_b32(qtype, data)["m"].astype(np.float64)) * (total * half_ulp(d) + half_ulp(s))
    assert np.all(np.abs(got - per_block.sum(axis=1)) <= 1e-5 * scale + slack + 1e-30)


# ---- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", sorted(NOT_ON_DEVICE), ids=lambda t: t.name)
def test_block_math_refuses_types_not_on_the_device(qtype, rng):
    data = random_rows(qtype, 1, 256, rng)
    with pytest.raises(UnsupportedError):
        _internal.cuda_block_math_dequantize(int(qtype), data)


def test_block_math_bad_input_is_a_typed_error():
    with pytest.raises(InvalidArgument, match="q4_K"):
        _internal.cuda_block_math_dequantize(int(Q.Q4_K), np.zeros(143, np.uint8))
    with pytest.raises(UnsupportedError, match="iq2_xxs|id 16"):
        _internal.cuda_block_math_dequantize(int(Q.IQ2_XXS), np.zeros(66, np.uint8))
    with pytest.raises(UnsupportedError, match="f32"):
        _internal.cuda_block_math_quantize_act(int(Q.F32), np.zeros(32, np.float32))
    with pytest.raises(InvalidArgument, match="multiple"):
        _internal.cuda_block_math_quantize_act(int(Q.Q4_K), np.zeros(100, np.float32))
    with pytest.raises(InvalidArgument, match="activation blocks"):
        _internal.cuda_block_math_dot_q8(int(Q.Q8_0), np.zeros(34, np.uint8), np.zeros(35, np.uint8))


# ---- the device entry without a device -------------------------------------------------------------


def test_device_info_is_consistent_with_describe():
    info = _internal.cuda_device_info()
    text = sharpi.cuda_describe()
    assert info["present"] == sharpi.cuda_available()
    if info["present"]:
        assert info["name"] in text and "MiB free" in text and "MiB used" in text
        assert info["vram_used"] + info["vram_free"] == info["vram_total"] > 0
    else:
        # A CUDA build on a machine without a driver or device says so plainly; the stub says why it has none.
        assert text.startswith(("no CUDA device", "CUDA unavailable: sharpi was built without")), text
        assert "insufficient" not in text
        assert info["vram_total"] == info["vram_free"] == 0


SHIPPED = os.path.join(os.path.dirname(sharpi.__file__), "models", "stdlib-moe-q8_0.gguf")


@pytest.mark.skipif(sharpi.cuda_available(), reason="a CUDA device is present: the gpu tests cover device='cuda'")
def test_session_device_cuda_without_a_device_is_a_typed_error():
    # A CPU-only build (stub) says it was built without CUDA; a CUDA build on a machine without a
    # device says there is no device, with the CUDA runtime's error.
    with pytest.raises((UnsupportedError, DeviceError)) as excinfo:
        sharpi.Session(SHIPPED, device="cuda")
    message = str(excinfo.value)
    assert "[cuda]" in message and "device=\"cuda\"" in message
    if isinstance(excinfo.value, UnsupportedError):
        assert "built without the CUDA backend" in message
    else:
        assert "no" in message and "CUDA device" in message


def test_session_device_name_is_checked():
    with pytest.raises(InvalidArgument, match="device must be"):
        sharpi.Session(SHIPPED, device="tpu")
    sharpi.Session(SHIPPED, device="cpu")  # the default, spelled out


def test_device_ops_without_a_device_are_typed_errors():
    if sharpi.cuda_available():
        pytest.skip("a CUDA device is present: tests/test_cuda_gpu.py runs the ops")
    with pytest.raises((UnsupportedError, DeviceError), match=r"\[cuda\] dequantize"):
        _internal.cuda_op_dequantize(int(Q.Q8_0), np.zeros(34, np.uint8))
    with pytest.raises((UnsupportedError, DeviceError), match=r"\[cuda\] rms_norm"):
        _internal.cuda_op_rms_norm(np.ones(8, np.float32), np.ones(8, np.float32), 1e-6)


# ---- the device forward pass's plan (no device needed) ------------------------------------------------
#
# _internal.cuda_device_plan runs the planner that Session(device="cuda") runs before it allocates: what
# goes to VRAM and what the device path refuses. Checked against the gguf package's reading of the
# same file (an independent reader): every tensor the layer loop reads is uploaded once, in its file
# type and size (1-D tensors as the f32 the loader makes of them), experts apart from dense weights.

PLAIN_MOE_ARCHES = ("qwen3moe", "qwen2moe", "olmoe", "llama")  # llama with experts: Mixtral


@pytest.fixture(scope="module")
def plan_files(models):  # noqa: F811  (the imported fixture)
    """test_session's tiny files: {(arch, quant): path} for the plain MoE archs, f32 and q4_k_m."""
    assert set(PLAIN_MOE_ARCHES) <= {arch for arch, _ in models}
    return models


def gguf_expected_uploads(path):
    """{name: (ggml type, bytes)} of every tensor in the file, as the device plan should upload it."""
    from gguf import GGUFReader

    out = {}
    for t in GGUFReader(path).tensors:
        dims = [int(d) for d in t.shape if int(d) > 1]
        if len(dims) <= 1 and "gate_inp_shexp" not in t.name:
            out[t.name] = (int(Q.F32), 4 * int(t.n_elements))  # norms, biases: f32 on the host and device
        else:
            out[t.name] = (int(t.tensor_type), int(t.n_bytes))
    return out


@pytest.mark.parametrize("quant", ["f32", "q4_k_m"])
@pytest.mark.parametrize("arch", PLAIN_MOE_ARCHES)
def test_device_plan_uploads_every_tensor_once_in_its_file_type(plan_files, arch, quant):
    from gguf import GGUFReader

    path = plan_files[arch, quant]
    n_ctx, max_batch = 512, 64
    plan = _internal.cuda_device_plan(path, n_ctx, max_batch)
    names = [u[0] for u in plan["uploads"]]
    assert len(names) == len(set(names)), "a tensor is uploaded twice"
    got = {name: (ttype, nbytes) for name, ttype, nbytes, _ in plan["uploads"]}
    want = gguf_expected_uploads(path)
    assert got == want
    experts = {name for name, _, _, expert in plan["uploads"] if expert}
    assert experts == {n for n in want if "_exps." in n}
    assert plan["expert_bytes"] == sum(want[n][1] for n in experts)
    assert plan["dense_bytes"] == sum(b for n, (_, b) in want.items() if n not in experts)
    if quant == "q4_k_m":  # the mix keeps its per-tensor types (Q6_K output, f32 router)
        assert len({t for t, _ in got.values()}) >= 3
    # KV cache: K and V rows of n_head_kv * head_dim f32 per position and layer.
    fields = GGUFReader(path).fields
    key = f"{arch}.attention."

    def field(name):
        return int(fields[name].contents())

    n_layer, n_head, n_embd = field(f"{arch}.block_count"), field(key + "head_count"), field(f"{arch}.embedding_length")
    head_dim = field(key + "key_length") if key + "key_length" in fields else n_embd // n_head
    assert plan["kv_bytes"] == 2 * 4 * n_layer * n_ctx * field(key + "head_count_kv") * head_dim
    # Buffers: at least the batch's logits and six residual-width activations.
    n_vocab = len(fields["tokenizer.ggml.tokens"].contents())
    assert plan["buffer_bytes"] >= 4 * max_batch * (n_vocab + 6 * n_embd)
    assert plan["total_bytes"] == plan["dense_bytes"] + plan["expert_bytes"] + plan["kv_bytes"] + plan["buffer_bytes"]
    if arch == "qwen2moe":
        assert plan["n_ff_dense"] > 0  # the shared expert runs as a dense FFN
    # The KV cache grows with n_ctx, the weights do not.
    bigger = _internal.cuda_device_plan(path, 2 * n_ctx, max_batch)
    assert bigger["kv_bytes"] == 2 * plan["kv_bytes"]
    assert bigger["dense_bytes"] == plan["dense_bytes"] and bigger["expert_bytes"] == plan["expert_bytes"]


def test_device_plan_tied_output_head_is_uploaded_once(plan_files, tmp_path):
    from model_files import rewrite_gguf

    path = str(tmp_path / "tied.gguf")
    rewrite_gguf(plan_files["qwen3moe", "f32"], path, drop_tensors=("output.weight",))
    names = [u[0] for u in _internal.cuda_device_plan(path, 256)["uploads"]]
    assert "output.weight" not in names and names.count("token_embd.weight") == 1


@pytest.mark.parametrize(
    "arch, needle",
    [
        ("qwen3", r"plain MoE architectures only .*not qwen3 without experts"),
        ("deepseek2", r"plain MoE architectures only .*not deepseek2"),
        ("gpt-oss", r"plain MoE architectures only .*not gpt-oss"),
        ("qwen3next", r"plain MoE architectures only .*not qwen3next"),
        ("llama4", r"plain MoE architectures only .*not llama4"),
    ],
)
def test_device_plan_refuses_archs_the_device_path_does_not_compute(arch, needle, tmp_path):
    from sharpi.make_model import write_model

    path = str(tmp_path / f"{arch}.gguf")
    write_model(path, arch=arch, preset="tiny", seed=1)
    with pytest.raises(UnsupportedError, match=r"\[cuda\] device=\"cuda\" for " + arch + ": .*" + needle):
        _internal.cuda_device_plan(path, 256)


def test_device_plan_refuses_types_without_device_kernels_and_quantized_kv(plan_files, tmp_path):
    from sharpi.make_model import write_model

    path = str(tmp_path / "iq4_xs.gguf")
    write_model(path, arch="qwen3moe", preset="tiny", quant="iq4_xs", seed=1)
    with pytest.raises(UnsupportedError, match=r"tensor token_embd\.weight is iq4_xs, a type without device kernels"):
        _internal.cuda_device_plan(path, 256)
    # A mix whose dense weights the device takes (Q4_K / Q6_K) and whose experts it does not.
    path = str(tmp_path / "iq2_xxs_mix.gguf")
    write_model(path, arch="qwen3moe", preset="tiny", quant="iq2_xxs_mix", seed=1)
    with pytest.raises(UnsupportedError, match=r"tensor blk\.0\.ffn_gate_exps\.weight is iq2_xxs, a type without"):
        _internal.cuda_device_plan(path, 256)
    f32 = plan_files["olmoe", "f32"]
    for k, v in (("q8_0", ""), ("", "f16"), ("q4_0", "q4_0")):
        with pytest.raises(UnsupportedError, match="device KV cache is f32"):
            _internal.cuda_device_plan(f32, 256, cache_type_k=k, cache_type_v=v)
    _internal.cuda_device_plan(f32, 256, cache_type_k="f32", cache_type_v="f32")  # f32 named explicitly


def test_device_plan_refuses_yarn(plan_files, tmp_path):
    from model_files import rewrite_gguf

    path = str(tmp_path / "yarn.gguf")
    rewrite_gguf(
        plan_files["qwen3moe", "f32"],
        path,
        set_kv={"qwen3moe.rope.scaling.type": "yarn", "qwen3moe.rope.scaling.factor": 4.0,
                "qwen3moe.rope.scaling.original_context_length": 1024},
    )
    sharpi.Session(path).close()  # the CPU runs it
    with pytest.raises(UnsupportedError, match="YaRN"):
        _internal.cuda_device_plan(path, 256)


def test_session_device_cuda_refuses_host_only_options_before_the_device(plan_files):
    # Streaming experts and activation dumps are not on the device path: refused (UnsupportedError)
    # before the device is even looked for, in every build.
    path = plan_files["qwen3moe", "f32"]
    with pytest.raises(UnsupportedError, match=r"ram_budget .*not on the device path"):
        sharpi.Session(path, device="cuda", ram_budget="64MiB")
    with pytest.raises(UnsupportedError, match=r"dump_activations is not on the device path"):
        sharpi.Session(path, device="cuda", dump_activations=True)


def test_inspect_device_cuda_reports_the_plan_or_the_refusal(plan_files, tmp_path, capsys):
    from sharpi import cli
    from sharpi.make_model import write_model

    path = plan_files["qwen2moe", "q4_k_m"]
    assert cli.main(["inspect", path, "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("device plan: "))
    plan = _internal.cuda_device_plan(path)  # n_ctx 0: the session default, min(trained context, 4096)
    assert plan["n_ctx"] == 4096
    mib = 1 << 20
    for key in ("dense_bytes", "expert_bytes", "kv_bytes", "buffer_bytes", "total_bytes"):
        assert f"{plan[key] / mib:.1f} MiB" in line
    assert "(n_ctx 4096, f32)" in line
    dense = str(tmp_path / "qwen3.gguf")
    write_model(dense, arch="qwen3", preset="tiny", seed=1)
    assert cli.main(["inspect", dense, "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "device plan: refused: [cuda] device=\"cuda\" for qwen3: " in out
