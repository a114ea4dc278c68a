// CUDA build: device discovery (backend/cuda_interface.h). The forward pass is device_forward.cu, its plan
// device_plan.cpp; kernels live one op per file under cuda/ops/ (docs/style.md habit 2).
#include <cuda_runtime.h>

#include <string>

#include "backend/cuda_interface.h"
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
        // Without any NVIDIA driver the runtime answers cudaErrorInsufficientDriver ("CUDA driver version
        // is insufficient for CUDA runtime version"), which reads like a version mismatch on a machine that
        // simply has no GPU; cudaDriverGetVersion reports 0 exactly when no driver is installed.
        int driver_version = 0;
        if (cudaDriverGetVersion(&driver_version) == cudaSuccess && driver_version == 0)
            return "no CUDA device (no NVIDIA driver)";
        if (err == cudaErrorNoDevice) return "no CUDA device";
        return std::string("CUDA unavailable: cudaGetDeviceCount failed: ") + cudaGetErrorString(err);
    }
    if (n == 0) return "no CUDA device";
    const DeviceInfo info = device_info();
    if (!info.present) return "CUDA device 0: properties or memory info unavailable";
    const uint64_t mib = 1ull << 20;
    return "CUDA device 0: " + info.name + ", sm_" + std::to_string(info.cc_major) +
           std::to_string(info.cc_minor) + ", VRAM " + std::to_string(info.vram_total / mib) +
           " MiB total, " + std::to_string((info.vram_total - info.vram_free) / mib) + " MiB used, " +
           std::to_string(info.vram_free / mib) + " MiB free";
}

}  // namespace sharpi::cuda
