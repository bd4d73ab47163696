// pykvtier._native.BlockIndex: include/pykvtier/block_index.hpp for DiskTier. Digests cross as
// bytes (16) or, for a batch, one C-contiguous buffer of n*16 bytes; codes come back as ints
// (Answer, Admit, BlockState) or one bytes object of n codes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

#include "key_digest.hpp"
#include "module_parts.hpp"
#include "pykvtier/block_index.hpp"

namespace py = pybind11;

namespace pykvtier::python {

namespace {

// A tier's index and whether the tier is shut down (then lookups raise).
struct PyBlockIndex {
  BlockIndex index;
  bool closed = false;
  explicit PyBlockIndex(bool unknown_is_miss) : index(unknown_is_miss) {}
};

std::string type_name(py::handle h) { return py::str(py::type::handle_of(h).attr("__name__")); }

// One digest: bytes of kDigestBytes.
const uint8_t* one_digest(py::handle h) {
  if (!PyBytes_Check(h.ptr())) throw py::type_error("digest must be bytes, not " + type_name(h));
  if (PyBytes_GET_SIZE(h.ptr()) != Py_ssize_t(kDigestBytes))
    throw py::value_error("digest must be " + std::to_string(kDigestBytes) + " bytes, got " +
                          std::to_string(PyBytes_GET_SIZE(h.ptr())));
  return reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(h.ptr()));
}

// A buffer held for the length of one call (released on every path).
struct HeldBuffer {
  Py_buffer view{};
  HeldBuffer(PyObject* o, int flags) {
    if (PyObject_GetBuffer(o, &view, flags) != 0) throw py::error_already_set();
  }
  explicit HeldBuffer(Py_buffer&& got) : view(got) {}  // (one PyObject_GetBuffer filled)
  ~HeldBuffer() { PyBuffer_Release(&view); }
  HeldBuffer(const HeldBuffer&) = delete;
  HeldBuffer& operator=(const HeldBuffer&) = delete;
};

// h, where it supports the buffer protocol (and is not str); TypeError naming digests else.
PyObject* digests_buffer(py::handle h) {
  if (PyUnicode_Check(h.ptr()) || !PyObject_CheckBuffer(h.ptr()))
    throw py::type_error("digests must be a buffer of 16-byte digests (bytes), not " + type_name(h));
  return h.ptr();
}

// A batch of digests: a C-contiguous buffer of n * kDigestBytes bytes (n may be 0). TypeError for
// another type or a buffer that is not C-contiguous, ValueError for a length not a multiple of 16.
struct Digests {
  HeldBuffer buf;
  const uint8_t* data = nullptr;
  size_t n = 0;
  explicit Digests(py::handle h) : buf(digests_buffer(h), PyBUF_FULL_RO) {
    const Py_buffer& v = buf.view;
    if (!PyBuffer_IsContiguous(&v, 'C'))
      throw py::type_error("digests must be a C-contiguous buffer of 16-byte digests; this " + type_name(h) +
                           " is not contiguous");
    const size_t bytes = size_t(v.len);
    if (bytes % kDigestBytes)
      throw py::value_error("digests: " + std::to_string(bytes) + " bytes is not a multiple of " +
                            std::to_string(kDigestBytes));
    data = static_cast<const uint8_t*>(v.buf);
    n = bytes / kDigestBytes;
  }
};

py::object codes_or_none(const std::string& codes, size_t ok) {
  if (ok == codes.size()) return py::none();
  return py::bytes(codes);
}

// The digest of a key: bytes as they are; any other buffer but str (bytearray, memoryview, numpy
// array...) over its logical bytes in C order, i.e. the digest of bytes(key), which check_job makes of
// such a key (a C-contiguous buffer is hashed in place, another one copied first).
void digest_key(py::handle key, uint8_t out[kDigestBytes]) {
  PyObject* k = key.ptr();
  if (PyBytes_CheckExact(k)) {
    detail::key_digest(PyBytes_AS_STRING(k), size_t(PyBytes_GET_SIZE(k)), out);
    return;
  }
  if (PyUnicode_Check(k) || !PyObject_CheckBuffer(k))
    throw py::type_error("key must be bytes, not " + type_name(key));
  {
    HeldBuffer b(k, PyBUF_FULL_RO);
    if (PyBuffer_IsContiguous(&b.view, 'C')) {
      detail::key_digest(b.view.buf, size_t(b.view.len), out);
      return;
    }
  }
  PyObject* copy = PyBytes_FromObject(k);
  if (copy == nullptr) throw py::error_already_set();
  py::object hold = py::reinterpret_steal<py::object>(copy);
  detail::key_digest(PyBytes_AS_STRING(copy), size_t(PyBytes_GET_SIZE(copy)), out);
}

int lookup_key(PyBlockIndex& self, py::handle key) {
  if (self.closed) throw std::runtime_error("DiskTier is shut down");
  uint8_t d[kDigestBytes];
  digest_key(key, d);
  return int(self.index.lookup(d));
}

// A job id as an int64: ValueError naming it outside [0, 2**63), TypeError for a non-integer.
int64_t job_id_of(py::handle h) {
  PyObject* o = h.ptr();
  if (PyBool_Check(o)) throw py::type_error("job_id must be an integer, not bool");
  PyObject* idx = PyNumber_Index(o);
  if (idx == nullptr) {
    PyErr_Clear();
    throw py::type_error("job_id must be an integer, not " + type_name(h));
  }
  py::object hold = py::reinterpret_steal<py::object>(idx);
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(idx, &overflow);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (overflow != 0 || v < 0)
    throw py::value_error("job_id " + py::str(idx).cast<std::string>() + " must be in [0, 2**63)");
  return v;
}

// Whether o is a bool of an array library (a torch bool tensor's item, numpy.bool_), which an index()
// would take as 0 or 1.
bool is_bool_scalar(PyObject* o) {
  PyObject* dt = PyObject_GetAttrString(o, "dtype");
  if (dt == nullptr) {
    PyErr_Clear();
    return false;
  }
  py::object hold = py::reinterpret_steal<py::object>(dt);
  const std::string name = py::str(hold);
  return name == "bool" || name == "torch.bool";
}

// One slot id as an int64 (-1 for a value beyond int64: outside the arena either way); TypeError naming
// the job for a non-integer or a bool.
int64_t slot_of(PyObject* o, const std::string& job) {
  long long v;
  if (PyLong_CheckExact(o)) {
    v = PyLong_AsLongLong(o);
  } else {
    if (PyBool_Check(o) || is_bool_scalar(o)) throw py::type_error(job + "slot id must be an integer, not bool");
    PyObject* idx = PyNumber_Index(o);
    if (idx == nullptr) {
      PyErr_Clear();
      throw py::type_error(job + "slot id must be an integer, not " + type_name(o));
    }
    v = PyLong_AsLongLong(idx);
    Py_DECREF(idx);
  }
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    v = -1;
  }
  return v;
}

[[noreturn]] void slot_outside(const std::string& job, const std::string& shown, uint64_t num_slots) {
  throw py::value_error(job + "slot " + shown + " outside the arena (0.." + std::to_string(num_slots - 1) + ")");
}

// The n integers of type T at base, step bytes apart, into out; ValueError naming the job for one
// outside [0, num_slots).
template <typename T>
void read_int_items(const char* base, Py_ssize_t step, size_t n, uint64_t num_slots, const std::string& job,
                    int64_t* out) {
  for (size_t i = 0; i < n; ++i) {
    T x;
    std::memcpy(&x, base + Py_ssize_t(i) * step, sizeof x);
    if (uint64_t(x) >= num_slots) slot_outside(job, std::to_string(x), num_slots);  // (negatives too)
    out[i] = int64_t(x);
  }
}

// A job's slot ids into out (n of them; ValueError naming the job for another count or a slot outside
// [0, num_slots)): a one-dimensional buffer of integers (a numpy integer array) read in place, any other
// sequence item by item.
void read_slots(py::handle slots, size_t n, uint64_t num_slots, const std::string& job, int64_t* out) {
  PyObject* so = slots.ptr();
  Py_buffer view{};
  bool got = false;
  if (PyObject_CheckBuffer(so)) {
    got = PyObject_GetBuffer(so, &view, PyBUF_RECORDS_RO) == 0;
    if (!got) PyErr_Clear();  // (e.g. a numpy datetime64 array: read item by item below, refused there)
  }
  if (got) {
    HeldBuffer b(std::move(view));
    const char* f = b.view.format ? b.view.format : "B";
    if (*f == '@' || *f == '=' || *f == '<') ++f;
    const bool integral = f[0] != '\0' && f[1] == '\0' && std::strchr("bBhHiIlLqQnN", f[0]) != nullptr;
    if (integral && b.view.ndim == 1) {
      if (size_t(b.view.shape[0]) != n)
        throw py::value_error(job + std::to_string(n) + " keys but " + std::to_string(b.view.shape[0]) +
                              " slot_ids");
      const bool is_signed = std::islower(static_cast<unsigned char>(f[0])) != 0;
      const auto* base = static_cast<const char*>(b.view.buf);
      const Py_ssize_t step = b.view.strides[0];
      switch (b.view.itemsize) {
        case 1: return is_signed ? read_int_items<int8_t>(base, step, n, num_slots, job, out)
                                 : read_int_items<uint8_t>(base, step, n, num_slots, job, out);
        case 2: return is_signed ? read_int_items<int16_t>(base, step, n, num_slots, job, out)
                                 : read_int_items<uint16_t>(base, step, n, num_slots, job, out);
        case 4: return is_signed ? read_int_items<int32_t>(base, step, n, num_slots, job, out)
                                 : read_int_items<uint32_t>(base, step, n, num_slots, job, out);
        case 8: return is_signed ? read_int_items<int64_t>(base, step, n, num_slots, job, out)
                                 : read_int_items<uint64_t>(base, step, n, num_slots, job, out);
        default:
          throw py::type_error(job + "slot_ids: an integer buffer of " + std::to_string(b.view.itemsize) +
                               "-byte items is not supported");
      }
      return;
    }
  }
  PyObject* seq = PySequence_Fast(so, "slot_ids must be a sequence of ints");
  if (seq == nullptr) {
    PyErr_Clear();
    throw py::type_error(job + "slot_ids must be a sequence of ints, not " + type_name(slots));
  }
  py::object hold = py::reinterpret_steal<py::object>(seq);
  const size_t ns = size_t(PySequence_Fast_GET_SIZE(seq));
  if (ns != n) throw py::value_error(job + std::to_string(n) + " keys but " + std::to_string(ns) + " slot_ids");
  PyObject** items = PySequence_Fast_ITEMS(seq);
  for (size_t i = 0; i < n; ++i) {
    const int64_t v = slot_of(items[i], job);
    if (v < 0 || uint64_t(v) >= num_slots) slot_outside(job, py::str(items[i]).cast<std::string>(), num_slots);
    out[i] = v;
  }
}

bool is_text_or_bytes(PyObject* o) {
  return PyUnicode_Check(o) || PyBytes_Check(o) || PyByteArray_Check(o) || PyMemoryView_Check(o);
}

// The checks of a DiskTier job (see check_job's docstring). Raises with the job's id.
py::tuple check_job(py::handle job_obj, uint64_t num_slots, bool unique_slots, py::handle digests,
                    py::handle in_flight) {
  py::object id_obj = job_obj.attr("job_id");
  const int64_t job_id = job_id_of(id_obj);
  const std::string job = "job " + std::to_string(job_id) + ": ";
  if (!in_flight.is_none()) {
    py::int_ key(job_id);
    const int found = PySet_Contains(in_flight.ptr(), key.ptr());
    if (found < 0) throw py::error_already_set();
    if (found)
      throw py::value_error("job_id " + std::to_string(job_id) +
                            " is already in flight (or its result not yet reported by get_finished_jobs())");
  }
  py::object keys_obj = job_obj.attr("keys");
  py::object slots = job_obj.attr("slot_ids");
  if (is_text_or_bytes(keys_obj.ptr()))
    throw py::type_error(job + "keys must be a sequence of keys (bytes), not one " + type_name(keys_obj) +
                         ": wrap a single key in a list");
  if (is_text_or_bytes(slots.ptr()))
    throw py::type_error(job + "slot_ids must be a sequence of ints, not one " + type_name(slots));
  PyObject* klist = PySequence_List(keys_obj.ptr());
  if (klist == nullptr) {
    PyErr_Clear();
    throw py::type_error(job + "keys must be a sequence of keys (bytes), not " + type_name(keys_obj));
  }
  py::list keys = py::reinterpret_steal<py::list>(klist);
  const size_t n = size_t(PyList_GET_SIZE(klist));
  std::string slot_buf(n * sizeof(int64_t), '\0');
  auto* out = reinterpret_cast<int64_t*>(slot_buf.data());
  read_slots(slots, n, num_slots, job, out);
  if (unique_slots && n > 1) {
    std::vector<int64_t> sorted(out, out + n);
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
      std::unordered_set<int64_t> seen;
      for (size_t i = 0; i < n; ++i)
        if (!seen.insert(out[i]).second)
          throw py::value_error(job + "slot " + std::to_string(out[i]) +
                                " given twice; a load needs a slot per key");
    }
  }
  std::string digest_buf(n * kDigestBytes, '\0');
  auto* dst = reinterpret_cast<uint8_t*>(digest_buf.data());
  const bool given = !digests.is_none();
  for (size_t i = 0; i < n; ++i) {  // keys as bytes (another buffer copied: bytes(key))
    PyObject* k = PyList_GET_ITEM(klist, Py_ssize_t(i));
    if (!PyBytes_CheckExact(k)) {
      if (PyUnicode_Check(k) || !PyObject_CheckBuffer(k))
        throw py::type_error(job + "key must be bytes, not " + type_name(k));
      PyObject* b = PyBytes_FromObject(k);
      if (b == nullptr) throw py::error_already_set();
      PyList_SetItem(klist, Py_ssize_t(i), b);  // (steals b, releases the old item)
      k = b;
    }
    if (!given) detail::key_digest(PyBytes_AS_STRING(k), size_t(PyBytes_GET_SIZE(k)), dst + i * kDigestBytes);
  }
  if (given) {
    const std::string bad = job + "digests must be one 16-byte key_digest per key";
    PyObject* dseq = PySequence_Fast(digests.ptr(), "digests must be a sequence");
    if (dseq == nullptr) {
      PyErr_Clear();
      throw py::value_error(bad);
    }
    py::object dhold = py::reinterpret_steal<py::object>(dseq);
    if (size_t(PySequence_Fast_GET_SIZE(dseq)) != n) throw py::value_error(bad);
    PyObject** ds = PySequence_Fast_ITEMS(dseq);
    for (size_t i = 0; i < n; ++i) {
      if (!PyBytes_CheckExact(ds[i]) || PyBytes_GET_SIZE(ds[i]) != Py_ssize_t(kDigestBytes))
        throw py::value_error(bad);
      std::memcpy(dst + i * kDigestBytes, PyBytes_AS_STRING(ds[i]), kDigestBytes);
    }
  }
  return py::make_tuple(keys, py::bytes(digest_buf), py::bytes(slot_buf));
}

}  // namespace

void register_block_index(py::module_& m) {
  m.def("check_job", &check_job, py::arg("job"), py::arg("num_slots"), py::arg("unique_slots"),
        py::arg("digests") = py::none(), py::arg("in_flight") = py::none(), R"doc(
The checks of a DiskTier job, in one call. ``job``: an object with ``job_id`` (an integer in
[0, 2**63); ValueError "job_id <id> must be in [0, 2**63)" else; ValueError "... already in flight"
when it is in the set ``in_flight``), ``keys`` (a sequence of keys: bytes, or another buffer than
str (bytearray, memoryview, numpy array, strided or not), taken as bytes(key); TypeError "key must be
bytes, not <type>" for str or a non-buffer, and for a single bytes/str given as keys) and
``slot_ids`` (a sequence of integers or a one-dimensional numpy integer array, one per key, each in
[0, num_slots); with unique_slots no slot twice). ``digests``: one 16-byte key_digest per key where
the caller has them, else computed here (BLAKE2b, once per key). Returns (keys: a new list of bytes,
digests: bytes of 16 per key, slots: bytes of one native int64 per key). TypeError / ValueError
naming the job ("job <id>: ...") and the slot; nothing is changed then.)doc");
  py::class_<PyBlockIndex>(m, "BlockIndex", R"doc(
The block index of one tier root (include/pykvtier/block_index.hpp): each key digest's state
(BlockState: 0 absent, 1 present, 2 writing, 3 removing, 4 failed: a tombstone, MISS until stored
again), loads reading it, a failed mark, and least-recently-used order of present blocks. Lookups
answer 0 HIT, 1 MISS, 2 RETRY, 3 HIT_PENDING (pykvtier.tier.LookupResult's members) or 4 (unknown:
not indexed, where unknown_is_miss is False). Batches take digests as one C-contiguous buffer of n*16
bytes (TypeError "digests must be a C-contiguous buffer ..." for one that is not); admit_*
give one code per key (bytes), or None when every key was admitted (Admit: 0 ok, 1 failed, 2 absent,
3 writing, 4 removing, 5 present, 6 needs room). Not thread-safe: the tier's calling thread only.
TypeError/ValueError for a digest that is not 16 bytes.)doc")
      .def(py::init<bool>(), py::arg("unknown_is_miss"))
      .def("lookup", [](PyBlockIndex& self, py::handle digest) {
             if (self.closed) throw std::runtime_error("DiskTier is shut down");
             return int(self.index.lookup(one_digest(digest)));
           }, py::arg("digest"), "Answer for a key digest (counted; 4 = unknown is not).")
      .def("lookup_key", &lookup_key, py::arg("key"),
           "lookup() of key's digest: BLAKE2b-16 of the key's bytes (bytes, or another buffer but str\n"
           "hashed as bytes(key), strided or not, as check_job makes it); TypeError otherwise.")
      .def("count", [](PyBlockIndex& self, int answer) {
             if (answer < 0 || answer > 3) throw py::value_error("answer must be 0..3");
             self.index.count(Answer(answer));
           }, py::arg("answer"), "Counts a lookup answered outside the index (a probe's answer).")
      .def("counts", [](PyBlockIndex& self) {
             const LookupCounts& c = self.index.counts();
             py::dict d;
             d["lookups"] = c.lookups;
             d["hits"] = c.hits;
             d["misses"] = c.misses;
             d["retries"] = c.retries;
             d["hit_pending"] = c.hit_pending;
             return d;
           }, "Lookups counted: a dict of lookups, hits, misses, retries, hit_pending.")
      .def("close", [](PyBlockIndex& self) { self.closed = true; },
           "From now on lookup() and lookup_key() raise RuntimeError (the tier is shut down).")
      .def("state", [](PyBlockIndex& self, py::handle d) { return int(self.index.state(one_digest(d))); },
           py::arg("digest"))
      .def("readers", [](PyBlockIndex& self, py::handle d) { return self.index.readers(one_digest(d)); },
           py::arg("digest"), "Loads in flight reading the block.")
      .def("failed", [](PyBlockIndex& self, py::handle d) { return self.index.failed(one_digest(d)); },
           py::arg("digest"))
      .def("__len__", [](PyBlockIndex& self) { return self.index.size(); },
           "Blocks indexed: present, writing or removing.")
      .def_property_readonly("present", [](PyBlockIndex& self) { return self.index.present(); },
                             "Present blocks (loadable, or failed and still read).")
      .def("__contains__", [](PyBlockIndex& self, py::handle d) {
             const BlockState s = self.index.state(one_digest(d));
             return s == BlockState::Present || s == BlockState::Writing || s == BlockState::Removing;
           }, py::arg("digest"), "Whether the digest is indexed (present, writing or removing).")
      .def("admit_loads", [](PyBlockIndex& self, py::handle digests) {
             Digests ds(digests);
             std::string codes(ds.n, '\0');
             const size_t ok = self.index.admit_loads(ds.data, ds.n, reinterpret_cast<uint8_t*>(codes.data()));
             return codes_or_none(codes, ok);
           }, py::arg("digests"),
           "Admits loads: a present block not failed gets one more reader and becomes the most\n"
           "recently used. Codes per key (bytes), or None when all were admitted.")
      .def("finish_loads", [](PyBlockIndex& self, py::handle digests) {
             Digests ds(digests);
             return self.index.finish_loads(ds.data, ds.n);
           }, py::arg("digests"),
           "One reader less per digest; returns how many failed blocks were dropped (left unread).")
      .def("mark_failed", [](PyBlockIndex& self, py::handle d) { return self.index.mark_failed(one_digest(d)); },
           py::arg("digest"), "Marks a block failed (MISS until stored again); True if newly marked.")
      .def("drop_failed", [](PyBlockIndex& self, py::handle d) { return self.index.drop_failed(one_digest(d)); },
           py::arg("digest"), "A failed present block without readers is dropped; True if it was.")
      .def("set_removing", [](PyBlockIndex& self, py::handle d) { return self.index.set_removing(one_digest(d)); },
           py::arg("digest"), "A present block without readers becomes removing; True if it did.")
      .def("admit_stores", [](PyBlockIndex& self, py::handle digests, size_t max_new) {
             Digests ds(digests);
             std::string codes(ds.n, '\0');
             const size_t n = self.index.admit_stores(ds.data, ds.n, max_new, reinterpret_cast<uint8_t*>(codes.data()));
             return py::make_tuple(n, codes_or_none(codes, n));
           }, py::arg("digests"), py::arg("max_new"),
           "Admits stores: new blocks (the first max_new) become writing. Returns (inserted, codes\n"
           "per key or None when every key was inserted).")
      .def("insert_writing", [](PyBlockIndex& self, py::handle d) { return self.index.insert_writing(one_digest(d)); },
           py::arg("digest"))
      .def("finish_stores", [](PyBlockIndex& self, py::handle digests, const std::vector<int64_t>& results) {
             Digests ds(digests);
             if (results.size() != ds.n)
               throw py::value_error(std::to_string(ds.n) + " digests but " + std::to_string(results.size()) + " results");
             return self.index.finish_stores(ds.data, ds.n, results.data());
           }, py::arg("digests"), py::arg("results"),
           "Writing blocks whose result is >= 0 become present (most recently used); returns how many.")
      .def("erase_writing", [](PyBlockIndex& self, py::handle d) { return self.index.erase_writing(one_digest(d)); },
           py::arg("digest"))
      .def("add_present", [](PyBlockIndex& self, py::handle d) { return self.index.add_present(one_digest(d)); },
           py::arg("digest"), "A block found on disk: present unless indexed or failed; True if added.")
      .def("take_victims", [](PyBlockIndex& self, size_t n, py::object keep) {
             std::unordered_set<Digest, DigestHash> k;
             if (!keep.is_none())
               for (py::handle d : keep) k.insert(Digest::of(one_digest(d)));
             std::vector<uint8_t> out;
             const size_t got = self.index.take_victims(n, k, out);
             py::list l(got);
             for (size_t i = 0; i < got; ++i)
               l[i] = py::bytes(reinterpret_cast<const char*>(out.data() + i * kDigestBytes), kDigestBytes);
             return l;
           }, py::arg("n"), py::arg("keep") = py::none(),
           "Up to n least recently used present blocks without readers (none of keep: digests)\n"
           "become removing; their digests (list of bytes), oldest first.")
      .def("forget_removed", [](PyBlockIndex& self, py::handle d) { return self.index.forget_removed(one_digest(d)); },
           py::arg("digest"))
      .def("restore", [](PyBlockIndex& self, py::handle d) { return self.index.restore(one_digest(d)); },
           py::arg("digest"), "A removing block is present again, least recently used; True if it was removing.")
      .def("touch", [](PyBlockIndex& self, py::handle digests) {
             Digests ds(digests);
             self.index.touch(ds.data, ds.n);
           }, py::arg("digests"), "Present blocks among the digests become the most recently used.")
      .def("lru_order", [](PyBlockIndex& self) {
             const std::vector<uint8_t> v = self.index.lru_order();
             py::list l(v.size() / kDigestBytes);
             for (size_t i = 0; i < v.size() / kDigestBytes; ++i)
               l[i] = py::bytes(reinterpret_cast<const char*>(v.data() + i * kDigestBytes), kDigestBytes);
             return l;
           }, "Present blocks' digests, least recently used first (list of bytes).");
}

}  // namespace pykvtier::python
