// The predictors that need only the model (prev_token, next_gate, pregate) and the factory.
#include "predict/predictor.h"

#include <algorithm>
#include <numeric>

#include "cpu/ops/rms_norm.h"
#include "cpu/ops/router.h"
#include "cpu/quant/kernels.h"
#include "sharpi/errors.h"

namespace sharpi {

void append_topk_hints(const float* scores, int64_t n_expert, int64_t k, int target_layer,
                       std::vector<PrefetchHint>& hints) {
    k = std::min(k, n_expert);
    // Small arrays (n_expert <= a few hundred): a partial sort of indices is cheap enough.
    int32_t order[1024];
    std::vector<int32_t> heap_order;
    int32_t* idx = order;
    if (n_expert > 1024) {
        heap_order.resize(static_cast<size_t>(n_expert));
        idx = heap_order.data();
    }
    std::iota(idx, idx + n_expert, 0);
    std::partial_sort(idx, idx + k, idx + n_expert, [&](int32_t a, int32_t b) {
        return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
    });
    for (int64_t j = 0; j < k; ++j) hints.push_back(PrefetchHint{target_layer, idx[j], scores[idx[j]]});
}

void add_table_rows(const float* table, const int32_t* ids, int64_t n_ids, int64_t n_expert, float* out) {
    for (int64_t j = 0; j < n_ids; ++j) {
        const int32_t i = ids[j];
        if (i < 0 || i >= n_expert) continue;
        const float* row = table + static_cast<int64_t>(i) * n_expert;
        for (int64_t e = 0; e < n_expert; ++e) out[e] += row[e];
    }
}

void gate_logits(const Model& model, int layer, bool pregate, const float* hidden, float* normed,
                 float* logits) {
    const LayerWeights& src = model.layers[static_cast<size_t>(layer)];
    const WeightView& w = pregate ? src.ffn_pregate_inp : src.ffn_gate_inp;
    const int64_t n_embd = model.hp.n_embd;
    cpu::rms_norm(hidden, n_embd, normed, n_embd, 1, n_embd, src.ffn_norm.data(), model.hp.rms_eps);
    const cpu::DotRowFn dot = cpu::row_kernels(w.type).dot_row;
    // The router's bias (gpt-oss) belongs to the router, not to a pre-gate.
    const float* bias = !pregate && !src.ffn_gate_inp_b.empty() ? src.ffn_gate_inp_b.data() : nullptr;
    for (int64_t e = 0; e < model.hp.n_expert; ++e) {
        logits[e] = dot(w.data + e * w.row_bytes, normed, n_embd);
        if (bias) logits[e] += bias[e];
    }
}

void ScoringPredictor::observe(const PredictorInput& in, std::vector<PrefetchHint>& hints) {
    for (int d = 1; d <= in.lookahead; ++d) {
        if (in.layer + d >= in.n_layer || !predicts(in, d)) continue;
        scores(in, d, buf_.data());
        append_topk_hints(buf_.data(), n_expert_, in.hints_per_layer > 0 ? in.hints_per_layer : top_k_,
                          in.layer + d, hints);
    }
}

namespace {

// Hints for layers layer+1 .. layer+lookahead: another token's selections there ([n_layer *
// top_k], -1 unknown), best rank first.
void append_selection_hints(const PredictorInput& in, const int32_t* selections,
                            std::vector<PrefetchHint>& hints) {
    for (int d = 1; d <= in.lookahead && in.layer + d < in.n_layer; ++d) {
        const int32_t* row = selections + static_cast<int64_t>(in.layer + d) * in.top_k;
        for (int j = 0; j < in.top_k; ++j) {
            if (row[j] >= 0)
                hints.push_back(PrefetchHint{in.layer + d, row[j], static_cast<float>(in.top_k - j)});
        }
    }
}

// Layer t's experts of the previous token. Training-free, and the baseline the other predictors
// are compared against.
class PrevTokenPredictor final : public Predictor {
  public:
    const char* name() const override { return "prev_token"; }
    void observe(const PredictorInput& in, std::vector<PrefetchHint>& hints) override {
        append_selection_hints(in, in.prev, hints);
    }
};

// Layer t's experts of this token's latest earlier occurrence (PredictorInput::echo), nothing for a
// token never seen. Training-free; a prompt-lookup draft's rows are spans the sequence already
// decoded, so their echo is the very routing they were copied from.
class EchoPredictor final : public Predictor {
  public:
    const char* name() const override { return "echo"; }
    void observe(const PredictorInput& in, std::vector<PrefetchHint>& hints) override {
        if (in.echo) append_selection_hints(in, in.echo, hints);
    }
};

// scores = router · rms_norm(hidden, norm) (+ the router's bias, gpt-oss): a router applied to this
// layer's residual, normalised with the norm weights that router is trained behind. next_gate uses
// layer t's own router and ffn_norm (FATE / PreScope style); pregate uses the model's pre-gate of
// layer L behind layer L's ffn_norm (Pre-gated MoE). Where the router does not rank experts by
// its logits (sigmoid gating with DeepSeek-V3's selection bias, group-limited top-k), the scores
// are the ones the router ranks by (cpu::selection_scores: experts of groups it cannot choose at
// -inf), so the predicted set is the set the target layer's own routing rule would pick.
class RouterPredictor final : public ScoringPredictor {
  public:
    RouterPredictor(const Model& model, bool pregate)
        : ScoringPredictor(model.hp.n_expert, model.hp.n_expert_used),
          model_(model),
          pregate_(pregate),
          normed_(static_cast<size_t>(model.hp.n_embd)),
          logits_(static_cast<size_t>(model.hp.n_expert)) {
        const RouterParams& r = model.hp.router;
        ranks_by_selection_ = r.gating == Gating::sigmoid || (r.n_group > 1 && r.n_group_used < r.n_group);
        for (const LayerWeights& layer : model.layers) ranks_by_selection_ |= !layer.exp_probs_b.empty();
    }
    const char* name() const override { return pregate_ ? "pregate" : "next_gate"; }
    bool predicts(const PredictorInput& in, int d) const override {
        return pregate_
                   ? d == 1 && model_.layers[static_cast<size_t>(in.layer)].ffn_pregate_inp.data != nullptr
                   : model_.layers[static_cast<size_t>(in.layer + d)].ffn_gate_inp.data != nullptr;
    }
    void scores(const PredictorInput& in, int d, float* out) override {
        float* logits = ranks_by_selection_ ? logits_.data() : out;
        gate_logits(model_, pregate_ ? in.layer : in.layer + d, pregate_, in.hidden, normed_.data(), logits);
        if (!ranks_by_selection_) return;
        RouterParams params = model_.hp.router;
        const LayerWeights& target = model_.layers[static_cast<size_t>(in.layer + d)];
        params.selection_bias = target.exp_probs_b.empty() ? nullptr : target.exp_probs_b.data();
        cpu::selection_scores(logits, n_expert_, params, nullptr, out, groups_);
    }

  private:
    const Model& model_;
    bool pregate_;
    bool ranks_by_selection_ = false;  // softmax without selection bias or groups ranks by the logits
    std::vector<float> normed_, logits_;
    cpu::GroupScratch groups_;  // reused by every call: the per-token path allocates nothing
};

// Sidecar predictors are trained on routing traces, which record the MoE layers only; on a model
// whose first `first` layers are dense (deepseek2) their layer L is the model's layer L + first.
// Gate events come from MoE layers only, so in.layer >= first here.
class MoeLayerOffset final : public Predictor {
  public:
    MoeLayerOffset(std::unique_ptr<Predictor> inner, int first) : inner_(std::move(inner)), first_(first) {}
    const char* name() const override { return inner_->name(); }
    void observe(const PredictorInput& in, std::vector<PrefetchHint>& hints) override {
        PredictorInput moe = in;
        moe.layer -= first_;
        moe.n_layer -= first_;
        moe.history += static_cast<int64_t>(first_) * in.top_k;
        moe.prev += static_cast<int64_t>(first_) * in.top_k;
        const size_t begin = hints.size();
        inner_->observe(moe, hints);
        for (size_t i = begin; i < hints.size(); ++i) hints[i].target_layer += first_;
    }

  private:
    std::unique_ptr<Predictor> inner_;
    int first_;
};

std::unique_ptr<Predictor> on_moe_layers(std::unique_ptr<Predictor> p, const HParams& h) {
    if (h.n_layer_dense_lead == 0) return p;
    return std::make_unique<MoeLayerOffset>(std::move(p), static_cast<int>(h.n_layer_dense_lead));
}

}  // namespace

void check_lookahead(int lookahead) {
    if (lookahead < 1 || lookahead > 3) {
        throw InvalidArgument("lookahead must be 1, 2 or 3, got " + std::to_string(lookahead));
    }
}

std::unique_ptr<Predictor> make_predictor(const std::string& name, const std::string& file,
                                          const Model& model, int lookahead) {
    const HParams& h = model.hp;
    check_lookahead(lookahead);
    const bool sidecar = name == "cooc" || name == "depthtime" || name == "learned" || name == "trajectory";
    if (!sidecar && name != "none" && name != "prev_token" && name != "echo" && name != "next_gate" &&
        name != "pregate") {
        throw InvalidArgument(
            "unknown predictor '" + name +
            "' (none, prev_token, echo, next_gate, pregate, cooc, depthtime, learned, trajectory)");
    }
    if (sidecar && file.empty()) {
        throw InvalidArgument("predictor '" + name + "' needs a predictor file (--predictor " + name +
                              ":FILE, trained with `sharpi predictor train --kind " + name + "`)");
    }
    if (!sidecar && !file.empty()) {
        throw InvalidArgument("predictor '" + name + "' takes no predictor file (got " + file + ")");
    }
    if (name == "none") return nullptr;
    if (!h.is_moe())
        throw InvalidArgument("predictor '" + name + "': " + model.file->path() + " has no routed experts");
    if (name == "prev_token") return std::make_unique<PrevTokenPredictor>();
    if (name == "echo") return std::make_unique<EchoPredictor>();
    if (name == "next_gate") return std::make_unique<RouterPredictor>(model, false);
    if (name == "pregate") {
        int n_present = 0;
        for (int il = 0; il + 1 < h.n_layer; ++il)
            n_present += model.layers[static_cast<size_t>(il)].ffn_pregate_inp.data != nullptr;
        if (n_present == 0) {
            throw InvalidArgument(
                "predictor 'pregate': " + model.file->path() +
                " has no pre-gate tensors (blk.N.ffn_pregate_inp.weight; see docs/predictors.md)");
        }
        return std::make_unique<RouterPredictor>(model, true);
    }
    // Sidecars are trained on traces of consecutive MoE layers (after deepseek2's dense lead);
    // interleaved dense layers (llama4 Maverick) would need a layer map they do not carry yet.
    for (int il = static_cast<int>(h.n_layer_dense_lead); il < h.n_layer; ++il) {
        if (!model.experts.layers[static_cast<size_t>(il)].present()) {
            throw UnsupportedError("predictor '" + name + "': " + model.file->path() +
                                   " interleaves dense layer " + std::to_string(il) +
                                   " between MoE layers; trained predictors take consecutive MoE layers only "
                                   "(use prev_token or next_gate)");
        }
    }
    if (name == "cooc") return on_moe_layers(load_cooc_predictor(file, model, lookahead), h);
    if (name == "depthtime") return on_moe_layers(load_depthtime_predictor(file, model, lookahead), h);
    if (name == "learned") return on_moe_layers(load_learned_predictor(file, model, lookahead), h);
    return on_moe_layers(load_trajectory_predictor(file, model, lookahead), h);  // name == "trajectory"
}

}  // namespace sharpi
