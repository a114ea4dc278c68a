// sharpi::Session: the public face of Engine (pimpl keeps the public headers free of internals).
#include "sharpi/session.h"

#include "engine.h"
#include "gguf/gguf_file.h"

namespace sharpi {

Session::Session(const std::string& model_path, const SessionOptions& options)
    : engine_(std::make_unique<Engine>(model_path, resolve_session_options(options))) {}

Session::~Session() = default;

const ModelInfo& Session::info() const {
    return engine_->info();
}

std::vector<float> Session::decode(const std::vector<token_t>& tokens, bool all_logits, bool rewindable) {
    return engine_->decode(tokens, all_logits, rewindable);
}

void Session::cancel() noexcept {
    engine_->cancel();
}

void Session::clear_cancel() noexcept {
    engine_->clear_cancel();
}

int64_t Session::n_past() const {
    return engine_->n_past();
}

void Session::reset() {
    engine_->reset();
}

void Session::truncate(int64_t n_keep) {
    engine_->truncate(n_keep);
}

int32_t Session::add_sequence() {
    return engine_->add_sequence();
}

int32_t Session::fork_sequence(int32_t src, int64_t n_keep) {
    return engine_->fork_sequence(src, n_keep);
}

void Session::remove_sequence(int32_t seq) {
    engine_->remove_sequence(seq);
}

std::vector<int32_t> Session::sequences() const {
    return engine_->sequence_ids();
}

int64_t Session::n_past(int32_t seq) const {
    return engine_->n_past(seq);
}

void Session::reset(int32_t seq) {
    engine_->reset(seq);
}

void Session::truncate(int32_t seq, int64_t n_keep) {
    engine_->truncate(n_keep, seq);
}

StepReadEstimate Session::predict_step_reads(int32_t seq, const std::vector<token_t>& tokens) const {
    return engine_->predict_step_reads(seq, tokens);
}

std::vector<token_t> Session::draft_mtp(int32_t seq, token_t next, int n, std::vector<float>* logits) {
    return engine_->draft_mtp(seq, next, n, logits);
}

std::vector<std::vector<float>> Session::decode_batch(const std::vector<SequenceTokens>& entries) {
    return engine_->decode_batch(entries);
}

void Session::cancel_sequence(int32_t seq) noexcept {
    engine_->cancel_sequence(seq);
}

const ActivationDump& Session::dump() const {
    return engine_->dump();
}

void Session::set_route_trace(const std::vector<int32_t>& experts, int64_t n_tokens, int64_t n_layers,
                              int64_t top_k) {
    RouteTrace trace;
    if (!experts.empty()) {
        trace.n_tokens = n_tokens;
        trace.n_layers = n_layers;
        trace.k = top_k;
        trace.experts = experts;
    }
    engine_->set_route_trace(std::move(trace));
}

std::vector<std::vector<int32_t>> Session::last_routing() const {
    std::vector<std::vector<int32_t>> out;
    for (const Routing& r : engine_->routing()) out.push_back(r.ids);
    return out;
}

std::vector<TimelineEvent> Session::timeline_events() const {
    return engine_->timeline().events();
}

void Session::clear_timeline() {
    engine_->timeline().clear();
}

std::optional<AutoRamBudget> Session::auto_ram_budget() const {
    return engine_->auto_ram_budget();
}

ExpertCacheStats Session::expert_stats() const {
    return engine_->expert_stats();
}

void Session::reset_stats() {
    engine_->reset_stats();
}

void Session::set_predictor(std::shared_ptr<Predictor> predictor) {
    engine_->set_predictor(std::move(predictor));
}

std::vector<std::string> Session::predictor_errors() const {
    return engine_->predictor_errors();
}

std::string Session::metadata_string(const std::string& key) const {
    const GgufValue* v = engine_->model().file->find(key);
    if (!v) return "";
    switch (v->type) {
        case GgufValueType::STRING:
            return v->str;
        case GgufValueType::ARRAY:
            return "[" + std::to_string(v->array_size()) + " items]";
        case GgufValueType::FLOAT32:
        case GgufValueType::FLOAT64:
            return std::to_string(v->f);
        case GgufValueType::BOOL:
            return v->i ? "true" : "false";
        default:
            return std::to_string(v->i);
    }
}

}  // namespace sharpi
