"""Tiny random Hugging Face MoE models, converted to GGUF by llama.cpp's real converter.

This is the second, independent oracle: transformers (torch, CPU) computes the logits, and the
GGUF files come from llama.cpp's own convert_hf_to_gguf.py, so tensor naming, expert stacking and
the q/k row reordering the converter applies for llama's normal RoPE are exactly what users' files
contain. It owns only the directories it is given; it never imports sharpi, never modifies the
converter (see convert_driver.py for the one in-memory patch) and never runs the converter's gguf-py
inside this process.

Every model is 2 layers (the hybrid ones 4: DeltaNet and gated attention alternating, plus one
nextn block; DeepSeek and GLM-4.5 3, the first dense, GLM-4.5 plus one nextn block; MiniMax-M2 16 experts), hidden size 128 (256 for the quantizer's model), 8 experts (MoE), seeded, with
weights drawn at std ~0.08 and norm weights around 1 so that hidden states and routing are far from
degenerate. The models also cover the variants the reference must get right: GQA everywhere,
linear RoPE scaling (qwen2moe, llama), head_dim != hidden/heads (qwen3moe, qwen3, glm4moe), tied
embeddings (qwen3moe, llama, qwen2), whole-projection q/k norms (olmoe, minimax_m2), q/k/v biases
(qwen2moe, qwen2, glm4moe), partial RoPE (glm4moe, minimax_m2, the hybrids), sigmoid routing with a
selection bias (deepseek_v3, glm4moe, minimax_m2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
FETCH_SCRIPT = REPO_ROOT / "tools" / "fetch_converter.sh"
DRIVER = Path(__file__).resolve().parent / "convert_driver.py"

# Model name -> the GGUF `general.architecture` llama.cpp's converter writes for it.
MOE_MODELS = {
    "mixtral": "llama",  # MixtralForCausalLM
    "qwen2moe": "qwen2moe",  # Qwen2MoeForCausalLM
    "qwen3moe": "qwen3moe",  # Qwen3MoeForCausalLM
    "olmoe": "olmoe",  # OlmoeForCausalLM
    "deepseek_v2": "deepseek2",  # DeepseekV2ForCausalLM
    "deepseek_v3": "deepseek2",  # DeepseekV3ForCausalLM
    "glm4moe": "glm4moe",  # Glm4MoeForCausalLM (GLM-4.5-Air: no q/k norm)
    "glm4moe_qknorm": "glm4moe",  # Glm4MoeForCausalLM with use_qk_norm (GLM-4.5)
    "minimax_m2": "minimax-m2",  # MiniMaxM2ForCausalLM
    "nemotron_h": "nemotron_h_moe",  # NemotronHForCausalLM with routed experts
    "nemotron_h_latent": "nemotron_h_moe",  # the same with Nemotron 3 Super's latent MoE
}
# Models whose checkpoint gets one multi-token-prediction block added (_add_mtp_layer,
# _add_glm_nextn_layer): converted, it is a nextn block after the trunk that the trunk's logits must
# not depend on. glm4moe_qknorm is left without one on purpose: its config still declares
# num_nextn_predict_layers 1, so the converter writes nextn_predict_layers 1 and block_count 4 with
# no blk.3 tensors (llama.cpp's "trunk only" file, which it loads too). nemotron_h_mtp gets Nemotron 3
# Super's two-sub-layer block instead (_add_nemotron_h_mtp_layer).
MTP_MODELS = {"qwen3next", "qwen35moe", "glm4moe", "glm4moe_256", "deepseek_v32", "nemotron_h_mtp"}
# Hybrid Gated DeltaNet + gated-attention MoE models (also in MOE_MODELS).
HYBRID_MODELS = {
    "qwen3next": "qwen3next",  # Qwen3NextForCausalLM
    "qwen35moe": "qwen35moe",  # Qwen3_5MoeForCausalLM
}
MOE_MODELS.update(HYBRID_MODELS)
# Every model with a recurrent token mixer (Gated DeltaNet or Mamba-2), whose recurrence carries weight
# rounding from position to position: quantized files are held to the reference on the same file,
# not to transformers (nemotron_h's q8_0 file vs HF: 1.5e-1 at position 0 from the Mamba-2 dt and
# decay, measured; f16 within 5e-3).
RECURRENT_MODELS = set(HYBRID_MODELS) | {"nemotron_h", "nemotron_h_latent", "nemotron_h_mtp"}
# The dense architectures the reference also implements; cheap to check, so checked too.
DENSE_MODELS = {
    "llama": "llama",  # LlamaForCausalLM
    "qwen2": "qwen2",  # Qwen2ForCausalLM
    "qwen3": "qwen3",  # Qwen3ForCausalLM
}
HF_ARCHS = {**MOE_MODELS, **DENSE_MODELS}
# Models checked against transformers by their own test file only (the numpy reference does not
# implement them, so they stay out of the parametrized families above).
ENGINE_ONLY_MODELS = {
    "gpt_oss": "gpt-oss",  # GptOssForCausalLM: tests/test_gpt_oss.py
    "llama4": "llama4",  # Llama4ForCausalLM (text model): tests/test_llama4.py
    "deepseek_v32": "deepseek32",  # DeepseekV32ForCausalLM (DSA): tests/test_deepseek32.py
    # nemotron_h plus an MTP block: the same trunk weights for the same seed, so the parametrized
    # families would only repeat nemotron_h's checks; its tests are about the block.
    "nemotron_h_mtp": "nemotron_h_moe",
}
# Models for llama.cpp's quantizer, checked by their own test file only (tests/test_llama_quantized.py):
# every weight matrix's rows are a multiple of 256 wide, so that each of them can take a K or IQ type.
# glm4moe_256 (Glm4MoeForCausalLM with its MTP layer) likewise, for tests/test_glm4moe.py's Q4_K_M file,
# and minimax_m2_256 for tests/test_minimax_m2.py's.
QUANTIZER_MODELS = {
    "qwen3moe_256": "qwen3moe",
    "glm4moe_256": "glm4moe",
    "minimax_m2_256": "minimax-m2",
    "deepseek_v32_256": "deepseek32",
    "nemotron_h_256": "nemotron_h_moe",
}
ALL_ARCHS = {**HF_ARCHS, **ENGINE_ONLY_MODELS, **QUANTIZER_MODELS}

# Any implementation on a converter-quantized file vs HF on the unquantized weights: this measures
# quantization error, not correctness (on the same file, reference and engine must agree to 1e-4).
# Measured reference-vs-HF on these models at positions before any top-k flip: f16 <= 1.2e-3,
# q8_0 <= 2.5e-2. The budgets only have to
# catch layout errors (wrong row order, wrong expert stacking), which give relative errors of order 1.
QUANTIZED_VS_HF_BUDGET = {"f16": 5e-3, "q8_0": 1e-1}
# Quantization also moves router logits (measured before any top-k flip: f16 ~2e-3, q8_0 ~4e-2), so
# a top-k flip at a router margin below these is quantization, not a bug (see compare.py).
QUANTIZED_VS_HF_NEAR_TIE = {"f16": 1e-2, "q8_0": 1e-1}

WEIGHT_STD = 0.08
NORM_WEIGHT_SPREAD = 0.1  # norm weights ~ 1 + N(0, 0.1^2)


@dataclass
class ExportedModel:
    name: str  # key of HF_ARCHS
    gguf_arch: str
    hf_dir: Path
    vocab_size: int


def _tokenizer_corpus(seed: int) -> list:
    """Deterministic training text for the tokenizer: a few hundred pseudo-sentences."""
    rng = np.random.default_rng(seed)
    text = (
        "the of and to in is was for on that with as by it from at his an are were which this be "
        "expert router token layer cache model memory prefetch stream mixture gate weight value "
        "alpha beta gamma delta 0 1 2 3 42 2024 3.14 hello world! sharpi, MoE; GGUF: (test)"
    )
    words = text.split()
    return [" ".join(rng.choice(words, size=rng.integers(4, 16))) for _ in range(400)]


# GLM-4.5's chat special tokens: llama.cpp's converter (_set_vocab_glm) looks up [gMASK] (bos),
# <|user|> (eot), <|endoftext|> (unk) and <|observation|> (eom) by name.
GLM_SPECIAL_TOKENS = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]


def build_tokenizer(vocab_size: int = 384, seed: int = 0, extra_special=(), add_bos: bool = False):
    """A byte-level BPE (GPT-2 pre-tokenizer) wrapped in PreTrainedTokenizerFast, trained on a small
    deterministic corpus. Byte-level means every string encodes; the model never sees it anyway,
    the tests feed token ids, but the converter needs a real tokenizer to write a vocab.
    extra_special: further special tokens a family's converter requires (after the first two).
    add_bos: the tokenizer prepends <|bos|> to every encoding (a TemplateProcessing post-processor)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|bos|>", *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_tokenizer_corpus(seed), trainer=trainer)
    if add_bos:
        bos = ("<|bos|>", tokenizer.token_to_id("<|bos|>"))
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[bos]
        )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|bos|>", eos_token="<|endoftext|>")


def make_config(name: str, vocab_size: int):
    """The transformers config for one tiny model."""
    import transformers

    common = {
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 0,
        "pad_token_id": None,
    }
    if name == "mixtral":
        return transformers.MixtralConfig(
            **common,
            intermediate_size=96,
            num_local_experts=8,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
    if name == "qwen2moe":
        return transformers.Qwen2MoeConfig(
            **common,
            intermediate_size=160,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=96,
            num_experts=8,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            qkv_bias=True,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        )
    if name == "qwen3moe":
        config = transformers.Qwen3MoeConfig(
            **common,
            intermediate_size=160,
            moe_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,  # as Qwen3-30B-A3B ships, and as llama.cpp hard-codes for qwen3moe
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
        config.head_dim = 48  # != hidden/heads = 32: exercises {arch}.attention.key_length
        return config
    if name == "qwen3moe_256":
        # qwen3moe 256 wide everywhere a row is (n_embd, n_head * head_dim, expert and dense FFN
        # widths), with an untied output as the real Qwen3 MoE checkpoints ship.
        config = make_config("qwen3moe", vocab_size)
        config.hidden_size = config.intermediate_size = config.moe_intermediate_size = 256
        config.head_dim = 64
        config.tie_word_embeddings = False
        return config
    if name == "olmoe":
        # OLMoE ships with n_head_kv == n_head, and llama.cpp sizes attn_k_norm as n_embd (it
        # cannot load a GQA OLMoE file), so the test model keeps that shape too.
        return transformers.OlmoeConfig(
            **{**common, "num_key_value_heads": common["num_attention_heads"]},
            intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if name in ("deepseek_v2", "deepseek_v3"):
        # MLA with the real models' proportions at a small size: q LoRA (V3) or one q projection
        # (V2-Lite), kv_lora_rank 64 + a 16-wide shared RoPE key, qk_nope 32, v_head_dim 24 (!= qk
        # widths), one leading dense layer, shared experts, 4 groups of 4 experts with top-2 groups,
        # a routed weight scale != 1, and YaRN with mscale == mscale_all_dim as the real configs have.
        deepseek = {
            **common,
            "num_hidden_layers": 3,
            "num_key_value_heads": common["num_attention_heads"],
            "intermediate_size": 192,
            "moe_intermediate_size": 64,
            "n_routed_experts": 16,
            "n_shared_experts": 2,
            "num_experts_per_tok": 4,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 64,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 32,
            "v_head_dim": 24,
            "n_group": 4,
            "topk_group": 2,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
        }
        if name == "deepseek_v2":
            return transformers.DeepseekV2Config(
                **deepseek,
                q_lora_rank=None,
                topk_method="group_limited_greedy",
                norm_topk_prob=False,
                routed_scaling_factor=1.5,
            )
        config = transformers.DeepseekV3Config(
            **deepseek, q_lora_rank=64, norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True
        )
        # What real V3 configs carry and the converter reads (expert_gating_func = sigmoid); HF's V3
        # always uses sigmoid scores.
        config.scoring_func = "sigmoid"
        config.topk_method = "noaux_tc"
        return config
    if name == "deepseek_v32_256":
        # deepseek_v32 256 wide where the widths allow (n_embd, q LoRA, kv LoRA, experts, dense FFN,
        # n_head * v_head_dim) for llama-quantize's K types; the per-head qk_nope rows stay narrow.
        config = make_config("deepseek_v32", vocab_size)
        config.hidden_size = config.intermediate_size = config.moe_intermediate_size = 256
        config.q_lora_rank = config.kv_lora_rank = 256
        config.v_head_dim = 64
        return config
    if name == "deepseek_v32":
        # DeepSeek-V3 at the same small size plus DSA's lightning indexer: 16 heads of 32 (RoPE on
        # their first 16 dimensions, the model's n_rot) and index_topk 5, so every prompt longer
        # than 5 tokens attends to a strict subset of its positions. 16 heads, not fewer: a position
        # whose q.k is negative in every head scores exactly 0, and with 4 heads (1 in 16 positions)
        # such zeros tie at the top-k boundary, where neither reference defines an order.
        v3 = make_config("deepseek_v3", vocab_size).to_dict()
        keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id", "pad_token_id",
                "intermediate_size", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
                "num_experts_per_tok", "first_k_dense_replace", "kv_lora_rank", "qk_rope_head_dim",
                "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group", "q_lora_rank", "norm_topk_prob",
                "routed_scaling_factor", "rope_parameters")
        config = transformers.DeepseekV32Config(
            **{k: v3[k] for k in keep}, index_topk=5, index_head_dim=32, index_n_heads=16
        )
        config.scoring_func = "sigmoid"
        config.topk_method = "noaux_tc"
        return config
    if name == "glm4moe_256":
        # glm4moe (q/k norms on) 256 wide wherever a row is, for llama-quantize's K types.
        config = make_config("glm4moe_qknorm", vocab_size)
        config.hidden_size = config.intermediate_size = config.moe_intermediate_size = 256
        config.head_dim = 64
        return config
    if name in ("glm4moe", "glm4moe_qknorm"):
        # GLM-4.5's proportions at a small size: head_dim 48 != hidden/heads, partial RoPE on half
        # of it (partial_rotary_factor 0.5, as every GLM-4.5/4.6/4.7 config), q/k/v biases, one
        # leading dense layer, 16 experts top-4 with one shared expert, sigmoid routing with the
        # selection bias, top-k renormalised and scaled by 2.5 (GLM-4.5-Air ships 1.0, GLM-4.6 2.5).
        return transformers.Glm4MoeConfig(
            **{**common, "num_hidden_layers": 3},
            head_dim=48,
            intermediate_size=192,
            moe_intermediate_size=64,
            n_routed_experts=16,
            n_shared_experts=1,
            num_experts_per_tok=4,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            n_group=1,
            topk_group=1,
            attention_bias=True,
            use_qk_norm=name == "glm4moe_qknorm",
            num_nextn_predict_layers=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        )
    if name == "minimax_m2_256":
        # minimax_m2 256 wide wherever a row is, for llama-quantize's K types; RoPE on half of each head.
        config = make_config("minimax_m2", vocab_size)
        config.hidden_size = config.intermediate_size = 256
        config.head_dim = 64
        config.rotary_dim = 32
        return config
    if name == "minimax_m2":
        # MiniMax-M2's proportions at a small size: head_dim 48 != hidden/heads (MiniMax-M2: 128 vs
        # 64), RoPE on half of each head through the legacy `rotary_dim` the real config carries (the
        # converter reads it; transformers turns it into partial_rotary_factor), GQA, no biases,
        # 16 experts top-4 with no shared expert, sigmoid routing with the selection bias and the
        # top-k renormalised. scoring_func is what the real config says and the converter reads
        # (expert_gating_func = sigmoid); transformers always routes with sigmoid.
        config = transformers.MiniMaxM2Config(
            **common,
            head_dim=48,
            intermediate_size=64,
            num_local_experts=16,
            num_experts_per_tok=4,
            rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        )
        config.rotary_dim = 24
        config.scoring_func = "sigmoid"
        return config
    if name in HYBRID_MODELS:
        # 4 layers: DeltaNet, gated attention, DeltaNet, gated attention (full_attention_interval 2).
        # 2 key heads serve 4 value heads (grouped for qwen3next, tiled by the converter for
        # qwen35moe); partial RoPE on 8 of 32 dims; conv kernel 4.
        hybrid = {
            **common,
            "num_hidden_layers": 4,
            "head_dim": 32,
            "full_attention_interval": 2,
            "layer_types": ["linear_attention", "full_attention"] * 2,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 96,
            "num_experts": 8,
            "num_experts_per_tok": 2,
        }
        if name == "qwen3next":
            return transformers.Qwen3NextConfig(
                **hybrid,
                intermediate_size=160,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
            )
        # Text-only MRoPE: every section sees the same position, so it is plain NeoX RoPE.
        return transformers.Qwen3_5MoeTextConfig(
            **hybrid,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e6,
                "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        )
    if name == "nemotron_h_mtp":
        # The config declares the block (the converter reads num_nextn_predict_layers; transformers
        # builds no MTP modules, so the trunk is nemotron_h's parameter for parameter).
        config = make_config("nemotron_h", vocab_size)
        config.num_nextn_predict_layers = 1
        return config
    if name == "nemotron_h_latent":
        # Nemotron 3 Super's latent MoE at a small size: the routed experts run in 64 of the 128
        # hidden dimensions (fc1_latent_proj / fc2_latent_proj around them).
        config = make_config("nemotron_h", vocab_size)
        config.moe_latent_size = 64
        return config
    if name in ("nemotron_h", "nemotron_h_256"):
        # Nemotron 3 Nano's structure at a small size: 6 blocks, each one mixer behind its own
        # RMSNorm (Mamba-2, MoE, NoPE GQA attention, MoE, Mamba-2, MoE); Mamba-2 with 4 heads of 32
        # in 2 groups (group size 64 for the gated norm), state 16, conv kernel 4; 16 relu^2
        # experts top-4 (no gate projection) with one relu^2 shared expert, sigmoid routing with
        # the selection bias, top-k renormalised and scaled by 2.5. nemotron_h_256: 256 wide
        # wherever a row is, for llama-quantize's K types.
        wide = name == "nemotron_h_256"
        return transformers.NemotronHConfig(
            vocab_size=vocab_size,
            hidden_size=256 if wide else 128,
            layers_block_type=["linear_attention", "moe", "full_attention", "moe", "linear_attention", "moe"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64 if wide else 48,
            max_position_embeddings=512,
            layer_norm_epsilon=1e-5,
            mamba_num_heads=8 if wide else 4,
            mamba_head_dim=32,
            ssm_state_size=16,
            n_groups=2,
            conv_kernel=4,
            chunk_size=8,
            n_routed_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=256 if wide else 64,
            moe_shared_expert_intermediate_size=256 if wide else 96,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            n_group=1,
            topk_group=1,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=0,
            pad_token_id=None,
        )
    if name == "llama":
        return transformers.LlamaConfig(
            **common,
            intermediate_size=192,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0},
        )
    if name == "qwen2":
        return transformers.Qwen2Config(
            **common,
            intermediate_size=192,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
    if name == "qwen3":
        return transformers.Qwen3Config(
            **common,
            intermediate_size=192,
            head_dim=48,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
    if name == "gpt_oss":
        # head_dim != hidden / heads, a sliding window shorter than prompt + greedy tokens (layers
        # 0 and 2 slide, 1 is full), and YaRN with a small original context so that the ramp
        # between interpolated and extrapolated dimensions is inside the rotated range.
        return transformers.GptOssConfig(
            **{**common, "num_hidden_layers": 3, "max_position_embeddings": 2048},
            head_dim=48,
            intermediate_size=64,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=8,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
                "rope_theta": 150000.0,
            },
        )
    if name == "llama4":
        # Llama 4's text model at 256 wide (so that llama-quantize's K-quants apply to every matrix):
        # 4 layers = three chunked RoPE layers and one global NoPE layer (no_rope_layer_interval 4),
        # MoE on layers 1 and 3 (interleave_moe_layer_step 2, as Maverick) with one shared expert,
        # top-1 of 8 experts, L2 q/k norm, llama3 RoPE scaling (the converter writes rope_freqs),
        # and llama.cpp's fixed chunk of 8192 positions and temperature floor of 8192: the GGUF
        # carries neither, so the HF model must use the numbers llama.cpp hard-codes.
        return transformers.Llama4TextConfig(
            **{**common, "hidden_size": 256, "num_hidden_layers": 4, "max_position_embeddings": 16384},
            head_dim=64,
            intermediate_size=256,
            intermediate_size_mlp=512,
            num_local_experts=8,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            use_qk_norm=True,
            attention_chunk_size=8192,
            attn_temperature_tuning=True,
            floor_scale=8192,
            attn_scale=0.1,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 16.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 500000.0,
            },
        )
    raise ValueError(f"unknown model {name!r}; expected one of {sorted(ALL_ARCHS)}")


def build_model(name: str, vocab_size: int, seed: int):
    """A randomly initialised float32 model. Every parameter is redrawn here (not left to HF's
    init, which zeroes or ones some of them): matrices N(0, 0.08^2), biases N(0, 0.05^2), norm
    weights 1 + N(0, 0.1^2)."""
    import torch
    import transformers

    config = make_config(name, vocab_size)
    config._attn_implementation = "eager"
    model_class = {
        "mixtral": transformers.MixtralForCausalLM,
        "qwen2moe": transformers.Qwen2MoeForCausalLM,
        "qwen3moe": transformers.Qwen3MoeForCausalLM,
        "qwen3moe_256": transformers.Qwen3MoeForCausalLM,
        "olmoe": transformers.OlmoeForCausalLM,
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "deepseek_v2": transformers.DeepseekV2ForCausalLM,
        "deepseek_v3": transformers.DeepseekV3ForCausalLM,
        "deepseek_v32": transformers.DeepseekV32ForCausalLM,
        "deepseek_v32_256": transformers.DeepseekV32ForCausalLM,
        "qwen3next": transformers.Qwen3NextForCausalLM,
        "qwen35moe": transformers.Qwen3_5MoeForCausalLM,
        "gpt_oss": transformers.GptOssForCausalLM,
        "glm4moe": transformers.Glm4MoeForCausalLM,
        "glm4moe_qknorm": transformers.Glm4MoeForCausalLM,
        "glm4moe_256": transformers.Glm4MoeForCausalLM,
        "llama4": transformers.Llama4ForCausalLM,
        "minimax_m2": transformers.MiniMaxM2ForCausalLM,
        "minimax_m2_256": transformers.MiniMaxM2ForCausalLM,
        "nemotron_h": transformers.NemotronHForCausalLM,
        "nemotron_h_latent": transformers.NemotronHForCausalLM,
        "nemotron_h_mtp": transformers.NemotronHForCausalLM,
        "nemotron_h_256": transformers.NemotronHForCausalLM,
    }[name]
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if "norm" in param_name:
                param.copy_(1.0 + NORM_WEIGHT_SPREAD * noise)
            elif param_name.endswith("bias"):
                param.copy_(0.05 * noise)
            else:
                param.copy_(WEIGHT_STD * noise)
        for buffer_name, buffer in sorted(model.named_buffers()):
            # DeepSeek-V3's (and MiniMax-M2's) selection bias (a persistent buffer, zeros at init): spread it so that it
            # changes which experts win.
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=generator, dtype=torch.float32))
        if name == "gpt_oss":
            # Expert gate/up outputs near gpt-oss's clamp (limit 7), so that the clamped SwiGLU's
            # min / clamp branches are taken; sinks spread as logits.
            for layer in model.model.layers:
                layer.mlp.experts.gate_up_proj.mul_(10.0)
                layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=generator))
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def export(name: str, out_dir: Path, seed: int = 1234) -> ExportedModel:
    """Write a tiny HF model (config, safetensors, tokenizer) to out_dir/hf."""
    tokenizer = build_tokenizer(
        seed=seed,
        extra_special=GLM_SPECIAL_TOKENS if name.startswith("glm4moe") else (),
        # llama.cpp's DeepSeek-V3.2 converter refuses a tokenizer that does not add BOS.
        add_bos=name.startswith("deepseek_v32"),
    )
    vocab_size = len(tokenizer)
    model = build_model(name, vocab_size, seed)
    hf_dir = Path(out_dir) / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(hf_dir, safe_serialization=True)
    if name in HYBRID_MODELS:
        _add_mtp_layer(hf_dir, seed)
    elif name == "nemotron_h_mtp":
        _add_nemotron_h_mtp_layer(hf_dir, seed)
    elif name in MTP_MODELS:
        # DeepSeek-V3.2's checkpoints hold their MTP block the same way (model.layers.61.*, with
        # eh_proj, enorm, hnorm, shared_head.norm), and the config declares it.
        _add_glm_nextn_layer(hf_dir, seed)
        if name == "deepseek_v32":
            config_path = hf_dir / "config.json"
            config = json.loads(config_path.read_text())
            config["num_nextn_predict_layers"] = 1
            config_path.write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(hf_dir)
    return ExportedModel(name=name, gguf_arch=ALL_ARCHS[name], hf_dir=hf_dir, vocab_size=vocab_size)


def _add_mtp_layer(hf_dir: Path, seed: int) -> None:
    """Real Qwen3-Next / Qwen3.5 checkpoints ship one multi-token-prediction block under `mtp.*`
    (transformers ignores it; llama.cpp's converter writes it as an extra `nextn` layer and refuses
    a Qwen3-Next checkpoint without one). Add one: a copy of the last decoder layer (a gated-attention
    MoE layer) plus the MTP projection and norms, seeded."""
    import torch
    from safetensors.torch import load_file, save_file

    path = hf_dir / "model.safetensors"
    tensors = load_file(str(path))
    config = json.loads((hf_dir / "config.json").read_text())
    last = f"model.layers.{config['num_hidden_layers'] - 1}."
    n_embd = config["hidden_size"]
    generator = torch.Generator().manual_seed(seed + 1)
    for key in [k for k in tensors if k.startswith(last)]:
        tensors["mtp.layers.0." + key[len(last) :]] = tensors[key].clone()
    tensors["mtp.fc.weight"] = WEIGHT_STD * torch.randn((n_embd, 2 * n_embd), generator=generator)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = NORM_WEIGHT_SPREAD * torch.randn((n_embd,), generator=generator)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _add_glm_nextn_layer(hf_dir: Path, seed: int) -> None:
    """Real GLM-4.5 checkpoints ship their multi-token-prediction block as one more decoder layer,
    model.layers.<num_hidden_layers>.* (transformers ignores it), with eh_proj, enorm, hnorm and
    shared_head.norm beside the layer's own tensors; llama.cpp's converter writes it as a nextn
    block. Add one: a copy of the last (MoE) decoder layer plus those four, seeded."""
    import torch
    from safetensors.torch import load_file, save_file

    path = hf_dir / "model.safetensors"
    tensors = load_file(str(path))
    config = json.loads((hf_dir / "config.json").read_text())
    n_trunk = config["num_hidden_layers"]
    last, nextn = f"model.layers.{n_trunk - 1}.", f"model.layers.{n_trunk}."
    n_embd = config["hidden_size"]
    generator = torch.Generator().manual_seed(seed + 1)
    for key in [k for k in tensors if k.startswith(last)]:
        tensors[nextn + key[len(last) :]] = tensors[key].clone()
    tensors[nextn + "eh_proj.weight"] = WEIGHT_STD * torch.randn((n_embd, 2 * n_embd), generator=generator)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{nextn}{norm}.weight"] = 1.0 + NORM_WEIGHT_SPREAD * torch.randn((n_embd,), generator=generator)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _add_nemotron_h_mtp_layer(hf_dir: Path, seed: int) -> None:
    """Nemotron 3 Super checkpoints ship their multi-token-prediction block as two sub-layers named
    like trunk blocks (norm.weight, mixer.*), as config's mtp_layers_block_type lists them
    (transformers ignores them): mtp.layers.0 = the NextN input fusion (enorm, hnorm, eh_proj
    [n_embd, 2 * n_embd] on [enorm(embedding), hnorm(hidden)], copied as is) + attention,
    mtp.layers.1 = MoE + final_layernorm. llama.cpp's converter folds both into one block,
    blk.<n_layer> (mtp.layers.1.norm -> post_attention_norm). Add one:
    the shapes of the first trunk block of each kind, with fresh seeded values (not copies, so that
    a block read from the wrong layer shows)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = hf_dir / "model.safetensors"
    tensors = load_file(str(path))
    config = json.loads((hf_dir / "config.json").read_text())
    n_embd = config["hidden_size"]
    generator = torch.Generator().manual_seed(seed + 1)

    def draw(name, shape):  # build_model's rules
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if "norm" in name:
            return 1.0 + NORM_WEIGHT_SPREAD * noise
        return (0.05 if name.endswith("bias") else WEIGHT_STD) * noise

    for sub, kind in enumerate(config["mtp_layers_block_type"]):
        trunk = f"backbone.layers.{config['layers_block_type'].index(kind)}."
        for key in sorted(k for k in tensors if k.startswith(trunk)):
            name = f"mtp.layers.{sub}.{key[len(trunk) :]}"
            tensors[name] = draw(name, tensors[key].shape)
    tensors["mtp.layers.0.eh_proj.weight"] = draw("eh_proj.weight", (n_embd, 2 * n_embd))
    for name in ("mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.1.final_layernorm.weight"):
        tensors[name] = draw(name, (n_embd,))
    save_file(tensors, str(path), metadata={"format": "pt"})


@dataclass
class ConvertedModel:
    exported: ExportedModel
    gguf: dict  # outtype -> Path of the converter's file


def prepare(name: str, root: Path, converter: Path, outtypes=("f32",), seed: int = 1234) -> ConvertedModel:
    """Export `name` under root/name and convert it to each outtype, reusing files an earlier call
    with the same root already wrote (tests in several modules share one session directory)."""
    out_dir = Path(root) / f"{name}-seed{seed}"
    hf_dir = out_dir / "hf"
    if (hf_dir / "config.json").is_file():
        vocab_size = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
        exported = ExportedModel(name=name, gguf_arch=ALL_ARCHS[name], hf_dir=hf_dir, vocab_size=vocab_size)
    else:
        exported = export(name, out_dir, seed=seed)
    files = {}
    for outtype in outtypes:
        path = out_dir / f"{name}-{outtype}.gguf"
        files[outtype] = path if path.is_file() else convert(hf_dir, path, outtype, converter)
    return ConvertedModel(exported=exported, gguf=files)


def load_hf_model_f64(hf_dir: Path):
    """The saved model, in float64 on CPU. The weights on disk are float32, so float64 here means
    HF computes with exactly the values the f32 GGUF holds, and the only differences left between
    HF and the reference are float64 rounding."""
    import torch
    import transformers

    # "eager" experts: the plain per-expert loop (the default grouped_mm kernel has no float64).
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
    )
    return model.eval()


def hf_logits(model, tokens) -> np.ndarray:
    """[n_tokens, n_vocab] float64 logits of one causal pass from position 0."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        return model(input_ids=ids, use_cache=False).logits[0].to(torch.float64).numpy()


def hf_hidden_states(model, tokens) -> list:
    """HF's per-layer hidden states (embeddings first), each [n_tokens, n_embd] float64; used only
    to say which layer a mismatch starts in."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        out = model(input_ids=ids, use_cache=False, output_hidden_states=True)
    return [h[0].to(torch.float64).numpy() for h in out.hidden_states]


def _deepseek_choice_scores(model, tokens) -> list:
    """DeepSeek (and GLM-4.5, whose router is DeepSeek-V3's) routers choose on more than the logits (softmax or sigmoid scores, V3's selection
    bias, group limits), so the order of the raw logits is not their choice. Per MoE layer: the
    scores HF's router ranks, experts of groups it excluded at -1e9, so that their top-k is HF's
    selection and the k-th minus (k+1)-th score is its margin."""
    import torch

    captured = []

    def hook(module, inputs, output):
        router_logits, _, topk_indices = output
        logits = router_logits.to(torch.float64)
        if hasattr(module, "e_score_correction_bias"):  # V3: sigmoid + bias
            scores = logits.sigmoid() + module.e_score_correction_bias.to(torch.float64)
        else:
            scores = logits.softmax(dim=-1)
        n_group = module.num_group or 1
        if n_group > 1:
            # Allowed = the groups HF's selection came from (its groups are contiguous).
            group_of = topk_indices // (scores.shape[1] // n_group)
            allowed = torch.zeros(scores.shape[0], n_group, dtype=torch.bool)
            allowed.scatter_(1, group_of, True)
            allowed = allowed.repeat_interleave(scores.shape[1] // n_group, dim=1)
            scores = torch.where(allowed, scores, torch.full_like(scores, -1e9))
        captured.append(scores.numpy())

    handles = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([list(tokens)], dtype=torch.long), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return [c.reshape(len(tokens), -1) for c in captured]


def _minimax_m2_choice_scores(model, tokens) -> list:
    """MiniMax-M2's router ranks sigmoid(logits) + the MoE block's e_score_correction_bias. Per MoE
    layer, those scores [n_tokens, n_expert], so that their top-k is HF's selection."""
    import torch

    captured = []
    handles = []
    for layer in model.model.layers:
        bias = layer.mlp.e_score_correction_bias

        def hook(module, inputs, output, bias=bias):
            scores = output[0].to(torch.float64).sigmoid() + bias.to(torch.float64)
            captured.append(scores.numpy())

        handles.append(layer.mlp.gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([list(tokens)], dtype=torch.long), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return [c.reshape(len(tokens), -1) for c in captured]


def hf_router_logits(model, tokens) -> list:
    """Per MoE layer, HF's router logits [n_tokens, n_expert] (to find a top-k flip); for DeepSeek,
    GLM-4.5 and MiniMax-M2 the scores their router ranks (see _deepseek_choice_scores)."""
    import torch

    if model.config.model_type in ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe"):
        return _deepseek_choice_scores(model, tokens)
    if model.config.model_type == "minimax_m2":
        return _minimax_m2_choice_scores(model, tokens)
    with torch.no_grad():
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        out = model(input_ids=ids, use_cache=False, output_router_logits=True)
    return [r.to(torch.float64).numpy().reshape(len(tokens), -1) for r in out.router_logits]


def hf_forward_result(model, tokens, n_expert_used: int):
    """HF's logits and routing packaged like the reference's ForwardResult, so the same comparison
    code (compare.py, engine_checks.py) can hold an engine to HF directly."""
    from .numpy_forward import ForwardResult

    result = ForwardResult(logits=hf_logits(model, tokens))
    if n_expert_used > 0:
        for router_logits in hf_router_logits(model, tokens):
            result.router_logits.append(router_logits)
            result.selected_experts.append(
                np.argsort(-router_logits, axis=1, kind="stable")[:, :n_expert_used]
            )
    return result


def hf_greedy(model, prompt, n_new: int) -> list:
    """n_new greedy tokens, recomputing the full sequence each step (no KV cache to get wrong)."""
    sequence = [int(t) for t in prompt]
    for _ in range(n_new):
        sequence.append(int(np.argmax(hf_logits(model, sequence)[-1])))
    return sequence[len(prompt) :]


# ----------------------------------------------------------------------------------------------
# The converter.


class ConverterUnavailable(RuntimeError):
    pass


def converter_dir() -> Path:
    """The directory holding convert_hf_to_gguf.py, fetching it with tools/fetch_converter.sh on
    first use (a pip download of the llama-cpp-python sdist, which vendors llama.cpp)."""
    try:
        done = subprocess.run(
            ["bash", str(FETCH_SCRIPT)], capture_output=True, text=True, timeout=600, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ConverterUnavailable(f"tools/fetch_converter.sh failed: {error}") from error
    path = Path(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else None
    if done.returncode != 0 or path is None or not (path / "convert_hf_to_gguf.py").is_file():
        raise ConverterUnavailable(
            f"tools/fetch_converter.sh failed (rc {done.returncode}): {done.stderr[-2000:]}"
        )
    return path


def convert(hf_dir: Path, out_path: Path, outtype: str, converter: Path, extra_args=()) -> Path:
    """Convert hf_dir to out_path with llama.cpp's converter (--outtype f32 | f16 | q8_0 ...).
    extra_args go to the converter as they are (e.g. ["--split-max-tensors", "20"]: then the files
    are out_path's stem + "-0000i-of-0000K.gguf" and the first of them is returned)."""
    env = dict(os.environ)
    # The downloaded gguf-py goes first: the converter may need a newer gguf than the installed one.
    env["PYTHONPATH"] = os.pathsep.join([str(converter / "gguf-py"), str(converter)])
    env.pop("NO_LOCAL_GGUF", None)
    command = [
        sys.executable,
        str(DRIVER),
        str(converter),
        str(hf_dir),
        "--outfile",
        str(out_path),
        "--outtype",
        outtype,
        *extra_args,
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, check=False)
    if extra_args and not Path(out_path).is_file():
        shards = sorted(Path(out_path).parent.glob(Path(out_path).stem + "-00001-of-*.gguf"))
        out_path = shards[0] if shards else out_path
    if done.returncode != 0 or not Path(out_path).is_file():
        raise RuntimeError(
            f"convert_hf_to_gguf failed for {hf_dir} ({outtype}), rc {done.returncode}:\n{done.stderr[-4000:]}"
        )
    return Path(out_path)


def random_prompt(vocab_size: int, n_tokens: int, seed: int) -> list:
    """Fresh seeded token ids, avoiding the special tokens (ids 0 and 1)."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(2, vocab_size, size=n_tokens)]
