// Registration functions of pykvtier._native's parts that live in their own binding files.
#pragma once

#include <pybind11/pybind11.h>

namespace pykvtier::python {

void register_key_digest(pybind11::module_& m);   // digest_bindings.cpp: key_digest, key_digests
void register_block_space(pybind11::module_& m);  // space_bindings.cpp: BlockSpace, SlotClaims, tmp_sequence
void register_block_index(pybind11::module_& m);  // index_bindings.cpp: BlockIndex

}  // namespace pykvtier::python
