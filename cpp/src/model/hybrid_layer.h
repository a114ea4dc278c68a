// The layer shared by the hybrid Gated DeltaNet archs (qwen3next, qwen35moe): three of every four
// layers mix tokens with Gated DeltaNet (linear attention with a recurrent state, no KV cache), the
// fourth with gated full attention (attn_q yields a per-head output gate; q/k RMSNorm per head;
// partial NeoX RoPE); every layer's FFN is routed experts plus a sigmoid-gated shared expert. The
// residual structure is the ordinary decoder_layer (model/forward.h); this file holds the tensor
// loading and the DeltaNet and output-gate builders.
//
// Tensors as llama.cpp's converter writes them: attn_qkv ([q | k | v] conv channels), attn_gate (z)
// (or, in qwen3next files from older converters, ssm_in: per key head [q, k, v x r, z x r]),
// ssm_ba (qwen3next; per key head [beta x r, alpha x r], r = n_v_heads / n_k_heads) or ssm_beta +
// ssm_alpha (qwen35moe), ssm_conv1d, ssm_a (= -exp(A_log)), ssm_dt.bias, ssm_norm, ssm_out; the FFN
// norm is post_attention_norm. The converter tiles qwen35moe's value heads and leaves qwen3next's
// grouped (GdnShape::v_heads_tiled).
//
// A batch of tokens runs the chunked delta rule and a single token the recurrent one; they agree to
// ~1e-6, not bit for bit, so on these archs prefill and token-by-token logits differ at that level
// (every other builder keeps its bit-exact batch invariance).
#pragma once

namespace sharpi {

class ModelLoader;

// Tokens per chunk of the chunked delta rule (prefill).
constexpr long kGdnChunkSize = 64;

void load_hybrid_layer(ModelLoader& ld, int il, bool v_heads_tiled);

}  // namespace sharpi
