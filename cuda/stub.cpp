// CPU-only build: CUDA is never available; every device entry is an UnsupportedError.
#include <string>

#include "backend/backend.h"
#include "backend/cuda_interface.h"
#include "model/model.h"
#include "sharpi/errors.h"

namespace sharpi::cuda {
namespace {

[[noreturn]] void no_cuda(const std::string& what) {
    throw UnsupportedError(
        "[cuda] " + what +
        ": this sharpi was built without the CUDA backend (configure with -DSHARPI_CUDA=ON "
        "and nvcc on the PATH)");
}

}  // namespace

bool available() {
    return false;
}

DeviceInfo device_info() {
    return DeviceInfo{};
}

std::string describe() {
    return "CUDA unavailable: sharpi was built without the CUDA backend";
}

std::unique_ptr<Backend> make_cuda_backend(const Model& model) {
    no_cuda("the CUDA backend for " + model.hp.arch);
}

std::unique_ptr<DeviceForward> open_device_forward(const Model& model, int64_t, int64_t, GgmlType, GgmlType,
                                                   bool, const ExpertCacheOptions*, const CpuMissOptions*) {
    no_cuda("device=\"cuda\" for " + model.hp.arch);
}

std::vector<float> op_dequantize(GgmlType, const void*, size_t) {
    no_cuda("dequantize");
}
std::vector<uint8_t> op_quantize_act(GgmlType, const float*, int64_t, int64_t) {
    no_cuda("quantize_act");
}
std::vector<float> op_matmul(GgmlType, const void*, size_t, int64_t, int64_t, const float*, int64_t, bool,
                             bool) {
    no_cuda("matmul");
}
std::vector<float> op_rms_norm(const float*, const float*, int64_t, int64_t, float) {
    no_cuda("rms_norm");
}
std::vector<float> op_rope(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, bool,
                           const RopeParams&) {
    no_cuda("rope");
}
std::vector<float> op_silu_mul(const float*, const float*, int64_t) {
    no_cuda("silu_mul");
}
std::vector<float> op_router(const float*, int64_t, int64_t, int64_t, const RouterParams&) {
    no_cuda("router");
}
std::vector<float> op_attention(const float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t,
                                int64_t, float, int64_t, int64_t, const float*) {
    no_cuda("attention");
}
std::vector<float> op_expert_ffn(const OpExperts&, const float*, int64_t, const int32_t*, const float*,
                                 int64_t, bool, bool) {
    no_cuda("expert_ffn");
}

VramTierRun op_vram_tier_run(const Model&, const VramTierOptions&, const std::vector<TierStep>&) {
    no_cuda("VRAM expert tier");
}

}  // namespace sharpi::cuda
