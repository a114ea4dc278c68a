#include "bindings.h"

namespace sharpi::py_bindings {

void bind_sampler(pybind11::module_& m) {}

}  // namespace sharpi::py_bindings
