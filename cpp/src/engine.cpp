#include "engine.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <deque>

#include "cpu/cpu_backend.h"
#include "model/forward.h"
#include "moe/cpu_miss.h"
#include "predict/echo_guess.h"
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
    kv_shape_ = kv_layout(h, plan.type_k, plan.type_v);
    n_ctx_ = plan.n_ctx;
    if (const char* env = std::getenv("SHARPI_READ_AHEAD")) read_ahead_ = std::string(env) != "0";
    if (const char* env = std::getenv("SHARPI_ECHO_PREFETCH")) echo_prefetch_ = std::string(env) == "1";
    if (options.mtp) {
        mtp_ = std::make_unique<MtpHead>(*model_, options.mtp_file);
        mtp_experts_ = std::make_unique<ResidentExperts>(mtp_->model().experts);
    }
    sequences_ = std::make_unique<SequenceTable>(options.n_seq, [this] { return make_sequence(); });
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
    info_.n_seq = options.n_seq;
    info_.max_step_tokens = std::max<int64_t>(plan.n_ctx, kMaxBatch);
    info_.max_draft_tokens = options.max_draft_tokens;
    info_.recurrent = RecurrentState::bytes_for(h) > 0;
    info_.n_layer_nextn = h.n_layer_nextn;
    info_.mtp = options.mtp;
    info_.bytes_dense = model_->bytes_dense;
    info_.bytes_experts = model_->bytes_experts;
    info_.cache_type_k = ggml_type_traits(plan.type_k).name;
    info_.cache_type_v = ggml_type_traits(plan.type_v).name;
    info_.bytes_kv = device_ ? device_->plan().kv_bytes
                             : static_cast<uint64_t>(options.n_seq) * KvCache::bytes(kv_shape_, plan.n_ctx);
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
    int32_t n_moe_layer = 0;
    trace.moe_index.assign(static_cast<size_t>(h.n_layer), -1);
    for (int il = 0; il < h.n_layer; ++il) {
        if (model_->experts.layers[static_cast<size_t>(il)].present())
            trace.moe_index[static_cast<size_t>(il)] = n_moe_layer++;
    }
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

std::unique_ptr<Sequence> Engine::make_sequence() const {
    auto s = std::make_unique<Sequence>();
    if (!device_) {
        s->kv = std::make_unique<KvCache>(model_->hp.n_layer, n_ctx_, kv_shape_.width, kv_shape_.head_dim,
                                          kv_shape_.type_k, kv_shape_.type_v, kv_shape_.with_v);
    }
    s->recurrent = std::make_unique<RecurrentState>(model_->hp);
    if (mtp_) {
        // The block's own layout (deepseek32: the latent without the indexer key).
        const KvLayout l = kv_layout(mtp_->model().hp, kv_shape_.type_k, kv_shape_.type_v);
        s->mtp_kv = std::make_unique<KvCache>(1, n_ctx_, l.width, l.head_dim, l.type_k, l.type_v, l.with_v);
        // new[] without (): pages are faulted in as positions fill, as the KV cache's.
        s->mtp_hidden.reset(new float[static_cast<size_t>(n_ctx_ * MtpHead::hidden_width(model_->hp))]);
    }
    return s;
}

void Engine::reset(int32_t seq) {
    Sequence& s = sequences_->at(seq);
    s.n_past = 0;
    if (seq == 0) clear_cancel();
    sequences_->consume_cancel(seq);
    s.recurrent->clear();
    // The next token has no previous token (prev-token history starts over).
    for (Routing& r : routing_) {
        r.ids.clear();
        r.weights.clear();
    }
    s.selections.clear();
    s.tokens.clear();
    s.replay_history = false;
}

void Engine::truncate(int64_t n_keep, int32_t seq) {
    Sequence& s = sequences_->at(seq);
    if (n_keep < 0 || n_keep > s.n_past) {
        throw InvalidArgument("truncate: " + std::to_string(n_keep) +
                              " positions to keep, the sequence holds " + std::to_string(s.n_past));
    }
    if (n_keep == s.n_past) return;
    if (!s.recurrent->empty()) {
        if (s.recurrent->n_past != s.n_past || !s.recurrent->can_rewind_to(n_keep)) {
            throw UnsupportedError(
                "truncate: " + info_.arch +
                " keeps a recurrent (DeltaNet) state that cannot be rewound to position " +
                std::to_string(n_keep) +
                " (only inside the last rewindable step); reset() and decode the prefix again");
        }
        s.recurrent->rewind_to(n_keep);
    }
    s.n_past = n_keep;
    // The last routing belongs to a dropped position. The predictor's history is rebuilt from the
    // kept tokens at the next decode (their previous token is the last kept one).
    for (Routing& r : routing_) {
        r.ids.clear();
        r.weights.clear();
    }
    if (prefetcher_) {
        s.selections.resize(static_cast<size_t>(n_keep * model_->hp.n_layer * model_->hp.n_expert_used));
        s.tokens.resize(static_cast<size_t>(n_keep));
        s.replay_history = true;
    }
}

int32_t Engine::add_sequence() {
    if (device_) throw UnsupportedError("add_sequence: batched sequences are not on the device path yet");
    return sequences_->add().id;
}

int32_t Engine::fork_sequence(int32_t src, int64_t n_keep) {
    const Sequence& from = sequences_->at(src);
    if (n_keep < 0 || n_keep > from.n_past) {
        throw InvalidArgument("fork_sequence: " + std::to_string(n_keep) + " positions to keep, sequence " +
                              std::to_string(src) + " holds " + std::to_string(from.n_past));
    }
    if (!from.recurrent->empty() && n_keep != from.n_past) {
        throw UnsupportedError("fork_sequence: " + info_.arch +
                               " keeps a recurrent (DeltaNet) state that holds all of sequence " +
                               std::to_string(src) + "'s " + std::to_string(from.n_past) +
                               " positions; fork it whole (n_keep = n_past) or decode the prefix again");
    }
    if (!from.recurrent->empty() && from.recurrent->n_past != from.n_past) {
        throw InvalidArgument("fork_sequence: sequence " + std::to_string(src) +
                              "'s recurrent state was left mid-update by a failed decode; reset it first");
    }
    if (device_) throw UnsupportedError("fork_sequence: batched sequences are not on the device path yet");
    Sequence& s = sequences_->add();
    std::vector<bool> written(static_cast<size_t>(model_->hp.n_layer));
    for (int il = 0; il < model_->hp.n_layer; ++il) written[static_cast<size_t>(il)] = model_->hp.has_kv(il);
    s.kv->copy_prefix(*from.kv, n_keep, written);
    if (mtp_ && n_keep > 0) {
        // The MTP pairs of the kept positions (rows 0 .. n_keep - 2) and their hidden rows.
        s.mtp_kv->copy_prefix(*from.mtp_kv, n_keep - 1, {true});
        std::copy_n(from.mtp_hidden.get(), n_keep * MtpHead::hidden_width(model_->hp), s.mtp_hidden.get());
    }
    if (!from.recurrent->empty()) {
        *s.recurrent = *from.recurrent;
        s.recurrent->drop_rewind_points();  // they describe the source's last step
    }
    s.n_past = n_keep;
    if (prefetcher_) {
        const size_t row = static_cast<size_t>(model_->hp.n_layer * model_->hp.n_expert_used);
        s.selections.assign(from.selections.begin(),
                            from.selections.begin() + static_cast<ptrdiff_t>(n_keep * row));
        s.tokens.assign(from.tokens.begin(), from.tokens.begin() + static_cast<ptrdiff_t>(n_keep));
        s.replay_history = true;
    }
    return s.id;
}

void Engine::remove_sequence(int32_t seq) {
    if (predictor_seq_ == seq) predictor_seq_ = -1;
    sequences_->remove(seq);
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
        // Selections are recorded only while a prefetcher exists: tokens decoded before this one was
        // installed are unknown (-1) rows, and each sequence's history starts over from them.
        const size_t row = static_cast<size_t>(h.n_layer * h.n_expert_used);
        for (int32_t id : sequences_->ids()) {
            Sequence& s = sequences_->at(id);
            s.selections.resize(static_cast<size_t>(s.n_past) * row, -1);
            s.tokens.resize(static_cast<size_t>(s.n_past), -1);
            s.replay_history = s.n_past > 0;
        }
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

std::vector<float> Engine::decode(const std::vector<token_t>& tokens, bool all_logits, bool rewindable) {
    std::vector<SequenceTokens> step(1);
    step[0].tokens = tokens;
    step[0].all_logits = all_logits;
    step[0].rewindable = rewindable;
    std::vector<std::vector<float>> logits = decode_batch(step);
    if (logits[0].empty()) {
        throw CancelledError("decode cancelled (cancel_sequence(0)) at position " + std::to_string(n_past()) +
                             " (nothing of the call was appended)");
    }
    return std::move(logits[0]);
}

void Engine::check_step(const std::vector<SequenceTokens>& entries) const {
    const HParams& h = model_->hp;
    const bool single = entries.size() == 1;
    if (entries.empty()) throw InvalidArgument("decode_batch: no sequences");
    if (device_ && (!single || entries[0].seq != 0))
        throw UnsupportedError(
            "decode_batch: batched sequences are not on the device path yet (device=\"cuda\")");
    std::vector<int32_t> seen;
    int64_t total = 0;
    for (const SequenceTokens& e : entries) {
        const Sequence& s = sequences_->at(e.seq);
        const std::string which = single && e.seq == 0 ? "" : " of sequence " + std::to_string(e.seq);
        if (std::find(seen.begin(), seen.end(), e.seq) != seen.end())
            throw InvalidArgument("decode_batch: sequence " + std::to_string(e.seq) +
                                  " appears twice in one step");
        seen.push_back(e.seq);
        const int64_t n = static_cast<int64_t>(e.tokens.size());
        if (n == 0) throw InvalidArgument("decode: no tokens" + which);
        for (size_t i = 0; i < e.tokens.size(); ++i) {
            if (e.tokens[i] < 0 || e.tokens[i] >= h.n_vocab) {
                throw InvalidArgument("decode: token " + std::to_string(e.tokens[i]) + " at index " +
                                      std::to_string(i) + which + " is outside the vocabulary [0, " +
                                      std::to_string(h.n_vocab) + ")");
            }
        }
        if (s.n_past + n > info_.n_ctx) {
            throw ContextOverflowError("decode: " + std::to_string(n) + " tokens at position " +
                                       std::to_string(s.n_past) + which + " exceed the context of " +
                                       std::to_string(info_.n_ctx) +
                                       " tokens (use a larger n_ctx or reset())");
        }
        if (e.rewindable && !s.recurrent->empty() && n - 1 > options_.max_draft_tokens) {
            throw InvalidArgument(
                "decode: a rewindable step of " + std::to_string(n) + " tokens" + which + " on " +
                info_.arch + " keeps its recurrent state after each token; the session holds " +
                std::to_string(options_.max_draft_tokens) + " such copies (max_draft_tokens), so at most " +
                std::to_string(options_.max_draft_tokens + 1) + " tokens");
        }
        if (e.rewindable && device_ && !s.recurrent->empty())
            throw UnsupportedError(
                "decode: rewindable steps of a model with recurrent state are not on the "
                "device path yet (device=\"cuda\")");
        if (!s.recurrent->empty() && s.recurrent->n_past != s.n_past) {
            throw InvalidArgument("decode: the recurrent (DeltaNet) state" + which +
                                  " was left mid-update by a failed or cancelled decode; "
                                  "call reset() to start the sequence again");
        }
        total += n;
    }
    // The residual rows of a step are live at once; the budget charged max_step_tokens of them.
    if (total > info_.max_step_tokens) {
        throw InvalidArgument("decode_batch: " + std::to_string(total) + " tokens in one step; at most " +
                              std::to_string(info_.max_step_tokens) + " per step (max(n_ctx, " +
                              std::to_string(kMaxBatch) + "))");
    }
}

std::vector<std::vector<float>> Engine::decode_batch(const std::vector<SequenceTokens>& entries) {
    const HParams& h = model_->hp;
    check_step(entries);
    const auto t_start = std::chrono::steady_clock::now();
    struct AddElapsed {  // decode_ms_ counts failed calls too
        std::chrono::steady_clock::time_point t0;
        double& total;
        ~AddElapsed() {
            total += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        }
    } add_elapsed{t_start, decode_ms_};
    dump_.clear();
    std::vector<Sequence*> seqs;
    std::vector<std::vector<float>> logits(entries.size());
    for (size_t e = 0; e < entries.size(); ++e) {
        seqs.push_back(&sequences_->at(entries[e].seq));
        const int64_t rows = entries[e].all_logits ? static_cast<int64_t>(entries[e].tokens.size()) : 1;
        logits[e].resize(static_cast<size_t>(rows * h.n_vocab));
    }
    const bool single = entries.size() == 1;
    followed_entry_ = -1;
    const auto forget = [&] {
        if (followed_entry_ >= 0) forget_failed_step(*seqs[static_cast<size_t>(followed_entry_)]);
    };
    try {
        if (device_) {
            forward_device(entries[0], logits[0]);
        } else {
            forward_step(entries, logits);
        }
        model_->file->check_mapping();  // resident: no result computed from a lost page
    } catch (const CancelledError&) {
        clear_cancel();  // this call consumed the request
        forget();
        throw;
    } catch (...) {
        forget();
        throw;
    }
    int64_t step_rows = 0;
    for (const SequenceTokens& e : entries) step_rows += static_cast<int64_t>(e.tokens.size());
    int64_t row0 = 0;
    for (size_t e = 0; e < entries.size(); ++e) {
        Sequence& s = *seqs[e];
        const int64_t n = static_cast<int64_t>(entries[e].tokens.size());
        const bool followed = static_cast<int64_t>(e) == followed_entry_;
        if (sequences_->consume_cancel(s.id)) {
            // Not appended. A recurrent state that absorbed the tokens stays marked mid-update.
            logits[e].clear();
            if (followed) forget_failed_step(s);
        } else {
            if (prefetcher_) {
                record_selections(s, entries[e].tokens, row0, n, step_rows);
                if (followed && n > 1) {
                    pass_step_context(s, n);
                } else if (single && !followed && n > 1) {
                    pass_batch_context(s, n);
                }
            }
            s.n_past += n;  // only once the whole step succeeded
            if (!s.recurrent->empty()) s.recurrent->n_past = s.n_past;
        }
        row0 += n;
    }
    // An unobserved step of several sequences (a long prompt beside others): the predictor saw none
    // of it, and every sequence replays its history before the predictor follows it again.
    if (prefetcher_ && !single && followed_entry_ < 0) predictor_seq_ = -1;
    return logits;
}

void Engine::forward_device(const SequenceTokens& entry, std::vector<float>& logits) {
    Sequence& s = sequences_->at(entry.seq);
    const int64_t n = static_cast<int64_t>(entry.tokens.size());
    std::vector<std::vector<int32_t>> ids;
    GateObserver* observer = nullptr;
    if (prefetcher_ && n == 1) {
        followed_entry_ = begin_prefetch_step({entry}, {&s});
        observer = this;
    }
    device_->forward(
        entry.tokens.data(), n, s.n_past, entry.all_logits, logits.data(), ids,
        [this](int il) { throw_if_cancelled(il); }, observer);
    for (size_t il = 0; il < routing_.size(); ++il) {
        routing_[il].ids = std::move(ids[il]);
        routing_[il].weights.clear();
    }
}

void Engine::pass_batch_context(Sequence& s, int64_t n) {
    const HParams& h = model_->hp;
    const int64_t row = h.n_layer * h.n_expert_used;
    // The tokens no observe() has seen, oldest first: when the predictor's history is not this
    // sequence's (a truncate(), a failed token, another sequence in between) the whole kept sequence
    // (the predictor starts over), else the token decoded just before the batch (no single-token
    // decode showed it as `prev`), then batch tokens 0..n-2 (the last is the next token's `prev`).
    const bool replay = s.replay_history || predictor_seq_ != s.id;
    const int64_t lead = replay ? s.n_past : std::min<int64_t>(s.n_past, 1);
    const bool new_sequence = replay || s.n_past == 0;
    s.replay_history = false;
    predictor_seq_ = s.id;
    // record_selections() already appended the batch: the context is rows [n_past - lead, n_past + n - 1).
    prefetcher_->observe_context(s.selections.data() + (s.n_past - lead) * row, lead + n - 1, new_sequence);
}

void Engine::record_selections(Sequence& s, const std::vector<token_t>& tokens, int64_t row0, int64_t n,
                               int64_t step_rows) {
    const HParams& h = model_->hp;
    s.tokens.insert(s.tokens.end(), tokens.begin(), tokens.begin() + n);
    const int64_t k = h.n_expert_used, row = h.n_layer * k;
    const size_t first = s.selections.size();
    s.selections.resize(first + static_cast<size_t>(n * row), -1);
    for (int il = 0; il < h.n_layer; ++il) {
        const std::vector<int32_t>& ids = routing_[static_cast<size_t>(il)].ids;
        if (ids.size() != static_cast<size_t>(step_rows * k)) continue;
        for (int64_t i = 0; i < n; ++i)
            std::copy(ids.begin() + (row0 + i) * k, ids.begin() + (row0 + i + 1) * k,
                      s.selections.begin() + static_cast<ptrdiff_t>(first) + i * row + il * k);
    }
}

void Engine::forget_failed_step(Sequence& s) {
    // The predictor folded the token before the step into its state (the followed row's `prev`) and
    // saw the step's gates, and nothing of the failed step is appended: the next decode hands the
    // kept tokens over again as a new sequence, as after truncate(), so the step leaves no trace.
    s.replay_history = true;
}

bool Engine::observed_entry(const SequenceTokens& e) {
    return e.tokens.size() == 1 || e.rewindable;
}

int64_t Engine::begin_prefetch_step(const std::vector<SequenceTokens>& entries,
                                    const std::vector<Sequence*>& seqs) {
    const HParams& h = model_->hp;
    const int64_t row = h.n_layer * h.n_expert_used;
    int64_t followed = -1;
    for (size_t e = 0; e < entries.size(); ++e) {
        if (!observed_entry(entries[e])) continue;
        if (followed < 0 || seqs[e]->id == predictor_seq_) followed = static_cast<int64_t>(e);
    }
    if (followed < 0) return -1;  // prompt rows only: not observed
    Sequence& f = *seqs[static_cast<size_t>(followed)];
    if (f.replay_history || predictor_seq_ != f.id) {  // the kept tokens but the last (which is `prev`)
        f.replay_history = false;
        prefetcher_->observe_context(f.selections.data(), std::max<int64_t>(f.n_past - 1, 0), true);
    }
    predictor_seq_ = f.id;
    // Every observed row's echo guess (predict/echo_guess.h), kept for the step: its predictors see
    // it (PredictorInput::echo) and its first MoE layers are staged from it now.
    step_echo_.clear();
    std::vector<int64_t> echo_at;  // per row: its guess's offset in step_echo_, -1 none
    for (size_t e = 0; e < entries.size(); ++e) {
        const std::vector<token_t>& t = entries[e].tokens;
        if (!observed_entry(entries[e])) {
            echo_at.insert(echo_at.end(), t.size(), -1);
            continue;
        }
        const Sequence& s = *seqs[e];
        const std::vector<int32_t> g = echo_guess(s.tokens.data(), s.selections.data(), s.n_past, row,
                                                  t.data(), static_cast<int64_t>(t.size()));
        for (size_t i = 0; i < t.size(); ++i) {
            const auto first = g.begin() + static_cast<ptrdiff_t>(i) * row;
            const bool known = std::any_of(first, first + row, [](int32_t x) { return x >= 0; });
            echo_at.push_back(known ? static_cast<int64_t>(step_echo_.size()) : -1);
            if (known) step_echo_.insert(step_echo_.end(), first, first + row);
        }
    }
    std::vector<PrefetchRow> rows;
    for (size_t e = 0; e < entries.size(); ++e) {
        const Sequence& s = *seqs[e];
        const bool observed = observed_entry(entries[e]);
        for (size_t i = 0; i < entries[e].tokens.size(); ++i) {
            PrefetchRow r;
            r.sequence = s.id;
            r.observed = observed;
            if (i == 0) {
                r.prev = s.n_past > 0 ? s.selections.data() + (s.n_past - 1) * row : nullptr;
            } else {
                r.prev_row = static_cast<int>(rows.size()) - 1;
            }
            r.updates_state = static_cast<int64_t>(e) == followed && i == 0;
            const int64_t at = echo_at[rows.size()];
            r.echo = at >= 0 ? step_echo_.data() + at : nullptr;
            rows.push_back(r);
        }
    }
    prefetcher_->begin_step(rows);
    if (echo_prefetch_) stage_guessed_rows(step_echo_);
    return followed;
}

void Engine::stage_guessed_rows(const std::vector<int32_t>& guesses) {
    const HParams& h = model_->hp;
    const int64_t k = h.n_expert_used, row = h.n_layer * k;
    const int64_t n_rows = static_cast<int64_t>(guesses.size()) / row;
    // The first `lookahead` MoE layers, each for every row before the next layer's: the predictor
    // covers the later ones from each layer's gate.
    int staged = 0;
    for (int il = 0; il < h.n_layer && staged < options_.lookahead; ++il) {
        if (cache_->expert_bytes(il) == 0) continue;  // a dense layer
        for (int64_t r = 0; r < n_rows; ++r)
            prefetcher_->stage_guesses(il, guesses.data() + r * row + il * k, k);
        ++staged;
    }
}

StepReadEstimate Engine::predict_step_reads(int32_t seq, const std::vector<token_t>& tokens) const {
    const Sequence& s = sequences_->at(seq);
    const HParams& h = model_->hp;
    const int64_t n = static_cast<int64_t>(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) {
        if (tokens[i] < 0 || tokens[i] >= h.n_vocab)
            throw InvalidArgument("predict_step_reads: token " + std::to_string(tokens[i]) + " at index " +
                                  std::to_string(i) + " is outside the vocabulary [0, " +
                                  std::to_string(h.n_vocab) + ")");
    }
    StepReadEstimate out;
    out.bytes.assign(static_cast<size_t>(n), 0.0);
    if (cache_ == nullptr || n == 0) return out;  // resident: a step reads nothing
    out.bytes_per_ms = cache_->reader().bytes_per_ms();
    const int64_t k = h.n_expert_used, row = h.n_layer * k;
    std::vector<int32_t> guess(static_cast<size_t>(n * row), -1);
    if (prefetcher_) {  // the history exists only with a prefetcher (record_selections)
        guess = echo_guess(s.tokens.data(), s.selections.data(), s.n_past, row, tokens.data(), n);
    }
    std::vector<int32_t> missing;  // this layer's guessed experts not present, over the rows so far
    for (int il = 0; il < h.n_layer; ++il) {
        const double expert_bytes = static_cast<double>(cache_->expert_bytes(il));
        if (expert_bytes == 0.0) continue;
        int64_t held = 0;
        for (int32_t e = 0; e < h.n_expert; ++e) held += cache_->present(il, e);
        // A row without a guess: top_k experts, each absent as often as the layer's experts are.
        const double unknown_misses = static_cast<double>(k) * (1.0 - static_cast<double>(held) / h.n_expert);
        missing.clear();
        double unknown = 0.0;
        for (int64_t r = 0; r < n; ++r) {
            const int32_t* g = guess.data() + r * row + il * k;
            if (std::any_of(g, g + k, [](int32_t e) { return e >= 0; })) {
                for (int64_t j = 0; j < k; ++j) {
                    if (g[j] < 0 || cache_->present(il, g[j])) continue;
                    if (std::find(missing.begin(), missing.end(), g[j]) == missing.end())
                        missing.push_back(g[j]);
                }
            } else {
                unknown += unknown_misses;
            }
            out.bytes[static_cast<size_t>(r)] +=
                (static_cast<double>(missing.size()) + unknown) * expert_bytes;
        }
    }
    return out;
}

void Engine::pass_step_context(Sequence& s, int64_t n) {
    const int64_t row = model_->hp.n_layer * model_->hp.n_expert_used;
    // record_selections() appended the step at row n_past; its first row folded the token before
    // it, its last is the next token's `prev`.
    prefetcher_->observe_context(s.selections.data() + s.n_past * row, n - 1, false);
}

void Engine::on_gate(int il, int64_t n_rows, const float* hidden, const float* router_logits,
                     const int32_t* selected) {
    prefetcher_->on_gate(il, n_rows, hidden, router_logits, selected);
}

void Engine::throw_if_cancelled(int il) const {
    if (!cancel_requested_.load(std::memory_order_relaxed)) return;
    throw CancelledError("decode cancelled at layer " + std::to_string(il) +
                         " (nothing of the call was appended)");
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

// Layer-major over chunks of at most kMaxBatch rows: every chunk runs layer il before any chunk runs
// layer il + 1. A chunk's attention at layer il reads the KV rows that the earlier chunks wrote at
// il, so this order is exact; and a layer's experts are read once for the whole step whenever the
// cache holds the layer's experts (chunk c + 1 finds what chunk c read), where chunk-major order
// re-read every expert once per chunk.
//
// Batch invariance: each entry is cut into pieces of kMaxBatch tokens from its start, exactly as a
// lone decode of it is, and a piece never straddles two chunks (one that does not fit the current
// chunk starts the next), so every sequence meets the span-wise ops (attention, the DeltaNet
// recurrence) in the same groups as alone; every other op computes each row by the same code
// whatever shares the step.
void Engine::forward_step(const std::vector<SequenceTokens>& entries,
                          std::vector<std::vector<float>>& logits) {
    const Model& m = *model_;
    const HParams& h = m.hp;
    struct Piece {
        size_t entry;
        int64_t offset, n_tokens;  // tokens [offset, offset + n_tokens) of the entry
    };
    std::vector<std::vector<Piece>> chunks;
    std::vector<token_t> tokens;  // the step's rows, in order
    int64_t rows_in_chunk = 0;
    for (size_t e = 0; e < entries.size(); ++e) {
        const int64_t n = static_cast<int64_t>(entries[e].tokens.size());
        for (int64_t off = 0; off < n; off += kMaxBatch) {
            const int64_t len = std::min(kMaxBatch, n - off);
            if (chunks.empty() || rows_in_chunk + len > kMaxBatch) {
                chunks.emplace_back();
                rows_in_chunk = 0;
            }
            chunks.back().push_back(Piece{e, off, len});
            rows_in_chunk += len;
        }
        tokens.insert(tokens.end(), entries[e].tokens.begin(), entries[e].tokens.end());
    }
    const int64_t n = static_cast<int64_t>(tokens.size()), n_chunks = static_cast<int64_t>(chunks.size());
    std::vector<Sequence*> seqs;
    for (const SequenceTokens& e : entries) {
        seqs.push_back(&sequences_->at(e.seq));
        RecurrentState& r = *seqs.back()->recurrent;
        // The step replaces the rewind points of the sequence's last step.
        if (e.rewindable && !r.empty()) {
            r.begin_rewind_points(seqs.back()->n_past, static_cast<int64_t>(e.tokens.size()));
        } else {
            r.drop_rewind_points();
        }
        r.n_past = -1;  // mid-update until the whole step completes
    }
    const int64_t n_residual = h.n_embd_residual();  // hc_mult streams (deepseek4), else n_embd
    residual_.resize(static_cast<size_t>(n * n_residual));
    // One MoE FFN (its routing) and one Forward (its spans) per chunk; deques keep addresses.
    // With dumping on, a step of several chunks records each chunk apart (merged after the step).
    std::deque<MoeFfn> moes;
    std::deque<Forward> fs;
    std::deque<ActivationDump> chunk_dumps;
    std::vector<Act> xs;
    int64_t c0 = 0;
    for (int64_t c = 0; c < n_chunks; ++c) {
        std::vector<SeqSpan> spans;
        int64_t rows = 0;
        for (const Piece& p : chunks[static_cast<size_t>(c)]) {
            Sequence& s = *seqs[p.entry];
            const bool rewindable = entries[p.entry].rewindable && !s.recurrent->empty();
            spans.push_back(
                SeqSpan{s.kv.get(), s.recurrent.get(), s.n_past + p.offset, rows, p.n_tokens, rewindable});
            rows += p.n_tokens;
        }
        MoeFfn& moe = moes.emplace_back(*experts_, h.n_layer);
        moe.set_cancel_flag(&cancel_requested_);
        if (route_trace_.n_tokens > 0) moe.set_route_trace(&route_trace_);
        // Resident: nothing to read. A step of a few rows (a speculative verify step) reads ahead the
        // union of guesses for each of its rows, mostly wrong, and evicts what later steps need.
        const bool ahead_rows = n == 1 || n >= kReadAheadMinRows;
        moe.set_read_ahead(read_ahead_ && ahead_rows && cache_ != nullptr && c + 1 == n_chunks);
        ActivationDump* dump = nullptr;
        if (options_.dump_activations) dump = n_chunks == 1 ? &dump_ : &chunk_dumps.emplace_back();
        Forward& f = fs.emplace_back(m, *backend_, moe, dump);
        f.set_timeline(&timeline_);
        f.set_exact(exact_);
        f.set_spans(std::move(spans));
        xs.push_back(Act{residual_.data() + c0 * n_residual, rows, n_residual});
        f.set_tokens(tokens.data() + c0);
        backend_->reset_activations();
        f.embed(tokens.data() + c0, xs.back());
        c0 += rows;
    }

    followed_entry_ = -1;
    if (prefetcher_ && n < kReadAheadMinRows) {
        // One token, or a step of a few rows (sequences decoding together, a verify step; one
        // chunk): the predictor sees its decode rows' gates at every layer.
        followed_entry_ = begin_prefetch_step(entries, seqs);
        if (followed_entry_ >= 0) moes.front().set_gate_observer(this);
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
        const Act& x = xs[static_cast<size_t>(c)];
        Forward& f = fs[static_cast<size_t>(c)];
        // The rows of this chunk whose logits are wanted: every row of an all_logits entry, else an
        // entry's last row; where each goes in its entry's logits.
        std::vector<int64_t> rows;
        std::vector<float*> dst;
        int64_t row = 0;
        for (const Piece& p : chunks[static_cast<size_t>(c)]) {
            const SequenceTokens& e = entries[p.entry];
            float* out = logits[p.entry].data();
            if (e.all_logits) {
                for (int64_t i = 0; i < p.n_tokens; ++i) {
                    rows.push_back(row + i);
                    dst.push_back(out + (p.offset + i) * h.n_vocab);
                }
            } else if (p.offset + p.n_tokens == static_cast<int64_t>(e.tokens.size())) {
                rows.push_back(row + p.n_tokens - 1);
                dst.push_back(out);
            }
            row += p.n_tokens;
        }
        if (rows.empty()) continue;
        backend_->reset_activations();
        const bool contiguous_tail = rows.back() == x.n_tokens - 1 &&
                                     rows.back() - rows.front() + 1 == static_cast<int64_t>(rows.size());
        bool in_order = contiguous_tail;
        for (size_t i = 1; in_order && i < dst.size(); ++i) in_order = dst[i] == dst[i - 1] + h.n_vocab;
        if (in_order) {
            // The wanted rows end the chunk and land back to back (every one-sequence step): the head
            // writes them in place.
            f.output_head(x, rows.front(), dst.front());
            continue;
        }
        // Gather the wanted rows, one head for all of them (the lm_head's weights are read once per
        // chunk, not once per sequence), and scatter the logits.
        Act picked = f.alloc(static_cast<int64_t>(rows.size()), n_residual);
        for (size_t i = 0; i < rows.size(); ++i)
            backend_->copy_rows(x.row(rows[i]), n_residual, picked.row(static_cast<int64_t>(i)), n_residual,
                                1, n_residual);
        std::vector<float> head(rows.size() * static_cast<size_t>(h.n_vocab));
        f.output_head(picked, 0, head.data());
        for (size_t i = 0; i < rows.size(); ++i)
            std::copy_n(head.data() + i * static_cast<size_t>(h.n_vocab), h.n_vocab, dst[i]);
    }
    if (!chunk_dumps.empty()) merge_chunk_dumps(chunk_dumps, xs, dump_);
    if (mtp_) forward_mtp_pairs(entries);
}

void Engine::forward_mtp_pairs(const std::vector<SequenceTokens>& entries) {
    const HParams& h = model_->hp;
    const int64_t W = MtpHead::hidden_width(h), n_residual = h.n_embd_residual();
    // Pair r of a sequence is (hidden of position r, token r + 1), in MTP KV row r. A step of
    // positions [P, P + n) completes pairs [max(P - 1, 0), P + n - 1).
    std::vector<token_t> tokens;
    std::vector<float> hidden;
    struct Pairs {
        Sequence* s;
        int64_t r0, n;
    };
    std::vector<Pairs> runs;
    int64_t row = 0;
    for (const SequenceTokens& e : entries) {
        Sequence& s = sequences_->at(e.seq);
        const int64_t n = static_cast<int64_t>(e.tokens.size()), P = s.n_past;
        const float* residual = residual_.data() + row * n_residual;
        if (MtpHead::hidden_is_normed(h)) {
            backend_->rms_norm(residual, n_residual, s.mtp_hidden.get() + P * W, W, n, W,
                               model_->output_norm.data(), h.rms_eps);
        } else {
            std::copy_n(residual, n * W, s.mtp_hidden.get() + P * W);
        }
        row += n;
        const int64_t r0 = std::max<int64_t>(P - 1, 0), r1 = P + n - 1;
        if (r1 <= r0) continue;
        for (int64_t r = r0; r < r1; ++r) tokens.push_back(e.tokens[static_cast<size_t>(r + 1 - P)]);
        hidden.insert(hidden.end(), s.mtp_hidden.get() + r0 * W, s.mtp_hidden.get() + r1 * W);
        runs.push_back(Pairs{&s, r0, r1 - r0});
    }
    // In chunks of at most kMaxBatch rows; a sequence's later pairs attend to the rows its earlier
    // chunk wrote.
    size_t run = 0;
    int64_t done_in_run = 0, first = 0;
    const int64_t total = static_cast<int64_t>(tokens.size());
    while (first < total) {
        std::vector<SeqSpan> spans;
        int64_t rows = 0;
        while (run < runs.size() && rows < kMaxBatch) {
            const Pairs& p = runs[run];
            const int64_t take = std::min(p.n - done_in_run, kMaxBatch - rows);
            spans.push_back(SeqSpan{p.s->mtp_kv.get(), nullptr, p.r0 + done_in_run, rows, take, false, 1});
            rows += take;
            done_in_run += take;
            if (done_in_run == p.n) {
                ++run;
                done_in_run = 0;
            }
        }
        backend_->reset_activations();
        MoeFfn moe(*mtp_experts_, 1);
        Forward f(mtp_->model(), *backend_, moe, nullptr);
        f.set_exact(exact_);
        f.set_spans(std::move(spans));
        mtp_->forward(f, tokens.data() + first, hidden.data() + first * W, rows);
        first += rows;
    }
}

std::vector<token_t> Engine::draft_mtp(int32_t seq, token_t next, int n, std::vector<float>* logits) {
    const HParams& h = model_->hp;
    if (!mtp_) throw InvalidArgument("draft_mtp: the session was opened without its MTP head (mtp = true)");
    Sequence& s = sequences_->at(seq);
    if (next < 0 || next >= h.n_vocab) {
        throw InvalidArgument("draft_mtp: token " + std::to_string(next) + " is outside the vocabulary [0, " +
                              std::to_string(h.n_vocab) + ")");
    }
    if (n < 1) throw InvalidArgument("draft_mtp: n must be >= 1, got " + std::to_string(n));
    const int64_t P = s.n_past;
    if (P == 0)
        throw InvalidArgument("draft_mtp: the sequence is empty (the head drafts from its last position)");
    // Chained draft pairs take KV rows P - 1, P, ...: at most n_ctx rows.
    const int64_t steps = std::min<int64_t>(n, n_ctx_ - P + 1);
    const int64_t W = MtpHead::hidden_width(h);
    std::vector<float> hidden(s.mtp_hidden.get() + (P - 1) * W, s.mtp_hidden.get() + P * W);
    std::vector<float> row(static_cast<size_t>(h.n_vocab));
    std::vector<token_t> out;
    // The verify step that follows decodes [next, drafts...]: each of its rows' echo guesses is
    // staged as soon as the row's token exists, so those reads overlap the drafting.
    std::vector<token_t> chain{next};
    const int64_t guess_row = h.n_layer * h.n_expert_used;
    const auto stage_last = [&] {
        if (!prefetcher_ || !echo_prefetch_) return;
        const std::vector<int32_t> g = echo_guess(s.tokens.data(), s.selections.data(), P, guess_row,
                                                  chain.data(), static_cast<int64_t>(chain.size()));
        stage_guessed_rows(std::vector<int32_t>(g.end() - guess_row, g.end()));
    };
    stage_last();
    token_t x = next;
    for (int64_t i = 0; i < steps; ++i) {
        backend_->reset_activations();
        MoeFfn moe(*mtp_experts_, 1);
        Forward f(mtp_->model(), *backend_, moe, nullptr);
        f.set_exact(exact_);
        f.set_spans({SeqSpan{s.mtp_kv.get(), nullptr, P - 1 + i, 0, 1, false, 1}});
        const Act o = mtp_->forward(f, &x, hidden.data(), 1);
        mtp_->head(f, o, 0, row.data());
        x = static_cast<token_t>(std::max_element(row.begin(), row.end()) - row.begin());
        out.push_back(x);
        if (i + 1 < steps) {  // the last draft's row is staged by the verify step itself
            chain.push_back(x);
            stage_last();
        }
        if (logits) logits->insert(logits->end(), row.begin(), row.end());
        std::copy(o.row(0), o.row(0) + W, hidden.begin());
    }
    return out;
}

}  // namespace sharpi
