// CPU-only build: CUDA is never available.
#include "cuda_backend.h"

namespace sharpi::cuda {

bool available() {
    return false;
}

std::string describe() {
    return "CUDA unavailable: sharpi was built without the CUDA backend";
}

}  // namespace sharpi::cuda
