// Sidecar predictor files (docs/predictors.md, "Sidecar predictor files"): a GGUF with
// general.architecture = "sharpi.predictor" that carries the weights of one trained predictor.
//
// SidecarReader owns the open GgufFile for the duration of a predictor's load and nothing else.
// It checks the common keys against the model and the session's lookahead (a file for another
// model or a shorter lookahead is an InvalidArgument naming both shapes), reads the kind-specific
// keys, and copies each f32 tensor into a std::vector<float> after an exact shape check (a missing
// tensor, a wrong shape or a non-f32 tensor is a FormatError naming the tensor). The predictor keeps
// only those copies, so the file is closed as soon as the reader goes away. It never writes to the
// file and never hands out pointers into the mapping.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gguf/gguf_file.h"
#include "model/model.h"

namespace sharpi {

// The common keys of every sidecar, already checked against the model and the lookahead.
struct SidecarHeader {
    std::string kind;  // "cooc" | "depthtime" | "learned" | "trajectory"
    int64_t n_layer = 0;
    int64_t n_expert = 0;
    int64_t top_k = 0;
    int max_lookahead = 0;  // 1..3, >= the session's lookahead
    std::string source;     // free text: what it was trained on ("" when absent)
};

class SidecarReader {
  public:
    // Opens `path` and validates it for `expected_kind` against `model` and `lookahead`.
    // Throws InvalidArgument: empty or nonexistent path, wrong general.architecture, wrong kind,
    //   n_layer / n_expert / top_k different from the model's, max_lookahead < lookahead, lookahead < 1.
    // Throws FormatError: malformed or truncated GGUF, a missing or ill-typed common key,
    //   max_lookahead outside 1..3. IoError when the file exists but cannot be read.
    SidecarReader(const std::string& path, const std::string& expected_kind, const Model& model,
                  int lookahead);

    const SidecarHeader& header() const { return header_; }
    const std::string& path() const { return path_; }

    // Required kind-specific integer key "sharpi.predictor.<suffix>" in [min_value, max_value];
    // FormatError naming the key when absent, ill-typed or out of range.
    int64_t uint_key(const std::string& suffix, int64_t min_value, int64_t max_value) const;
    // The same for a key a file may lack (written before the key existed): `absent` then.
    int64_t uint_key_or(const std::string& suffix, int64_t absent, int64_t min_value,
                        int64_t max_value) const;

    // A copy of f32 tensor `name` whose numpy shape must be `numpy_shape` (GGUF stores it reversed;
    // outer dimensions of size 1 are ignored on both sides, since writers differ on keeping them).
    // FormatError naming the tensor, the expected and the actual shape / type.
    std::vector<float> tensor(const std::string& name, const std::vector<int64_t>& numpy_shape) const;

    // "[predictor] <path>: " — the prefix of every error message about this file.
    std::string where() const;

  private:
    std::string path_;
    std::unique_ptr<GgufFile> file_;
    SidecarHeader header_;
};

// "[a, b, c]": numpy-style shape for error messages.
std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace sharpi
