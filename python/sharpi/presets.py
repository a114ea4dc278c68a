"""Model shapes for `sharpi make-model`: the published hyper-parameters of real MoE models, a "tiny"
shape valid for every architecture, and shapes matching the routing traces in ../shared/traces/.

A preset is a set of hyper-parameters; `resolve()` combines a preset, an architecture and user
overrides into one validated `HParams`. Field names follow llama.cpp's (n_embd, n_head_kv, n_ff_exp).
Sources for the real models are their Hugging Face config.json files:
  allenai/OLMoE-1B-7B-0924, Qwen/Qwen3-30B-A3B, mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen1.5-MoE-A2.7B,
  deepseek-ai/DeepSeek-V2-Lite (preset deepseek-v2-lite: the real deepseek2 architecture, MLA and all;
  the older trace-shaped "deepseek-trace" is a qwen3moe with DeepSeek-V2-Lite's expert layout),
  zai-org/GLM-4.5-Air and zai-org/GLM-4.6 (presets glm-4.5-air and glm-4.6; GLM-4.5 and GLM-4.7 have
  GLM-4.6's shapes), MiniMaxAI/MiniMax-M2 (preset minimax-m2; MiniMax-M2.1 has the same shapes),
  deepseek-ai/DeepSeek-V3.2 (preset deepseek-v3.2, arch deepseek32; V3.2-Exp has the same shapes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ._core import InvalidArgument

# Architectures make-model writes, as GGUF `general.architecture` strings.
MOE_ARCHES = ("qwen2moe", "qwen3moe", "olmoe", "deepseek2", "qwen3next", "qwen35moe", "gpt-oss", "glm4moe",
              "llama4", "minimax-m2", "deepseek4", "deepseek32", "nemotron_h_moe")  # always MoE
# Multi-head latent attention: deepseek2, and deepseek32 (deepseek2 plus DeepSeek Sparse Attention).
MLA_ARCHES = ("deepseek2", "deepseek32")
# Hybrid Gated DeltaNet + gated attention (every full_attention_interval-th layer is attention).
HYBRID_ARCHES = ("qwen3next", "qwen35moe")
DENSE_ARCHES = ("qwen2", "qwen3")  # never MoE
ARCHES = ("llama",) + MOE_ARCHES + DENSE_ARCHES  # llama: Mixtral-style MoE when n_expert > 0, else dense


@dataclass(frozen=True)
class HParams:
    arch: str
    n_vocab: int
    n_ctx_train: int  # {arch}.context_length
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int  # per-head width of q/k/v; n_head * head_dim may differ from n_embd (qwen3)
    n_ff: int  # dense FFN width (dense archs; the "intermediate_size" qwen MoE configs also carry)
    n_expert: int  # 0 = dense
    n_expert_used: int
    n_ff_exp: int  # width of one routed expert
    n_ff_shexp: int  # width of the shared expert (qwen2moe only, else 0)
    rope_freq_base: float
    rms_eps: float
    tie_embeddings: bool = False  # no output.weight; the lm head reuses token_embd
    # deepseek2 (multi-head latent attention). head_dim is then the per-head q/k width (qk_nope +
    # n_rot, key_length_mla) and n_head_kv is 1 (the converter writes MLA as MQA over the latent).
    n_lora_q: int = 0  # q LoRA rank; 0: one q projection (DeepSeek-V2-Lite)
    n_lora_kv: int = 0  # compressed KV width (kv_lora_rank)
    head_dim_v: int = 0  # v_head_dim
    n_layer_dense_lead: int = 0  # first_k_dense_replace
    expert_weights_scale: float = 1.0  # routed_scaling_factor
    yarn_factor: float = 0.0  # YaRN rope scaling factor (0: none)
    yarn_n_ctx_orig: int = 0
    yarn_mscale_all_dim: float = 0.0
    # deepseek32 only: DeepSeek-V3's group-limited routing (n_group, topk_group; 0: no key written)
    # and a lightning indexer (index_n_heads, index_head_dim, index_topk: deepseek32's DSA and
    # deepseek4's CSA layers).
    n_expert_group: int = 0
    n_expert_group_used: int = 0
    indexer_n_head: int = 0
    indexer_head_dim: int = 0
    indexer_top_k: int = 0
    # Hybrid archs only (llama.cpp's ssm.* keys): conv kernel, key head width, key heads, value
    # heads, value heads * value head width; the layer pattern; RoPE'd dims per head (0: head_dim).
    ssm_d_conv: int = 0
    ssm_d_state: int = 0
    ssm_n_group: int = 0
    ssm_dt_rank: int = 0
    ssm_d_inner: int = 0
    full_attention_interval: int = 0
    n_rot: int = 0  # deepseek2: qk_rope_head_dim; glm4moe, minimax-m2, hybrids: RoPE'd dims per head
    n_swa: int = 0  # gpt-oss: attention.sliding_window (even layers slide, odd ones attend to all)
    # glm4moe: per-head q/k RMSNorm (use_qk_norm: GLM-4.5 / 4.6 / 4.7, not 4.5-Air).
    use_qk_norm: bool = False
    # Multi-token-prediction blocks after the trunk (nextn_predict_layers; glm4moe, qwen3next,
    # qwen35moe, deepseek32, deepseek4, nemotron_h_moe): blk.<n_layer + i>, a full-attention block plus
    # the nextn.* tensors (block_count = n_layer + n_layer_nextn).
    n_layer_nextn: int = 0
    # llama4: MoE on layers (il + 1) % moe_layer_step == 0 (interleave_moe_layer_step), dense SwiGLU of
    # n_ff elsewhere; a shared expert of n_ff_exp on every MoE layer. Llama-3-style RoPE scaling
    # (HF rope_type "llama3": factor, low / high frequency factors, original context), written as the
    # converter writes it, a rope_freqs tensor; factor 0: none.
    moe_layer_step: int = 0
    rope_llama3_factor: float = 0.0
    rope_llama3_low_freq: float = 1.0
    rope_llama3_high_freq: float = 4.0
    rope_llama3_n_ctx_orig: int = 8192
    # deepseek4 (DeepSeek-V4; docs/design.md §12): per-layer compression ratios (0 sliding window
    # only, 4 CSA, 128 HCA), the compressed branches' RoPE base, hyper-connection streams, Sinkhorn
    # iterations and epsilon, the Lightning Indexer (heads, head width, top-k), the grouped output
    # projection (groups, rank per group), hash-routed leading layers and the SwiGLU clamp. n_lora_q,
    # n_rot and n_swa (the window) are the fields above; n_head_kv is 1.
    compress_ratios: tuple = ()
    compress_rope_freq_base: float = 160000.0
    hc_mult: int = 0
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    o_groups: int = 0
    o_lora_rank: int = 0
    n_hash_layers: int = 0
    swiglu_clamp: float = 0.0
    # nemotron_h_moe: one character per block, as the HF config's hybrid_override_pattern: "M"
    # Mamba-2 (ssm_* fields: ssm_n_group groups, ssm_dt_rank heads of ssm_d_inner / ssm_dt_rank,
    # ssm_d_state state), "E" MoE (relu^2 experts and shared expert), "*" attention (GQA, no RoPE).
    layer_pattern: str = ""

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @property
    def q_width(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_head_kv * self.head_dim


# Field values per preset. "arch" is None for presets valid for any architecture. head_dim None means
# n_embd // n_head (recomputed when n_embd or n_head is overridden).
PRESETS: dict[str, dict] = {
    # Small enough to write with real float weights in well under a second; every row length is a
    # multiple of 256 so every K-quant applies to every matrix.
    "tiny": {
        "arch": None,
        "n_vocab": 1024,
        "n_ctx_train": 4096,
        "n_embd": 256,
        "n_layer": 2,
        "n_head": 4,
        "n_head_kv": 2,
        "head_dim": None,
        "n_ff": 512,
        "n_expert": 8,
        "n_expert_used": 2,
        "n_ff_exp": 256,
        "n_ff_shexp": 256,
        "rope_freq_base": 10000.0,
        "rms_eps": 1e-6,
    },
    "olmoe-1b-7b": {
        "arch": "olmoe",
        "n_vocab": 50304,
        "n_ctx_train": 4096,
        "n_embd": 2048,
        "n_layer": 16,
        "n_head": 16,
        "n_head_kv": 16,
        "head_dim": None,
        "n_ff": 1024,
        "n_expert": 64,
        "n_expert_used": 8,
        "n_ff_exp": 1024,
        "n_ff_shexp": 0,
        "rope_freq_base": 10000.0,
        "rms_eps": 1e-5,
    },
    "qwen3-30b-a3b": {
        "arch": "qwen3moe",
        "n_vocab": 151936,
        "n_ctx_train": 40960,
        "n_embd": 2048,
        "n_layer": 48,
        "n_head": 32,
        "n_head_kv": 4,
        "head_dim": 128,
        "n_ff": 6144,
        "n_expert": 128,
        "n_expert_used": 8,
        "n_ff_exp": 768,
        "n_ff_shexp": 0,
        "rope_freq_base": 1000000.0,
        "rms_eps": 1e-6,
    },
    "mixtral-8x7b": {
        "arch": "llama",
        "n_vocab": 32000,
        "n_ctx_train": 32768,
        "n_embd": 4096,
        "n_layer": 32,
        "n_head": 32,
        "n_head_kv": 8,
        "head_dim": None,
        "n_ff": 14336,
        "n_expert": 8,
        "n_expert_used": 2,
        "n_ff_exp": 14336,
        "n_ff_shexp": 0,
        "rope_freq_base": 1000000.0,
        "rms_eps": 1e-5,
    },
    "qwen1.5-moe-a2.7b": {
        "arch": "qwen2moe",
        "n_vocab": 151936,
        "n_ctx_train": 8192,
        "n_embd": 2048,
        "n_layer": 24,
        "n_head": 16,
        "n_head_kv": 16,
        "head_dim": None,
        "n_ff": 5632,
        "n_expert": 60,
        "n_expert_used": 4,
        "n_ff_exp": 1408,
        "n_ff_shexp": 5632,
        "rope_freq_base": 1000000.0,
        "rms_eps": 1e-6,
    },
    # ../shared/traces/deepseek_v2_lite_train.npz: 26 MoE layers x 64 experts, top-6. DeepSeek-V2-Lite's
    # first layer is dense and it has 2 shared experts; kept simple here: 26 MoE layers, no shared expert.
    "deepseek-trace": {
        "arch": "qwen3moe",
        "n_vocab": 102400,
        "n_ctx_train": 163840,
        "n_embd": 2048,
        "n_layer": 26,
        "n_head": 16,
        "n_head_kv": 16,
        "head_dim": 128,
        "n_ff": 10944,
        "n_expert": 64,
        "n_expert_used": 6,
        "n_ff_exp": 1408,
        "n_ff_shexp": 0,
        "rope_freq_base": 10000.0,
        "rms_eps": 1e-6,
    },
}
# deepseek-ai/DeepSeek-V3.2 (and V3.2-Exp, the same shapes; config.json): 61 layers, the first 3 dense
# (18432), then 58 MoE layers of 256 routed experts of 2048, top-8 within the best 4 of 8 groups,
# plus 1 shared expert; routed weights x2.5. MLA of 128 heads: q LoRA 1536, kv LoRA 512, qk_nope 128
# + RoPE 64, v 128; YaRN x40 over 4096 positions (mscale_all_dim 1). DSA's lightning indexer: 64
# heads of 128, top-2048. The converter also writes its MTP block (num_nextn_predict_layers 1).
PRESETS["deepseek-v3.2"] = {
    "arch": "deepseek32",
    "n_vocab": 129280,
    "n_ctx_train": 163840,
    "n_embd": 7168,
    "n_layer": 61,
    "n_head": 128,
    "n_head_kv": 1,
    "head_dim": 192,
    "n_ff": 18432,
    "n_expert": 256,
    "n_expert_used": 8,
    "n_ff_exp": 2048,
    "n_ff_shexp": 2048,
    "rope_freq_base": 10000.0,
    "rms_eps": 1e-6,
    "n_lora_q": 1536,
    "n_lora_kv": 512,
    "n_rot": 64,
    "head_dim_v": 128,
    "n_layer_dense_lead": 3,
    "expert_weights_scale": 2.5,
    "yarn_factor": 40.0,
    "yarn_n_ctx_orig": 4096,
    "yarn_mscale_all_dim": 1.0,
    "n_expert_group": 8,
    "n_expert_group_used": 4,
    "indexer_n_head": 64,
    "indexer_head_dim": 128,
    "indexer_top_k": 2048,
    "n_layer_nextn": 1,
}
# deepseek-ai/DeepSeek-V2-Lite: 27 layers (the first dense, then 26 MoE layers of 64 routed experts,
# top-6, plus 2 shared experts = n_ff_shexp 2 * 1408), MLA without q LoRA, YaRN x40. Its routing is
# ../shared/traces/deepseek_v2_lite_train.npz's.
PRESETS["deepseek-v2-lite"] = {
    "arch": "deepseek2",
    "n_vocab": 102400,
    "n_ctx_train": 163840,
    "n_embd": 2048,
    "n_layer": 27,
    "n_head": 16,
    "n_head_kv": 1,
    "head_dim": 192,
    "n_ff": 10944,
    "n_expert": 64,
    "n_expert_used": 6,
    "n_ff_exp": 1408,
    "n_ff_shexp": 2816,
    "rope_freq_base": 10000.0,
    "rms_eps": 1e-6,
    "n_lora_q": 0,
    "n_lora_kv": 512,
    "n_rot": 64,
    "head_dim_v": 128,
    "n_layer_dense_lead": 1,
    "expert_weights_scale": 1.0,
    "yarn_factor": 40.0,
    "yarn_n_ctx_orig": 4096,
    "yarn_mscale_all_dim": 0.707,
}
# openai/gpt-oss-20b: 24 layers of 32 experts (top-4), n_embd 2880, 64 query heads of 64 over 8 KV
# heads, sliding window 128 on every other layer, YaRN x32 over 4096 positions; make-model's mxfp4
# quant writes its experts as MXFP4 like the released checkpoint.
PRESETS["gpt-oss-20b"] = {
    "arch": "gpt-oss",
    "n_vocab": 201088,
    "n_ctx_train": 131072,
    "n_embd": 2880,
    "n_layer": 24,
    "n_head": 64,
    "n_head_kv": 8,
    "head_dim": 64,
    "n_ff": 2880,
    "n_expert": 32,
    "n_expert_used": 4,
    "n_ff_exp": 2880,
    "n_ff_shexp": 0,
    "rope_freq_base": 150000.0,
    "rms_eps": 1e-5,
    "yarn_factor": 32.0,
    "yarn_n_ctx_orig": 4096,
    "n_swa": 128,
}
# zai-org/GLM-4.5-Air (106B-A12B): 46 layers (the first dense) of 128 routed experts top-8 plus one
# shared expert, 96 query heads of 128 over 8 KV heads (q/k/v biases, no q/k norm), RoPE on half of
# each head, routed_scaling_factor 1.0, one MTP block.
PRESETS["glm-4.5-air"] = {
    "arch": "glm4moe",
    "n_vocab": 151552,
    "n_ctx_train": 131072,
    "n_embd": 4096,
    "n_layer": 46,
    "n_head": 96,
    "n_head_kv": 8,
    "head_dim": 128,
    "n_ff": 10944,
    "n_expert": 128,
    "n_expert_used": 8,
    "n_ff_exp": 1408,
    "n_ff_shexp": 1408,
    "rope_freq_base": 1000000.0,
    "rms_eps": 1e-5,
    "n_rot": 64,
    "n_layer_dense_lead": 1,
    "expert_weights_scale": 1.0,
    "use_qk_norm": False,
    "n_layer_nextn": 1,
}
# zai-org/GLM-4.6 (355B-A32B; GLM-4.5 and GLM-4.7 have the same shapes, GLM-4.5 a 131072 context):
# 92 layers (the first 3 dense) of 160 routed experts top-8 plus one shared expert, n_embd 5120,
# 96 query heads of 128 over 8 KV heads with q/k RMSNorm, routed_scaling_factor 2.5, one MTP block.
PRESETS["glm-4.6"] = {
    "arch": "glm4moe",
    "n_vocab": 151552,
    "n_ctx_train": 202752,
    "n_embd": 5120,
    "n_layer": 92,
    "n_head": 96,
    "n_head_kv": 8,
    "head_dim": 128,
    "n_ff": 12288,
    "n_expert": 160,
    "n_expert_used": 8,
    "n_ff_exp": 1536,
    "n_ff_shexp": 1536,
    "rope_freq_base": 1000000.0,
    "rms_eps": 1e-5,
    "n_rot": 64,
    "n_layer_dense_lead": 3,
    "expert_weights_scale": 2.5,
    "use_qk_norm": True,
    "n_layer_nextn": 1,
}
# "tiny" as glm4moe: one leading dense layer + 2 MoE layers with a shared expert, q/k norms, RoPE on
# half of each head, and one MTP block. The routed weight scale is GLM-4.5-Air's 1.0: with GLM-4.6's
# 2.5 on 2 of 8 experts, one router flip of fast mode's quantized activations moves the logits by up
# to 0.94 of their range (test_fast_mode.py's budgets are for a flip's usual 0.4); the converter
# models of tests/reference/hf_export.py carry 2.5 against transformers and llama.cpp.
TINY_GLM4MOE = {
    "n_layer": 3,
    "n_rot": 32,
    "n_layer_dense_lead": 1,
    "expert_weights_scale": 1.0,
    "use_qk_norm": True,
    "n_layer_nextn": 1,
}
# meta-llama/Llama-4-Scout-17B-16E (text_config of its config.json): 48 layers, every one MoE (16
# experts, top-1, plus a shared expert of the same 8192 width), n_embd 5120, 40 query heads of 128 over
# 8 KV heads, llama3 RoPE scaling x16 over 8192 positions (the converter's rope_freqs). The chunked /
# NoPE layer pattern, chunk 8192 and temperature are llama.cpp's constants (no keys in the file).
PRESETS["llama-4-scout"] = {
    "arch": "llama4",
    "n_vocab": 202048,
    "n_ctx_train": 10485760,
    "n_embd": 5120,
    "n_layer": 48,
    "n_head": 40,
    "n_head_kv": 8,
    "head_dim": 128,
    "n_ff": 16384,
    "n_expert": 16,
    "n_expert_used": 1,
    "n_ff_exp": 8192,
    "n_ff_shexp": 8192,
    "rope_freq_base": 500000.0,
    "rms_eps": 1e-5,
    "moe_layer_step": 1,
    "rope_llama3_factor": 16.0,
    "rope_llama3_low_freq": 1.0,
    "rope_llama3_high_freq": 1.0,
    "rope_llama3_n_ctx_orig": 8192,
}
# meta-llama/Llama-4-Maverick-17B-128E: the same attention, MoE on every other layer (1, 3, ..., 47:
# 24 layers of 128 experts, top-1, plus the shared expert), dense SwiGLU of 16384 on the others, no
# RoPE scaling, no q/k norm (llama.cpp: 128-expert files). Its routing is
# ../shared/traces/llama4_maverick_train.npz's (24 MoE layers x 128 experts, top-1).
PRESETS["llama-4-maverick"] = {
    **PRESETS["llama-4-scout"],
    "n_ctx_train": 1048576,
    "n_expert": 128,
    "moe_layer_step": 2,
    "rope_llama3_factor": 0.0,
}
# "tiny" as llama4: 4 layers (three chunked RoPE layers, one global NoPE layer), MoE on 1 and 3, top-1.
TINY_LLAMA4 = {"n_layer": 4, "n_expert_used": 1, "moe_layer_step": 2, "n_ff_shexp": 256}
# MiniMaxAI/MiniMax-M2 (230B-A10B): 62 layers, all MoE: 256 routed experts top-8 of width 1536 (no
# shared expert; sigmoid routing with the selection bias, top-k renormalised), 48 query heads of 128
# over 8 KV heads (n_head * head_dim = 6144 != n_embd 3072), q/k RMSNorm over the whole projection,
# RoPE on rotary_dim 64 of each head's 128. Its config declares 3 MTP modules, but neither
# transformers nor llama.cpp's converter carries them, so its files have none.
PRESETS["minimax-m2"] = {
    "arch": "minimax-m2",
    "n_vocab": 200064,
    "n_ctx_train": 196608,
    "n_embd": 3072,
    "n_layer": 62,
    "n_head": 48,
    "n_head_kv": 8,
    "head_dim": 128,
    "n_ff": 1536,  # feed_forward_length = intermediate_size, the expert width
    "n_expert": 256,
    "n_expert_used": 8,
    "n_ff_exp": 1536,
    "n_ff_shexp": 0,
    "rope_freq_base": 5000000.0,
    "rms_eps": 1e-6,
    "n_rot": 64,
}
# deepseek-ai/DeepSeek-V4-Flash (transformers' DeepseekV4Config defaults, which are V4-Flash's): 43
# layers, 64 query heads of 512 over one shared K=V head, q LoRA 1024, RoPE on 64 dims, output in 8
# groups of rank 1024, 256 routed experts top-6 of width 2048 + 1 shared, sqrt(softplus) routing
# scaled 1.5, the first 3 layers hash-routed, 4 hyper-connection streams, window 128, an indexer of
# 64 heads x 128 keeping 512 entries; layers: 2 HCA then CSA / HCA alternating (transformers'
# default schedule). The released config's YaRN on the compressed branches is left out of the
# preset (make-model writes YaRN keys for deepseek2 only; sharpi runs it on converted V4 files).
PRESETS["deepseek-v4"] = {
    "arch": "deepseek4",
    "n_vocab": 129280,
    "n_ctx_train": 1048576,
    "n_embd": 4096,
    "n_layer": 43,
    "n_head": 64,
    "n_head_kv": 1,
    "head_dim": 512,
    "n_ff": 0,
    "n_expert": 256,
    "n_expert_used": 6,
    "n_ff_exp": 2048,
    "n_ff_shexp": 2048,
    "rope_freq_base": 10000.0,
    "rms_eps": 1e-6,
    "n_lora_q": 1024,
    "n_rot": 64,
    "n_swa": 128,
    "expert_weights_scale": 1.5,
    "compress_ratios": (128, 128) + tuple(4 if i % 2 else 128 for i in range(41)),
    "hc_mult": 4,
    "indexer_n_head": 64,
    "indexer_head_dim": 128,
    "indexer_top_k": 512,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "n_hash_layers": 3,
    "swiglu_clamp": 10.0,
}
# "tiny" as deepseek4: CSA, sliding only, HCA, CSA; a window of 8 and an indexer keeping 2 entries,
# so that short test prompts pass every window; the first layer hash-routed.
TINY_DEEPSEEK4 = {
    "n_layer": 4, "n_head_kv": 1, "head_dim": 64, "n_rot": 16, "n_lora_q": 64, "n_swa": 8,
    "n_ff_shexp": 256, "expert_weights_scale": 1.5, "compress_ratios": (4, 0, 128, 4), "hc_mult": 4,
    "indexer_n_head": 4, "indexer_head_dim": 64, "indexer_top_k": 2, "o_groups": 2, "o_lora_rank": 64,
    "n_hash_layers": 1, "swiglu_clamp": 10.0,
}  # fmt: skip
# "tiny" as minimax-m2: head_dim 128 != n_embd / n_head (as MiniMax-M2's 128 vs 64), RoPE on half of it.
TINY_MINIMAX_M2 = {"head_dim": 128, "n_rot": 64}
# "tiny" as gpt-oss: 3 layers (sliding, full, sliding) with a window shorter than a typical test run.
TINY_GPT_OSS = {"n_layer": 3, "n_swa": 16, "yarn_factor": 32.0, "yarn_n_ctx_orig": 256}
# "tiny" as deepseek2: the same widths, one leading dense layer + 2 MoE layers, 2 shared experts.
TINY_DEEPSEEK2 = {
    "n_layer": 3,
    "n_head_kv": 1,
    "head_dim": 96,
    "n_ff_shexp": 512,
    "n_lora_kv": 256,
    "n_rot": 32,
    "head_dim_v": 64,
    "n_layer_dense_lead": 1,
    "expert_weights_scale": 1.5,
}
# "tiny" as deepseek32: tiny deepseek2 with a q LoRA and DSA's indexer (16 heads of 64, top-8: a
# prompt of more than 8 tokens attends to a subset). 16 heads, not a few: a position whose q.k is
# negative in every head scores exactly 0, and such zeros would tie at the top-k boundary.
TINY_DEEPSEEK32 = {
    **TINY_DEEPSEEK2,
    "n_lora_q": 256,
    "expert_weights_scale": 2.5,
    "indexer_n_head": 16,
    "indexer_head_dim": 64,
    "indexer_top_k": 8,
}
# Qwen/Qwen3.5-35B-A3B (text model of its config.json): 40 layers, 3 of every 4 Gated DeltaNet.
PRESETS["qwen3.5-35b-a3b"] = {
    "arch": "qwen35moe",
    "n_vocab": 248320,
    "n_ctx_train": 262144,
    "n_embd": 2048,
    "n_layer": 40,
    "n_head": 16,
    "n_head_kv": 2,
    "head_dim": 256,
    "n_ff": 0,
    "n_expert": 256,
    "n_expert_used": 8,
    "n_ff_exp": 512,
    "n_ff_shexp": 512,
    "rope_freq_base": 10000000.0,
    "rms_eps": 1e-6,
    "ssm_d_conv": 4,
    "ssm_d_state": 128,
    "ssm_n_group": 16,
    "ssm_dt_rank": 32,
    "ssm_d_inner": 4096,
    "full_attention_interval": 4,
    "n_rot": 64,  # partial_rotary_factor 0.25
    "n_layer_nextn": 1,  # mtp_num_hidden_layers
}
# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 (config.json): 52 blocks, 23 Mamba-2, 23 MoE, 6 GQA
# attention without RoPE; 128 relu^2 experts top-6 of width 1856 plus one shared expert of 3712,
# sigmoid routing with the selection bias, top-k renormalised and scaled by 2.5; Mamba-2 with 64
# heads of 64 in 8 groups, state 128, conv kernel 4; vocabulary 131072.
PRESETS["nemotron-3-nano-30b-a3b"] = {
    "arch": "nemotron_h_moe",
    "n_vocab": 131072,
    "n_ctx_train": 262144,
    "n_embd": 2688,
    "n_layer": 52,
    "n_head": 32,
    "n_head_kv": 2,
    "head_dim": 128,
    "n_ff": 0,
    "n_expert": 128,
    "n_expert_used": 6,
    "n_ff_exp": 1856,
    "n_ff_shexp": 3712,
    "rope_freq_base": 10000.0,
    "rms_eps": 1e-5,
    "expert_weights_scale": 2.5,
    "ssm_d_conv": 4,
    "ssm_d_state": 128,
    "ssm_n_group": 8,
    "ssm_dt_rank": 64,
    "ssm_d_inner": 4096,
    "layer_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
}
# "tiny" as nemotron_h_moe: 6 blocks covering each kind twice (Mamba-2, MoE, attention), Mamba-2
# with 8 heads of 32 in 2 groups (every row a multiple of 256 wide, for the K types).
TINY_NEMOTRON_H_MOE = {
    "n_layer": 6,
    "n_ff": 0,
    "expert_weights_scale": 2.5,
    "ssm_d_conv": 4,
    "ssm_d_state": 64,
    "ssm_n_group": 2,
    "ssm_dt_rank": 8,
    "ssm_d_inner": 256,
    "layer_pattern": "ME*MEE",
}
# The tiny preset's DeltaNet shape on a hybrid arch.
_TINY_HYBRID = {
    "ssm_d_conv": 4, "ssm_d_state": 64, "ssm_n_group": 2, "ssm_dt_rank": 4, "ssm_d_inner": 256,
    "full_attention_interval": 2, "n_rot": 16,
}  # fmt: skip

# ../shared/traces/mixtral_8x7b_small.npz: 32 layers x 8 experts, top-2 = Mixtral 8x7B itself.
PRESETS["mixtral-trace"] = dict(PRESETS["mixtral-8x7b"])

FIELDS = tuple(f.name for f in dataclasses.fields(HParams) if f.name != "arch")


def preset_arch(preset: str) -> str | None:
    """The architecture a preset fixes (None for "tiny")."""
    if preset not in PRESETS:
        raise InvalidArgument(f"unknown preset '{preset}' (known: {', '.join(PRESETS)})")
    return PRESETS[preset]["arch"]


def resolve(arch: str | None = None, preset: str = "tiny", **overrides) -> HParams:
    """Hyper-parameters for `preset`, on architecture `arch` (None: the preset's own, qwen3moe for tiny),
    with `overrides` (HParams field names) applied. Raises InvalidArgument for an unknown preset, arch
    or field, an arch that conflicts with the preset, or a shape the architecture cannot express."""
    fixed = preset_arch(preset)
    if arch is not None and arch not in ARCHES:
        raise InvalidArgument(f"unknown arch '{arch}' (known: {', '.join(ARCHES)})")
    if fixed is not None and arch is not None and arch != fixed:
        raise InvalidArgument(f"preset '{preset}' is a {fixed} model; it cannot be written as arch '{arch}'")
    arch = arch or fixed or "qwen3moe"
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise InvalidArgument(f"unknown hyper-parameter(s) {unknown} (known: {', '.join(FIELDS)})")

    p = dict(PRESETS[preset])
    p["arch"] = arch
    if preset == "tiny":
        if arch in DENSE_ARCHES:
            p["n_expert"] = p["n_expert_used"] = 0
        if arch not in ("qwen2moe", "glm4moe", "nemotron_h_moe") + HYBRID_ARCHES:
            p["n_ff_shexp"] = 0
        if arch == "deepseek4":
            p.update(TINY_DEEPSEEK4)
        if arch == "deepseek2":
            p.update(TINY_DEEPSEEK2)
        if arch == "deepseek32":
            p.update(TINY_DEEPSEEK32)
        if arch == "gpt-oss":
            p.update(TINY_GPT_OSS)
        if arch == "glm4moe":
            p.update(TINY_GLM4MOE)
        if arch == "llama4":
            p.update(TINY_LLAMA4)
        if arch == "minimax-m2":
            p.update(TINY_MINIMAX_M2)
        if arch == "nemotron_h_moe":
            p.update(TINY_NEMOTRON_H_MOE)
        if arch in HYBRID_ARCHES:
            p.update(_TINY_HYBRID)
        if arch == "olmoe":
            # llama.cpp sizes OLMoE's k_norm as n_embd, i.e. it assumes n_head_kv == n_head.
            p["n_head_kv"] = p["n_head"]
    p.update({k: v for k, v in overrides.items() if v is not None})
    if p["head_dim"] is None:
        p["head_dim"] = p["n_embd"] // p["n_head"] if p["n_head"] else 0
    if p["n_expert"] == 0:
        p["n_expert_used"] = 0
    hp = HParams(**p)
    validate(hp)
    return hp


def _validate_deepseek4(hp: HParams, bad) -> None:
    if hp.n_head_kv != 1:
        bad("one shared K=V head: n_head_kv must be 1")
    if len(hp.compress_ratios) != hp.n_layer or any(r not in (0, 4, 128) for r in hp.compress_ratios):
        bad(f"compress_ratios {tuple(hp.compress_ratios)} must give each of the {hp.n_layer} layers 0, 4 or 128")
    for name in ("n_lora_q", "n_rot", "n_swa", "hc_sinkhorn_iters", "o_groups", "o_lora_rank"):
        if int(getattr(hp, name)) <= 0:
            bad(f"{name} = {getattr(hp, name)} must be positive")
    if hp.hc_mult < 2:
        bad(f"hc_mult = {hp.hc_mult}: DeepSeek-V4's residual is at least 2 hyper-connection streams")
    if hp.n_head % hp.o_groups:
        bad(f"o_groups = {hp.o_groups} must divide n_head = {hp.n_head}")
    if 4 in hp.compress_ratios and (hp.indexer_n_head <= 0 or hp.indexer_head_dim < hp.n_rot or hp.indexer_top_k <= 0):
        bad("CSA layers need indexer_n_head > 0, indexer_head_dim >= n_rot and indexer_top_k > 0")
    if not 0 <= hp.n_hash_layers <= hp.n_layer:
        bad(f"n_hash_layers = {hp.n_hash_layers} must be in 0..n_layer")
    if hp.n_ff_shexp % hp.n_ff_exp:
        bad("n_ff_shexp must be a whole number of experts (n_shared_experts * n_ff_exp)")


def validate(hp: HParams) -> None:
    def bad(msg: str):
        raise InvalidArgument(f"{hp.arch}: {msg}")

    for name in ("n_vocab", "n_ctx_train", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim"):
        if int(getattr(hp, name)) <= 0:
            bad(f"{name} = {getattr(hp, name)} must be positive")
    if hp.n_head % hp.n_head_kv:
        bad(f"n_head = {hp.n_head} is not a multiple of n_head_kv = {hp.n_head_kv}")
    if hp.n_vocab < 300:
        bad(f"n_vocab = {hp.n_vocab} is too small for a byte-level BPE vocabulary (need >= 300)")
    if hp.arch in MOE_ARCHES and hp.n_expert <= 0:
        bad("is a MoE architecture; n_expert must be > 0")
    if hp.arch in DENSE_ARCHES and hp.n_expert != 0:
        bad("is a dense architecture; n_expert must be 0 (use qwen2moe / qwen3moe / llama for MoE)")
    if hp.n_expert < 0 or (hp.is_moe and not 0 < hp.n_expert_used <= hp.n_expert):
        bad(f"n_expert_used = {hp.n_expert_used} must be in 1..n_expert = {hp.n_expert}")
    if hp.is_moe and hp.n_ff_exp <= 0:
        bad("n_ff_exp must be positive in a MoE model")
    if not hp.is_moe and hp.n_ff <= 0:
        bad("n_ff must be positive in a dense model")
    shexp_required = ("qwen2moe", "nemotron_h_moe") + HYBRID_ARCHES
    if hp.arch in shexp_required and hp.n_ff_shexp <= 0:
        bad(f"{hp.arch} needs a shared expert: n_ff_shexp must be positive")
    if hp.arch not in shexp_required + MLA_ARCHES + ("glm4moe", "llama4", "deepseek4") and hp.n_ff_shexp:
        bad(
            "only qwen2moe, deepseek2, deepseek32, glm4moe, qwen3next, qwen35moe, llama4, deepseek4 and "
            "nemotron_h_moe have shared experts; set n_ff_shexp = 0"
        )
    if hp.arch == "deepseek4":
        _validate_deepseek4(hp, bad)
    if hp.arch == "llama4":
        if hp.n_ff_shexp != hp.n_ff_exp:
            bad("the shared expert is as wide as a routed one (llama.cpp): n_ff_shexp must equal n_ff_exp")
        if not 1 <= hp.moe_layer_step <= hp.n_layer:
            bad(f"moe_layer_step = {hp.moe_layer_step} must be in 1..n_layer")
        if hp.moe_layer_step > 1 and hp.n_ff <= 0:
            bad("the dense layers between MoE layers need n_ff > 0")
        if hp.rope_llama3_factor and hp.rope_llama3_n_ctx_orig <= 0:
            bad("llama3 RoPE scaling needs rope_llama3_n_ctx_orig > 0")
    if hp.arch in MLA_ARCHES:
        if hp.n_lora_kv <= 0 or hp.n_rot <= 0 or hp.head_dim_v <= 0 or hp.head_dim <= hp.n_rot:
            bad("MLA needs n_lora_kv, n_rot, head_dim_v > 0 and head_dim (qk_nope + n_rot) > n_rot")
        if hp.n_head_kv != 1:
            bad(f"{hp.arch} files carry MLA as one latent KV head: n_head_kv must be 1")
    if hp.arch == "deepseek32":
        if hp.n_lora_q <= 0:
            bad("the DSA indexer reads the q LoRA: n_lora_q must be positive")
        if hp.indexer_n_head <= 0 or hp.indexer_top_k <= 0 or hp.indexer_head_dim < hp.n_rot:
            bad("DSA needs indexer_n_head, indexer_top_k > 0 and indexer_head_dim >= n_rot")
        if hp.n_expert_group and (hp.n_expert % hp.n_expert_group or not 0 < hp.n_expert_group_used <= hp.n_expert_group):
            bad("n_expert must split into n_expert_group groups, of which 1..n_expert_group are used")
    elif hp.n_expert_group or (hp.arch != "deepseek4" and (hp.indexer_n_head or hp.indexer_top_k)):
        bad("indexer_* are deepseek32 and deepseek4 fields, n_expert_group a deepseek32 one")
    if hp.arch in MLA_ARCHES + ("glm4moe",):  # leading dense layers, shared experts in expert units
        if not 0 <= hp.n_layer_dense_lead < hp.n_layer:
            bad(f"n_layer_dense_lead = {hp.n_layer_dense_lead} must be in 0..n_layer-1")
        if hp.n_ff_shexp % hp.n_ff_exp:
            bad("n_ff_shexp must be a whole number of experts (n_shared_experts * n_ff_exp)")
        if hp.n_layer_dense_lead and hp.n_ff <= 0:
            bad("the leading dense layers need n_ff > 0")
    if hp.n_layer_nextn and hp.arch not in ("glm4moe", "deepseek32", "deepseek4", "nemotron_h_moe") + HYBRID_ARCHES:
        bad("make-model writes nextn (MTP) blocks for glm4moe, deepseek32, deepseek4, nemotron_h_moe, qwen3next "
            "and qwen35moe only; set n_layer_nextn = 0")
    if hp.n_layer_nextn < 0:
        bad(f"n_layer_nextn = {hp.n_layer_nextn} must be >= 0")
    if hp.use_qk_norm and hp.arch != "glm4moe":
        bad("use_qk_norm is a glm4moe switch (qwen3 and olmoe always have q/k norms)")
    if hp.arch == "gpt-oss" and hp.n_swa <= 0:
        bad("gpt-oss alternates sliding-window and full attention: n_swa must be positive")
    if hp.arch in HYBRID_ARCHES:
        for name in ("ssm_d_conv", "ssm_d_state", "ssm_n_group", "ssm_dt_rank", "ssm_d_inner", "full_attention_interval"):
            if int(getattr(hp, name)) <= 0:
                bad(f"{name} = {getattr(hp, name)} must be positive")
        if hp.ssm_dt_rank % hp.ssm_n_group or hp.ssm_d_inner % hp.ssm_dt_rank:
            bad("ssm_dt_rank must be a multiple of ssm_n_group and ssm_d_inner of ssm_dt_rank")
    if hp.arch == "nemotron_h_moe":
        for name in ("ssm_d_conv", "ssm_d_state", "ssm_n_group", "ssm_dt_rank", "ssm_d_inner"):
            if int(getattr(hp, name)) <= 0:
                bad(f"{name} = {getattr(hp, name)} must be positive")
        if hp.ssm_dt_rank % hp.ssm_n_group or hp.ssm_d_inner % hp.ssm_dt_rank:
            bad("ssm_dt_rank (Mamba-2 heads) must be a multiple of ssm_n_group and ssm_d_inner of ssm_dt_rank")
        if len(hp.layer_pattern) != hp.n_layer or set(hp.layer_pattern) - set("ME*"):
            bad(f"layer_pattern {hp.layer_pattern!r} must hold one of M, E, * per block ({hp.n_layer})")
    elif hp.layer_pattern:
        bad("layer_pattern is a nemotron_h_moe field")
    if hp.n_rot and (hp.n_rot % 2 or hp.n_rot > hp.head_dim):
        bad(f"n_rot = {hp.n_rot} must be even and <= head_dim = {hp.head_dim}")
    # The converter writes attention.key_length only where the HF config has head_dim (qwen3, qwen3moe,
    # and llama when set); elsewhere readers derive head_dim = n_embd / n_head, so it must be that.
    if hp.arch in ("qwen2moe", "olmoe", "qwen2") and hp.n_head * hp.head_dim != hp.n_embd:
        bad(
            f"n_head * head_dim = {hp.n_head * hp.head_dim} must equal n_embd = {hp.n_embd} "
            "(its GGUF files carry no attention.key_length)"
        )
    if hp.arch == "olmoe" and hp.n_head_kv != hp.n_head:
        bad("llama.cpp's OLMoE sizes attn_k_norm as n_embd, so n_head_kv must equal n_head")
    if hp.head_dim % 2:
        bad(f"head_dim = {hp.head_dim} must be even (RoPE rotates pairs)")
