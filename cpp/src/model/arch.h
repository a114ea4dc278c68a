// The architecture table: one row per GGUF `general.architecture` string sharpi runs.
//
// Each architecture lives in one file under model/archs/ that defines its ArchSpec: which tensors a
// layer has (load_layer, using ModelLoader's shared loaders) and how a layer computes
// (build_layer, using the shared layer builders of model/forward.h). Traits that differ between
// architectures but not between models of one architecture (RoPE pairing, whether top-k weights
// are renormalised by default) are fields here; everything model-specific comes from metadata.
#pragma once

#include <string>
#include <vector>

#include "backend/op_types.h"

namespace sharpi {

class ModelLoader;
class Forward;
struct Act;

struct ArchSpec {
    const char* name;
    RopeType rope_type;
    // Default for renormalising the top-k router weights; {arch}.expert_weights_norm overrides it.
    bool expert_weights_norm;
    void (*load_layer)(ModelLoader& loader, int il);
    // Returns the layer's output for input `inp` (both [n_tokens, n_embd]).
    Act (*build_layer)(Forward& f, const Act& inp, int il);
    // Router gating when the file has no {arch}.expert_gating_func (llama.cpp's per-arch default).
    Gating default_gating = Gating::softmax;
};

// nullptr when the architecture is unknown.
const ArchSpec* find_arch(const std::string& name);
// Names of every supported architecture, for error messages.
std::vector<std::string> arch_names();

}  // namespace sharpi
