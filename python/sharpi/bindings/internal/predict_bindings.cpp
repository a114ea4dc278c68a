// sharpi._internal.load_predictor / PredictorHandle: the sidecar predictors (cpp/src/predict/) seen from
// Python, for tests and benchmarks only; the engine builds its predictor with make_predictor.
//
// A PredictorHandle owns the Model it was validated against (loaded streaming: dense tensors only)
// and the predictor, so the model outlives it. Arrays are checked here (dtype, shape, expert ids in
// [-1, n_expert)) and raise InvalidArgument naming the argument; the predictor code itself trusts
// the engine's inputs. time_observe() loops in C++ for the micro-benchmark, so the numbers carry no
// Python call overhead.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "internal.h"
#include "model/model.h"
#include "moe/prefetch_sizing.h"
#include "predict/echo_guess.h"
#include "predict/predictor.h"
#include "sharpi/errors.h"

namespace py = pybind11;

namespace sharpi::py_bindings {

namespace {

using F32Array = py::array_t<float, py::array::c_style | py::array::forcecast>;
using I32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

std::string shape_of(const py::array& a) {
    std::string s = "(";
    for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
    return s + (a.ndim() == 1 ? ",)" : ")");
}

class PredictorHandle {
  public:
    PredictorHandle(const std::string& kind, const std::string& file, const std::string& model_path,
                    int lookahead)
        : model_(load_model(model_path, /*streaming=*/true)), lookahead_(lookahead) {
        if (kind == "cooc") {
            predictor_ = load_cooc_predictor(file, *model_, lookahead);
        } else if (kind == "depthtime") {
            predictor_ = load_depthtime_predictor(file, *model_, lookahead);
        } else if (kind == "learned") {
            predictor_ = load_learned_predictor(file, *model_, lookahead);
        } else if (kind == "trajectory") {
            predictor_ = load_trajectory_predictor(file, *model_, lookahead);
        } else if (kind == "next_gate" || kind == "pregate") {
            predictor_ = make_predictor(kind, file, *model_, lookahead);  // the model's routers: no file
        } else {
            throw InvalidArgument(
                "load_predictor: kind must be 'cooc', 'depthtime', 'learned', 'trajectory', "
                "'next_gate' or 'pregate', not '" +
                kind + "'");
        }
        scoring_ = dynamic_cast<ScoringPredictor*>(predictor_.get());
        if (!scoring_) throw InvalidArgument("load_predictor: '" + kind + "' is not a scoring predictor");
    }

    std::string name() const { return predictor_->name(); }
    int lookahead() const { return lookahead_; }

    py::object scores(int layer, int d, const F32Array& hidden, const F32Array& router_logits,
                      const I32Array& history, const I32Array& prev) {
        const PredictorInput in = input(layer, hidden, router_logits, history, prev);
        if (!scoring_->predicts(in, d)) return py::none();
        py::array_t<float> out(static_cast<py::ssize_t>(model_->hp.n_expert));
        scoring_->scores(in, d, out.mutable_data());
        return std::move(out);
    }

    std::vector<std::tuple<int, int, float>> observe(int layer, const F32Array& hidden,
                                                     const F32Array& router_logits, const I32Array& history,
                                                     const I32Array& prev) {
        const PredictorInput in = input(layer, hidden, router_logits, history, prev);
        hints_.clear();
        predictor_->observe(in, hints_);
        std::vector<std::tuple<int, int, float>> out;
        out.reserve(hints_.size());
        for (const PrefetchHint& h : hints_) out.emplace_back(h.target_layer, h.expert, h.score);
        return out;
    }

    // selections int32 [n_tokens, n_layer, top_k]: Predictor::observe_context.
    void observe_context(const I32Array& selections, bool new_sequence) {
        const HParams& hp = model_->hp;
        const int64_t n_tokens = selections.ndim() == 3 ? selections.shape(0) : -1;
        check_shape("selections", selections, {n_tokens, hp.n_layer, hp.n_expert_used});
        predictor_->observe_context(selections.data(), n_tokens, new_sequence);
    }

    // Mean seconds per observe() over `n_tokens` simulated tokens: layers 0..n_layer-1 in order,
    // each token's hidden states taken from hidden[n_layer, n_embd] and routing from history (the
    // whole token's rows; the predictor only reads rows <= layer, as in the engine), so consecutive
    // calls differ in layer exactly as in decoding and no call is served by a cache meant for
    // the d-loop of one observe().
    double time_observe(const F32Array& hidden, const F32Array& router_logits, const I32Array& history,
                        const I32Array& prev, int n_tokens) {
        const HParams& hp = model_->hp;
        check_shape("hidden", hidden, {hp.n_layer, hp.n_embd});
        check_shape("router_logits", router_logits, {hp.n_layer, hp.n_expert});
        check_ids("history", history);
        check_ids("prev", prev);
        if (n_tokens < 1) throw InvalidArgument("time_observe: n_tokens must be >= 1");
        py::gil_scoped_release release;
        const auto t0 = std::chrono::steady_clock::now();
        for (int token = 0; token < n_tokens; ++token) {
            for (int il = 0; il < hp.n_layer; ++il) {
                PredictorInput in = base_input(il, history, prev);
                in.hidden = hidden.data() + il * hp.n_embd;
                in.router_logits = router_logits.data() + il * hp.n_expert;
                hints_.clear();
                predictor_->observe(in, hints_);
            }
        }
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        return seconds / (static_cast<double>(n_tokens) * static_cast<double>(hp.n_layer));
    }

  private:
    void check_shape(const char* what, const py::array& a, const std::vector<int64_t>& shape) const {
        bool ok = a.ndim() == static_cast<py::ssize_t>(shape.size());
        for (size_t i = 0; ok && i < shape.size(); ++i) ok = a.shape(static_cast<py::ssize_t>(i)) == shape[i];
        if (!ok) {
            std::string want = "(";
            for (size_t i = 0; i < shape.size(); ++i) want += (i ? ", " : "") + std::to_string(shape[i]);
            want += shape.size() == 1 ? ",)" : ")";
            throw InvalidArgument(std::string("predictor: ") + what + " has shape " + shape_of(a) +
                                  ", expected " + want);
        }
    }

    void check_ids(const char* what, const I32Array& ids) const {
        const HParams& hp = model_->hp;
        check_shape(what, ids, {hp.n_layer, hp.n_expert_used});
        const int32_t* p = ids.data();
        for (py::ssize_t i = 0; i < ids.size(); ++i) {
            if (p[i] < -1 || p[i] >= hp.n_expert) {
                throw InvalidArgument(std::string("predictor: ") + what + " holds expert id " +
                                      std::to_string(p[i]) + ", expected -1 or 0.." +
                                      std::to_string(hp.n_expert - 1));
            }
        }
    }

    PredictorInput input(int layer, const F32Array& hidden, const F32Array& router_logits,
                         const I32Array& history, const I32Array& prev) const {
        const HParams& hp = model_->hp;
        if (layer < 0 || layer >= hp.n_layer) {
            throw InvalidArgument("predictor: layer " + std::to_string(layer) + " outside 0.." +
                                  std::to_string(hp.n_layer - 1));
        }
        check_shape("hidden", hidden, {hp.n_embd});
        check_shape("router_logits", router_logits, {hp.n_expert});
        check_ids("history", history);
        check_ids("prev", prev);
        PredictorInput in = base_input(layer, history, prev);
        in.hidden = hidden.data();
        in.router_logits = router_logits.data();
        return in;
    }

    // Everything but hidden and router_logits, as the engine's prefetcher fills it.
    PredictorInput base_input(int layer, const I32Array& history, const I32Array& prev) const {
        const HParams& hp = model_->hp;
        PredictorInput in;
        in.layer = layer;
        in.n_layer = static_cast<int>(hp.n_layer);
        in.n_expert = static_cast<int>(hp.n_expert);
        in.top_k = static_cast<int>(hp.n_expert_used);
        in.n_embd = static_cast<int>(hp.n_embd);
        in.history = history.data();
        in.prev = prev.data();
        in.lookahead = lookahead_;
        return in;
    }

    // Member order: the predictor is destroyed before the model it was validated against.
    std::unique_ptr<Model> model_;
    std::unique_ptr<Predictor> predictor_;
    ScoringPredictor* scoring_ = nullptr;
    int lookahead_;
    std::vector<PrefetchHint> hints_;
};

// The prefetcher's "bytes" rule on explicit inputs (tests): hints [(target, expert, score)] of one
// call at source_layer, present: bool [n_layer, n_expert] (cached or loading), expert_bytes
// [n_layer]. Hints are ordered as the prefetcher orders them; invalid ones are an InvalidArgument
// here (the prefetcher drops them before the rule sees them).
py::dict byte_sized_prefetch(int source_layer, int top_k,
                             const std::vector<std::tuple<int, int32_t, float>>& hints,
                             const py::array_t<bool, py::array::c_style | py::array::forcecast>& present,
                             const std::vector<double>& expert_bytes, double bytes_per_ms,
                             double queued_bytes, double layer_ms, bool timeliness, uint64_t free_slots) {
    if (present.ndim() != 2 || static_cast<size_t>(present.shape(0)) != expert_bytes.size())
        throw InvalidArgument(
            "byte_sized_prefetch: present must be [n_layer, n_expert] with n_layer = "
            "len(expert_bytes), got " +
            shape_of(present));
    const int n_layer = static_cast<int>(present.shape(0)), n_expert = static_cast<int>(present.shape(1));
    std::vector<PrefetchHint> ordered;
    for (const auto& [t, e, score] : hints) {
        if (t <= source_layer || t >= n_layer || e < 0 || e >= n_expert || std::isnan(score))
            throw InvalidArgument("byte_sized_prefetch: invalid hint (" + std::to_string(t) + ", " +
                                  std::to_string(e) + ")");
        ordered.push_back(PrefetchHint{t, e, score});
    }
    order_hints(ordered);
    const bool* mask = present.data();
    ReaderLoad load;
    load.bytes_per_ms = bytes_per_ms;
    load.queued_bytes = queued_bytes;
    load.layer_ms = layer_ms;
    load.timeliness = timeliness;
    load.free_slots = free_slots;
    ByteSizedPrefetch plan;
    plan_byte_sized_prefetch(
        source_layer, top_k, ordered, [&](int t, int32_t e) { return mask[t * n_expert + e]; },
        [&](int t) { return expert_bytes[static_cast<size_t>(t)]; }, load, plan);
    py::dict out;
    out["sets"] = plan.sets;
    out["reads"] = plan.reads;
    out["skipped"] = plan.skipped;
    return out;
}

}  // namespace

void bind_predict(py::module_& m) {
    py::class_<PredictorHandle>(m, "PredictorHandle",
                                "A scoring predictor (cooc / depthtime / learned / trajectory from a "
                                "sidecar; next_gate / pregate) checked against a model")
        .def_property_readonly("name", &PredictorHandle::name)
        .def_property_readonly("lookahead", &PredictorHandle::lookahead)
        .def("scores", &PredictorHandle::scores, py::arg("layer"), py::arg("d"), py::arg("hidden"),
             py::arg("router_logits"), py::arg("history"), py::arg("prev"),
             "float32 [n_expert] scores of layer layer+d, or None when the predictor does not predict it")
        .def("observe", &PredictorHandle::observe, py::arg("layer"), py::arg("hidden"),
             py::arg("router_logits"), py::arg("history"), py::arg("prev"),
             "Hints [(target_layer, expert, score)] for layers layer+1 .. layer+lookahead")
        .def("observe_context", &PredictorHandle::observe_context, py::arg("selections"),
             py::arg("new_sequence"),
             "Predictor::observe_context: the tokens of a batched prompt, int32 [n_tokens, n_layer, top_k]")
        .def("time_observe", &PredictorHandle::time_observe, py::arg("hidden"), py::arg("router_logits"),
             py::arg("history"), py::arg("prev"), py::arg("n_tokens"),
             "Benchmark helper: mean seconds per observe() call over n_tokens x n_layer calls "
             "(hidden [n_layer, n_embd], router_logits [n_layer, n_expert])");
    m.def(
        "load_predictor",
        [](const std::string& kind, const std::string& file, const std::string& model_path, int lookahead) {
            return std::make_unique<PredictorHandle>(kind, file, model_path, lookahead);
        },
        py::arg("kind"), py::arg("file"), py::arg("model_path"), py::arg("lookahead"),
        "Loads predictor `kind` (sidecar `file` for the trained kinds, empty for next_gate / pregate) and "
        "validates it against the model at model_path");
    m.def(
        "byte_sized_prefetch", &byte_sized_prefetch, py::arg("source_layer"), py::arg("top_k"),
        py::arg("hints"), py::arg("present"), py::arg("expert_bytes"), py::arg("bytes_per_ms"),
        py::arg("queued_bytes"), py::arg("layer_ms"), py::arg("timeliness"), py::arg("free_slots"),
        "The prefetcher's byte-sized plan for one call's hints: {sets: [(t, [experts])], reads: [(t, e)] in "
        "issue order, skipped: [(t, e)]} (docs/predictors.md)");
    m.def(
        "echo_guess",
        [](const std::vector<token_t>& history,
           const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& selections,
           const std::vector<token_t>& step) {
            if (selections.ndim() != 2 || static_cast<size_t>(selections.shape(0)) != history.size())
                throw InvalidArgument("echo_guess: selections must be [len(history), row], got " +
                                      shape_of(selections));
            const int64_t row = selections.shape(1);
            std::vector<int32_t> out =
                echo_guess(history.data(), selections.data(), static_cast<int64_t>(history.size()), row,
                           step.data(), static_cast<int64_t>(step.size()));
            py::array_t<int32_t> a({static_cast<py::ssize_t>(step.size()), static_cast<py::ssize_t>(row)});
            std::copy(out.begin(), out.end(), a.mutable_data());
            return a;
        },
        py::arg("history"), py::arg("selections"), py::arg("step"),
        "predict/echo_guess.h on explicit inputs: int32 [len(step), row] guesses (-1: none) from the "
        "history's tokens and their selections [len(history), row]");
}

}  // namespace sharpi::py_bindings
