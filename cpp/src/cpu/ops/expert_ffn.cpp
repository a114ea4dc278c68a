// Fused expert FFN of one token (see expert_ffn.h).
#include "cpu/ops/expert_ffn.h"

#include <string>
#include <vector>

#include "cpu/ops/activation.h"
#include "sharpi/errors.h"

namespace sharpi::cpu {

void expert_ffn_one_token(ThreadPool& pool, const ExpertFfnWeights* experts, const float* weights, int k,
                          const float* x, float* out, bool exact) {
    if (k < 1) throw InvalidArgument("[expert_ffn] k must be >= 1, got " + std::to_string(k));
    const int64_t n_ff = experts[0].gate.n_rows, n_embd = experts[0].gate.n_cols;
    for (int j = 0; j < k; ++j) {
        const ExpertFfnWeights& e = experts[j];
        if (e.gate.n_rows != n_ff || e.up.n_rows != n_ff || e.gate.n_cols != n_embd ||
            e.up.n_cols != n_embd || e.down.n_rows != n_embd || e.down.n_cols != n_ff) {
            throw InvalidArgument("[expert_ffn] expert slot " + std::to_string(j) + ": gate/up must be [" +
                                  std::to_string(n_ff) + ", " + std::to_string(n_embd) + "] and down [" +
                                  std::to_string(n_embd) + ", " + std::to_string(n_ff) + "]");
        }
    }

    // Pass 1: gate and up rows of every slot; row r of slot j writes act[j][r].
    PreparedRow x_in(x, n_embd, exact);
    std::vector<RowDot> gate_dot(static_cast<size_t>(k)), up_dot(static_cast<size_t>(k));
    for (int j = 0; j < k; ++j) {
        gate_dot[j] = x_in.bind(experts[j].gate.type);
        up_dot[j] = x_in.bind(experts[j].up.type);
    }
    std::vector<float> act(static_cast<size_t>(k * n_ff));
    pool.parallel_for(k * n_ff, [&](int64_t begin, int64_t end, int) {
        for (int64_t item = begin; item < end; ++item) {
            const int64_t j = item / n_ff, r = item % n_ff;
            const ExpertFfnWeights& e = experts[j];
            const float g = gate_dot[j](e.gate.data + r * e.gate.row_bytes);
            const float u = up_dot[j](e.up.data + r * e.up.row_bytes);
            swiglu(&g, &u, &act[static_cast<size_t>(item)], 1);
        }
    });

    // Pass 2: each output row sums its k down dots in slot order.
    std::vector<PreparedRow> act_in(static_cast<size_t>(k));
    std::vector<RowDot> down_dot(static_cast<size_t>(k));
    for (int j = 0; j < k; ++j) {
        act_in[j].reset(act.data() + j * n_ff, n_ff, exact);
        down_dot[j] = act_in[j].bind(experts[j].down.type);
    }
    pool.parallel_for(n_embd, [&](int64_t begin, int64_t end, int) {
        for (int64_t i = begin; i < end; ++i) {
            float sum = weights[0] * down_dot[0](experts[0].down.data + i * experts[0].down.row_bytes);
            for (int j = 1; j < k; ++j)
                sum += weights[j] * down_dot[j](experts[j].down.data + i * experts[j].down.row_bytes);
            out[i] = sum;
        }
    });
}

}  // namespace sharpi::cpu
