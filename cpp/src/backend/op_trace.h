// The op sequence of one forward pass: a model run through the layer builders on the CPU backend
// wrapped in a RecordingBackend, with every expert resident. An internal harness for the host test
// of the one forward pass (tests/test_backend_ops.py), which checks each call against the CUDA
// backend's support table; not part of a session.
#pragma once

#include <string>
#include <vector>

#include "backend/op_call.h"
#include "sharpi/types.h"

namespace sharpi {

// Runs `tokens` as one prefill batch and then `tokens[0]` again as a single decoded token (both
// paths: the grouped and the one-token expert FFN), and returns every op call in order. exact:
// SessionOptions::exact (an f32 KV cache; fast mode's is f16, as a session's).
std::vector<OpCall> record_forward_ops(const std::string& path, const std::vector<token_t>& tokens,
                                       bool exact);

}  // namespace sharpi
