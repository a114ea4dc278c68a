#include "io/cufile_probe.h"

#include <dlfcn.h>

#include <cstdlib>
#include <vector>

#include "backend/cuda_interface.h"

namespace sharpi {

CufileProbe probe_cufile() {
    CufileProbe p;
    std::vector<std::string> missing;
    const bool device = cuda::available();
    if (!device) missing.push_back(cuda::describe());
    std::vector<std::string> names;
    if (const char* env = std::getenv("SHARPI_CUFILE_LIB"); env != nullptr && *env != '\0') {
        names.emplace_back(env);
    } else {
        names = {"libcufile.so.0", "libcufile.so"};
    }
    std::string load_error;
    for (const std::string& name : names) {
        void* handle = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (handle == nullptr) {
            const char* e = ::dlerror();
            load_error = e != nullptr ? e : name + ": cannot be loaded";
            continue;
        }
        const bool complete =
            ::dlsym(handle, "cuFileDriverOpen") != nullptr && ::dlsym(handle, "cuFileRead") != nullptr;
        ::dlclose(handle);
        if (complete) {
            p.library = name;
            load_error.clear();
            break;
        }
        load_error = name + " does not export cuFileDriverOpen and cuFileRead";
    }
    // Without a device the library could not be used anyway: say only that, not how to install it.
    if (p.library.empty() && device) {
        missing.push_back("libcufile not found (" + load_error +
                          "; pip install nvidia-cufile or set SHARPI_CUFILE_LIB)");
    }
    for (size_t i = 0; i < missing.size(); ++i) p.why += (i ? "; " : "") + missing[i];
    p.usable = missing.empty();
    return p;
}

}  // namespace sharpi
