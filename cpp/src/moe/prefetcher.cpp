#include "moe/prefetcher.h"

#include <algorithm>
#include <cmath>

#include "sharpi/errors.h"

namespace sharpi {

namespace {
constexpr size_t kMaxErrors = 16;
constexpr double kLayerMsSmoothing = 0.2;  // weight of the newest sample in layer_ms_
}  // namespace

Prefetcher::Prefetcher(const PrefetchShape& shape, ExpertCache& cache, std::shared_ptr<Predictor> predictor,
                       int lookahead, bool skip_late, PrefetchSizing sizing)
    : n_layer_(shape.n_layer),
      n_expert_(shape.n_expert),
      top_k_(shape.top_k),
      n_embd_(shape.n_embd),
      lookahead_(lookahead),
      skip_late_(skip_late),
      sizing_(sizing),
      cache_(cache),
      predictor_(std::move(predictor)),
      stats_(static_cast<size_t>(n_layer_)) {}

void Prefetcher::begin_step(const std::vector<PrefetchRow>& rows) {
    const size_t width = static_cast<size_t>(n_layer_ * top_k_);
    if (rows_.size() < rows.size()) rows_.resize(rows.size());
    n_rows_ = rows.size();
    for (size_t r = 0; r < n_rows_; ++r) {
        Row& row = rows_[r];
        row.source = rows[r];
        row.history.assign(width, -1);
        if (rows[r].prev && rows[r].prev_row < 0) {
            row.prev.assign(rows[r].prev, rows[r].prev + width);
        } else {
            row.prev.assign(width, -1);  // none, or an earlier row's history (read live in on_gate)
        }
        row.pending.resize(static_cast<size_t>(n_layer_));
        for (auto& sets : row.pending) sets.clear();
    }
    last_layer_ = -1;
}

void Prefetcher::observe_context(const int32_t* selections, int64_t n_tokens, bool new_sequence) {
    const Clock::time_point t0 = Clock::now();
    try {
        predictor_->observe_context(selections, n_tokens, new_sequence);
    } catch (const CancelledError&) {
        throw;
    } catch (const std::exception& e) {
        ++failures_;
        if (errors_.size() == kMaxErrors) errors_.erase(errors_.begin());
        errors_.push_back(std::string(predictor_->name()) + " on the context of a batch: " + e.what());
    }
    predict_ms_ += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

void Prefetcher::score_predictions(Row& row, int il, const int32_t* selected) {
    LayerExpertStats& ls = stats_[static_cast<size_t>(il)];
    for (const std::vector<int32_t>& set : row.pending[static_cast<size_t>(il)]) {
        ++ls.predictions;
        ls.predicted_experts += set.size();
        for (int32_t e : set)
            ls.predicted_correct += std::find(selected, selected + top_k_, e) != selected + top_k_;
    }
    row.pending[static_cast<size_t>(il)].clear();
}

void Prefetcher::on_gate(int il, int64_t n_rows, const float* hidden, const float* router_logits,
                         const int32_t* selected) {
    const Clock::time_point t0 = Clock::now();
    if (last_layer_ >= 0 && il == last_layer_ + 1) {
        const double ms = std::chrono::duration<double, std::milli>(t0 - last_gate_).count();
        layer_ms_ = layer_ms_ == 0.0 ? ms : (1.0 - kLayerMsSmoothing) * layer_ms_ + kLayerMsSmoothing * ms;
    }
    last_layer_ = il;
    last_gate_ = t0;
    if (static_cast<size_t>(n_rows) != n_rows_) {
        throw InvalidArgument("prefetcher: a gate of " + std::to_string(n_rows) + " rows in a step of " +
                              std::to_string(n_rows_));
    }
    // Every row's selections first: a later row whose prev is an earlier row sees that row's layer il.
    for (size_t r = 0; r < n_rows_; ++r) {
        Row& row = rows_[r];
        const int32_t* sel = selected + static_cast<int64_t>(r) * top_k_;
        std::copy(sel, sel + top_k_, row.history.begin() + static_cast<ptrdiff_t>(il) * top_k_);
        score_predictions(row, il, sel);
    }
    for (size_t r = 0; r < n_rows_; ++r) {
        if (!rows_[r].source.observed) continue;
        observe_row(rows_[r], static_cast<int>(r), il, hidden + static_cast<int64_t>(r) * n_embd_,
                    router_logits + static_cast<int64_t>(r) * n_expert_);
    }
    predict_ms_ += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

void Prefetcher::observe_row(Row& row, int r, int il, const float* hidden, const float* router_logits) {
    PredictorInput in;
    in.layer = il;
    in.n_layer = n_layer_;
    in.n_expert = n_expert_;
    in.top_k = top_k_;
    in.n_embd = n_embd_;
    in.hidden = hidden;
    in.router_logits = router_logits;
    in.history = row.history.data();
    in.prev = row.source.prev_row >= 0 ? rows_[static_cast<size_t>(row.source.prev_row)].history.data()
                                       : row.prev.data();
    in.lookahead = lookahead_;
    in.hints_per_layer = sizing_ == PrefetchSizing::bytes ? n_expert_ : top_k_;
    in.sequence = row.source.sequence;
    in.row = r;
    in.n_rows = static_cast<int>(n_rows_);
    in.updates_state = row.source.updates_state;
    in.echo = row.source.echo;
    hints_.clear();
    ++calls_;
    try {
        predictor_->observe(in, hints_);
    } catch (const CancelledError&) {
        throw;  // the host asked to stop (a Python predictor saw KeyboardInterrupt): not a predictor fault
    } catch (const std::exception& e) {
        // A failing predictor costs its hints, never a token (docs/predictors.md).
        ++failures_;
        ++stats_[static_cast<size_t>(il)].hints_dropped;
        if (errors_.size() == kMaxErrors) errors_.erase(errors_.begin());
        errors_.push_back(std::string(predictor_->name()) + " at layer " + std::to_string(il) + ": " +
                          e.what());
        hints_.clear();
    }
    issue(row, il, hints_);
}

void Prefetcher::issue(Row& row, int il, std::vector<PrefetchHint>& hints) {
    LayerExpertStats& source = stats_[static_cast<size_t>(il)];
    // Drop what cannot be a hint, then order: nearest layer first, best score first, one per expert.
    auto invalid = [&](const PrefetchHint& h) {
        return h.target_layer <= il || h.target_layer > il + lookahead_ || h.target_layer >= n_layer_ ||
               h.expert < 0 || h.expert >= n_expert_ || std::isnan(h.score);
    };
    const auto bad = std::remove_if(hints.begin(), hints.end(), invalid);
    source.hints_dropped += static_cast<uint64_t>(hints.end() - bad);
    hints.erase(bad, hints.end());
    order_hints(hints);
    if (sizing_ == PrefetchSizing::bytes) {
        issue_by_bytes(row, il, hints);
        return;
    }

    const double bytes_per_ms = cache_.reader().bytes_per_ms();
    double queued = static_cast<double>(cache_.reader().inflight_bytes());
    size_t i = 0;
    while (i < hints.size()) {
        const int t = hints[i].target_layer;
        std::vector<int32_t> set;  // this call's prediction set for t: its best k distinct experts
        for (; i < hints.size() && hints[i].target_layer == t; ++i) {
            const int32_t e = hints[i].expert;
            if (static_cast<int>(set.size()) == top_k_ || std::find(set.begin(), set.end(), e) != set.end())
                continue;
            set.push_back(e);
            // A cached expert the prediction names is kept until t's gate, if the policy uses hints.
            cache_.hint(t, e);
            if (cache_.present(t, e)) continue;
            // Timeliness: a read that could only start after layer t's gate (queue ahead of it
            // drained at the measured bandwidth) would arrive no earlier than a demand read issued
            // at the gate, so it would only take bandwidth from demand reads.
            const double deadline_ms = (t - il) * layer_ms_;
            if (skip_late_ && bytes_per_ms > 0.0 && layer_ms_ > 0.0 && queued / bytes_per_ms > deadline_ms) {
                ++stats_[static_cast<size_t>(t)].prefetch_skipped;
                continue;
            }
            if (start_read(t, e)) queued += static_cast<double>(cache_.expert_bytes(t));
        }
        if (!set.empty()) row.pending[static_cast<size_t>(t)].push_back(std::move(set));
    }
}

void Prefetcher::stage_guesses(int target_layer, const int32_t* experts, int64_t n) {
    if (target_layer < 0 || target_layer >= n_layer_) return;
    for (int64_t i = 0; i < n; ++i) {
        const int32_t e = experts[i];
        if (e < 0 || e >= n_expert_) continue;
        cache_.hint(target_layer, e);
        if (!cache_.present(target_layer, e)) start_read(target_layer, e);
    }
}

bool Prefetcher::start_read(int t, int32_t e) {
    switch (cache_.prefetch(t, e)) {
        case ExpertCache::PrefetchOutcome::issued:
            return true;
        case ExpertCache::PrefetchOutcome::no_slot:
            ++stats_[static_cast<size_t>(t)].prefetch_skipped;
            return false;
        case ExpertCache::PrefetchOutcome::present:
            break;
    }
    return false;
}

void Prefetcher::issue_by_bytes(Row& row, int il, const std::vector<PrefetchHint>& hints) {
    ReaderLoad load;
    load.bytes_per_ms = cache_.reader().bytes_per_ms();
    load.queued_bytes = static_cast<double>(cache_.reader().inflight_bytes());
    load.layer_ms = layer_ms_;
    load.timeliness = skip_late_;
    load.free_slots = cache_.free_staging_slots();
    plan_byte_sized_prefetch(
        il, top_k_, hints, [this](int t, int32_t e) { return cache_.present(t, e); },
        [this](int t) { return static_cast<double>(cache_.expert_bytes(t)); }, load, plan_);
    for (auto& [t, set] : plan_.sets) {
        // Cached members are kept until t's gate, if the policy uses hints (as with top-k sets).
        for (int32_t e : set) cache_.hint(t, e);
        row.pending[static_cast<size_t>(t)].push_back(set);
    }
    for (const auto& [t, e] : plan_.reads) start_read(t, e);
    for (const auto& [t, e] : plan_.skipped) ++stats_[static_cast<size_t>(t)].prefetch_skipped;
}

void Prefetcher::add_stats(ExpertCacheStats& st) const {
    for (size_t il = 0; il < st.layers.size() && il < stats_.size(); ++il) {
        LayerExpertStats& out = st.layers[il];
        const LayerExpertStats& in = stats_[il];
        out.prefetch_skipped += in.prefetch_skipped;
        out.predictions += in.predictions;
        out.predicted_correct += in.predicted_correct;
        out.predicted_experts += in.predicted_experts;
        out.hints_dropped += in.hints_dropped;
    }
    st.predict_ms += predict_ms_;
    st.predictor_calls += calls_;
    st.predictor_failures += failures_;
}

void Prefetcher::reset_stats() {
    std::fill(stats_.begin(), stats_.end(), LayerExpertStats{});
    predict_ms_ = 0.0;
    calls_ = failures_ = 0;
}

}  // namespace sharpi
