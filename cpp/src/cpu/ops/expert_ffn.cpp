// Fused expert FFNs: one token (decode) and grouped by expert (prefill); see expert_ffn.h.
#include "cpu/ops/expert_ffn.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/ops/activation.h"
#include "sharpi/errors.h"

namespace sharpi::cpu {

namespace {

// Checks that every expert has gate/up [n_ff, n_embd] and down [n_embd, n_ff], with expert 0's
// n_ff and n_embd; returns them.
void check_shapes(const ExpertFfnWeights* experts, int k, int64_t* n_ff_out, int64_t* n_embd_out) {
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
    *n_ff_out = n_ff;
    *n_embd_out = n_embd;
}

int64_t matrix_bytes(const WeightView& w) {
    return w.n_rows * static_cast<int64_t>(w.row_bytes);
}

}  // namespace

void expert_glu(const ExpertFfnWeights& e, int64_t r0, float* gate, float* up, float* act, int64_t n) {
    if (e.gate_b) {
        for (int64_t i = 0; i < n; ++i) gate[i] += e.gate_b[r0 + i];
    }
    if (e.up_b) {
        for (int64_t i = 0; i < n; ++i) up[i] += e.up_b[r0 + i];
    }
    if (e.relu_sqr) {
        relu_sqr(up, act, n);  // no gate: its dots (the up matrix's again) are discarded
    } else if (e.swiglu_clamp > 0.0f) {
        swiglu_clamped(gate, up, act, n, e.swiglu_clamp);
    } else if (e.swiglu_limit > 0.0f) {
        swiglu_oai(gate, up, act, n, kSwigluOaiAlpha, e.swiglu_limit);
    } else {
        swiglu(gate, up, act, n);
    }
}

void expert_down_bias(const ExpertFfnWeights& e, int64_t n_members, int64_t r0, int64_t r1, float* y,
                      int64_t ldy) {
    if (!e.down_b) return;
    for (int64_t m = 0; m < n_members; ++m) {
        for (int64_t i = r0; i < r1; ++i) y[m * ldy + i] += e.down_b[i];
    }
}

void expert_ffn_one_token(ThreadPool& pool, const ExpertFfnWeights* experts, const float* weights, int k,
                          const float* x, float* out, bool exact) {
    int64_t n_ff = 0, n_embd = 0;
    check_shapes(experts, k, &n_ff, &n_embd);

    // Pass 1: gate and up rows of every slot; row r of slot j writes act[j][r].
    PreparedRow x_in(x, n_embd, exact);
    std::vector<RowDot> gate_dot(static_cast<size_t>(k)), up_dot(static_cast<size_t>(k));
    for (int j = 0; j < k; ++j) {
        gate_dot[j] = x_in.bind(experts[j].gate.type);
        up_dot[j] = x_in.bind(experts[j].up.type);
    }
    int64_t gate_up_bytes = 0, down_bytes = 0;
    for (int j = 0; j < k; ++j) {
        gate_up_bytes +=
            (experts[j].relu_sqr ? 0 : matrix_bytes(experts[j].gate)) + matrix_bytes(experts[j].up);
        down_bytes += matrix_bytes(experts[j].down);
    }
    std::vector<float> act(static_cast<size_t>(k * n_ff));
    pool.parallel_for_bytes(k * n_ff, gate_up_bytes, [&](int64_t begin, int64_t end, int) {
        for (int64_t item = begin; item < end; ++item) {
            const int64_t j = item / n_ff, r = item % n_ff;
            const ExpertFfnWeights& e = experts[j];
            float g = e.relu_sqr ? 0.0f : gate_dot[j](e.gate.data + r * e.gate.row_bytes);
            float u = up_dot[j](e.up.data + r * e.up.row_bytes);
            expert_glu(e, r, &g, &u, &act[static_cast<size_t>(item)], 1);
        }
    });

    // Pass 2: each output row sums its k down dots in slot order.
    std::vector<PreparedRow> act_in(static_cast<size_t>(k));
    std::vector<RowDot> down_dot(static_cast<size_t>(k));
    for (int j = 0; j < k; ++j) {
        act_in[j].reset(act.data() + j * n_ff, n_ff, exact);
        down_dot[j] = act_in[j].bind(experts[j].down.type);
    }
    pool.parallel_for_bytes(n_embd, down_bytes, [&](int64_t begin, int64_t end, int) {
        // Expert j's output row i, its down bias added (as expert_down_bias does).
        auto y = [&](int j, int64_t i) {
            float v = down_dot[j](experts[j].down.data + i * experts[j].down.row_bytes);
            if (experts[j].down_b) v += experts[j].down_b[i];
            return v;
        };
        for (int64_t i = begin; i < end; ++i) {
            float sum = weights[0] * y(0, i);
            for (int j = 1; j < k; ++j) sum += weights[j] * y(j, i);
            out[i] = sum;
        }
    });
}

namespace {

// Per-call plan of the grouped prefill: one work item = one expert's rows [r0, r1) of a pass.
struct RowItem {
    int e;
    int64_t r0, r1;
};

// Items covering rows [0, n_rows) of every expert with members, each about `target` (rows x
// members) of work, at least kMinItemRows rows (a multiple of 16, so items split no SIMD chunk).
constexpr int64_t kMinItemRows = 16;
void plan_items(const int64_t* member_begin, const int64_t* member_end, int n_experts, int64_t n_rows,
                int64_t target, std::vector<RowItem>* items) {
    items->clear();
    for (int e = 0; e < n_experts; ++e) {
        const int64_t n = member_end[e] - member_begin[e];
        if (n <= 0) continue;
        int64_t rows = (target + n - 1) / n;
        rows = std::max<int64_t>(kMinItemRows, (rows + kMinItemRows - 1) / kMinItemRows * kMinItemRows);
        for (int64_t r0 = 0; r0 < n_rows; r0 += rows) items->push_back({e, r0, std::min(n_rows, r0 + rows)});
    }
}

// Quantizes rows src(m) (m in [0, n_rows)) into dst + m * row_bytes on the pool.
template <typename Src>
void quantize_rows(ThreadPool& pool, QuantizeActFn quantize, Src src, int64_t n_rows, int64_t n, uint8_t* dst,
                   size_t row_bytes) {
    pool.parallel_for_bytes(n_rows, n_rows * n * static_cast<int64_t>(sizeof(float)),
                            [&](int64_t begin, int64_t end, int) {
                                for (int64_t m = begin; m < end; ++m)
                                    quantize(src(m), dst + static_cast<size_t>(m) * row_bytes, n);
                            });
}

// Exact mode / types without integer kernels: expert by expert, the engine's unfused matmuls.
void expert_ffn_batch_matmul(ThreadPool& pool, const ExpertFfnWeights* experts, const int64_t* member_begin,
                             const int64_t* member_end, int n_experts, const int64_t* tokens, const float* x,
                             int64_t ldx, float* y, int64_t ldy, bool exact, int64_t n_ff, int64_t n_embd) {
    std::vector<float> xe, g, u;
    for (int e = 0; e < n_experts; ++e) {
        const int64_t m0 = member_begin[e], n = member_end[e] - m0;
        if (n <= 0) continue;
        xe.resize(static_cast<size_t>(n * n_embd));
        g.resize(static_cast<size_t>(n * n_ff));
        u.resize(static_cast<size_t>(n * n_ff));
        for (int64_t m = 0; m < n; ++m) {
            std::memcpy(xe.data() + m * n_embd, x + tokens[m0 + m] * ldx, sizeof(float) * n_embd);
        }
        if (!experts[e].relu_sqr)
            cpu::matmul(pool, experts[e].gate, xe.data(), n_embd, n, g.data(), n_ff, exact);
        cpu::matmul(pool, experts[e].up, xe.data(), n_embd, n, u.data(), n_ff, exact);
        for (int64_t m = 0; m < n; ++m) {
            expert_glu(experts[e], 0, g.data() + m * n_ff, u.data() + m * n_ff, g.data() + m * n_ff, n_ff);
        }
        cpu::matmul(pool, experts[e].down, g.data(), n_ff, n, y + m0 * ldy, ldy, exact);
        expert_down_bias(experts[e], n, 0, n_embd, y + m0 * ldy, ldy);
    }
}

}  // namespace

void expert_ffn_batch(ThreadPool& pool, const ExpertFfnWeights* experts, const int64_t* member_begin,
                      const int64_t* member_end, int n_experts, const int64_t* tokens, const float* x,
                      int64_t ldx, float* y, int64_t ldy, bool exact) {
    int64_t n_ff = 0, n_embd = 0;
    check_shapes(experts, n_experts, &n_ff, &n_embd);
    // The fast path needs one type per projection across the experts (a layer's experts come from
    // one tensor each) so that every member row is quantized once per format.
    const ExpertFfnWeights& e0 = experts[0];
    const QuantDotKernels* kg = fast_dot_kernels(e0.gate.type, exact);
    const QuantDotKernels* ku = fast_dot_kernels(e0.up.type, exact);
    const QuantDotKernels* kd = fast_dot_kernels(e0.down.type, exact);
    bool uniform = true;
    int64_t m_lo = member_begin[0], m_hi = member_end[0];
    for (int e = 0; e < n_experts; ++e) {
        uniform = uniform && experts[e].gate.type == e0.gate.type && experts[e].up.type == e0.up.type &&
                  experts[e].down.type == e0.down.type;
        if (member_end[e] > member_begin[e]) {
            m_lo = std::min(m_lo, member_begin[e]);
            m_hi = std::max(m_hi, member_end[e]);
        }
    }
    if (!kg || !ku || !kd || !uniform || n_ff % kMinItemRows != 0 || n_embd % kMinItemRows != 0) {
        expert_ffn_batch_matmul(pool, experts, member_begin, member_end, n_experts, tokens, x, ldx, y, ldy,
                                exact, n_ff, n_embd);
        return;
    }
    // Scratch indexed by member m - m_lo (the members may be a sub-range of the caller's).
    const int64_t n_members = m_hi - m_lo;
    const Isa isa = active_isa();
    const ActFormat fg = act_format(e0.gate.type), fu = act_format(e0.up.type), fd = act_format(e0.down.type);
    const size_t g_bytes = act_row_bytes(fg, n_embd), u_bytes = act_row_bytes(fu, n_embd),
                 d_bytes = act_row_bytes(fd, n_ff);
    thread_local std::vector<uint8_t> xq_gate, xq_up, act_q;
    thread_local std::vector<float> act;
    xq_gate.resize(g_bytes * static_cast<size_t>(n_members));
    if (fu != fg) xq_up.resize(u_bytes * static_cast<size_t>(n_members));
    act_q.resize(d_bytes * static_cast<size_t>(n_members));
    act.resize(static_cast<size_t>(n_members * n_ff));
    // Raw pointers for the pool's threads (a thread_local named inside a body is that thread's own).
    uint8_t* const xq_gate_data = xq_gate.data();
    const uint8_t* const xq_up_data = fu != fg ? xq_up.data() : xq_gate_data;
    uint8_t* const act_q_data = act_q.data();
    auto token_row = [&](int64_t i) { return x + tokens[m_lo + i] * ldx; };
    quantize_rows(pool, quantize_act_kernel(fg, isa), token_row, n_members, n_embd, xq_gate_data, g_bytes);
    if (fu != fg)
        quantize_rows(pool, quantize_act_kernel(fu, isa), token_row, n_members, n_embd, xq_up.data(),
                      u_bytes);

    // Items of about 1/16 of a thread's share of the work, at least a few tile passes each.
    const int64_t target = std::max<int64_t>(
        8 * kMinItemRows, n_members * std::max(n_ff, n_embd) / (16 * static_cast<int64_t>(pool.n_threads())));
    // Work of the passes (weight bytes times the members reading them), for parallel_for_bytes.
    int64_t gate_up_work = 0, down_work = 0;
    for (int e = 0; e < n_experts; ++e) {
        const int64_t n = std::max<int64_t>(0, member_end[e] - member_begin[e]);
        gate_up_work +=
            n * ((experts[e].relu_sqr ? 0 : matrix_bytes(experts[e].gate)) + matrix_bytes(experts[e].up));
        down_work += n * matrix_bytes(experts[e].down);
    }
    std::vector<RowItem> items;
    // Pass 1: gate rows into act, up rows into per-thread scratch, then act = silu(gate) * up.
    plan_items(member_begin, member_end, n_experts, n_ff, target, &items);
    float* act_data = act.data();
    pool.parallel_for_bytes(
        static_cast<int64_t>(items.size()), gate_up_work,
        [&](int64_t begin, int64_t end, int) {
            thread_local std::vector<float> up;
            for (int64_t it = begin; it < end; ++it) {
                const RowItem& item = items[static_cast<size_t>(it)];
                const int64_t m0 = member_begin[item.e] - m_lo, n = member_end[item.e] - member_begin[item.e];
                const int64_t rows = item.r1 - item.r0;
                if (up.size() < static_cast<size_t>(n * rows)) up.resize(static_cast<size_t>(n * rows));
                float* g = act_data + m0 * n_ff;
                if (!experts[item.e].relu_sqr) {
                    quantized_rows(experts[item.e].gate, *kg,
                                   xq_gate_data + static_cast<size_t>(m0) * g_bytes, g_bytes, n, item.r0,
                                   item.r1, g, n_ff);
                }
                // up rows r0..r1 (a view starting at row r0) land at up[m * rows + (r - r0)].
                WeightView up_rows = experts[item.e].up;
                up_rows.data += static_cast<size_t>(item.r0) * up_rows.row_bytes;
                up_rows.n_rows = rows;
                quantized_rows(up_rows, *ku, xq_up_data + static_cast<size_t>(m0) * u_bytes, u_bytes, n, 0,
                               rows, up.data(), rows);
                for (int64_t m = 0; m < n; ++m) {
                    float* row = g + m * n_ff + item.r0;
                    expert_glu(experts[item.e], item.r0, row, up.data() + m * rows, row, rows);
                }
            }
        },
        static_cast<int64_t>(items.size()));
    // Pass 2: the down input of every member, quantized once.
    quantize_rows(
        pool, quantize_act_kernel(fd, isa), [&](int64_t i) { return act_data + i * n_ff; }, n_members, n_ff,
        act_q_data, d_bytes);
    // Pass 3: down rows over each expert's members, straight into y.
    plan_items(member_begin, member_end, n_experts, n_embd, target, &items);
    pool.parallel_for_bytes(
        static_cast<int64_t>(items.size()), down_work,
        [&](int64_t begin, int64_t end, int) {
            for (int64_t it = begin; it < end; ++it) {
                const RowItem& item = items[static_cast<size_t>(it)];
                const int64_t m0 = member_begin[item.e], n = member_end[item.e] - m0;
                quantized_rows(experts[item.e].down, *kd,
                               act_q_data + static_cast<size_t>(m0 - m_lo) * d_bytes, d_bytes, n, item.r0,
                               item.r1, y + m0 * ldy, ldy);
                expert_down_bias(experts[item.e], n, item.r0, item.r1, y + m0 * ldy, ldy);
            }
        },
        static_cast<int64_t>(items.size()));
}

// The unfused decode path, slot by slot: two passes on the pool per call (gate+up rows, then down
// rows), each row one RowDot, so every row has the bits expert_ffn_one_token gives it however the
// slots are grouped across calls (MoeFfn computes ready experts first, then each as it arrives).
void expert_ffn_slots(ThreadPool& pool, const ExpertFfnWeights* experts, const int64_t* slots,
                      int64_t n_slots, const float* x, float* y, int64_t ldy, bool exact) {
    if (n_slots == 0) return;
    const int64_t n_embd = experts[0].gate.n_cols, n_ff = experts[0].gate.n_rows;
    PreparedRow x_in(x, n_embd, exact);
    std::vector<RowDot> gate_dot(static_cast<size_t>(n_slots)), up_dot(static_cast<size_t>(n_slots)),
        down_dot(static_cast<size_t>(n_slots));
    std::vector<PreparedRow> down_in(static_cast<size_t>(n_slots));
    std::vector<float> g(static_cast<size_t>(n_slots * n_ff)), up(g.size()), act(g.size());
    int64_t gate_up_bytes = 0, down_bytes = 0;  // for parallel_for_bytes
    for (int64_t i = 0; i < n_slots; ++i) {
        const ExpertFfnWeights& e = experts[i];
        gate_dot[i] = x_in.bind(e.gate.type);
        up_dot[i] = x_in.bind(e.up.type);
        gate_up_bytes += static_cast<int64_t>((e.relu_sqr ? 0 : e.gate.row_bytes) + e.up.row_bytes) * n_ff;
        down_bytes += static_cast<int64_t>(e.down.row_bytes) * n_embd;
    }
    pool.parallel_for_bytes(n_slots * 2 * n_ff, gate_up_bytes, [&](int64_t begin, int64_t end, int) {
        for (int64_t item = begin; item < end; ++item) {
            const int64_t i = item / (2 * n_ff), r = item % (2 * n_ff);
            const ExpertFfnWeights& e = experts[i];
            if (r < n_ff) {
                if (!e.relu_sqr) g[i * n_ff + r] = gate_dot[i](e.gate.data + r * e.gate.row_bytes);
            } else {
                const int64_t ru = r - n_ff;
                up[i * n_ff + ru] = up_dot[i](e.up.data + ru * e.up.row_bytes);
            }
        }
    });
    for (int64_t i = 0; i < n_slots; ++i) {
        expert_glu(experts[i], 0, g.data() + i * n_ff, up.data() + i * n_ff, act.data() + i * n_ff, n_ff);
        down_in[i].reset(act.data() + i * n_ff, n_ff, exact);
        down_dot[i] = down_in[i].bind(experts[i].down.type);
    }
    pool.parallel_for_bytes(n_slots * n_embd, down_bytes, [&](int64_t begin, int64_t end, int) {
        for (int64_t item = begin; item < end; ++item) {
            const int64_t i = item / n_embd, r = item % n_embd;
            const ExpertFfnWeights& e = experts[i];
            y[slots[i] * ldy + r] = down_dot[i](e.down.data + r * e.down.row_bytes);
        }
    });
    for (int64_t i = 0; i < n_slots; ++i) expert_down_bias(experts[i], 1, 0, n_embd, y + slots[i] * ldy, ldy);
}

}  // namespace sharpi::cpu
