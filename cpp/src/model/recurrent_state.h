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

    // Zeroes every state: the start of a sequence (and drops the rewind points).
    void clear();

    // ---- Rewind points (speculative decoding) -------------------------------------------------
    // A rewindable step (SequenceTokens::rewindable) runs its tokens through the DeltaNet layers
    // one at a time and keeps the state after each but the last, so the sequence can be cut back
    // to any position inside the step (a rejected draft) without decoding again. The points
    // belong to the last step only: any other step, clear() or a rewind drops them.
    //
    // Starts the points of a step of n_tokens at position pos0 (n_tokens - 1 points).
    void begin_rewind_points(int64_t pos0, int64_t n_tokens);
    void drop_rewind_points() { n_points_ = 0; }
    // Save layer il's live conv / delta-rule state as the state at position `pos` (pos positions
    // absorbed), as soon as the token at pos - 1 has updated it; a position without a point (the
    // step's last) is ignored.
    void save_conv_point(int il, int64_t pos);
    void save_ssm_point(int il, int64_t pos);
    // True when the state at position n (n positions absorbed) is held: a point or the live state.
    bool can_rewind_to(int64_t n) const {
        return n == n_past || (n > points_pos0_ && n < points_pos0_ + 1 + n_points_);
    }
    // Makes the state at position n live (can_rewind_to(n) must hold) and drops the points.
    void rewind_to(int64_t n);

    int64_t n_past = 0;  // positions absorbed since clear()

  private:
    struct Point {
        std::vector<std::vector<float>> conv, ssm;  // as conv_ / ssm_
    };
    std::vector<std::vector<float>> conv_, ssm_;  // [n_layer]; empty for attention layers
    std::vector<Point> points_;  // capacity kept between steps; the first n_points_ are valid
    int64_t n_points_ = 0, points_pos0_ = 0;
    uint64_t bytes_ = 0;
};

}  // namespace sharpi
