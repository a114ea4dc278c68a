// Whether the cuFile (GPUDirect Storage) reader could run here, and if not, why (docs/design.md §5, §10).
// cuFile reads file ranges straight into VRAM slots; it needs a CUDA device and libcufile (shipped
// by the `nvidia-cufile` wheel or a CUDA install), which is loaded with dlopen only when present, so
// no build ever links it. `--reader auto` records the probe's answer as the first step of its
// fallback chain (cuFile -> io_uring -> pread); `--reader cufile` turns a failed probe into
// UnsupportedError with the same reason.
#pragma once

#include <string>

namespace sharpi {

struct CufileProbe {
    bool usable = false;
    std::string library;  // the path or soname that loaded, when it did
    // What is missing, empty if usable: without a device only cuda::describe() ("no CUDA device (no
    // NVIDIA driver)"); with one, "libcufile not found (...; pip install nvidia-cufile ...)".
    std::string why;
};

// Looks for a device (cuda::available) and libcufile: $SHARPI_CUFILE_LIB when set, else
// libcufile.so.0 then libcufile.so through the dynamic loader's search path; the library must export
// cuFileDriverOpen and cuFileRead. Loads nothing else and calls nothing in it. `library` is filled
// whether or not there is a device; a missing library counts in `why` only where a device is present.
CufileProbe probe_cufile();

}  // namespace sharpi
