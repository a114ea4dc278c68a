// Mamba-2's selective state-space scan (nemotron_h_moe), the recurrence of the Mamba-2 paper
// (Dao & Gu 2024, "SSD") in its sequential form, one token after another:
//
//   dt_h  = softplus(dt_raw_h + dt_bias_h)
//   S_h   = exp(dt_h * A_h) * S_h + dt_h * x_h (outer) B_g       S_h: [head_dim, d_state]
//   y_h   = S_h C_g + D_h * x_h                                   g = h / (n_head / n_group)
//
// Prefill runs the same per-token loop as decode (no chunked SSD form), so a prompt prefilled in
// one step and decoded token by token give bit-identical outputs and states; transformers' chunked
// form agrees to f32 rounding. The state ([n_head, head_dim, d_state] f32) is read and updated in
// place; heads split across the pool, each head's arithmetic independent of the split.
#pragma once

#include <cstdint>

#include "backend/op_types.h"
#include "threads/thread_pool.h"

namespace sharpi::cpu {

using sharpi::SsmInputs;
using sharpi::SsmShape;

// out: [n_tokens, n_head * head_dim] (row stride ldo).
void ssm_scan(ThreadPool& pool, const SsmInputs& in, int64_t n_tokens, const SsmShape& shape, float* state,
              float* out, int64_t ldo);

}  // namespace sharpi::cpu
