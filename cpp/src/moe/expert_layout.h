// ExpertLayout: where every routed expert's bytes are, built once when the model loads
// (model/model.cpp) and read-only afterwards. It is the only thing the expert cache and the
// resident source know about the model: file paths, byte ranges and matrix shapes, no GGUF or
// Model objects.
//
// In GGUF the stacked expert tensors ffn_{gate,up,down}_exps are expert-major (ggml ne [in, out,
// n_expert]), so one expert of one part is one contiguous range of `bytes` bytes starting at
// offset + e * bytes. ExpertPart is the one place that slices a stacked tensor into experts, for
// file ranges (streaming) and for views into the mapping (resident) alike.
//
// `file` indexes ExpertLayout::files: one entry per GGUF file (one per shard of a split model, in
// shard order), and each part names the file its tensor is in.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/op_types.h"

namespace sharpi {

enum ExpertPartId : int { kExpertGate = 0, kExpertUp = 1, kExpertDown = 2, kExpertParts = 3 };

inline const char* expert_part_name(int part) {
    return part == kExpertGate ? "gate" : part == kExpertUp ? "up" : "down";
}

// Bytes [offset, offset + bytes) of file number `file`.
struct FileRange {
    uint32_t file = 0;
    uint64_t offset = 0;
    uint64_t bytes = 0;
};

// One stacked tensor of one layer (gate, up or down of every expert).
struct ExpertPart {
    std::string tensor;   // tensor name, for error messages ("blk.3.ffn_up_exps.weight")
    uint32_t file = 0;    // index into ExpertLayout::files
    uint64_t offset = 0;  // file offset of expert 0
    uint64_t bytes = 0;   // bytes of one expert: its rows, a whole number of quant blocks each
    // One expert's matrix (gate/up [n_ff_exp, n_embd], down [n_embd, n_ff_exp]); data points at
    // expert 0 in the file mapping, or is nullptr when the file is not mapped (streaming).
    WeightView view;

    FileRange range(int64_t e) const {
        return FileRange{file, offset + static_cast<uint64_t>(e) * bytes, bytes};
    }
    // Expert e's matrix in the mapping (resident models only).
    WeightView mapped(int64_t e) const { return at(view.data + static_cast<size_t>(e) * bytes); }
    // The same matrix over a copy of its bytes elsewhere (a cache slot).
    WeightView at(const uint8_t* data) const {
        WeightView w = view;
        w.data = data;
        return w;
    }
};

// Ungated experts (nemotron_h_moe: down(relu(up x)^2)) have a gate part of 0 bytes: nothing is read
// or cached for it, and an expert's gate view is its up view (ExpertFfnWeights::relu_sqr).
struct ExpertLayerLayout {
    ExpertPart parts[kExpertParts];
    bool present() const { return parts[kExpertDown].bytes > 0; }  // false: no routed experts
    bool gated() const { return parts[kExpertGate].bytes > 0; }
    uint64_t expert_bytes() const {
        return parts[kExpertGate].bytes + parts[kExpertUp].bytes + parts[kExpertDown].bytes;
    }
};

struct ExpertLayout {
    std::vector<std::string> files;         // file index -> path
    int64_t n_expert = 0;                   // experts per MoE layer
    int64_t n_expert_used = 0;              // experts one token uses per layer (top-k)
    std::vector<ExpertLayerLayout> layers;  // [n_layer]; dense layers have !present()

    int64_t n_layer() const { return static_cast<int64_t>(layers.size()); }
    const ExpertPart& part(int il, int part) const { return layers[static_cast<size_t>(il)].parts[part]; }
    // Requested bytes of one expert (its three ranges); the same for every expert of a layer.
    uint64_t expert_bytes(int il) const { return layers[static_cast<size_t>(il)].expert_bytes(); }
};

}  // namespace sharpi
