// OpCall: one op as the layer builders ask a backend to run it, as RecordingBackend records it and
// as the CUDA backend's support table (backend/cuda_interface.h unsupported_op) judges it.
#pragma once

#include <string>

#include "quant/ggml_type.h"

namespace sharpi {

// One op as a backend is asked to run it. op: the Backend method's name. type: the weight type the
// op reads (a matmul's matrix, an expert's projection, the embedding table; the cache's type for the
// KV ops; F32 for ops on activations alone). variant: "" for the plain op, else what it asks beyond
// it (attention "sinks" / "window", rope "yarn", route_topk "sigmoid" / "groups" / "scale" /
// "selection_bias", expert ops "bias" / "clamped_swiglu", matmul and experts "exact"; comma-separated,
// with the sizes a kernel may bound: attention "head_dim=N", route_topk "n_expert=N").
struct OpCall {
    std::string op;
    GgmlType type = GgmlType::F32;
    std::string variant;
};

}  // namespace sharpi
