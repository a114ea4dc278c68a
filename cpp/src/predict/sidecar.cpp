// Sidecar reading and validation; see sidecar.h for what it owns and the error contract.
#include "predict/sidecar.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>

#include "sharpi/errors.h"

namespace sharpi {

namespace {

constexpr const char* kArchitecture = "sharpi.predictor";
constexpr const char* kKeyPrefix = "sharpi.predictor.";

// ggml order (innermost first) with outer dimensions of size 1 removed, so [E] and [E, 1] compare
// equal: both describe the same bytes, and writers differ on keeping trailing ones.
std::vector<int64_t> canonical_ggml_shape(std::vector<int64_t> ne) {
    while (ne.size() > 1 && ne.back() == 1) ne.pop_back();
    return ne;
}

std::string model_shape(int64_t n_layer, int64_t n_expert, int64_t top_k) {
    return "n_layer=" + std::to_string(n_layer) + ", n_expert=" + std::to_string(n_expert) +
           ", top_k=" + std::to_string(top_k);
}

}  // namespace

std::string shape_string(const std::vector<int64_t>& shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
}

std::string SidecarReader::where() const {
    return "[predictor] " + path_ + ": ";
}

SidecarReader::SidecarReader(const std::string& path, const std::string& expected_kind, const Model& model,
                             int lookahead)
    : path_(path) {
    if (path.empty())
        throw InvalidArgument("[predictor] the '" + expected_kind +
                              "' predictor needs a sidecar file, none given");
    struct stat st{};
    if (::stat(path.c_str(), &st) != 0)
        throw InvalidArgument(where() + "sidecar file for the '" + expected_kind +
                              "' predictor does not exist");
    if (lookahead < 1)
        throw InvalidArgument(where() + "lookahead must be >= 1, got " + std::to_string(lookahead));

    file_ = GgufFile::open(path, /*map_data=*/true);

    const std::string arch = file_->get_string_or("general.architecture", "");
    if (arch != kArchitecture) {
        throw InvalidArgument(where() + "general.architecture is '" + arch + "', expected '" + kArchitecture +
                              "': not a sidecar predictor file");
    }
    header_.kind = file_->get_string(std::string(kKeyPrefix) + "kind");
    if (header_.kind != expected_kind) {
        throw InvalidArgument(where() + "sidecar is a '" + header_.kind + "' predictor, expected '" +
                              expected_kind + "'");
    }
    header_.source = file_->get_string_or(std::string(kKeyPrefix) + "source", "");

    // Model-facing shape first (the common mistake is a file trained for another model), then the
    // lookahead. Upper bounds only keep the integer arithmetic sane; equality is what matters.
    header_.n_layer = uint_key("n_layer", 1, 1 << 20);
    header_.n_expert = uint_key("n_expert", 1, 1 << 20);
    header_.top_k = uint_key("top_k", 1, 1 << 20);
    const HParams& hp = model.hp;
    const int64_t n_moe_layer = hp.n_layer - hp.n_layer_dense_lead;  // traces record MoE layers only
    if (header_.n_layer != n_moe_layer || header_.n_expert != hp.n_expert ||
        header_.top_k != hp.n_expert_used) {
        throw InvalidArgument(where() + "sidecar is for " +
                              model_shape(header_.n_layer, header_.n_expert, header_.top_k) + " but model " +
                              (model.file ? model.file->path() : std::string("(in memory)")) + " has " +
                              model_shape(n_moe_layer, hp.n_expert, hp.n_expert_used));
    }
    header_.max_lookahead = static_cast<int>(uint_key("max_lookahead", 1, 3));
    if (header_.max_lookahead < lookahead) {
        throw InvalidArgument(
            where() + "sidecar predicts at most max_lookahead=" + std::to_string(header_.max_lookahead) +
            " layers ahead but the session's lookahead is " + std::to_string(lookahead));
    }
}

int64_t SidecarReader::uint_key_or(const std::string& suffix, int64_t absent, int64_t min_value,
                                   int64_t max_value) const {
    return file_->find(kKeyPrefix + suffix) ? uint_key(suffix, min_value, max_value) : absent;
}

int64_t SidecarReader::uint_key(const std::string& suffix, int64_t min_value, int64_t max_value) const {
    const std::string key = kKeyPrefix + suffix;
    const GgufValue* v = file_->find(key);
    if (!v) throw FormatError(where() + "missing metadata key '" + key + "'");
    const uint64_t value = file_->get_uint(key);  // FormatError naming the key when not an integer
    if (value < static_cast<uint64_t>(min_value) || value > static_cast<uint64_t>(max_value)) {
        throw FormatError(where() + "metadata key '" + key + "' = " + std::to_string(value) +
                          " is outside [" + std::to_string(min_value) + ", " + std::to_string(max_value) +
                          "]");
    }
    return static_cast<int64_t>(value);
}

std::vector<float> SidecarReader::tensor(const std::string& name,
                                         const std::vector<int64_t>& numpy_shape) const {
    const GgufTensor* t = file_->find_tensor(name);
    if (!t) {
        throw FormatError(where() + "missing tensor '" + name + "' (expected f32 " +
                          shape_string(numpy_shape) + ")");
    }
    std::vector<int64_t> actual_numpy(t->ne.rbegin(), t->ne.rend());
    const std::vector<int64_t> expected_ggml(numpy_shape.rbegin(), numpy_shape.rend());
    if (canonical_ggml_shape(t->ne) != canonical_ggml_shape(expected_ggml)) {
        throw FormatError(where() + "tensor '" + name + "' has shape " + shape_string(actual_numpy) +
                          ", expected " + shape_string(numpy_shape));
    }
    if (t->type != GgmlType::F32) {
        throw FormatError(where() + "tensor '" + name + "' is " + ggml_type_traits(t->type).name +
                          ", expected f32 (every sidecar tensor is f32)");
    }
    // GgufFile::open checked that [file_offset, file_offset + nbytes) lies inside the file.
    if (t->nbytes != static_cast<uint64_t>(t->n_elements) * sizeof(float)) {
        throw FormatError(where() + "tensor '" + name + "': " + std::to_string(t->nbytes) + " bytes for " +
                          std::to_string(t->n_elements) + " f32 elements");
    }
    std::vector<float> out(static_cast<size_t>(t->n_elements));
    if (!out.empty()) std::memcpy(out.data(), file_->tensor_data(*t), t->nbytes);
    file_->check_mapping();
    return out;
}

}  // namespace sharpi
