#include "cpu/ops/hyper_connection.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace sharpi::cpu {

namespace {

float sigmoid(float x) {
    return 1.0f / (1.0f + std::exp(-x));
}

}  // namespace

void rms_norm_unweighted(const float* x, float* y, int64_t ld, int64_t n_rows, int64_t width, float eps) {
    for (int64_t r = 0; r < n_rows; ++r) {
        const float* xr = x + r * ld;
        float* yr = y + r * ld;
        double ss = 0.0;
        for (int64_t i = 0; i < width; ++i) ss += static_cast<double>(xr[i]) * xr[i];
        const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(width) + eps));
        for (int64_t i = 0; i < width; ++i) yr[i] = xr[i] * inv;
    }
}

void hc_block_weights(const float* mixes, int64_t n_tokens, int64_t n_hc, const float* base,
                      const float* scale, float eps, int64_t sinkhorn_iters, float* pre, float* post,
                      float* comb) {
    const int64_t n = n_hc, width = (2 + n) * n;
    for (int64_t t = 0; t < n_tokens; ++t) {
        const float* m = mixes + t * width;
        float* pr = pre + t * n;
        float* po = post + t * n;
        float* c = comb + t * n * n;
        for (int64_t j = 0; j < n; ++j) {
            pr[j] = sigmoid(m[j] * scale[0] + base[j]) + eps;
            po[j] = 2.0f * sigmoid(m[n + j] * scale[1] + base[n + j]);
        }
        for (int64_t j = 0; j < n; ++j) {
            float* row = c + j * n;
            float mx = -INFINITY;
            for (int64_t k = 0; k < n; ++k) {
                row[k] = m[2 * n + j * n + k] * scale[2] + base[2 * n + j * n + k];
                mx = std::max(mx, row[k]);
            }
            float sum = 0.0f;
            for (int64_t k = 0; k < n; ++k) {
                row[k] = std::exp(row[k] - mx);
                sum += row[k];
            }
            for (int64_t k = 0; k < n; ++k) row[k] = row[k] / sum + eps;
        }
        auto normalise_columns = [&] {
            for (int64_t k = 0; k < n; ++k) {
                float s = 0.0f;
                for (int64_t j = 0; j < n; ++j) s += c[j * n + k];
                for (int64_t j = 0; j < n; ++j) c[j * n + k] /= s + eps;
            }
        };
        normalise_columns();
        for (int64_t it = 1; it < sinkhorn_iters; ++it) {
            for (int64_t j = 0; j < n; ++j) {
                float s = 0.0f;
                for (int64_t k = 0; k < n; ++k) s += c[j * n + k];
                for (int64_t k = 0; k < n; ++k) c[j * n + k] /= s + eps;
            }
            normalise_columns();
        }
    }
}

void hc_head_weights(const float* mixes, int64_t n_tokens, int64_t n_hc, const float* base,
                     const float* scale, float eps, float* pre) {
    for (int64_t t = 0; t < n_tokens; ++t) {
        for (int64_t j = 0; j < n_hc; ++j)
            pre[t * n_hc + j] = sigmoid(mixes[t * n_hc + j] * scale[0] + base[j]) + eps;
    }
}

void hc_collapse(const float* x, int64_t n_tokens, int64_t n_hc, int64_t d, const float* pre, float* y) {
    for (int64_t t = 0; t < n_tokens; ++t) {
        const float* xt = x + t * n_hc * d;
        float* yt = y + t * d;
        const float* p = pre + t * n_hc;
        for (int64_t i = 0; i < d; ++i) {
            float s = 0.0f;
            for (int64_t j = 0; j < n_hc; ++j) s += p[j] * xt[j * d + i];
            yt[i] = s;
        }
    }
}

void hc_expand(const float* x, const float* out, int64_t n_tokens, int64_t n_hc, int64_t d, const float* post,
               const float* comb, float* y) {
    for (int64_t t = 0; t < n_tokens; ++t) {
        const float* xt = x + t * n_hc * d;
        const float* ot = out + t * d;
        const float* c = comb + t * n_hc * n_hc;
        float* yt = y + t * n_hc * d;
        for (int64_t k = 0; k < n_hc; ++k) {
            const float pk = post[t * n_hc + k];
            for (int64_t i = 0; i < d; ++i) {
                float s = 0.0f;
                for (int64_t j = 0; j < n_hc; ++j) s += c[j * n_hc + k] * xt[j * d + i];
                yt[k * d + i] = pk * ot[i] + s;
            }
        }
    }
}

}  // namespace sharpi::cpu
