// The data the layer builders hand to a backend's ops: weight views, RoPE, router and attention
// parameters, the Gated DeltaNet shapes and a routed expert's weights. Plain structs with no kernel
// behind them, so that model/, moe/ and the architecture files describe an op without including
// any backend's kernel header (tests/test_layering.py). Every backend (cpu/cpu_backend.h,
// cuda/) reads the same structs; the CPU kernels still name them cpu::X (aliases in their headers).
#pragma once

#include <cstddef>
#include <cstdint>

#include "quant/ggml_type.h"

namespace sharpi {

// A weight matrix [n_rows, n_cols] in its file type: row r is the bytes [data + r * row_bytes, ...).
// `data` is host memory (the mapping, or an expert slot); a device backend finds its own copy.
struct WeightView {
    GgmlType type = GgmlType::F32;
    const uint8_t* data = nullptr;
    int64_t n_rows = 0;
    int64_t n_cols = 0;
    size_t row_bytes = 0;
};

// Rotary position embedding on the first n_rot dimensions of every head (cpu/ops/rope.h has the
// arithmetic). normal pairs (x[2i], x[2i+1]); neox pairs (x[i], x[i + n_rot/2]).
enum class RopeType { normal, neox };

struct RopeParams {
    RopeType type = RopeType::normal;
    int64_t n_rot = 0;
    float freq_base = 10000.0f;
    float freq_scale = 1.0f;
    float ext_factor = 0.0f;  // YaRN: 0 off, 1 on
    float corr_low = 0.0f, corr_high = 0.0f;
    float mscale = 1.0f;
    // Per-pair divisors of the frequencies (llama3-style scaling, the file's rope_freqs tensor):
    // pair i rotates by theta_i / freq_factors[i]. [n_rot / 2] floats, host memory; nullptr: none.
    const float* freq_factors = nullptr;
};

// The MoE router's gating and top-k rule (cpu/ops/router.h has the arithmetic).
// sqrt_softplus: DeepSeek-V4's sqrt(softplus(logit)) (llama.cpp's expert_gating_func 4).
enum class Gating { softmax, sigmoid, sqrt_softplus };

struct RouterParams {
    Gating gating = Gating::softmax;
    bool normalize_topk = false;
    float weights_scale = 1.0f;
    int64_t n_group = 1;                    // 1: no group limit
    int64_t n_group_used = 1;               // groups a token may choose from
    const float* selection_bias = nullptr;  // [n_expert], nullptr: none
    // Rank the experts by their raw logits (llama4: llama.cpp applies the sigmoid only after the
    // top-k), the weights still the gating scores. Unlike ranking by sigmoid(logit), two logits that
    // round to one f32 sigmoid (1.8e-6 apart near 2.9 already) keep their order.
    bool rank_logits = false;
};

struct AttentionShape {
    int64_t n_head = 0;
    int64_t n_head_kv = 0;
    int64_t head_dim = 0;
    float scale = 1.0f;  // usually 1 / sqrt(head_dim)
    // Sliding window (gpt-oss's even layers): > 0 limits position p to cache positions
    // (p - window, p]; 0 attends to all of [0, p]. Blocks stay counted from position 0 (clipped at the
    // window's start), so the arithmetic of a token is still independent of its batch.
    int64_t window = 0;
    // Chunked local attention (llama4's RoPE layers): > 0 limits position p to cache positions
    // [floor(p / chunk) * chunk, p], llama.cpp's LLAMA_SWA_TYPE_CHUNKED; 0: no chunking. Like the
    // window, the first position a token reads never moves backwards as p grows.
    int64_t chunk = 0;
    // Attention sinks (gpt-oss): one learned logit per query head that joins the softmax denominator
    // only: the running state starts at (M, L, O) = (sink_h, 1, 0) instead of (-inf, 0, 0).
    const float* sinks = nullptr;  // [n_head]; nullptr: none
    // Exact mode (SessionOptions::exact): the per-row arithmetic, bit for bit as before the fast
    // kernels existed. false: fast mode's block kernels (cpu/ops/attention.h).
    bool exact = false;
};

// One layer's stored K or V: position j's row (n_head_kv * head_dim elements of `type`) starts at
// data + j * row_bytes; head g is the bytes of elements [g * head_dim, (g + 1) * head_dim).
struct KvRows {
    const uint8_t* data = nullptr;
    size_t row_bytes = 0;
    GgmlType type = GgmlType::F32;
};

// Multi-head latent attention (deepseek2) over the absorbed queries (cpu/ops/mla_attention.h).
struct MlaShape {
    int64_t n_head = 0;
    int64_t n_lora_kv = 0;  // kv_lora_rank
    int64_t n_rot = 0;      // width of the RoPE part of the key
    float scale = 1.0f;     // 1 / sqrt(qk_nope + qk_rope), times the YaRN mscale^2 where used
};

// The positions each query of an MLA call attends to (DeepSeek Sparse Attention, deepseek32):
// token t reads the cache rows positions[t * ld + i], i < count[t], in ascending order. Host memory.
// mla_attention with no selection attends to every position 0 .. pos0 + t.
struct MlaSelection {
    const int32_t* positions = nullptr;  // [n_tokens, ld]
    const int32_t* count = nullptr;      // [n_tokens]
    int64_t ld = 0;
};

// The DSA lightning indexer (cpu/ops/lightning_indexer.h): n_head query heads of head_dim score one
// key per cached position, read at element key_offset of each KV row (after the MLA latent).
struct IndexerShape {
    int64_t n_head = 0;
    int64_t head_dim = 0;
    int64_t key_offset = 0;  // kv_lora_rank + n_rot
    int64_t top_k = 0;
    float weight_scale = 1.0f;  // multiplies each head weight: 1 / sqrt(n_head * head_dim)
};

// DeepSeek-V4's attention of one layer (cpu/ops/compressed_attention.h): shared-KV heads of head_dim
// (the last n_rot dims rotated) over a sliding window of `window` positions and, on a compressed
// layer (ratio 4: CSA, 128: HCA), the entries its compressors emit, one per closed window of `ratio`
// positions; CSA's lightning indexer (indexer_n_head heads of indexer_head_dim) keeps the best
// indexer_top_k of them.
struct CompressedAttentionShape {
    int64_t n_head = 0;
    int64_t head_dim = 0;
    int64_t window = 0;
    int64_t ratio = 0;
    int64_t indexer_n_head = 0;
    int64_t indexer_head_dim = 0;
    int64_t indexer_top_k = 0;
    float scale = 1.0f;        // on q.k
    float eps = 0.0f;          // the compressors' RMSNorm
    RopeParams rope;           // the layer's: undone on the output's rope dims
    RopeParams compress_rope;  // the entries'
};

// One step's rows of a sequence for CompressedAttentionShape (rows t = 0 .. n_tokens - 1, each with
// its own stride). q [n_head * head_dim] and kv [head_dim] come normed and rotated; the compressor's
// kv and gate rows are [coff * head_dim] (coff 2 on CSA, 1 on HCA) and the indexer's [2 *
// indexer_head_dim], before the gate's absolute position embedding (ape: [ratio, width], the row
// of p % ratio is added); idx_q [indexer_n_head * indexer_head_dim] comes rotated, idx_w
// [indexer_n_head] is the indexer's head weights. Unused pointers (by the layer's ratio) may be null.
// Weights: ape, norm [head_dim or indexer_head_dim], sinks [n_head], f32.
struct CompressedAttentionInputs {
    const float* q = nullptr;
    int64_t ldq = 0;
    const float* kv = nullptr;
    int64_t ldkv = 0;
    const float* comp_kv = nullptr;
    const float* comp_gate = nullptr;
    int64_t ld_comp = 0;
    const float* comp_ape = nullptr;
    const float* comp_norm = nullptr;
    const float* idx_kv = nullptr;
    const float* idx_gate = nullptr;
    int64_t ld_idx = 0;
    const float* idx_ape = nullptr;
    const float* idx_norm = nullptr;
    const float* idx_q = nullptr;
    int64_t ld_idx_q = 0;
    const float* idx_w = nullptr;
    int64_t ld_idx_w = 0;
    const float* sinks = nullptr;
};

// Gated DeltaNet heads (cpu/ops/gated_delta_net.h).
struct GdnShape {
    int64_t n_k_heads = 0;
    int64_t n_v_heads = 0;
    int64_t head_k_dim = 0;
    int64_t head_v_dim = 0;
    bool v_heads_tiled = false;  // value head h reads key head h % n_k_heads (else h / ratio)

    int64_t k_head_of(int64_t h) const { return v_heads_tiled ? h % n_k_heads : h / (n_v_heads / n_k_heads); }
};

// q, k: [T, n_k_heads * head_k_dim] (row strides ldq, ldk); v: [T, n_v_heads * head_v_dim] (ldv);
// g, beta: [T, n_v_heads].
struct GdnInputs {
    const float* q;
    int64_t ldq;
    const float* k;
    int64_t ldk;
    const float* v;
    int64_t ldv;
    const float* g;
    const float* beta;
};

// Mamba-2's selective state-space scan (nemotron_h_moe): n_head heads of head_dim channels; head h
// reads the B and C rows of group h / (n_head / n_group), each d_state wide.
struct SsmShape {
    int64_t n_head = 0;
    int64_t head_dim = 0;
    int64_t n_group = 0;
    int64_t d_state = 0;
};

// x: [T, n_head * head_dim] (row stride ldx); b, c: [T, n_group * d_state] (ldb, ldc); dt: [T,
// n_head] before its bias and softplus (ldt); a = -exp(A_log), d (skip) and dt_bias: [n_head].
struct SsmInputs {
    const float* x;
    int64_t ldx;
    const float* b;
    int64_t ldb;
    const float* c;
    int64_t ldc;
    const float* dt;
    int64_t ldt;
    const float* a;
    const float* d;
    const float* dt_bias;
};

// One routed expert: gate and up [n_ff, n_embd], down [n_embd, n_ff], any supported types.
// gpt-oss adds per-expert biases (f32, gate_b / up_b [n_ff], down_b [n_embd]; nullptr: none; they
// are resident, never part of the expert's streamed bytes) and its clamped SwiGLU (swiglu_limit > 0):
//   y = down (glu(gate x + gate_b, up x + up_b)) + down_b
// nemotron_h_moe's experts have no gate: y = down(relu(up x)^2) (relu_sqr). Their `gate` view is
// the up matrix again (the layout has no gate bytes: moe/expert_layout.h), so every expert path
// keeps its shapes; the kernels skip the gate dots of a relu_sqr expert.
struct ExpertFfnWeights {
    WeightView gate, up, down;
    const float* gate_b = nullptr;
    const float* up_b = nullptr;
    const float* down_b = nullptr;
    float swiglu_limit = 0.0f;
    // DeepSeek-V4's clamped SwiGLU: silu(min(gate, L)) * clamp(up, -L, L); 0: none.
    float swiglu_clamp = 0.0f;
    bool relu_sqr = false;
};

}  // namespace sharpi
