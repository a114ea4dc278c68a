#include "model/recurrent_state.h"

#include <algorithm>

namespace sharpi {

namespace {

int64_t conv_floats(const HParams& h) {
    return (h.ssm_d_conv - 1) * h.ssm_conv_channels();
}

int64_t ssm_floats(const HParams& h) {
    return h.ssm_dt_rank * h.ssm_d_state * h.ssm_head_v_dim();
}

}  // namespace

uint64_t RecurrentState::bytes_for(const HParams& h) {
    int64_t n_recurrent = 0;
    for (int64_t il = 0; il < h.n_layer; ++il) n_recurrent += h.is_recurrent(static_cast<int>(il)) ? 1 : 0;
    return static_cast<uint64_t>(n_recurrent * (conv_floats(h) + ssm_floats(h))) * sizeof(float);
}

RecurrentState::RecurrentState(const HParams& h) : bytes_(bytes_for(h)) {
    conv_.resize(static_cast<size_t>(h.n_layer));
    ssm_.resize(static_cast<size_t>(h.n_layer));
    for (int il = 0; il < h.n_layer; ++il) {
        if (!h.is_recurrent(il)) continue;
        conv_[static_cast<size_t>(il)].assign(static_cast<size_t>(conv_floats(h)), 0.0f);
        ssm_[static_cast<size_t>(il)].assign(static_cast<size_t>(ssm_floats(h)), 0.0f);
    }
}

void RecurrentState::clear() {
    for (auto& s : conv_) std::fill(s.begin(), s.end(), 0.0f);
    for (auto& s : ssm_) std::fill(s.begin(), s.end(), 0.0f);
    n_past = 0;
}

}  // namespace sharpi
