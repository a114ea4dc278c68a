// CUDA build: device discovery. Kernels live under cuda/ops/, one .cu/.cuh pair per op.
#include <cuda_runtime.h>

#include <string>

#include "cuda_backend.h"

namespace sharpi::cuda {

bool available() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::string describe() {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        return std::string("CUDA unavailable: cudaGetDeviceCount failed: ") + cudaGetErrorString(err);
    }
    if (n == 0) return "CUDA unavailable: no device";
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "CUDA device 0: properties unavailable";
    return std::string("CUDA device 0: ") + prop.name + ", " + std::to_string(prop.totalGlobalMem >> 20) +
           " MiB";
}

}  // namespace sharpi::cuda
