// Internal harnesses of the one forward pass, not part of a session: a model run through the layer
// builders (model/forward.h, the architecture files, moe/moe_ffn.h) on a chosen backend, with every
// expert resident. record_forward_ops gives the op sequence on the CPU backend for the host test of
// the CUDA backend's support table (tests/test_backend_ops.py); forward_logits gives the logits on
// "cpu" or "cuda" for the device test of the CUDA backend against the CPU one
// (tests/test_cuda_backend_gpu.py). Both drive the layers with run_forward, as the engine does.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/op_call.h"
#include "sharpi/types.h"

namespace sharpi {

struct Model;

// Runs `tokens` through every layer on `backend` at positions 0 .. n - 1, as consecutive batches of
// the given sizes (summing to n), each batch like Engine::forward_batch: embed into the backend's
// residual, reset / build_layer / copy back per layer, the output head. Returns every token's
// logits [n, n_vocab] (host). The KV cache holds n positions of `cache_type` (a session's
// cache_type_k/v names; "": the session's default, f32 exact and f16 fast). A backend that cannot run
// an op throws its UnsupportedError.
std::vector<float> run_forward(const Model& model, Backend& backend, const std::vector<token_t>& tokens,
                               const std::vector<int64_t>& batches, bool exact,
                               const std::string& cache_type = "");

// Runs `tokens` as one prefill batch and then `tokens[0]` again as a single decoded token (both
// paths: the grouped and the one-token expert FFN), and returns every op call in order. exact:
// SessionOptions::exact (an f32 KV cache; fast mode's is f16, as a session's).
std::vector<OpCall> record_forward_ops(const std::string& path, const std::vector<token_t>& tokens,
                                       bool exact);

// The weights (host addresses) the same pass as record_forward_ops names, on `model` (so the
// addresses are that Model's): what a device backend must have uploaded.
std::vector<WeightRead> record_weight_reads(const Model& model, const std::vector<token_t>& tokens,
                                            bool exact);

// Every token's logits [n, n_vocab] of `tokens` on `backend` ("cpu": one thread; "cuda": the CUDA
// backend, backend/cuda_interface.h make_cuda_backend), in batches of at most `batch` tokens (0 or n:
// one prefill; 1: token by token), with a KV cache of `cache_type` (as run_forward).
std::vector<float> forward_logits(const std::string& path, const std::vector<token_t>& tokens,
                                  const std::string& backend, bool exact, int64_t batch,
                                  const std::string& cache_type = "");

}  // namespace sharpi
