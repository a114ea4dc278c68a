#include "cpu/ops/gated_delta_net.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace sharpi::cpu {

void conv1d_silu(float* state, const float* x, int64_t ldx, int64_t n_tokens, int64_t channels,
                 int64_t kernel_size, const float* kernel, const float* bias, float* y, int64_t ldy) {
    const int64_t n_state = kernel_size - 1;
    // Row r of the virtual sequence xs = [state; x].
    auto xs = [&](int64_t r) { return r < n_state ? state + r * channels : x + (r - n_state) * ldx; };
    for (int64_t t = 0; t < n_tokens; ++t) {
        float* out = y + t * ldy;
        for (int64_t c = 0; c < channels; ++c) {
            const float* w = kernel + c * kernel_size;
            float sum = 0.0f;
            for (int64_t j = 0; j < kernel_size; ++j) sum += w[j] * xs(t + j)[c];
            if (bias) sum += bias[c];
            out[c] = sum / (1.0f + std::exp(-sum));
        }
    }
    // The new state is the last K-1 rows of xs. Rows move forward only (row r takes row
    // r + n_tokens), so copying in increasing r never reads a row this loop already overwrote.
    for (int64_t r = 0; r < n_state; ++r) {
        const float* src = xs(r + n_tokens);
        float* dst = state + r * channels;
        if (src != dst) {
            for (int64_t c = 0; c < channels; ++c) dst[c] = src[c];
        }
    }
}

void gated_delta_rule_recurrent(ThreadPool& pool, const GdnInputs& in, int64_t n_tokens,
                                const GdnShape& shape, float* state, float* out, int64_t ldo) {
    const int64_t dk = shape.head_k_dim, dv = shape.head_v_dim, nv = shape.n_v_heads;
    pool.parallel_for(nv, [&](int64_t h0, int64_t h1, int) {
        std::vector<float> kv_mem(static_cast<size_t>(dv));
        // The state, kv_mem and the output row never overlap; __restrict lets the j loops vectorise.
        float* __restrict mem = kv_mem.data();
        for (int64_t h = h0; h < h1; ++h) {
            float* S = state + h * dk * dv;
            const int64_t kh = shape.k_head_of(h);
            for (int64_t t = 0; t < n_tokens; ++t) {
                const float* __restrict q = in.q + t * in.ldq + kh * dk;
                const float* __restrict k = in.k + t * in.ldk + kh * dk;
                const float* __restrict v = in.v + t * in.ldv + h * dv;
                const float decay = std::exp(in.g[t * nv + h]);
                const float beta = in.beta[t * nv + h];
                float* __restrict o = out + t * ldo + h * dv;
                // kv_mem = S^T k (undecayed; the decay is applied below)
                for (int64_t j = 0; j < dv; ++j) mem[j] = 0.0f;
                for (int64_t i = 0; i < dk; ++i) {
                    const float* __restrict s = S + i * dv;
                    const float ki = k[i];
                    for (int64_t j = 0; j < dv; ++j) mem[j] += s[j] * ki;
                }
                // delta = beta (v - decay kv_mem), in kv_mem's storage
                for (int64_t j = 0; j < dv; ++j) mem[j] = (v[j] - decay * mem[j]) * beta;
                // S = decay S + k delta^T;  o = S^T q
                for (int64_t j = 0; j < dv; ++j) o[j] = 0.0f;
                for (int64_t i = 0; i < dk; ++i) {
                    float* __restrict s = S + i * dv;
                    const float ki = k[i], qi = q[i];
                    for (int64_t j = 0; j < dv; ++j) {
                        s[j] = s[j] * decay + ki * mem[j];
                        o[j] += s[j] * qi;
                    }
                }
            }
        }
    });
}

namespace {

double dot(const double* a, const double* b, int64_t n) {
    double s = 0.0;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

}  // namespace

void gated_delta_rule_chunked(ThreadPool& pool, const GdnInputs& in, int64_t n_tokens, const GdnShape& shape,
                              int64_t chunk_size, float* state, float* out, int64_t ldo) {
    const int64_t dk = shape.head_k_dim, dv = shape.head_v_dim, nv = shape.n_v_heads;
    const int64_t C = chunk_size < 1 ? 1 : chunk_size;
    pool.parallel_for(nv, [&](int64_t h0, int64_t h1, int) {
        auto buf = [](int64_t n) { return std::vector<double>(static_cast<size_t>(n)); };
        std::vector<double> S = buf(dk * dv), Q = buf(C * dk), K = buf(C * dk), cum = buf(C), beta = buf(C);
        std::vector<double> A = buf(C * C), U = buf(C * dv), W = buf(C * dk), row = buf(dv);
        for (int64_t h = h0; h < h1; ++h) {
            float* Sf = state + h * dk * dv;
            for (int64_t i = 0; i < dk * dv; ++i) S[static_cast<size_t>(i)] = Sf[i];
            const int64_t kh = shape.k_head_of(h);
            for (int64_t c0 = 0; c0 < n_tokens; c0 += C) {
                const int64_t n = std::min(C, n_tokens - c0);
                // Load the chunk: q, k, beta, cumulative log decay; U = beta v, W = beta exp(cum) k.
                double running = 0.0;
                for (int64_t i = 0; i < n; ++i) {
                    const int64_t t = c0 + i;
                    const float* q = in.q + t * in.ldq + kh * dk;
                    const float* k = in.k + t * in.ldk + kh * dk;
                    const float* v = in.v + t * in.ldv + h * dv;
                    running += in.g[t * nv + h];
                    cum[static_cast<size_t>(i)] = running;
                    beta[static_cast<size_t>(i)] = in.beta[t * nv + h];
                    const double b = beta[static_cast<size_t>(i)], bd = b * std::exp(running);
                    for (int64_t a = 0; a < dk; ++a) {
                        Q[static_cast<size_t>(i * dk + a)] = q[a];
                        K[static_cast<size_t>(i * dk + a)] = k[a];
                        W[static_cast<size_t>(i * dk + a)] = bd * k[a];
                    }
                    for (int64_t j = 0; j < dv; ++j) U[static_cast<size_t>(i * dv + j)] = b * v[j];
                }
                // (I + A) U = beta V and (I + A) W = beta exp(cum) K by forward substitution, with
                // A[i][j] = beta_i (k_i . k_j) exp(cum_i - cum_j) for j < i.
                for (int64_t i = 0; i < n; ++i) {
                    const double* ki = &K[static_cast<size_t>(i * dk)];
                    for (int64_t j = 0; j < i; ++j) {
                        const double a = beta[static_cast<size_t>(i)] *
                                         dot(ki, &K[static_cast<size_t>(j * dk)], dk) *
                                         std::exp(cum[static_cast<size_t>(i)] - cum[static_cast<size_t>(j)]);
                        for (int64_t x = 0; x < dv; ++x)
                            U[static_cast<size_t>(i * dv + x)] -= a * U[static_cast<size_t>(j * dv + x)];
                        for (int64_t x = 0; x < dk; ++x)
                            W[static_cast<size_t>(i * dk + x)] -= a * W[static_cast<size_t>(j * dk + x)];
                    }
                }
                // v_new = U - W S (in U's storage).
                for (int64_t i = 0; i < n; ++i) {
                    for (int64_t a = 0; a < dk; ++a) {
                        const double w = W[static_cast<size_t>(i * dk + a)];
                        const double* s = &S[static_cast<size_t>(a * dv)];
                        for (int64_t j = 0; j < dv; ++j) U[static_cast<size_t>(i * dv + j)] -= w * s[j];
                    }
                }
                // o_i = exp(cum_i) q_i^T S + sum_{j <= i} (q_i . k_j) exp(cum_i - cum_j) v_new_j
                for (int64_t i = 0; i < n; ++i) {
                    const double* qi = &Q[static_cast<size_t>(i * dk)];
                    const double ei = std::exp(cum[static_cast<size_t>(i)]);
                    for (int64_t j = 0; j < dv; ++j) row[static_cast<size_t>(j)] = 0.0;
                    for (int64_t a = 0; a < dk; ++a) {
                        const double qa = qi[a] * ei;
                        const double* s = &S[static_cast<size_t>(a * dv)];
                        for (int64_t j = 0; j < dv; ++j) row[static_cast<size_t>(j)] += qa * s[j];
                    }
                    for (int64_t j = 0; j <= i; ++j) {
                        const double w = dot(qi, &K[static_cast<size_t>(j * dk)], dk) *
                                         std::exp(cum[static_cast<size_t>(i)] - cum[static_cast<size_t>(j)]);
                        for (int64_t x = 0; x < dv; ++x)
                            row[static_cast<size_t>(x)] += w * U[static_cast<size_t>(j * dv + x)];
                    }
                    float* o = out + (c0 + i) * ldo + h * dv;
                    for (int64_t j = 0; j < dv; ++j) o[j] = static_cast<float>(row[static_cast<size_t>(j)]);
                }
                // S = exp(cum_last) S + sum_i exp(cum_last - cum_i) k_i v_new_i^T
                const double last = cum[static_cast<size_t>(n - 1)];
                const double e_last = std::exp(last);
                for (double& s : S) s *= e_last;
                for (int64_t i = 0; i < n; ++i) {
                    const double e = std::exp(last - cum[static_cast<size_t>(i)]);
                    for (int64_t a = 0; a < dk; ++a) {
                        const double ka = e * K[static_cast<size_t>(i * dk + a)];
                        double* s = &S[static_cast<size_t>(a * dv)];
                        for (int64_t j = 0; j < dv; ++j) s[j] += ka * U[static_cast<size_t>(i * dv + j)];
                    }
                }
            }
            for (int64_t i = 0; i < dk * dv; ++i) Sf[i] = static_cast<float>(S[static_cast<size_t>(i)]);
        }
    });
}

}  // namespace sharpi::cpu
