"""Load a qwen3moe GGUF (as llama.cpp's converter writes it) into transformers' Qwen3MoeForCausalLM.

Owns nothing: it reads the file with the installed `gguf` package, dequantizes every tensor with
`gguf.quants.dequantize` and copies it into a freshly built float32 model. It never writes.

Name and layout mapping (the inverse of the converter for this architecture). qwen3moe uses NeoX
RoPE, so the converter does not reorder q/k rows and nothing has to be undone. Expert tensors are
stacked expert-major: ggml ne [n_embd, n_ff, n_expert] reads in numpy as [n_expert, n_ff, n_embd],
which is transformers' layout; gate and up are concatenated into its gate_up_proj.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def read_tensors(path: Path) -> dict:
    """name -> float32 numpy array in numpy (row-major, ggml-reversed) shape."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    tensors = {}
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        tensors[tensor.name] = np.asarray(values, dtype=np.float32).reshape(shape)
    return tensors


def read_metadata(path: Path) -> dict:
    """The scalar and string metadata (arrays other than short ones are skipped)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out = {}
    for key, field in reader.fields.items():
        if not field.types or field.types[0] == gguf.GGUFValueType.ARRAY:
            continue
        value = field.parts[field.data[0]]
        out[key] = bytes(value).decode() if field.types[0] == gguf.GGUFValueType.STRING else value.tolist()[0]
    return out


def arch_from_metadata(meta: dict):
    from model import ArchConfig

    if meta.get("general.architecture") != "qwen3moe":
        raise ValueError(f"expected a qwen3moe file, got {meta.get('general.architecture')!r}")
    p = "qwen3moe."
    return ArchConfig(
        vocab_size=0,  # filled from token_embd by the caller
        hidden_size=meta[p + "embedding_length"],
        num_hidden_layers=meta[p + "block_count"],
        num_attention_heads=meta[p + "attention.head_count"],
        num_key_value_heads=meta[p + "attention.head_count_kv"],
        head_dim=meta[p + "attention.key_length"],
        num_experts=meta[p + "expert_count"],
        num_experts_per_tok=meta[p + "expert_used_count"],
        moe_intermediate_size=meta[p + "expert_feed_forward_length"],
        max_position_embeddings=meta[p + "context_length"],
        rope_theta=float(meta[p + "rope.freq_base"]),
        rms_norm_eps=float(meta[p + "attention.layer_norm_rms_epsilon"]),
    )


def hf_state_dict(tensors: dict, n_layer: int) -> dict:
    import torch

    def t(name):
        return torch.from_numpy(tensors[name].copy())

    sd = {"model.embed_tokens.weight": t("token_embd.weight"), "model.norm.weight": t("output_norm.weight")}
    if "output.weight" in tensors:
        sd["lm_head.weight"] = t("output.weight")
    for il in range(n_layer):
        b, h = f"blk.{il}.", f"model.layers.{il}."
        sd[h + "input_layernorm.weight"] = t(b + "attn_norm.weight")
        sd[h + "post_attention_layernorm.weight"] = t(b + "ffn_norm.weight")
        sd[h + "self_attn.q_proj.weight"] = t(b + "attn_q.weight")
        sd[h + "self_attn.k_proj.weight"] = t(b + "attn_k.weight")
        sd[h + "self_attn.v_proj.weight"] = t(b + "attn_v.weight")
        sd[h + "self_attn.o_proj.weight"] = t(b + "attn_output.weight")
        sd[h + "self_attn.q_norm.weight"] = t(b + "attn_q_norm.weight")
        sd[h + "self_attn.k_norm.weight"] = t(b + "attn_k_norm.weight")
        sd[h + "mlp.gate.weight"] = t(b + "ffn_gate_inp.weight")
        sd[h + "mlp.experts.gate_up_proj"] = torch.cat(
            [t(b + "ffn_gate_exps.weight"), t(b + "ffn_up_exps.weight")], dim=1
        )
        sd[h + "mlp.experts.down_proj"] = t(b + "ffn_down_exps.weight")
    return sd


def load_model(path: Path):
    """(transformers model in eval mode, ArchConfig) with the file's dequantized weights."""
    from model import build_model

    path = Path(path)
    meta = read_metadata(path)
    arch = arch_from_metadata(meta)
    tensors = read_tensors(path)
    arch.vocab_size = tensors["token_embd.weight"].shape[0]
    model = build_model(arch, seed=0)
    missing, unexpected = model.load_state_dict(hf_state_dict(tensors, arch.num_hidden_layers), strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]  # tied to embed_tokens
    if missing or unexpected:
        raise RuntimeError(f"{path}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval(), arch
