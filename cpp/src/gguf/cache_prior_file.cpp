#include "gguf/cache_prior_file.h"

#include <sys/stat.h>

#include <cstring>

#include "gguf/gguf_file.h"
#include "sharpi/errors.h"

namespace sharpi {

std::vector<float> read_cache_prior(const std::string& path, int64_t n_layer, int64_t n_expert) {
    const std::string where = "[cache] " + path + ": ";
    struct stat st{};
    if (path.empty()) throw InvalidArgument("[cache] the 'prior' policy needs a prior file, none given");
    if (::stat(path.c_str(), &st) != 0 || S_ISDIR(st.st_mode))
        throw InvalidArgument(where + "cache prior file does not exist");
    const auto file = GgufFile::open(path, /*map_data=*/true);
    const std::string arch = file->get_string_or("general.architecture", "");
    if (arch != "sharpi.cache_prior") {
        throw InvalidArgument(where + "general.architecture is '" + arch +
                              "', expected 'sharpi.cache_prior': not a cache prior file");
    }
    for (const char* k : {"sharpi.cache_prior.n_layer", "sharpi.cache_prior.n_expert"}) {
        if (!file->has(k)) throw FormatError(where + "missing metadata key '" + k + "'");
    }
    // Compared as read (u64), before anything is sized by them: the only allocation below is sized
    // by the model's own (validated) n_layer * n_expert, once the file is known to agree with it.
    const uint64_t file_layers = file->get_uint("sharpi.cache_prior.n_layer");
    const uint64_t file_experts = file->get_uint("sharpi.cache_prior.n_expert");
    if (file_layers != static_cast<uint64_t>(n_layer) || file_experts != static_cast<uint64_t>(n_expert)) {
        throw InvalidArgument(where + "prior is for n_layer=" + std::to_string(file_layers) +
                              ", n_expert=" + std::to_string(file_experts) + " but the model has n_layer=" +
                              std::to_string(n_layer) + ", n_expert=" + std::to_string(n_expert));
    }
    const GgufTensor* t = file->find_tensor("cache_prior.freq");
    if (!t) throw FormatError(where + "missing tensor 'cache_prior.freq'");
    const bool shape_ok = t->ne.size() == 2 && t->ne[0] == n_expert && t->ne[1] == n_layer;
    if (!shape_ok || t->type != GgmlType::F32 ||
        t->nbytes != static_cast<uint64_t>(n_layer * n_expert) * sizeof(float)) {
        throw FormatError(where + "tensor 'cache_prior.freq' must be f32 [" + std::to_string(n_layer) + ", " +
                          std::to_string(n_expert) + "]");
    }
    std::vector<float> out(static_cast<size_t>(n_layer * n_expert));
    std::memcpy(out.data(), file->tensor_data(*t), t->nbytes);
    file->check_mapping();
    return out;
}

}  // namespace sharpi
