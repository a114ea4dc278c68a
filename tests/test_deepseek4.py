"""deepseek4 (DeepSeek-V4) against transformers' DeepseekV4ForCausalLM, on a tiny random model that
llama.cpp's own converter turns into GGUF (tests/reference/deepseek_v4_export.py writes the
original DeepSeek checkpoint layout the converter reads, routed experts as MXFP4).

The tiny config makes every V4 mechanism matter for the prompts here: sliding window 8, a CSA
layer whose indexer keeps 2 of up to 75 compressed entries, an HCA layer that emits its first entry
at position 127, a hash-routed first layer, 4 hyper-connection streams, a SwiGLU clamp taken by
many activations. Checked:
  - the converter's keys and tensor types for what V4 adds;
  - exact mode on the f32 file within rel-L2 1e-4 of transformers (float64) at every one of 300
    positions (past every window, top-k and compression block), also with the released
    checkpoints' YaRN on the compressed branches (at a small original context);
  - the per-sequence state: token by token, in uneven chunks, after truncating mid-window and
    decoding again, and batched beside another sequence, the logits are bit-identical to one prefill;
  - f16, q8_0 and Q4_K_M files made by llama.cpp's own llama-quantize (--allow-requantize: the
    converter's experts are MXFP4) in exact mode within 1e-4 of transformers computing on the
    file's own weights (dequantized by the gguf package) and of the float64 numpy reference
    (tests/reference/deepseek4_numpy.py, itself held to transformers) at every position;
  - streamed == resident bit for bit at a quarter budget for each reader, and on the Q4_K_M file;
  - make-model's tiny deepseek4 carries the converter's keys (value types) and tensor names (ranks),
    matches the float64 reference at q4_k_m past the HCA block, and keeps its state exactly; the deepseek-v4 preset plans DeepSeek-V4-Flash (284B, 13B
    active);
  - inspect describes the layer pattern and the state; refusals are typed errors (a quantized KV
    cache, the MTP head, a compression ratio llama.cpp does not have, linear rope scaling, a
    missing tensor).

Skips (never fails) without torch/transformers or when the converter cannot be fetched.
"""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5.0")

import sharpi
from llama_quantize import llama_quantize
from model_files import rewrite_gguf
from reference import deepseek_v4_export, hf_export
from reference.deepseek4_numpy import Deepseek4Reference
from reference.engine_checks import check_streams_like_resident
from sharpi.inspect_model import inspect_report, inspect_summary

THREADS = 2
N_PROMPT = 300


@pytest.fixture(scope="module")
def converted(model_dir):
    try:
        converter = hf_export.converter_dir()
    except hf_export.ConverterUnavailable as error:
        pytest.skip(f"llama.cpp converter unavailable: {error}")
    return deepseek_v4_export.prepare(model_dir, converter, outtypes=("f32",))


@pytest.fixture(scope="module")
def f32(converted):
    return str(converted.gguf["f32"])


@pytest.fixture(scope="module")
def prompt(converted):
    return hf_export.random_prompt(converted.exported.vocab_size, N_PROMPT, seed=7)


@pytest.fixture(scope="module")
def prefill(f32, prompt):
    """Exact-mode logits of the whole prompt in one step: [N_PROMPT, n_vocab]."""
    s = sharpi.Session(f32, threads=THREADS, n_ctx=512, exact=True)
    return np.asarray(s.decode(prompt, all_logits=True))


def test_converter_file_carries_the_deepseek4_parameters(f32):
    import gguf

    reader = gguf.GGUFReader(f32)
    md = {name: f.contents() for name, f in reader.fields.items() if f.types}
    p = "deepseek4."
    assert list(md[p + "attention.compress_ratios"]) == [4, 0, 128, 4]
    assert md[p + "hyper_connection.count"] == 4
    assert md[p + "hash_layer_count"] == 1
    assert md[p + "expert_gating_func"] == 4  # sqrt(softplus)
    assert md[p + "attention.indexer.top_k"] == 2
    assert md[p + "attention.sliding_window"] == 8
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "MXFP4"
    assert types["blk.0.ffn_gate_tid2eid.weight"] == "I32"
    assert "blk.0.exp_probs_b.bias" not in types  # the hash layer routes by token, no selection bias
    assert "blk.1.attn_compressor_kv.weight" not in types  # sliding-window-only layer
    assert "blk.2.indexer.proj.weight" not in types  # HCA: no indexer


def test_f32_matches_transformers_at_every_position(converted, prompt, prefill):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        deepseek_v4_export.transformers_dir(converted),
        dtype=torch.float64,
        attn_implementation="eager",
        experts_implementation="eager",
    ).eval()
    cfg = model.config
    # The prompt passes every window, top-k and compression block of the config.
    assert N_PROMPT > 2 * cfg.compress_rates["heavily_compressed_attention"]
    assert N_PROMPT // cfg.compress_rates["compressed_sparse_attention"] > 10 * cfg.index_topk
    assert N_PROMPT > 10 * cfg.sliding_window
    expected = hf_export.hf_logits(model, prompt)
    err = np.linalg.norm(prefill - expected, axis=1) / np.linalg.norm(expected, axis=1)
    assert err.max() <= 1e-4, f"rel-L2 {err.max():.3g} at position {int(err.argmax())}"


def test_yarn_on_the_compressed_branches_matches_transformers(model_dir):
    """The released checkpoints' rope_scaling: YaRN on the compressed layers only (transformers'
    "compress" rope, attention_factor 1), plain RoPE on the sliding-window-only layer."""
    import torch
    import transformers

    converted = deepseek_v4_export.prepare(model_dir, hf_export.converter_dir(), outtypes=("f32",), yarn=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        deepseek_v4_export.transformers_dir(converted),
        dtype=torch.float64,
        attn_implementation="eager",
        experts_implementation="eager",
    ).eval()
    assert model.config.rope_parameters["compress"]["rope_type"] == "yarn"
    assert model.config.rope_parameters["main"]["rope_type"] == "default"
    prompt = hf_export.random_prompt(converted.exported.vocab_size, N_PROMPT, seed=7)
    expected = hf_export.hf_logits(model, prompt)
    s = sharpi.Session(str(converted.gguf["f32"]), threads=THREADS, n_ctx=512, exact=True)
    got = np.asarray(s.decode(prompt, all_logits=True))
    err = np.linalg.norm(got - expected, axis=1) / np.linalg.norm(expected, axis=1)
    assert err.max() <= 1e-4, f"rel-L2 {err.max():.3g} at position {int(err.argmax())}"


def test_state_is_exact_token_by_token_in_chunks_and_after_truncation(f32, prompt, prefill):
    s = sharpi.Session(f32, threads=THREADS, n_ctx=512, exact=True)
    rows = [np.asarray(s.decode([t])).reshape(-1) for t in prompt]
    np.testing.assert_array_equal(np.stack(rows), prefill, err_msg="token by token vs prefill")

    s.reset()
    bounds = [0, 1, 8, 61, 130, 131, 260, N_PROMPT]  # chunk edges inside and across windows
    chunks = [np.asarray(s.decode(prompt[a:b], all_logits=True)) for a, b in zip(bounds, bounds[1:])]
    np.testing.assert_array_equal(np.concatenate(chunks), prefill, err_msg="uneven chunks vs prefill")

    # Truncate inside a CSA window and before the HCA entry at 127, then decode the rest again.
    s.truncate(126)
    again = np.asarray(s.decode(prompt[126:], all_logits=True))
    np.testing.assert_array_equal(again, prefill[126:], err_msg="after truncate(126)")


def test_batched_sequences_match_alone(f32, prompt, prefill):
    other = hf_export.random_prompt(len(prefill[0]), 150, seed=11)
    alone = sharpi.Session(f32, threads=THREADS, n_ctx=512, exact=True)
    other_alone = np.asarray(alone.decode(other, all_logits=True))
    s = sharpi.Session(f32, threads=THREADS, n_ctx=512, exact=True, n_seq=2)
    a, b = s.sequence(0), s.add_sequence()
    first = s.decode_batch([(a, prompt[:200], True, False), (b, other[:100], True, False)])
    second = s.decode_batch([(a, prompt[200:], True, False), (b, other[100:], True, False)])
    np.testing.assert_array_equal(np.concatenate([first[0], second[0]]), prefill, err_msg="sequence 0 batched")
    np.testing.assert_array_equal(np.concatenate([first[1], second[1]]), other_alone, err_msg="sequence 1 batched")


@pytest.mark.parametrize("reader", ["pread", "io_uring"])
def test_streamed_matches_resident(f32, prompt, reader):
    def open_session(ram_budget):
        return sharpi.Session(f32, threads=THREADS, n_ctx=512, ram_budget=ram_budget, reader=reader)

    check_streams_like_resident(open_session, prompt[:140], 8, f"deepseek4 f32 ({reader})")


def _transformers_on(converted, path):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        deepseek_v4_export.transformers_dir(converted),
        dtype=torch.float64,
        attn_implementation="eager",
        experts_implementation="eager",
    ).eval()
    deepseek_v4_export.load_gguf_weights(model, path)
    return model


@pytest.fixture(scope="module")
def quantized(f32):
    def make(quant):
        return llama_quantize(f32, f"{f32[:-5]}-{quant}.gguf", quant, options=("--allow-requantize",))

    return make


def _rel(got, expected):
    err = np.linalg.norm(got - expected, axis=1) / np.linalg.norm(expected, axis=1)
    return err.max(), int(err.argmax())


def test_numpy_reference_matches_transformers(converted, prompt):
    # The float64 numpy reference (tests/reference/deepseek4_numpy.py) is held to transformers first.
    expected = hf_export.hf_logits(_transformers_on(converted, converted.gguf["f32"]), prompt)
    err, at = _rel(Deepseek4Reference(converted.gguf["f32"]).logits(prompt), expected)
    assert err <= 1e-4, f"numpy reference vs transformers: rel-L2 {err:.3g} at position {at}"


@pytest.mark.parametrize("quant", ["F16", "Q8_0", "Q4_K_M"])
def test_quantized_files_match_transformers_on_their_weights(converted, prompt, quantized, quant):
    path = quantized(quant)
    expected = hf_export.hf_logits(_transformers_on(converted, path), prompt)
    s = sharpi.Session(str(path), threads=THREADS, n_ctx=512, exact=True)
    got = np.asarray(s.decode(prompt, all_logits=True))
    err, at = _rel(got, expected)
    assert err <= 1e-4, f"{quant}: rel-L2 {err:.3g} at position {at} vs transformers"
    err, at = _rel(got, Deepseek4Reference(path).logits(prompt))
    assert err <= 1e-4, f"{quant}: rel-L2 {err:.3g} at position {at} vs the float64 reference"


def test_quantized_streams_like_resident(prompt, quantized):
    path = str(quantized("Q4_K_M"))

    def open_session(ram_budget):
        return sharpi.Session(path, threads=THREADS, n_ctx=512, ram_budget=ram_budget, exact=True)

    check_streams_like_resident(open_session, prompt[:140], 8, "deepseek4 Q4_K_M")


def test_inspect_describes_deepseek4(f32):
    s = inspect_summary(f32)
    d = s["attention"]["deepseek4"]
    assert d["layer_kinds"] == "CSHC"
    assert d["hc_streams"] == 4 and d["hash_layers"] == 1 and d["output_groups"] == 2
    # head_dim 32, indexer 32: sliding 32; CSA 32 + 5*32 + 5*32; HCA 32 + 3*32.
    assert d["kv_row_floats"] == [352, 32, 128, 352]
    assert s["routing"]["gating"] == "sqrt(softplus)"
    assert "deepseek4 layers" in inspect_report(f32, list_tensors=False)


def test_refusals_are_typed_errors(f32, tmp_path):
    with pytest.raises(sharpi.SharpiError, match="f32 cache row"):
        sharpi.Session(f32, threads=THREADS, n_ctx=64, cache_type_k="f16", cache_type_v="f16")
    with pytest.raises(sharpi.InvalidArgument, match="no multi-token-prediction layers"):
        sharpi.Session(f32, threads=THREADS, n_ctx=64, mtp=True)
    bad_ratio = tmp_path / "ratio8.gguf"
    rewrite_gguf(f32, str(bad_ratio), set_kv={"deepseek4.attention.compress_ratios": [8, 0, 128, 4]})
    with pytest.raises(sharpi.UnsupportedError, match="compress ratio 8"):
        sharpi.Session(str(bad_ratio), threads=THREADS, n_ctx=64)
    one_stream = tmp_path / "hc1.gguf"
    rewrite_gguf(f32, str(one_stream), set_kv={"deepseek4.hyper_connection.count": 1})
    with pytest.raises(sharpi.FormatError, match="hyper_connection.count 1"):
        sharpi.Session(str(one_stream), threads=THREADS, n_ctx=64)
    linear = tmp_path / "linear.gguf"
    rewrite_gguf(f32, str(linear), set_kv={"deepseek4.rope.scaling.type": "linear", "deepseek4.rope.scaling.factor": 2.0})
    with pytest.raises(sharpi.UnsupportedError, match="linear rope scaling"):
        sharpi.Session(str(linear), threads=THREADS, n_ctx=64)
    bad_table = tmp_path / "tid2eid.gguf"

    def out_of_range(name, raw, ttype, shape):
        if name != "blk.0.ffn_gate_tid2eid.weight":
            return None
        table = np.frombuffer(raw.tobytes(), dtype=np.int32).copy()
        table[5] = 99  # no such expert
        return table.view(np.uint8), ttype, shape

    rewrite_gguf(f32, str(bad_table), tensor_edit=out_of_range)
    with pytest.raises(sharpi.FormatError, match="names expert 99"):
        sharpi.Session(str(bad_table), threads=THREADS, n_ctx=64)
    missing = tmp_path / "no_hc_head.gguf"
    rewrite_gguf(f32, str(missing), drop_tensors=("output_hc_fn.weight",))
    with pytest.raises(sharpi.MissingTensorError, match="output_hc_fn"):
        sharpi.Session(str(missing), threads=THREADS, n_ctx=64)


def _keys_and_tensors(path):
    import gguf

    reader = gguf.GGUFReader(str(path))
    keys = {name: f.types for name, f in reader.fields.items() if name.startswith("deepseek4.")}
    return keys, {t.name: len(t.shape) for t in reader.tensors}


def test_make_model_tiny_carries_the_converters_keys_and_tensors(f32, tmp_path):
    from sharpi import make_model as mm

    path = tmp_path / "tiny-deepseek4.gguf"
    mm.write_model(str(path), arch="deepseek4", preset="tiny", quant="f32", seed=3)
    want_keys, want_tensors = _keys_and_tensors(f32)
    got_keys, got_tensors = _keys_and_tensors(path)
    # Same layer pattern (CSA, sliding, HCA, CSA; one hash layer): the same keys with the same value
    # types, the same tensor names with the same ranks.
    assert got_keys == want_keys
    assert got_tensors == want_tensors


def test_make_model_tiny_runs_and_its_state_is_exact(tmp_path):
    from sharpi import make_model as mm

    path = str(tmp_path / "tiny-deepseek4-q4_k_m.gguf")
    mm.write_model(path, arch="deepseek4", preset="tiny", quant="q4_k_m", seed=3)
    tokens = hf_export.random_prompt(1024, 200, seed=5)  # past the HCA block at 128
    s = sharpi.Session(path, threads=THREADS, n_ctx=256, exact=True)
    whole = np.asarray(s.decode(tokens, all_logits=True))
    err, at = _rel(whole, Deepseek4Reference(path).logits(tokens))
    assert err <= 1e-4, f"make-model q4_k_m: rel-L2 {err:.3g} at position {at} vs the float64 reference"
    s.reset()
    rows = [np.asarray(s.decode([t])).reshape(-1) for t in tokens]
    np.testing.assert_array_equal(np.stack(rows), whole)


def test_deepseek_v4_preset_plans_v4_flash():
    from sharpi import presets
    from sharpi.tensor_plan import plan_tensors

    hp = presets.resolve(None, "deepseek-v4")
    assert hp.arch == "deepseek4" and hp.n_layer == 43 and hp.compress_ratios[:4] == (128, 128, 128, 4)
    specs = {s.name: s for s in plan_tensors(hp, "mxfp4")}
    total = sum(s.n_elements for s in specs.values())
    experts = sum(s.n_elements for s in specs.values() if "_exps." in s.name)
    active = total - experts + experts * hp.n_expert_used / hp.n_expert
    # DeepSeek-V4-Flash: 284B parameters, 13B activated (its model card), MTP block not counted.
    assert 283e9 < total < 286e9 and 13e9 < active < 14.5e9
    assert specs["blk.0.attn_q_b.weight"].ne == (1024, 64 * 512)
    assert specs["blk.0.attn_output_a.weight"].ne == (64 * 512 // 8, 8 * 1024)
    assert specs["blk.0.hc_attn_fn.weight"].ne == (4 * 4096, 24)
    assert specs["blk.3.indexer.attn_q_b.weight"].ne == (1024, 64 * 128)  # layer 3 is CSA
    assert specs["blk.2.ffn_gate_tid2eid.weight"].ne == (6, 129280)
    assert "blk.3.ffn_gate_tid2eid.weight" not in specs and "blk.3.exp_probs_b.bias" in specs
    assert specs["blk.5.ffn_gate_exps.weight"].type.name == "MXFP4"


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"compress_ratios": (4, 0, 128)}, "compress_ratios"),
        ({"compress_ratios": (4, 0, 8, 4)}, "compress_ratios"),
        ({"hc_mult": 1}, "hyper-connection streams"),
        ({"n_head_kv": 2}, "n_head_kv must be 1"),
        ({"o_groups": 3}, "o_groups = 3 must divide"),
        ({"indexer_head_dim": 8}, "indexer_head_dim >= n_rot"),
    ],
)
def test_make_model_refuses_shapes_deepseek4_cannot_have(overrides, match):
    from sharpi import presets
    from sharpi.make_model import parse_overrides

    assert parse_overrides(["compress_ratios=0,4,4,128"]) == {"compress_ratios": (0, 4, 4, 128)}
    with pytest.raises(sharpi.InvalidArgument, match=match):
        presets.resolve("deepseek4", "tiny", **overrides)
