// The core's only view of the CUDA backend. Implemented by backend.cu in a CUDA build and by
// stub.cpp otherwise, so core code never needs #ifdef SHARPI_WITH_CUDA.
#pragma once

#include <string>

namespace sharpi::cuda {

// True when the library was built with CUDA and at least one device is usable right now.
bool available();

// One line for logs and `sharpi inspect`: the device name and memory, or why CUDA is unavailable.
std::string describe();

}  // namespace sharpi::cuda
