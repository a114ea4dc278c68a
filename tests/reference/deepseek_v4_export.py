"""A tiny random DeepSeek-V4 (transformers' DeepseekV4ForCausalLM), written twice:

  - hf_tf/: transformers' own save_pretrained (the oracle loads it back);
  - hf/:    the layout DeepSeek publishes and llama.cpp's converter reads (conversion/deepseek.py,
            DeepseekV4Model): original tensor names (`layers.N.attn.wq_a.weight`, `hc_head_fn`, ...),
            routed experts as MXFP4 (packed e2m1 codes + one E8M0 scale per 32 values, which the
            converter repacks losslessly into GGUF MXFP4), the hash layers' `ffn.gate.tid2eid`, and
            the legacy config keys the converter reads (compress_ratios, num_hash_layers, ...).

The routed experts' weights are drawn as MXFP4 values, so the transformers model and the converted
file hold exactly the same numbers. The config makes every V4 mechanism matter on short prompts:
sliding window 8, CSA every 4 positions with an indexer (16 heads, so that no two entries tie at a
score of exactly 0, which torch.topk would break in an unspecified order) keeping 2 entries, HCA every 128
positions, the first layer hash-routed, 4 hyper-connection streams, SwiGLU clamp 0.6 (taken by
many activations at these weight scales).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from reference import hf_export

LAYER_TYPES = [
    "compressed_sparse_attention",
    "sliding_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
]
RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
N_HASH = 1
# E2M1 values by code (low 3 bits magnitude, bit 3 sign), as MXFP4 defines them.
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
EXPERT_SCALE_EXP = -5  # 2^-5 * e2m1: std ~0.09, like the other weights


# The released checkpoints' RoPE scaling, at the tiny model's scale: YaRN on the compressed branches
# only (factor 4 over an original context of 64 positions, so it bends the angles of a 300-token
# prompt), the sliding-window-only layers unscaled.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0}  # fmt: skip


def make_config(vocab_size: int, yarn: bool = False):
    import transformers

    return transformers.DeepseekV4Config(
        rope_parameters=dict(YARN) if yarn else None,
        vocab_size=vocab_size,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        q_lora_rank=32,
        num_experts_per_tok=2,
        n_routed_experts=8,
        n_shared_experts=1,
        routed_scaling_factor=1.5,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        partial_rotary_factor=0.5,
        layer_types=LAYER_TYPES,
        mlp_layer_types=["hash_moe"] * N_HASH + ["moe"] * (len(LAYER_TYPES) - N_HASH),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        swiglu_limit=0.6,
        sliding_window=8,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=16,
        index_head_dim=32,
        index_topk=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=0,
    )


def _mxfp4(rng, shape):
    """Random MXFP4 weights [rows, cols]: (values f32, packed codes u8 [rows, cols/2], scales u8)."""
    rows, cols = shape
    codes = rng.integers(0, 16, size=(rows, cols)).astype(np.uint8)
    exps = (EXPERT_SCALE_EXP + rng.integers(-1, 2, size=(rows, cols // 32))).astype(np.int32)
    values = E2M1[codes] * np.repeat(np.exp2(exps.astype(np.float32)), 32, axis=1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return values.astype(np.float32), packed, (exps + 127).astype(np.uint8)


def build(vocab_size: int, seed: int, yarn: bool = False):
    """The transformers model (float32, eval) and the original-layout tensors for the converter."""
    import torch
    import transformers

    config = make_config(vocab_size, yarn)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    originals = {}
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + hf_export.NORM_WEIGHT_SPREAD * noise)
            elif name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                param.copy_(0.5 * noise)
            elif name.endswith(("scale", "hc_scale")):
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(hf_export.WEIGHT_STD * noise)
        for il, layer in enumerate(model.model.layers):
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                table = np.stack([rng.permutation(config.n_routed_experts)[: config.num_experts_per_tok]
                                  for _ in range(vocab_size)])
                gate.tid2eid.copy_(torch.from_numpy(table))
            else:
                gate.e_score_correction_bias.copy_(0.05 * torch.randn(config.n_routed_experts, generator=generator))
            experts = layer.mlp.experts
            n_ff, n_embd = config.moe_intermediate_size, config.hidden_size
            for e in range(config.n_routed_experts):
                w1, p1, s1 = _mxfp4(rng, (n_ff, n_embd))
                w3, p3, s3 = _mxfp4(rng, (n_ff, n_embd))
                w2, p2, s2 = _mxfp4(rng, (n_embd, n_ff))
                experts.gate_up_proj[e].copy_(torch.from_numpy(np.concatenate([w1, w3], axis=0)))
                experts.down_proj[e].copy_(torch.from_numpy(w2))
                for tag, packed, scale in (("w1", p1, s1), ("w2", p2, s2), ("w3", p3, s3)):
                    originals[f"layers.{il}.ffn.experts.{e}.{tag}.weight"] = torch.from_numpy(packed)
                    originals[f"layers.{il}.ffn.experts.{e}.{tag}.scale"] = torch.from_numpy(scale)
    originals.update(_original_names(model))
    return model, originals


def _original_names(model) -> dict:
    """Every non-expert tensor under the name DeepSeek's checkpoint gives it (the inverse of
    transformers' deepseek_v4 conversion mapping)."""
    out = {}
    m = model.model
    out["embed.weight"] = m.embed_tokens.weight
    out["norm.weight"] = m.norm.weight
    out["head.weight"] = model.lm_head.weight
    out["hc_head_fn"] = m.hc_head.hc_fn
    out["hc_head_base"] = m.hc_head.hc_base
    out["hc_head_scale"] = m.hc_head.hc_scale
    for il, layer in enumerate(m.layers):
        p = f"layers.{il}."
        a = layer.self_attn
        for hc, tag in ((layer.attn_hc, "attn"), (layer.ffn_hc, "ffn")):
            out[p + f"hc_{tag}_fn"] = hc.fn
            out[p + f"hc_{tag}_base"] = hc.base
            out[p + f"hc_{tag}_scale"] = hc.scale
        out[p + "attn_norm.weight"] = layer.input_layernorm.weight
        out[p + "ffn_norm.weight"] = layer.post_attention_layernorm.weight
        out[p + "attn.attn_sink"] = a.sinks
        out[p + "attn.wq_a.weight"] = a.q_a_proj.weight
        out[p + "attn.q_norm.weight"] = a.q_a_norm.weight
        out[p + "attn.wq_b.weight"] = a.q_b_proj.weight
        out[p + "attn.wkv.weight"] = a.kv_proj.weight
        out[p + "attn.kv_norm.weight"] = a.kv_norm.weight
        out[p + "attn.wo_a.weight"] = a.o_a_proj.weight
        out[p + "attn.wo_b.weight"] = a.o_b_proj.weight
        c = a.compressor
        if c is not None:
            out[p + "attn.compressor.ape"] = c.position_bias
            out[p + "attn.compressor.wkv.weight"] = c.kv_proj.weight
            out[p + "attn.compressor.wgate.weight"] = c.gate_proj.weight
            out[p + "attn.compressor.norm.weight"] = c.kv_norm.weight
            if hasattr(c, "indexer"):
                ix = c.indexer
                out[p + "attn.indexer.wq_b.weight"] = ix.q_b_proj.weight
                out[p + "attn.indexer.weights_proj.weight"] = ix.scorer.weights_proj.weight
                out[p + "attn.indexer.compressor.ape"] = ix.position_bias
                out[p + "attn.indexer.compressor.wkv.weight"] = ix.kv_proj.weight
                out[p + "attn.indexer.compressor.wgate.weight"] = ix.gate_proj.weight
                out[p + "attn.indexer.compressor.norm.weight"] = ix.kv_norm.weight
        g = layer.mlp.gate
        out[p + "ffn.gate.weight"] = g.weight
        if hasattr(g, "tid2eid"):
            out[p + "ffn.gate.tid2eid"] = g.tid2eid
        else:
            out[p + "ffn.gate.bias"] = g.e_score_correction_bias
        s = layer.mlp.shared_experts
        out[p + "ffn.shared_experts.w1.weight"] = s.gate_proj.weight
        out[p + "ffn.shared_experts.w2.weight"] = s.down_proj.weight
        out[p + "ffn.shared_experts.w3.weight"] = s.up_proj.weight
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def _original_config(config, yarn: bool = False) -> dict:
    extra = {}
    if yarn:
        extra["rope_scaling"] = {"type": "yarn", **{k: v for k, v in YARN.items() if k != "rope_type"}}
    return {
        **extra,
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "moe_intermediate_size": config.moe_intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "q_lora_rank": config.q_lora_rank,
        "num_experts_per_tok": config.num_experts_per_tok,
        "n_routed_experts": config.n_routed_experts,
        "n_shared_experts": config.n_shared_experts,
        "scoring_func": config.scoring_func,
        "norm_topk_prob": True,
        "routed_scaling_factor": config.routed_scaling_factor,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "compress_rope_theta": config.compress_rope_theta,
        "compress_ratios": [RATIO[t] for t in config.layer_types],
        "num_hash_layers": N_HASH,
        "hc_mult": config.hc_mult,
        "hc_sinkhorn_iters": config.hc_sinkhorn_iters,
        "hc_eps": config.hc_eps,
        "swiglu_limit": config.swiglu_limit,
        "sliding_window": config.sliding_window,
        "o_groups": config.o_groups,
        "o_lora_rank": config.o_lora_rank,
        "index_n_heads": config.index_n_heads,
        "index_head_dim": config.index_head_dim,
        "index_topk": config.index_topk,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "torch_dtype": "float32",
    }


def _mtp_tensors(originals: dict, config, seed: int) -> dict:
    """One multi-token-prediction block under DeepSeek's names (`mtp.0.*`): the tensors of one more
    sliding-window layer (compress ratio 0, so no compressor or indexer) routed by score, not hashed,
    plus the MTP's own e/h projections, their norms, its final norm and its own hc_head. Drawn from
    seed + 1, after build(), so the trunk's tensors stay exactly those of export(mtp=False)."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    rng = np.random.default_rng(seed + 1)
    sliding = f"layers.{LAYER_TYPES.index('sliding_attention')}."  # not a hash layer (N_HASH = 1)
    shapes = {
        k[len(sliding) :]: v.shape
        for k, v in originals.items()
        if k.startswith(sliding) and not k.startswith(sliding + "ffn.experts.")
    }
    n_embd = config.hidden_size
    for name in ("e_proj.weight", "h_proj.weight"):
        shapes[name] = (n_embd, n_embd)
    for name in ("enorm.weight", "hnorm.weight", "norm.weight"):
        shapes[name] = (n_embd,)
    for name in ("hc_head_fn", "hc_head_base", "hc_head_scale"):
        shapes[name] = originals[name].shape
    out = {}
    for name, shape in sorted(shapes.items()):
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if "norm" in name:
            out[name] = 1.0 + hf_export.NORM_WEIGHT_SPREAD * noise
        elif name.endswith(("sink", "base")):
            out[name] = 0.5 * noise
        elif name.endswith("scale"):
            out[name] = 1.0 + 0.2 * noise
        elif name == "ffn.gate.bias":
            out[name] = 0.05 * noise
        else:
            out[name] = hf_export.WEIGHT_STD * noise
    n_ff = config.moe_intermediate_size
    for e in range(config.n_routed_experts):
        for tag, shape in (("w1", (n_ff, n_embd)), ("w3", (n_ff, n_embd)), ("w2", (n_embd, n_ff))):
            _, packed, scale = _mxfp4(rng, shape)
            out[f"ffn.experts.{e}.{tag}.weight"] = torch.from_numpy(packed)
            out[f"ffn.experts.{e}.{tag}.scale"] = torch.from_numpy(scale)
    return {"mtp.0." + k: v.contiguous() for k, v in out.items()}


def export(out_dir: Path, seed: int = 1234, yarn: bool = False, mtp: bool = False) -> hf_export.ExportedModel:
    """mtp: hf/ also holds one MTP block (mtp.0.*, which transformers has no module for, so hf_tf/
    is the same model either way) and the config declares it."""
    from safetensors.torch import save_file

    tokenizer = hf_export.build_tokenizer(seed=seed)
    vocab_size = len(tokenizer)
    model, originals = build(vocab_size, seed, yarn)
    tf_dir = Path(out_dir) / "hf_tf"
    model.save_pretrained(tf_dir, safe_serialization=True)
    tokenizer.save_pretrained(tf_dir)
    hf_dir = Path(out_dir) / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    original_config = _original_config(model.config, yarn)
    if mtp:
        originals.update(_mtp_tensors(originals, model.config, seed))
        # llama.cpp reads one compress ratio per block, the MTP block's (0: sliding window only)
        # included; transformers' config keeps only the first num_hidden_layers of them.
        original_config["num_nextn_predict_layers"] = 1
        original_config["compress_ratios"].append(0)
    save_file(originals, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    (hf_dir / "config.json").write_text(json.dumps(original_config, indent=1))
    tokenizer.save_pretrained(hf_dir)
    return hf_export.ExportedModel(name="deepseek_v4", gguf_arch="deepseek4", hf_dir=hf_dir, vocab_size=vocab_size)


def prepare(root: Path, converter: Path, outtypes=("f32",), seed: int = 1234, yarn: bool = False):
    """Export under root/deepseek_v4[_yarn]-seed<seed> once and convert to each outtype (reused)."""
    out_dir = Path(root) / f"deepseek_v4{'_yarn' if yarn else ''}-seed{seed}"
    hf_dir = out_dir / "hf"
    if (hf_dir / "config.json").is_file():
        vocab_size = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
        exported = hf_export.ExportedModel("deepseek_v4", "deepseek4", hf_dir, vocab_size)
    else:
        exported = export(out_dir, seed=seed, yarn=yarn)
    files = {}
    for outtype in outtypes:
        path = out_dir / f"deepseek_v4-{outtype}.gguf"
        files[outtype] = path if path.is_file() else hf_export.convert(hf_dir, path, outtype, converter)
    return hf_export.ConvertedModel(exported=exported, gguf=files)


def prepare_mtp(root: Path, converter: Path, outtypes=("f32",), seed: int = 1234) -> dict:
    """Export the checkpoint with an MTP block under root/deepseek_v4_mtp-seed<seed> once and convert
    it twice per outtype (files reused): {outtype: (trunk GGUF, MTP sidecar GGUF)}. The plain
    conversion drops mtp.*, so the trunk file holds prepare()'s weights; `--mtp` writes only the block,
    as blk.<n_layer>, with the embeddings, output norm and head (and the MTP's hc_head as output_hc_*)."""
    out_dir = Path(root) / f"deepseek_v4_mtp-seed{seed}"
    hf_dir = out_dir / "hf"
    if not (hf_dir / "config.json").is_file():
        export(out_dir, seed=seed, mtp=True)
    files = {}
    for outtype in outtypes:
        trunk = out_dir / f"deepseek_v4-{outtype}.gguf"
        sidecar = out_dir / f"mtp-deepseek_v4-{outtype}.gguf"
        if not trunk.is_file():
            hf_export.convert(hf_dir, trunk, outtype, converter)
        if not sidecar.is_file():
            hf_export.convert(hf_dir, sidecar, outtype, converter, ["--mtp"])
        files[outtype] = (trunk, sidecar)
    return files


def transformers_dir(converted) -> Path:
    return converted.exported.hf_dir.parent / "hf_tf"


# GGUF tensor (llama.cpp's names, blk.N. prefix stripped) -> the transformers parameter it fills.
_LAYER_PARAMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn.weight": "attn_hc.fn",
    "hc_attn_base.weight": "attn_hc.base",
    "hc_attn_scale.weight": "attn_hc.scale",
    "hc_ffn_fn.weight": "ffn_hc.fn",
    "hc_ffn_base.weight": "ffn_hc.base",
    "hc_ffn_scale.weight": "ffn_hc.scale",
    "attn_sinks.weight": "self_attn.sinks",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_norm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv.weight": "self_attn.kv_proj.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_norm.weight",
    "attn_output_a.weight": "self_attn.o_a_proj.weight",
    "attn_output_b.weight": "self_attn.o_b_proj.weight",
    "attn_compressor_kv.weight": "self_attn.compressor.kv_proj.weight",
    "attn_compressor_gate.weight": "self_attn.compressor.gate_proj.weight",
    "attn_compressor_ape.weight": "self_attn.compressor.position_bias",
    "attn_compressor_norm.weight": "self_attn.compressor.kv_norm.weight",
    "indexer.proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "indexer.attn_q_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "indexer_compressor_kv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "indexer_compressor_gate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "indexer_compressor_ape.weight": "self_attn.compressor.indexer.position_bias",
    "indexer_compressor_norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
_ROOT_PARAMS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",
    "output_hc_fn.weight": "model.hc_head.hc_fn",
    "output_hc_base.weight": "model.hc_head.hc_base",
    "output_hc_scale.weight": "model.hc_head.hc_scale",
}


def load_gguf_weights(model, path) -> None:
    """Replace every weight of the transformers model by the GGUF file's (dequantized by the gguf
    package, an implementation independent of sharpi's): transformers then computes on exactly the
    numbers a quantized file holds. The hash tables are i32 and copied as they are."""
    import gguf
    import torch

    reader = gguf.GGUFReader(str(path))
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    gate_up = {}
    with torch.no_grad():
        for t in reader.tensors:
            is_table = t.tensor_type == gguf.GGMLQuantizationType.I32
            values = None if is_table else gguf.quants.dequantize(t.data, t.tensor_type)
            if t.name.startswith("blk."):
                il, rest = t.name[4:].split(".", 1)
                prefix = f"model.layers.{il}."
                if rest == "ffn_gate_tid2eid.weight":
                    buffers[prefix + "mlp.gate.tid2eid"].copy_(torch.from_numpy(np.asarray(t.data).astype(np.int64)))
                    continue
                if rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
                    gate_up.setdefault(il, {})[rest] = values
                    continue
                name = prefix + _LAYER_PARAMS[rest]
            else:
                name = _ROOT_PARAMS[t.name]
            target = params.get(name)
            if target is None:
                target = buffers[name]
            target.copy_(torch.from_numpy(np.array(values, dtype=np.float32).reshape(target.shape)))
        for il, parts in gate_up.items():
            both = np.concatenate([parts["ffn_gate_exps.weight"], parts["ffn_up_exps.weight"]], axis=1)
            params[f"model.layers.{il}.mlp.experts.gate_up_proj"].copy_(torch.from_numpy(both.astype(np.float32)))
