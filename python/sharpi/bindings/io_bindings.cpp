#include "bindings.h"

namespace sharpi::py_bindings {

void bind_io(pybind11::module_& m) {}

}  // namespace sharpi::py_bindings
