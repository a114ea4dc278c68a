#include "engine.h"

#include <algorithm>
#include <chrono>
#include <deque>

#include "cpu/cpu_backend.h"
#include "model/forward.h"
#include "moe/cpu_miss.h"
#include "predict/predictor.h"
#include "sharpi/errors.h"

namespace sharpi {

Engine::Engine(const std::string& path, const SessionOptions& options) : options_(options) {
    check_session_options(options_);
    const MachineProbe probe;
    // "auto" is measured before the model is loaded: the dense weights are charged inside the budget.
    const RamBudget ram = resolve_ram_budget(options_, probe);
    timeline_.set_enabled(options.timeline);
    model_ = load_model(path, /*streaming=*/ram.bytes > 0);
    const HParams& h = model_->hp;
    check_options_for_model(options_, ram, *model_);
    // Built before any memory is planned, so a bad name or predictor file fails fast ("custom": the
    // host installs one later, set_predictor).
    std::shared_ptr<Predictor> predictor;
    if (options.predictor != "custom")
        predictor = make_predictor(options.predictor, options.predictor_file, *model_, options.lookahead);
    const Placement plan = plan_placement(options_, ram, *model_, kMaxBatch, probe);

    // Build what the plan says.
    exact_ = plan.exact;
    auto_ram_budget_ = ram.auto_choice;
    plan_.budget_bytes = plan.budget_bytes;
    plan_.fixed_bytes = plan.fixed_bytes;
    pool_ = std::make_unique<ThreadPool>(options.n_threads > 0 ? options.n_threads : hardware_threads());
    backend_ = std::make_unique<CpuBackend>(*pool_, scratch_);
    if (plan.on_device) {
        CpuMissOptions misses = plan.misses;
        misses.pool = pool_.get();
        device_ =
            cuda::open_device_forward(*model_, plan.n_ctx, kMaxBatch, plan.device_type_k, plan.device_type_v,
                                      exact_, plan.vram_streams ? &plan.vram_cache : nullptr, &misses);
        cache_ = device_->expert_cache();
        if (cache_ != nullptr) cache_->set_timeline(&timeline_);
        device_->set_timeline(&timeline_);
    }
    if (plan.ram_streams) {
        auto cache = std::make_unique<ExpertCache>(model_->experts, plan.ram_cache);
        cache->set_timeline(&timeline_);
        cache_ = cache.get();
        experts_ = std::move(cache);
    } else {
        experts_ = std::make_unique<ResidentExperts>(model_->experts);
    }
    const KvLayout kv_shape = kv_layout(h, plan.type_k, plan.type_v);
    if (!device_) {
        kv_ = std::make_unique<KvCache>(h.n_layer, plan.n_ctx, kv_shape.width, kv_shape.head_dim,
                                        kv_shape.type_k, kv_shape.type_v, kv_shape.with_v);
    }
    recurrent_ = std::make_unique<RecurrentState>(h);
    if (plan.prefetches() && cache_ != nullptr) install_predictor(std::move(predictor));
    routing_.resize(static_cast<size_t>(h.n_layer));

    info_.path = path;
    info_.arch = h.arch;
    info_.name = model_->file->get_string_or("general.name", "");
    info_.n_vocab = h.n_vocab;
    info_.n_embd = h.n_embd;
    info_.n_layer = h.n_layer;
    info_.n_head = h.n_head;
    info_.n_head_kv = h.n_head_kv;
    info_.head_dim = h.head_dim;
    info_.n_ff = h.n_ff;
    info_.n_ff_exp = h.n_ff_exp;
    info_.n_ff_shexp = h.n_ff_shexp;
    info_.n_expert = h.n_expert;
    info_.n_expert_used = h.n_expert_used;
    info_.n_layer_dense_lead = h.n_layer_dense_lead;
    info_.n_ctx_train = h.n_ctx_train;
    info_.n_ctx = plan.n_ctx;
    info_.bytes_dense = model_->bytes_dense;
    info_.bytes_experts = model_->bytes_experts;
    info_.cache_type_k = ggml_type_traits(plan.type_k).name;
    info_.cache_type_v = ggml_type_traits(plan.type_v).name;
    info_.bytes_kv = device_ ? device_->plan().kv_bytes : KvCache::bytes(kv_shape, plan.n_ctx);
    if (device_) info_.cache_type_k = info_.cache_type_v = "f32";
}

void Engine::set_route_trace(RouteTrace trace) {
    const HParams& h = model_->hp;
    if (trace.n_tokens == 0) {
        route_trace_ = RouteTrace{};
        return;
    }
    if (device_) throw UnsupportedError("route trace: not on the device path yet (device=\"cuda\")");
    if (!h.is_moe()) throw InvalidArgument("route trace: " + model_->file->path() + " has no routed experts");
    const int64_t n_moe_layer = h.n_layer - h.n_layer_dense_lead;
    trace.first_layer = h.n_layer_dense_lead;
    if (trace.n_tokens < 0 || trace.n_layers != n_moe_layer || trace.k != h.n_expert_used ||
        static_cast<int64_t>(trace.experts.size()) != trace.n_tokens * trace.n_layers * trace.k) {
        throw InvalidArgument("route trace shape [" + std::to_string(trace.n_tokens) + ", " +
                              std::to_string(trace.n_layers) + ", " + std::to_string(trace.k) +
                              "] does not match the model: " + std::to_string(n_moe_layer) +
                              " MoE layers, top-" + std::to_string(h.n_expert_used) +
                              " (use the make-model preset of the trace's shape)");
    }
    for (size_t i = 0; i < trace.experts.size(); ++i) {
        const int32_t e = trace.experts[i];
        if (e < -1 || e >= h.n_expert) {
            throw InvalidArgument("route trace: expert id " + std::to_string(e) + " at token " +
                                  std::to_string(i / static_cast<size_t>(trace.n_layers * trace.k)) +
                                  " is outside [0, " + std::to_string(h.n_expert) + ")");
        }
    }
    route_trace_ = std::move(trace);
}

ExpertCacheStats Engine::expert_stats() const {
    ExpertCacheStats st;
    if (cache_) {
        st = cache_->stats();
        st.budget_bytes = plan_.budget_bytes;
        st.fixed_bytes = plan_.fixed_bytes;
    }
    if (prefetcher_) prefetcher_->add_stats(st);
    if (device_) device_->add_miss_stats(st);
    st.decode_ms = decode_ms_;
    return st;
}

void Engine::reset_stats() {
    if (cache_) cache_->reset_stats();
    if (prefetcher_) prefetcher_->reset_stats();
    decode_ms_ = 0.0;
}

void Engine::reset() {
    n_past_ = 0;
    clear_cancel();
    recurrent_->clear();
    // The next token has no previous token (prev-token history starts over).
    for (Routing& r : routing_) {
        r.ids.clear();
        r.weights.clear();
    }
    sequence_selection_.clear();
    replay_history_ = false;
}

void Engine::truncate(int64_t n_keep) {
    if (n_keep < 0 || n_keep > n_past_) {
        throw InvalidArgument("truncate: " + std::to_string(n_keep) +
                              " positions to keep, the session holds " + std::to_string(n_past_));
    }
    if (n_keep == n_past_) return;
    if (!recurrent_->empty()) {
        throw UnsupportedError("truncate: " + info_.arch +
                               " keeps a recurrent (DeltaNet) state that cannot be rewound to position " +
                               std::to_string(n_keep) + "; reset() and decode the prefix again");
    }
    n_past_ = n_keep;
    // The last routing belongs to a dropped position. The predictor's history is rebuilt from the
    // kept tokens at the next decode (their previous token is the last kept one).
    for (Routing& r : routing_) {
        r.ids.clear();
        r.weights.clear();
    }
    if (prefetcher_) {
        sequence_selection_.resize(
            static_cast<size_t>(n_keep * model_->hp.n_layer * model_->hp.n_expert_used));
        replay_history_ = true;
    }
}

void Engine::set_predictor(std::shared_ptr<Predictor> predictor) {
    if (options_.predictor != "custom") {
        throw InvalidArgument("set_predictor: the session was made with predictor '" + options_.predictor +
                              "'; make it with predictor \"custom\" to install your own");
    }
    install_predictor(std::move(predictor));
}

void Engine::install_predictor(std::shared_ptr<Predictor> predictor) {
    prefetcher_.reset();
    if (predictor) {
        const HParams& h = model_->hp;
        PrefetchShape shape;
        shape.n_layer = static_cast<int>(h.n_layer);
        shape.n_expert = static_cast<int>(h.n_expert);
        shape.top_k = static_cast<int>(h.n_expert_used);
        shape.n_embd = static_cast<int>(h.n_embd);
        prefetcher_ = std::make_unique<Prefetcher>(shape, *cache_, std::move(predictor), options_.lookahead,
                                                   options_.skip_late_prefetch,
                                                   parse_prefetch_sizing(options_.prefetch_sizing));
    }
}

std::vector<std::string> Engine::predictor_errors() const {
    return prefetcher_ ? prefetcher_->errors() : std::vector<std::string>{};
}

std::vector<float> Engine::decode(const std::vector<token_t>& tokens, bool all_logits) {
    const HParams& h = model_->hp;
    const int64_t n = static_cast<int64_t>(tokens.size());
    if (n == 0) throw InvalidArgument("decode: no tokens");
    for (size_t i = 0; i < tokens.size(); ++i) {
        if (tokens[i] < 0 || tokens[i] >= h.n_vocab) {
            throw InvalidArgument("decode: token " + std::to_string(tokens[i]) + " at index " +
                                  std::to_string(i) + " is outside the vocabulary [0, " +
                                  std::to_string(h.n_vocab) + ")");
        }
    }
    if (n_past_ + n > info_.n_ctx) {
        throw ContextOverflowError("decode: " + std::to_string(n) + " tokens at position " +
                                   std::to_string(n_past_) + " exceed the context of " +
                                   std::to_string(info_.n_ctx) + " tokens (use a larger n_ctx or reset())");
    }
    if (!recurrent_->empty() && recurrent_->n_past != n_past_) {
        throw InvalidArgument(
            "decode: the recurrent (DeltaNet) state was left mid-update by a failed decode; "
            "call reset() to start the sequence again");
    }
    const auto t_start = std::chrono::steady_clock::now();
    struct AddElapsed {  // decode_ms_ counts failed calls too
        std::chrono::steady_clock::time_point t0;
        double& total;
        ~AddElapsed() {
            total += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        }
    } add_elapsed{t_start, decode_ms_};
    dump_.clear();
    const int64_t n_logit_rows = all_logits ? n : 1;
    std::vector<float> logits(static_cast<size_t>(n_logit_rows * h.n_vocab));
    try {
        if (device_) {
            std::vector<std::vector<int32_t>> ids;
            GateObserver* observer = nullptr;
            if (prefetcher_ && n == 1) {
                begin_prefetch_token();
                observer = this;
            }
            device_->forward(
                tokens.data(), n, n_past_, all_logits, logits.data(), ids,
                [this](int il) { throw_if_cancelled(il); }, observer);
            for (size_t il = 0; il < routing_.size(); ++il) {
                routing_[il].ids = std::move(ids[il]);
                routing_[il].weights.clear();
            }
        } else {
            forward_batch(tokens.data(), n, all_logits, logits.data());
        }
        model_->file->check_mapping();  // resident: no result computed from a lost page
    } catch (const CancelledError&) {
        clear_cancel();  // this call consumed the request
        forget_failed_token(n);
        throw;
    } catch (...) {
        forget_failed_token(n);
        throw;
    }
    if (prefetcher_) {
        record_selections(n);
        if (n > 1) pass_batch_context(n);
    }
    n_past_ += n;  // only once the whole batch succeeded
    return logits;
}

void Engine::pass_batch_context(int64_t n) {
    const HParams& h = model_->hp;
    const int64_t row = h.n_layer * h.n_expert_used;
    // The tokens no observe() has seen, oldest first: after a truncate() the whole kept sequence
    // (the predictor starts over), else the token decoded just before the batch (no single-token
    // decode showed it as `prev`), then batch tokens 0..n-2 (the last is the next token's `prev`).
    const int64_t lead = replay_history_ ? n_past_ : std::min<int64_t>(n_past_, 1);
    const bool new_sequence = replay_history_ || n_past_ == 0;
    replay_history_ = false;
    // record_selections() already appended the batch: the context is rows [n_past_ - lead, n_past_ + n - 1).
    prefetcher_->observe_context(sequence_selection_.data() + (n_past_ - lead) * row, lead + n - 1,
                                 new_sequence);
}

void Engine::record_selections(int64_t n) {
    const HParams& h = model_->hp;
    const int64_t k = h.n_expert_used, row = h.n_layer * k;
    const size_t first = sequence_selection_.size();
    sequence_selection_.resize(first + static_cast<size_t>(n * row), -1);
    for (int il = 0; il < h.n_layer; ++il) {
        const std::vector<int32_t>& ids = routing_[static_cast<size_t>(il)].ids;
        if (ids.size() != static_cast<size_t>(n * k)) continue;
        for (int64_t i = 0; i < n; ++i)
            std::copy(ids.begin() + i * k, ids.begin() + (i + 1) * k,
                      sequence_selection_.begin() + static_cast<ptrdiff_t>(first) + i * row + il * k);
    }
}

void Engine::forget_failed_token(int64_t n) {
    // A single-token decode shows the predictor its gates as it goes (a stateful one folds `prev` in
    // at the first), and nothing of a failed call is appended: the next decode hands the kept tokens
    // over again as a new sequence, as after truncate(), so the failed token leaves no trace there.
    if (prefetcher_ && n == 1) replay_history_ = true;
}

void Engine::begin_prefetch_token() {
    const HParams& h = model_->hp;
    const int64_t row = h.n_layer * h.n_expert_used;
    if (replay_history_) {  // after a truncate(): the kept tokens but the last (which is `prev`)
        replay_history_ = false;
        prefetcher_->observe_context(sequence_selection_.data(), std::max<int64_t>(n_past_ - 1, 0), true);
    }
    prefetcher_->begin_token(n_past_ > 0 ? sequence_selection_.data() + (n_past_ - 1) * row : nullptr);
}

void Engine::on_gate(int il, const float* hidden, const float* router_logits, const int32_t* selected) {
    prefetcher_->on_gate(il, hidden, router_logits, selected);
}

void Engine::throw_if_cancelled(int il) const {
    if (!cancel_requested_.load(std::memory_order_relaxed)) return;
    throw CancelledError("decode cancelled at position " + std::to_string(n_past_) + ", layer " +
                         std::to_string(il) + " (nothing of the call was appended)");
}

namespace {

// An activation that every chunk recorded with one row per token of the chunk becomes one
// [n_tokens, width] activation in token order, as a single-chunk batch records it. Any other (the
// logits of the batch's last row) is the last chunk's. Empties `chunks`.
void merge_chunk_dumps(std::deque<ActivationDump>& chunks, const std::vector<Act>& xs, ActivationDump& out) {
    int64_t n_tokens = 0;
    for (const Act& x : xs) n_tokens += x.n_tokens;
    for (auto& [key, last] : chunks.back()) {
        bool per_token = last.shape.size() == 2;
        const int64_t width = per_token ? last.shape[1] : 0;
        for (size_t c = 0; per_token && c < chunks.size(); ++c) {
            const auto it = chunks[c].find(key);
            per_token =
                it != chunks[c].end() && it->second.shape == std::vector<int64_t>{xs[c].n_tokens, width};
        }
        if (!per_token) {
            out[key] = std::move(last);
            continue;
        }
        Activation& merged = out[key];
        merged.shape = {n_tokens, width};
        merged.data.clear();
        merged.data.reserve(static_cast<size_t>(n_tokens * width));
        for (ActivationDump& chunk : chunks) {
            const std::vector<float>& rows = chunk[key].data;
            merged.data.insert(merged.data.end(), rows.begin(), rows.end());
        }
    }
    chunks.clear();
}

}  // namespace

// Layer-major over chunks of at most kMaxBatch tokens: every chunk runs layer il before any chunk
// runs layer il + 1. A chunk's attention at layer il reads the KV rows that the earlier chunks wrote
// at il, so this order is exact; and a layer's experts are read once for the whole batch whenever
// the cache holds the layer's experts (chunk c + 1 finds what chunk c read), where chunk-major order
// re-read every expert once per chunk. Each row is computed by the same code as before, so the
// output does not depend on the order.
void Engine::forward_batch(const token_t* tokens, int64_t n, bool all_logits, float* logits) {
    const Model& m = *model_;
    const HParams& h = m.hp;
    const int64_t start_pos = n_past_, n_chunks = (n + kMaxBatch - 1) / kMaxBatch;
    recurrent_->n_past = -1;  // mid-update until the whole batch completes
    residual_.resize(static_cast<size_t>(n * h.n_embd));
    // One MoE FFN (its routing) and one Forward (its position) per chunk; deques keep addresses.
    // With dumping on, a batch of several chunks records each chunk apart (merged after the batch).
    std::deque<MoeFfn> moes;
    std::deque<Forward> fs;
    std::deque<ActivationDump> chunk_dumps;
    std::vector<Act> xs;
    for (int64_t c = 0; c < n_chunks; ++c) {
        const int64_t c0 = c * kMaxBatch, rows = std::min(kMaxBatch, n - c0);
        MoeFfn& moe = moes.emplace_back(*experts_, h.n_layer);
        moe.set_cancel_flag(&cancel_requested_);
        if (route_trace_.n_tokens > 0) moe.set_route_trace(&route_trace_);
        moe.set_read_ahead(cache_ != nullptr && c + 1 == n_chunks);  // resident: nothing to read
        ActivationDump* dump = nullptr;
        if (options_.dump_activations) dump = n_chunks == 1 ? &dump_ : &chunk_dumps.emplace_back();
        Forward& f = fs.emplace_back(m, *kv_, *backend_, moe, dump);
        f.set_timeline(&timeline_);
        f.set_exact(exact_);
        f.set_pos0(start_pos + c0);
        f.set_recurrent_state(recurrent_.get());
        xs.push_back(Act{residual_.data() + c0 * h.n_embd, rows, h.n_embd});
        backend_->reset_activations();
        f.embed(tokens + c0, xs.back());
    }

    if (prefetcher_ && n == 1) {
        // Single-token decoding: the predictor sees every layer's gate.
        begin_prefetch_token();
        moes.front().set_gate_observer(this);
    }
    for (int il = 0; il < h.n_layer; ++il) {
        for (int64_t c = 0; c < n_chunks; ++c) {
            throw_if_cancelled(il);
            backend_->reset_activations();
            const double t0 = timeline_.enabled() ? timeline_.now_us() : 0.0;
            Act& x = xs[static_cast<size_t>(c)];
            Act out = m.spec->build_layer(fs[static_cast<size_t>(c)], x, il);
            if (timeline_.enabled())
                timeline_.span("compute", "layer " + std::to_string(il), t0, timeline_.now_us());
            backend_->copy(out, x);
        }
    }
    for (int il = 0; il < h.n_layer; ++il) {
        Routing& r = routing_[static_cast<size_t>(il)];
        r.ids.clear();
        r.weights.clear();
        for (MoeFfn& moe : moes) {
            const Routing& rc = moe.routing()[static_cast<size_t>(il)];
            r.ids.insert(r.ids.end(), rc.ids.begin(), rc.ids.end());
            r.weights.insert(r.weights.end(), rc.weights.begin(), rc.weights.end());
        }
    }
    for (int64_t c = 0; c < n_chunks; ++c) {
        // Rows of this chunk whose logits are wanted, and where they go in `logits`.
        const Act& x = xs[static_cast<size_t>(c)];
        const bool last = c + 1 == n_chunks;
        if (!all_logits && !last) continue;
        backend_->reset_activations();
        const int64_t first = all_logits ? 0 : x.n_tokens - 1;
        fs[static_cast<size_t>(c)].output_head(x, first,
                                               logits + (all_logits ? c * kMaxBatch * h.n_vocab : 0));
    }
    if (!chunk_dumps.empty()) merge_chunk_dumps(chunk_dumps, xs, dump_);
    recurrent_->n_past = start_pos + n;
}

}  // namespace sharpi
