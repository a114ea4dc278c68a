#include "backend/op_trace.h"

#include <algorithm>
#include <memory>

#include "backend/cuda_interface.h"
#include "backend/recording_backend.h"
#include "cpu/cpu_backend.h"
#include "model/forward.h"
#include "model/model.h"
#include "model/recurrent_state.h"
#include "moe/expert_source.h"
#include "moe/moe_ffn.h"
#include "sharpi/errors.h"

namespace sharpi {

namespace {

void check_tokens(const Model& model, const std::vector<token_t>& tokens, const char* who) {
    if (tokens.empty()) throw InvalidArgument(std::string("[backend] ") + who + " needs at least one token");
    for (token_t t : tokens) {
        if (t < 0 || t >= model.hp.n_vocab)
            throw InvalidArgument("[backend] token " + std::to_string(t) + " is out of the vocabulary");
    }
}

std::unique_ptr<Model> load_checked(const std::string& path, const std::vector<token_t>& tokens,
                                    const char* who) {
    if (tokens.empty()) throw InvalidArgument(std::string("[backend] ") + who + " needs at least one token");
    std::unique_ptr<Model> model = load_model(path);
    check_tokens(*model, tokens, who);
    return model;
}

}  // namespace

std::vector<float> run_forward(const Model& model, Backend& backend, const std::vector<token_t>& tokens,
                               const std::vector<int64_t>& batches, bool exact,
                               const std::string& cache_type) {
    const HParams& h = model.hp;
    const int64_t n = static_cast<int64_t>(tokens.size());
    int64_t total = 0;
    for (const int64_t b : batches) {
        if (b < 1)
            throw InvalidArgument("[backend] run_forward: a batch of " + std::to_string(b) + " tokens");
        total += b;
    }
    if (total != n) {
        throw InvalidArgument("[backend] run_forward: batches of " + std::to_string(total) + " tokens for " +
                              std::to_string(n) + " tokens");
    }
    // deepseek4's state rows are f32 whatever the mode (placement.cpp does the same).
    const bool f32_state = !h.compress_ratios.empty();
    const GgmlType type_k = kv_type_for(cache_type, exact || f32_state),
                   type_v = kv_type_for(cache_type, exact || f32_state);
    const KvLayout shape = kv_layout(h, type_k, type_v);
    KvCache kv(h.n_layer, n, shape.width, shape.head_dim, shape.type_k, shape.type_v, shape.with_v);
    RecurrentState recurrent(h);
    ResidentExperts experts(model.experts);

    std::vector<float> logits(static_cast<size_t>(n * h.n_vocab));
    int64_t pos = 0;
    for (const int64_t batch : batches) {
        MoeFfn moe(experts, h.n_layer);
        Forward f(model, backend, moe, nullptr);
        f.set_exact(exact);
        f.set_spans({SeqSpan{&kv, &recurrent, pos, 0, batch}});
        f.set_tokens(tokens.data() + pos);  // deepseek4's hash layers route by token
        Act x = backend.residual(batch, h.n_embd_residual());
        backend.reset_activations();
        f.embed(tokens.data() + pos, x);
        for (int il = 0; il < h.n_layer; ++il) {
            backend.reset_activations();
            Act out = model.spec->build_layer(f, x, il);
            backend.copy(out, x);
        }
        backend.reset_activations();
        f.output_head(x, 0, logits.data() + pos * h.n_vocab);
        pos += batch;
    }
    return logits;
}

namespace {

// The CPU backend on one thread, recorded.
struct CpuRecorder {
    ThreadPool pool{1};
    Scratch scratch;
    CpuBackend cpu{pool, scratch};
    RecordingBackend recorder{cpu};

    // The pass record_forward_ops records: tokens as one prefill, then tokens[0] decoded.
    void run(const Model& model, const std::vector<token_t>& tokens, bool exact) {
        std::vector<token_t> run = tokens;
        run.push_back(tokens[0]);
        run_forward(model, recorder, run, {static_cast<int64_t>(tokens.size()), 1}, exact);
    }
};

}  // namespace

std::vector<OpCall> record_forward_ops(const std::string& path, const std::vector<token_t>& tokens,
                                       bool exact) {
    std::unique_ptr<Model> model = load_checked(path, tokens, "record_forward_ops");
    CpuRecorder r;
    r.run(*model, tokens, exact);
    return r.recorder.calls();
}

std::vector<WeightRead> record_weight_reads(const Model& model, const std::vector<token_t>& tokens,
                                            bool exact) {
    check_tokens(model, tokens, "record_weight_reads");
    CpuRecorder r;
    r.run(model, tokens, exact);
    return r.recorder.weight_reads();
}

std::vector<float> forward_logits(const std::string& path, const std::vector<token_t>& tokens,
                                  const std::string& backend, bool exact, int64_t batch,
                                  const std::string& cache_type) {
    std::unique_ptr<Model> model = load_checked(path, tokens, "forward_logits");
    if (batch < 0) throw InvalidArgument("[backend] forward_logits: batch must be at least 0");
    const int64_t n = static_cast<int64_t>(tokens.size());
    if (batch == 0) batch = n;
    std::vector<int64_t> batches;
    for (int64_t at = 0; at < n; at += batch) batches.push_back(std::min(batch, n - at));
    if (backend == "cpu") {
        ThreadPool pool(1);
        Scratch scratch;
        CpuBackend cpu(pool, scratch);
        return run_forward(*model, cpu, tokens, batches, exact, cache_type);
    }
    if (backend == "cuda") {
        const std::unique_ptr<Backend> cuda_backend = cuda::make_cuda_backend(*model);
        return run_forward(*model, *cuda_backend, tokens, batches, exact, cache_type);
    }
    throw InvalidArgument("[backend] forward_logits: unknown backend '" + backend + "' (cpu, cuda)");
}

}  // namespace sharpi
