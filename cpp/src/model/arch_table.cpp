// The architecture table: the only place that lists the supported GGUF architecture strings.
#include "model/arch.h"

namespace sharpi {

extern const ArchSpec kArchLlama;
extern const ArchSpec kArchQwen2Moe;
extern const ArchSpec kArchQwen3Moe;
extern const ArchSpec kArchOlmoe;
extern const ArchSpec kArchQwen2;
extern const ArchSpec kArchQwen3;
extern const ArchSpec kArchDeepseek2;
extern const ArchSpec kArchDeepseek32;
extern const ArchSpec kArchQwen3Next;
extern const ArchSpec kArchQwen35Moe;
extern const ArchSpec kArchGptOss;
extern const ArchSpec kArchGlm4Moe;
extern const ArchSpec kArchLlama4;
extern const ArchSpec kArchMinimaxM2;
extern const ArchSpec kArchDeepseek4;
extern const ArchSpec kArchNemotronHMoe;

static const ArchSpec* const kArchTable[] = {
    &kArchLlama,     &kArchQwen2Moe,  &kArchQwen3Moe,   &kArchOlmoe,        &kArchQwen2,   &kArchQwen3,
    &kArchDeepseek2, &kArchQwen3Next, &kArchQwen35Moe,  &kArchGptOss,       &kArchGlm4Moe, &kArchLlama4,
    &kArchMinimaxM2, &kArchDeepseek4, &kArchDeepseek32, &kArchNemotronHMoe,
};

const ArchSpec* find_arch(const std::string& name) {
    for (const ArchSpec* spec : kArchTable) {
        if (name == spec->name) return spec;
    }
    return nullptr;
}

std::vector<std::string> arch_names() {
    std::vector<std::string> names;
    for (const ArchSpec* spec : kArchTable) names.emplace_back(spec->name);
    return names;
}

}  // namespace sharpi
