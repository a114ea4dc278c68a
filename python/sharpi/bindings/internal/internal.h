// sharpi._internal: the engine's internals seen from Python, for the package's own planners, the
// tests and the benchmarks (kernels, quantization, readers, caches, tiers, predictors, CUDA ops and
// the harnesses ExpertReaderTest, ReadQueueTest, TierCacheTest). Not the public API: these files may
// include the private headers of cpp/src and cuda/. One bind_* function per area; module.cpp calls
// them in order.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "bindings.h"  // stats_dict, shared with _core
#include "cpu/quant/kernels.h"

namespace sharpi::py_bindings {

void bind_quant(pybind11::module_& m);       // quant_bindings.cpp
void bind_threadpool(pybind11::module_& m);  // threadpool_bindings.cpp
void bind_io(pybind11::module_& m);          // io_bindings.cpp
void bind_predict(pybind11::module_& m);     // predict_bindings.cpp
void bind_cache(pybind11::module_& m);       // cache_bindings.cpp
void bind_gdn(pybind11::module_& m);         // gdn_bindings.cpp
void bind_kv(pybind11::module_& m);          // kv_bindings.cpp
void bind_cuda(pybind11::module_& m);        // cuda_bindings.cpp
void bind_tiers(pybind11::module_& m);       // tier_bindings.cpp

// "" -> the active ISA; "scalar" | "avx2" | "avx512" (InvalidArgument when unknown or above the CPU's).
cpu::Isa isa_arg(const std::string& name);  // quant_bindings.cpp

}  // namespace sharpi::py_bindings
