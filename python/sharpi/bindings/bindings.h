// One bind_* function per area; module.cpp calls them in order.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "cpu/quant/kernels.h"
#include "sharpi/types.h"

namespace sharpi::py_bindings {

void bind_errors(pybind11::module_& m);   // module.cpp
void bind_gguf(pybind11::module_& m);     // gguf_bindings.cpp
void bind_quant(pybind11::module_& m);    // quant_bindings.cpp
void bind_session(pybind11::module_& m);  // session_bindings.cpp
void bind_sampler(pybind11::module_& m);  // sampler_bindings.cpp
void bind_io(pybind11::module_& m);       // io_bindings.cpp
void bind_predict(pybind11::module_& m);  // predict_bindings.cpp
void bind_cache(pybind11::module_& m);    // cache_bindings.cpp
void bind_gdn(pybind11::module_& m);      // gdn_bindings.cpp
void bind_kv(pybind11::module_& m);       // kv_bindings.cpp
void bind_cuda(pybind11::module_& m);     // cuda_bindings.cpp
void bind_tiers(pybind11::module_& m);    // tier_bindings.cpp

// "" -> the active ISA; "scalar" | "avx2" | "avx512" (InvalidArgument when unknown or above the CPU's).
cpu::Isa isa_arg(const std::string& name);  // quant_bindings.cpp

// Session.expert_stats()'s dict of an ExpertCacheStats (docs/design.md §7 names), whatever the cache's tier.
pybind11::dict stats_dict(const ExpertCacheStats& st);  // session_bindings.cpp

}  // namespace sharpi::py_bindings
