#include "memory_plan.h"

#include <algorithm>
#include <cstdio>

#include "cpu/ops/attention.h"
#include "model/kv_cache.h"
#include "model/mtp.h"
#include "model/recurrent_state.h"
#include "moe/expert_cache.h"

namespace sharpi {

namespace {

std::string mib(uint64_t bytes) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
    return buf;
}

}  // namespace

// DeepSeek Sparse Attention's activations per token of a step (model/archs/deepseek32.cpp): the
// indexer's queries and head weights, its key (and the RoPE'd copy), the cached row it is joined
// into, and the selected positions (int32, one float each) with their count.
static int64_t dsa_floats_per_token(const HParams& h) {
    if (!h.has_indexer()) return 0;
    return h.indexer_n_head * (h.indexer_head_dim + 1) + 2 * h.indexer_head_dim + h.kv_floats_per_token() +
           h.indexer_top_k + 1;
}

MemoryPlan plan_memory(const Model& model, const MemoryPlanRequest& r) {
    const HParams& h = model.hp;
    MemoryPlan p;
    p.dense_bytes = model.bytes_dense;
    // KV rows of the attention layers (MLA: the latent), plus the DeltaNet layers' fixed-size state.
    // Every sequence the session may hold is charged up front (its pages are faulted in only as it fills).
    p.n_seq = std::max<int64_t>(r.n_seq, 1);
    // A recurrent state also keeps max_draft_tokens rewind points (RecurrentState) per sequence.
    p.kv_bytes =
        static_cast<uint64_t>(p.n_seq) *
        (KvCache::bytes(kv_layout(h, r.type_k, r.type_v), r.n_ctx) +
         static_cast<uint64_t>(1 + std::max<int64_t>(r.max_draft_tokens, 0)) * RecurrentState::bytes_for(h));
    if (r.mtp) {
        p.mtp_bytes = MtpHead::file_bytes(model, r.mtp_file) +
                      static_cast<uint64_t>(p.n_seq) *
                          MtpHead::sequence_bytes(model, r.mtp_file, r.n_ctx, r.type_k, r.type_v);
    }
    p.latent_kv = h.is_mla();
    // Activations of one batch (the scratch arena's high-water mark, rounded up) plus its logits.
    const int64_t T = r.max_batch, k = h.n_expert_used;
    const int64_t floats_per_token =
        10 * h.n_embd + 4 * h.n_embd_q() + 3 * h.n_embd_kv() + 3 * h.n_expert + 3 * h.ssm_conv_channels() +
        3 * h.ssm_d_inner + 6 * h.ssm_dt_rank + k * (4 * h.n_embd + 3 * h.n_ff_exp) +
        4 * std::max(h.n_ff_shexp, h.n_ff) +
        // deepseek4: the hyper-connection rows (streams, their norm, the
        // mixed output) and the compressor / indexer projections.
        (h.hc_mult > 1
             ? 4 * h.n_embd_residual() + 6 * h.head_dim + 4 * h.indexer_head_dim +
                   h.indexer_n_head * (h.indexer_head_dim + 1) + h.o_groups * h.o_lora_rank + 2 * h.n_lora_q
             : 0) +
        dsa_floats_per_token(h);
    // The residual rows of a whole step are live at once (a prompt runs layer-major over its chunks):
    // at most max(n_ctx, max_batch) of them (Engine::max_step_tokens).
    const int64_t step_rows = std::max(r.n_ctx, r.max_batch);
    p.buffer_bytes =
        static_cast<uint64_t>(T * floats_per_token + T * h.n_vocab + step_rows * h.n_embd_residual()) *
            sizeof(float) +
        cpu::kAttentionSplitMaxFloats * sizeof(float) + (8u << 20);
    p.fixed_bytes = p.dense_bytes + p.kv_bytes + p.buffer_bytes + p.mtp_bytes;
    if (h.is_moe()) {
        p.slot_bytes = ExpertCache::slot_bytes(model.experts);
        p.n_staging = r.n_staging;
        p.n_min_slots = static_cast<uint64_t>(k) + r.n_staging;
    }
    p.minimum_bytes = p.fixed_bytes + p.n_min_slots * p.slot_bytes;
    return p;
}

std::string MemoryPlan::describe(int64_t n_ctx, GgmlType type_k, GgmlType type_v) const {
    return "dense weights " + mib(dense_bytes) + " + KV cache " + mib(kv_bytes) + " (n_ctx " +
           std::to_string(n_ctx) +
           (n_seq > 1 ? " per sequence x " + std::to_string(n_seq) + " sequences" : "") + ", " +
           (latent_kv ? std::string("MLA latent ") + ggml_type_traits(type_k).name
                      : std::string("K ") + ggml_type_traits(type_k).name + ", V " +
                            ggml_type_traits(type_v).name) +
           ") + buffers " + mib(buffer_bytes) +
           (mtp_bytes ? " + MTP head " + mib(mtp_bytes) : std::string()) + " + " +
           std::to_string(n_min_slots - n_staging) + " expert slots (+" + std::to_string(n_staging) +
           " staging) of " + mib(slot_bytes) + " need at least " + mib(minimum_bytes);
}

}  // namespace sharpi
