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
    n_points_ = 0;
}

void RecurrentState::begin_rewind_points(int64_t pos0, int64_t n_tokens) {
    points_pos0_ = pos0;
    n_points_ = std::max<int64_t>(n_tokens - 1, 0);
    while (static_cast<int64_t>(points_.size()) < n_points_) {
        Point p;
        p.conv.resize(conv_.size());
        p.ssm.resize(ssm_.size());
        for (size_t il = 0; il < conv_.size(); ++il) {
            p.conv[il].resize(conv_[il].size());
            p.ssm[il].resize(ssm_[il].size());
        }
        points_.push_back(std::move(p));
    }
}

// Point i holds the state at position points_pos0_ + 1 + i.
void RecurrentState::save_conv_point(int il, int64_t pos) {
    const int64_t i = pos - points_pos0_ - 1;
    if (i < 0 || i >= n_points_) return;
    const size_t l = static_cast<size_t>(il);
    std::copy(conv_[l].begin(), conv_[l].end(), points_[static_cast<size_t>(i)].conv[l].begin());
}

void RecurrentState::save_ssm_point(int il, int64_t pos) {
    const int64_t i = pos - points_pos0_ - 1;
    if (i < 0 || i >= n_points_) return;
    const size_t l = static_cast<size_t>(il);
    std::copy(ssm_[l].begin(), ssm_[l].end(), points_[static_cast<size_t>(i)].ssm[l].begin());
}

void RecurrentState::rewind_to(int64_t n) {
    if (n != n_past) {
        const Point& p = points_[static_cast<size_t>(n - points_pos0_ - 1)];
        for (size_t il = 0; il < conv_.size(); ++il) {
            std::copy(p.conv[il].begin(), p.conv[il].end(), conv_[il].begin());
            std::copy(p.ssm[il].begin(), p.ssm[il].end(), ssm_[il].begin());
        }
        n_past = n;
    }
    n_points_ = 0;
}

}  // namespace sharpi
