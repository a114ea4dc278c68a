// Per-sequence state of the Gated DeltaNet layers (qwen3next, qwen35moe), the counterpart of the KV
// cache for layers that have none: per recurrent layer a conv state (the last ssm_d_conv - 1 inputs
// of the causal conv1d, [d_conv - 1, conv_channels]) and the delta-rule state
// ([n_v_heads, head_k_dim, head_v_dim]), all f32. Sized once from the hyper-parameters, so its
// bytes are known before anything runs (the budget planner charges bytes_for()).
//
// Owned by the engine beside the KV cache; only the DeltaNet builder (model/hybrid_layer.cpp)
// reads and writes it, on the decode thread. Unlike KV rows, a step overwrites the state, so a
// decode that fails half-way leaves it ahead of the engine's n_past: `n_past` records how many
// positions it has absorbed, and the engine refuses to go on from a state that disagrees with its
// own position (reset() clears both).
#pragma once

#include <cstdint>
#include <vector>

#include "model/hparams.h"

namespace sharpi {

class RecurrentState {
  public:
    explicit RecurrentState(const HParams& h);

    // Bytes of the state of one sequence for these hyper-parameters (0 for a model without
    // recurrent layers).
    static uint64_t bytes_for(const HParams& h);
    uint64_t bytes() const { return bytes_; }
    bool empty() const { return bytes_ == 0; }

    float* conv(int il) { return conv_[static_cast<size_t>(il)].data(); }
    float* ssm(int il) { return ssm_[static_cast<size_t>(il)].data(); }

    // Zeroes every state: the start of a sequence.
    void clear();

    int64_t n_past = 0;  // positions absorbed since clear()

  private:
    std::vector<std::vector<float>> conv_, ssm_;  // [n_layer]; empty for attention layers
    uint64_t bytes_ = 0;
};

}  // namespace sharpi
