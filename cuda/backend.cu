// CUDA build: device discovery and the entry the core calls for device="cuda"
// (cuda_backend.h). Kernels live one op per file under cuda/ops/ (STYLE.md habit 2).
#include <cuda_runtime.h>

#include <string>

#include "cuda_backend.h"
#include "cuda_check.cuh"
#include "sharpi/errors.h"

namespace sharpi::cuda {

bool available() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

DeviceInfo device_info() {
    DeviceInfo info;
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        cudaGetLastError();
        return info;
    }
    cudaDeviceProp prop{};
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || cudaSetDevice(0) != cudaSuccess ||
        cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
        cudaGetLastError();
        return info;
    }
    info.present = true;
    info.name = prop.name;
    info.cc_major = prop.major;
    info.cc_minor = prop.minor;
    info.vram_total = total_bytes;
    info.vram_free = free_bytes;
    return info;
}

std::string describe() {
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        cudaGetLastError();
        return std::string("CUDA unavailable: cudaGetDeviceCount failed: ") + cudaGetErrorString(err);
    }
    if (n == 0) return "CUDA unavailable: no device";
    const DeviceInfo info = device_info();
    if (!info.present) return "CUDA device 0: properties or memory info unavailable";
    const uint64_t mib = 1ull << 20;
    return "CUDA device 0: " + info.name + ", sm_" + std::to_string(info.cc_major) +
           std::to_string(info.cc_minor) + ", VRAM " + std::to_string(info.vram_total / mib) +
           " MiB total, " + std::to_string((info.vram_total - info.vram_free) / mib) + " MiB used, " +
           std::to_string(info.vram_free / mib) + " MiB free";
}

void require_device_forward(const DeviceRequest& req) {
    const std::string what = "device=\"cuda\" for " + req.arch;
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        cudaGetLastError();
        throw DeviceError(cuda_error_message(err, what + ": no usable CUDA device"));
    }
    if (n == 0) throw DeviceError("[cuda] " + what + ": no CUDA device");
    const bool plain_moe = req.moe && (req.arch == "qwen3moe" || req.arch == "olmoe" || req.arch == "llama");
    if (!plain_moe) {
        throw UnsupportedError(
            "[cuda] " + what + ": the device path computes the plain MoE architectures only " +
            "(qwen3moe, olmoe, mixtral), not " + req.arch + (req.moe ? "" : " without experts"));
    }
    const DeviceInfo info = device_info();
    const uint64_t need = req.dense_bytes + req.expert_bytes + req.kv_bytes;
    const uint64_t mib = 1ull << 20;
    if (need > info.vram_free) {
        throw InvalidArgument("[cuda] " + what + ": dense weights " + std::to_string(req.dense_bytes / mib) +
                              " MiB + experts " + std::to_string(req.expert_bytes / mib) +
                              " MiB + KV cache " + std::to_string(req.kv_bytes / mib) +
                              " MiB = " + std::to_string(need / mib) + " MiB do not fit the " +
                              std::to_string(info.vram_free / mib) + " MiB free on " + info.name +
                              " (a smaller n_ctx shrinks the KV cache; use device=\"cpu\")");
    }
    // The kernels of the forward pass exist (cuda/ops/); the layer loop that drives them on the
    // device is not written yet (issue 21, part 1 open): refuse rather than silently use the CPU.
    throw UnsupportedError("[cuda] " + what +
                           ": the device forward pass is not implemented yet; use device=\"cpu\"");
}

}  // namespace sharpi::cuda
