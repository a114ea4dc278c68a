// Cache prior files: a small GGUF (general.architecture = "sharpi.cache_prior") holding one f32
// tensor "cache_prior.freq" of numpy shape [n_layer, n_expert], how often each (layer, expert)
// was routed to in the train sequences of a trace, and the keys sharpi.cache_prior.n_layer /
// .n_expert (uint32) and .source (free text). Written by `sharpi cache-prior`
// (python/sharpi/cache_eval.py), read here for the "prior" replacement policy
// (moe/policies/prior.cpp), which never sees the file itself (moe/ knows no GGUF).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sharpi {

// The prior of `path` for a model of n_layer x n_expert, layer-major. Throws InvalidArgument (no
// such file, not a cache prior, another model's shape) or FormatError (a missing key or tensor, a
// tensor of the wrong shape or type); messages start with "[cache] <path>: ".
std::vector<float> read_cache_prior(const std::string& path, int64_t n_layer, int64_t n_expert);

}  // namespace sharpi
