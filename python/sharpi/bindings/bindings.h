// sharpi._core: the bindings of the public API (cpp/include/sharpi/ only; tests/test_layering.py
// checks it). One bind_* function per area; module.cpp calls them in order.
#pragma once

#include <pybind11/pybind11.h>

#include "sharpi/types.h"

namespace sharpi::py_bindings {

void bind_errors(pybind11::module_& m);   // module.cpp
void bind_gguf(pybind11::module_& m);     // gguf_bindings.cpp
void bind_session(pybind11::module_& m);  // session_bindings.cpp
void bind_sampler(pybind11::module_& m);  // sampler_bindings.cpp

// Session.expert_stats()'s dict of an ExpertCacheStats (docs/design.md §7 names), whatever the cache's
// tier; _internal's cache harnesses return the same dict.
pybind11::dict stats_dict(const ExpertCacheStats& st);  // expert_stats.cpp

}  // namespace sharpi::py_bindings
