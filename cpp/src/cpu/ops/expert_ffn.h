// Fused FFNs of routed experts: expert_ffn_one_token for decode, expert_ffn_batch for prefill.
//
// expert_ffn_one_token: the routed experts of ONE token, as an op the MoE layer can call:
//
//   out[n_embd] = sum_{j < k} weights[j] * down_j(silu(gate_j x) * up_j x),   slots in order j = 0..k-1
//
// Two passes on the pool, one barrier between them (none per expert or per matmul):
//   1. the gate and up rows of every slot together, x prepared once (fast mode: quantized once for
//      every expert), SiLU * up fused per row into act_j;
//   2. act_j prepared once per slot, then each output row i sums its k down-projection dots in slot
//      order straight into out[i] (no per-expert output rows, no separate weighted sum).
// Bit for bit what the unfused composition gives in the same mode (matmul of one token per
// projection, cpu::swiglu, then out = w_0 y_0; out += w_j y_j), which the tests check.
//
// Called from the decode thread; scratch is allocated per call (k * n_ff floats and the quantized
// rows). MoeFfn::experts_one_token calls it when every selected expert is ready, and otherwise
// computes the same values unfused, overlapping experts still being read (streaming).
//
// expert_ffn_batch: several experts, each over its own tokens (prefill, rows grouped by expert as
// llama.cpp's mul_mat_id does). Member m of expert e (m in [member_begin[e], member_end[e])) is
// token row x + tokens[m] * ldx, and its unweighted output goes to y + m * ldy:
//
//   y_m = down_e(silu(gate_e x_m) * up_e x_m)
//
// bit for bit what the one-token composition gives for that token (matmul of one token per
// projection, cpu::swiglu), so prefill == decode. In fast mode, when every projection has integer
// kernels, ALL the experts run together in three passes on the pool (two barriers in all, not
// three matmuls per expert): (1) work items (expert, block of gate/up rows): gate and up rows over
// the expert's members, whose rows are quantized once up front, SiLU * up fused; (2) the act rows
// quantized for down; (3) items (expert, block of down rows). Items are sized to similar work
// (rows x members), so threads balance by claiming items. Otherwise (exact mode, F32/F16/BF16
// weights, Isa::scalar) expert by expert through cpu::matmul, exact mode's arithmetic unchanged.
// Scratch: the calling thread's, reused across calls.
#pragma once

#include <cstdint>

#include "backend/op_types.h"
#include "cpu/ops/matmul.h"
#include "threads/thread_pool.h"

namespace sharpi::cpu {

using sharpi::ExpertFfnWeights;

// act[i] = glu of rows r0 + i (i < n) from the raw gate / up dots: the biases added in place, then
// SwiGLU or the clamped form. act may alias gate.
void expert_glu(const ExpertFfnWeights& e, int64_t r0, float* gate, float* up, float* act, int64_t n);
// y[m * ldy + i] += down_b[i] for n_members rows and i in [r0, r1) (nothing without a down bias).
void expert_down_bias(const ExpertFfnWeights& e, int64_t n_members, int64_t r0, int64_t r1, float* y,
                      int64_t ldy);

// experts[k], weights[k]; x[n_embd] -> out[n_embd]. Throws InvalidArgument on inconsistent shapes,
// UnsupportedError for a type without kernels.
void expert_ffn_one_token(ThreadPool& pool, const ExpertFfnWeights* experts, const float* weights, int k,
                          const float* x, float* out, bool exact);

// The experts of one token slot by slot, unfused and unweighted: y + slots[i] * ldy = expert i's output
// for x (experts[i]: slot i's weights), bit for bit the rows expert_ffn_one_token sums.
void expert_ffn_slots(ThreadPool& pool, const ExpertFfnWeights* experts, const int64_t* slots,
                      int64_t n_slots, const float* x, float* y, int64_t ldy, bool exact);

void expert_ffn_batch(ThreadPool& pool, const ExpertFfnWeights* experts, const int64_t* member_begin,
                      const int64_t* member_end, int n_experts, const int64_t* tokens, const float* x,
                      int64_t ldx, float* y, int64_t ldy, bool exact);

}  // namespace sharpi::cpu
