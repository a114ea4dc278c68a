// Mamba-2's selective scan; see ssm_scan.h.
#include "cpu/ops/ssm_scan.h"

#include <cmath>

namespace sharpi::cpu {

namespace {

// softplus as torch computes it (threshold 20: above it, x itself).
float softplus(float x) {
    return x > 20.0f ? x : std::log1p(std::exp(x));
}

}  // namespace

void ssm_scan(ThreadPool& pool, const SsmInputs& in, int64_t n_tokens, const SsmShape& shape, float* state,
              float* out, int64_t ldo) {
    const int64_t hd = shape.head_dim, ds = shape.d_state, heads_per_group = shape.n_head / shape.n_group;
    pool.parallel_for(shape.n_head, [&](int64_t h0, int64_t h1, int) {
        for (int64_t h = h0; h < h1; ++h) {
            const int64_t g = h / heads_per_group;
            float* __restrict s_h = state + h * hd * ds;
            for (int64_t t = 0; t < n_tokens; ++t) {
                const float dt = softplus(in.dt[t * in.ldt + h] + in.dt_bias[h]);
                const float decay = std::exp(dt * in.a[h]);
                const float* __restrict x = in.x + t * in.ldx + h * hd;
                const float* __restrict b = in.b + t * in.ldb + g * ds;
                const float* __restrict c = in.c + t * in.ldc + g * ds;
                float* __restrict y = out + t * ldo + h * hd;
                for (int64_t p = 0; p < hd; ++p) {
                    float* __restrict s = s_h + p * ds;
                    const float dtx = dt * x[p];
                    float acc = 0.0f;
                    for (int64_t n = 0; n < ds; ++n) {
                        s[n] = s[n] * decay + dtx * b[n];
                        acc += s[n] * c[n];
                    }
                    y[p] = acc + in.d[h] * x[p];
                }
            }
        }
    });
}

}  // namespace sharpi::cpu
