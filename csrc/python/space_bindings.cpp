// (stub: filled in by its owner this session)
#include "module_parts.hpp"

namespace pykvtier::python {

void register_block_space(pybind11::module_&) {}

}  // namespace pykvtier::python
