#include "backend/op_trace.h"

#include "backend/recording_backend.h"
#include "cpu/cpu_backend.h"
#include "model/forward.h"
#include "model/model.h"
#include "model/recurrent_state.h"
#include "moe/expert_source.h"
#include "moe/moe_ffn.h"
#include "sharpi/errors.h"

namespace sharpi {

std::vector<OpCall> record_forward_ops(const std::string& path, const std::vector<token_t>& tokens,
                                       bool exact) {
    if (tokens.empty()) throw InvalidArgument("[backend] record_forward_ops needs at least one token");
    std::unique_ptr<Model> model = load_model(path);
    const HParams& h = model->hp;
    for (token_t t : tokens) {
        if (t < 0 || t >= h.n_vocab)
            throw InvalidArgument("[backend] token " + std::to_string(t) + " is out of the vocabulary");
    }
    const int64_t n = static_cast<int64_t>(tokens.size());
    const GgmlType type_k = kv_type_for("", exact), type_v = kv_type_for("", exact);
    const KvLayout shape = kv_layout(h, type_k, type_v);
    KvCache kv(h.n_layer, n + 1, shape.width, shape.head_dim, shape.type_k, shape.type_v, shape.with_v);
    RecurrentState recurrent(h);
    ResidentExperts experts(model->experts);
    ThreadPool pool(1);
    Scratch scratch;
    CpuBackend cpu(pool, scratch);
    RecordingBackend recorder(cpu);

    std::vector<float> residual(static_cast<size_t>(n * h.n_embd));
    std::vector<float> logits(static_cast<size_t>(h.n_vocab));
    int64_t pos = 0;
    for (const int64_t batch : {n, int64_t{1}}) {
        MoeFfn moe(experts, h.n_layer);
        Forward f(*model, kv, recorder, moe, nullptr);
        f.set_exact(exact);
        f.set_pos0(pos);
        f.set_recurrent_state(&recurrent);
        Act x{residual.data(), batch, h.n_embd};
        recorder.reset_activations();
        f.embed(tokens.data(), x);
        for (int il = 0; il < h.n_layer; ++il) {
            recorder.reset_activations();
            Act out = model->spec->build_layer(f, x, il);
            recorder.copy(out, x);
        }
        recorder.reset_activations();
        f.output_head(x, batch - 1, logits.data());
        pos += batch;
    }
    return recorder.calls();
}

}  // namespace sharpi
