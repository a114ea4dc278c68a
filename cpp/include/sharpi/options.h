// Options for a Session and for sampling. Defaults are what `sharpi run` uses.
#pragma once

#include <cstdint>
#include <string>

namespace sharpi {

struct SessionOptions {
    int n_threads = 0;  // 0: one per online core
    int n_ctx = 0;      // 0: min(n_ctx_train, 4096)
    // Every kernel computes in f32 on dequantized weights. The CPU kernels already do this (they
    // never quantize activations), so today this only documents intent; kept for fast paths to come.
    bool exact = false;
    // Record every named intermediate activation of the next decode() (see Session::dump()).
    bool dump_activations = false;
};

struct SamplingParams {
    float temperature = 0.8f;  // 0: greedy
    int32_t top_k = 40;        // <= 0: disabled
    float top_p = 0.95f;       // 1: disabled
    float min_p = 0.05f;       // 0: disabled
    float repeat_penalty = 1.0f;  // 1: disabled
    int32_t repeat_last_n = 64;   // window the penalty looks back over
    uint64_t seed = 0xC0FFEE;
};

}  // namespace sharpi
