// SHARPI_HD marks a function that both the host compiler and nvcc compile: `__host__ __device__`
// under nvcc, nothing otherwise. Headers that use it (quant/fp16.h, cuda/block_math.cuh) hold the
// arithmetic the CPU and the CUDA kernels share, so the host test suite checks the device's math.
#pragma once

#ifdef __CUDACC__
#define SHARPI_HD __host__ __device__
#else
#define SHARPI_HD
#endif
