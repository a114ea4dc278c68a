// CUDA runtime errors as sharpi's typed errors. Every runtime call in the backend goes through
// cuda_check (or SHARPI_CUDA_CHECK for a kernel launch), so a failure surfaces as an exception
// that names the operation and carries cudaGetErrorString: a DeviceError, or an InvalidArgument
// for out-of-memory (the caller asked for more than the device holds). Never a crash, never a
// silently wrong result.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "sharpi/errors.h"

namespace sharpi::cuda {

// "[cuda] <what>: <cudaErrorName>: <cudaGetErrorString>".
inline std::string cuda_error_message(cudaError_t err, const std::string& what) {
    return "[cuda] " + what + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
}

// Throws on any error. Out-of-memory is an InvalidArgument (a budget the device cannot meet);
// everything else, "no device" included, a DeviceError.
inline void cuda_check(cudaError_t err, const std::string& what) {
    if (err == cudaSuccess) return;
    if (err == cudaErrorMemoryAllocation) {
        cudaGetLastError();  // reset the last-error slot so the next launch check does not report it
        throw InvalidArgument(cuda_error_message(err, what));
    }
    throw DeviceError(cuda_error_message(err, what));
}

// Throws DeviceError (with the CUDA error string) unless a CUDA device is usable.
inline void require_device(const std::string& what) {
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        cudaGetLastError();
        throw DeviceError(cuda_error_message(err, what + ": no usable CUDA device"));
    }
    if (n == 0) throw DeviceError("[cuda] " + what + ": no CUDA device");
}

// After a <<<...>>> launch: launch-configuration errors are reported by cudaGetLastError.
#define SHARPI_CUDA_CHECK_LAUNCH(what) ::sharpi::cuda::cuda_check(cudaGetLastError(), (what))

}  // namespace sharpi::cuda
