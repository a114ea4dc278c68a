// Fused FFN of the routed experts of ONE token (decode), as an op the MoE layer can call:
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
// rows). Not yet called by the engine: Forward::experts_one_token computes the same values unfused
// and also overlaps experts still being read (streaming), which this op does not do.
#pragma once

#include <cstdint>

#include "cpu/ops/matmul.h"
#include "cpu/threadpool.h"

namespace sharpi::cpu {

// One routed expert: gate and up [n_ff, n_embd], down [n_embd, n_ff], any supported types.
struct ExpertFfnWeights {
    WeightView gate, up, down;
};

// experts[k], weights[k]; x[n_embd] -> out[n_embd]. Throws InvalidArgument on inconsistent shapes,
// UnsupportedError for a type without kernels.
void expert_ffn_one_token(ThreadPool& pool, const ExpertFfnWeights* experts, const float* weights, int k,
                          const float* x, float* out, bool exact);

}  // namespace sharpi::cpu
