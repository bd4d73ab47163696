// pykvtier._native.key_digest / key_digests: detail::key_digest (BLAKE2b-128 through libb2) of
// keys given as bytes, bytearray or a C-contiguous memoryview (its raw bytes, whatever its format).
// Hashing is short, so the GIL is held throughout; nothing here calls back into Python code.
#include <pybind11/pybind11.h>

#include <string>

#include "key_digest.hpp"
#include "module_parts.hpp"

namespace py = pybind11;

namespace pykvtier::python {

namespace {

std::string type_name(PyObject* o) { return py::str(py::type::handle_of(o).attr("__name__")); }

// Writes the digest of key to out; what_prefix and index (-1: none) name the key in errors
// ("key", "keys[3]"). Raises
// TypeError for a key that is not bytes, bytearray or memoryview, ValueError for a memoryview that
// is not C-contiguous, and the memoryview's own error for a released one.
void digest_of(PyObject* key, const char* what_prefix, Py_ssize_t index, uint8_t out[kDigestBytes]) {
  auto what = [&] {
    return index < 0 ? std::string(what_prefix) : std::string(what_prefix) + "[" + std::to_string(index) + "]";
  };
  if (PyBytes_Check(key)) {
    detail::key_digest(PyBytes_AS_STRING(key), size_t(PyBytes_GET_SIZE(key)), out);
  } else if (PyByteArray_Check(key)) {
    detail::key_digest(PyByteArray_AS_STRING(key), size_t(PyByteArray_GET_SIZE(key)), out);
  } else if (PyMemoryView_Check(key)) {
    Py_buffer view;
    if (PyObject_GetBuffer(key, &view, PyBUF_RECORDS_RO) != 0) throw py::error_already_set();
    if (!PyBuffer_IsContiguous(&view, 'C')) {
      PyBuffer_Release(&view);
      throw py::value_error(what() + " must be a C-contiguous buffer; this memoryview is not");
    }
    detail::key_digest(view.buf, size_t(view.len), out);
    PyBuffer_Release(&view);
  } else {
    throw py::type_error(what() + " must be bytes, not " + type_name(key));
  }
}

}  // namespace

void register_key_digest(py::module_& m) {
  m.def(
      "key_digest",
      [](py::handle key) {
        uint8_t d[kDigestBytes];
        digest_of(key.ptr(), "key", -1, d);
        return py::bytes(reinterpret_cast<const char*>(d), kDigestBytes);
      },
      py::arg("key"),
      "key_digest(key) -> bytes: the 16-byte BLAKE2b digest of key (bytes, bytearray or a\n"
      "C-contiguous memoryview, hashed as its raw bytes) that names the key's block file and is\n"
      "stored in its header; equals hashlib.blake2b(key, digest_size=16).digest(). Raises\n"
      "TypeError (\"key must be bytes, not <type>\") for another type, ValueError for a\n"
      "memoryview that is not C-contiguous. Thread-safe; holds the GIL.");
  m.def(
      "key_digests",
      [](py::handle keys) {
        PyObject* seq = keys.ptr();
        if (!PyList_Check(seq) && !PyTuple_Check(seq))
          throw py::type_error("keys must be a list or tuple of bytes, not " + type_name(seq));
        const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        PyObject** items = PySequence_Fast_ITEMS(seq);
        PyObject* out = PyBytes_FromStringAndSize(nullptr, n * Py_ssize_t(kDigestBytes));
        if (!out) throw py::error_already_set();
        py::object result = py::reinterpret_steal<py::object>(out);
        auto* dst = reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(out));
        // No Python code runs in this loop (and the GIL is held), so the list cannot change.
        for (Py_ssize_t i = 0; i < n; ++i) digest_of(items[i], "keys", i, dst + size_t(i) * kDigestBytes);
        return result;
      },
      py::arg("keys"),
      "key_digests(keys) -> bytes: the key_digest of each key of a list or tuple, in order,\n"
      "concatenated: 16 * len(keys) bytes (b\"\" for no keys). Raises TypeError (\"keys[<i>] must\n"
      "be bytes, not <type>\") for a key of another type, naming its index, and for keys that\n"
      "are not a list or tuple; ValueError for a memoryview that is not C-contiguous.\n"
      "Thread-safe; holds the GIL.");
}

}  // namespace pykvtier::python
