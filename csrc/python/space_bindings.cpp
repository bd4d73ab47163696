// pykvtier._native.BlockSpace and tmp_sequence: a tier's block names and slot addresses built in
// C++ (pykvtier/block_space.hpp), for every engine's submit_blocks and, as entry tuples, for
// engines written in Python.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "engine_bindings.hpp"
#include "module_parts.hpp"
#include "pykvtier/block_space.hpp"

namespace pykvtier::python {

namespace {

const uint8_t* digest_of(const std::string& d) {
  if (d.size() != kDigestBytes)
    throw py::value_error("key digest must be " + std::to_string(kDigestBytes) + " bytes, got " +
                          std::to_string(d.size()));
  return reinterpret_cast<const uint8_t*>(d.data());
}

// The requests as the entry tuples submit takes (engine_bindings.hpp).
py::list as_entries(Op op, const std::vector<Request>& reqs) {
  py::list out(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    const Request& r = reqs[i];
    const py::bytes digest(reinterpret_cast<const char*>(r.digest), kDigestBytes);
    if (op == Op::ReadBlock)
      out[i] = py::make_tuple(r.path, r.length, r.addr, digest);
    else if (op == Op::Unlink)
      out[i] = py::make_tuple(r.path);
    else if (r.recycle.empty())
      out[i] = py::make_tuple(r.path, r.target, r.length, r.addr, digest);
    else
      out[i] = py::make_tuple(r.path, r.target, r.length, r.addr, digest, r.recycle);
  }
  return out;
}

// Slots jobs in flight use: per slot 0 (free), kLoading (a load writes it) or the count of store
// entries reading it (claim/release, under the GIL). With span > 1 a job's slot s uses the span
// slots s .. s + span - 1 (a spanning BlockSpace's block), each claimed as above.
class SlotClaims {
 public:
  explicit SlotClaims(uint64_t num_slots, uint64_t span = 1) : span_(span), num_slots_(num_slots) {
    if (num_slots == 0) throw py::value_error("num_slots is 0");
    if (span == 0) throw py::value_error("span is 0");
    use_.assign(num_slots + span - 1, 0);
  }
  // Claims every slot of slots (n native int64, each in [0, num_slots): the caller's check) for
  // job_id, or none: a load's alone (ValueError naming the first slot another job uses), a store's
  // beside other stores' (ValueError naming the first slot a load writes).
  void claim(uint64_t job_id, py::handle slots, bool load) {
    HeldBuffer b(slots, "slots");
    const size_t n = b.nbytes() / 8;
    const uint8_t* p = b.data();
    size_t i = 0;
    try {
      for (; i < n; ++i) {
        const uint64_t s = slot_at(p, i);
        for (uint64_t k = 0; k < span_; ++k) {
          uint32_t& u = use_[s + k];
          if (u == kLoading) {
            release_part(s, k, load);
            throw py::value_error("job " + std::to_string(job_id) + ": slot " + std::to_string(s) +
                                  (k ? " overlaps a slot that" : "") + " is being loaded by another job (" +
                                  (load ? "two reads into one slot would race)"
                                        : "a store from it would write what that load leaves there)"));
          }
          if (load && u != 0) {
            release_part(s, k, load);
            throw py::value_error("job " + std::to_string(job_id) + ": slot " + std::to_string(s) +
                                  (k ? " overlaps a slot that" : "") +
                                  " is being read by a store in flight (the load would overwrite what it stores)");
          }
          u = load ? kLoading : u + 1;
        }
      }
    } catch (...) {
      release_first(p, i, load);  // none claimed
      throw;
    }
  }
  // Releases what claim(job_id, slots, load) claimed.
  void release(py::handle slots, bool load) {
    HeldBuffer b(slots, "slots");
    release_first(b.data(), b.nbytes() / 8, load);
  }
  // Slots in use (by a load or by stores; with span > 1, every slot a claimed block covers).
  size_t claimed() const { return use_.size() - size_t(std::count(use_.begin(), use_.end(), 0u)); }

 private:
  static constexpr uint32_t kLoading = UINT32_MAX;
  void release_one(uint32_t& u, bool load) {
    if (load)
      u = 0;
    else if (u != 0 && u != kLoading)
      --u;
  }
  // Releases the first k slots of slot s's span.
  void release_part(uint64_t s, uint64_t k, bool load) {
    for (uint64_t j = 0; j < k; ++j) release_one(use_[s + j], load);
  }
  void release_first(const uint8_t* p, size_t n, bool load) {
    for (size_t i = 0; i < n; ++i) release_part(slot_at(p, i), span_, load);
  }
  uint64_t slot_at(const uint8_t* p, size_t i) const {
    int64_t s;
    std::memcpy(&s, p + 8 * i, 8);
    if (s < 0 || uint64_t(s) >= num_slots_)
      throw py::value_error("slot " + std::to_string(s) + " is outside [0, " + std::to_string(num_slots_) + ")");
    return uint64_t(s);
  }
  uint64_t span_ = 1;
  uint64_t num_slots_ = 0;
  std::vector<uint32_t> use_;
};

}  // namespace

void register_block_space(py::module_& m) {
  py::class_<SlotClaims>(m, "SlotClaims", R"doc(
The arena slots jobs in flight use: SlotClaims(num_slots, span=1). With span > 1 a job's slot s
stands for the span slots s .. s + span - 1 (a spanning BlockSpace's block), each claimed as one.
claim(job_id, slots, load) claims every
slot of slots (a buffer of native int64: bytes, array('q'), numpy int64) or none: a load's slots
for it alone (ValueError naming the job and the slot when another load writes it: two reads racing
into one slot would each fail verification over the other's bytes; or a store reads it: the store
would write the loaded bytes under its own key), a store's beside other stores' (ValueError when a
load writes one). release(slots, load) frees what claim took; claimed() counts the slots in use. A
slot outside [0, num_slots) is a ValueError. Not thread-safe (the tier's thread; an adapter over
several tiers may share one).
)doc")
      .def(py::init<uint64_t, uint64_t>(), py::arg("num_slots"), py::arg("span") = 1)
      .def("claim", &SlotClaims::claim, py::arg("job_id"), py::arg("slots"), py::arg("load"))
      .def("release", &SlotClaims::release, py::arg("slots"), py::arg("load"))
      .def("claimed", &SlotClaims::claimed);

  m.def("tmp_sequence", &next_tmp_sequence,
        "The next value (int: 1, 2, 3, ...) of the process's one temporary-name sequence, which\n"
        "BlockSpace.tmp_path and pykvtier.layout's temporaries draw from: no two temporary names of\n"
        "the process repeat. Thread-safe.");

  py::class_<BlockSpace>(m, "BlockSpace", R"doc(
A tier's block space: its block files' directory and the arena its slots are in.

BlockSpace(blocks_dir: str, payload_bytes: int, arena_addr: int, slot_bytes: int, num_slots: int,
           spanning: bool = False)

Slot s is the memory [arena_addr + s * slot_bytes, + payload_bytes) (host or device memory, as
the engine it is given to moves it). With spanning=True slot_bytes may be smaller than
payload_bytes: slots start every slot_bytes and a block covers several (the caller keeps jobs'
blocks apart, e.g. SlotClaims(num_slots, span)). Names (str): block_path(d) = blocks_dir + "/<2 hex>/<32
hex>.kvb" of the 16-byte key digest d (pykvtier.layout.Layout.block_path); tmp_path(d) =
block_path(d) + ".tmp.<pid>.<n>", n the next tmp_sequence() (pid taken at construction).
Raises ValueError naming the argument: payload_bytes 0 or above 1 GiB, slot_bytes 0 or (not
spanning) < payload_bytes, arena_addr 0, num_slots 0, an arena past the end of the address space, a
blocks_dir that is empty, has a NUL byte or leaves no room for its names under PATH_MAX.
Immutable; thread-safe. Engines take it in submit_blocks.
)doc")
      .def(py::init([](const std::string& blocks_dir, uint64_t payload_bytes, uint64_t arena_addr, uint64_t slot_bytes,
                       uint64_t num_slots, bool spanning) {
             try {
               return BlockSpace(blocks_dir, payload_bytes, arena_addr, slot_bytes, num_slots, spanning);
             } catch (const std::invalid_argument& e) {
               throw py::value_error(e.what());
             }
           }),
           py::arg("blocks_dir"), py::arg("payload_bytes"), py::arg("arena_addr"), py::arg("slot_bytes"),
           py::arg("num_slots"), py::arg("spanning") = false)
      .def_readonly("blocks_dir", &BlockSpace::blocks_dir)
      .def_readonly("spanning", &BlockSpace::spanning)
      .def_readonly("payload_bytes", &BlockSpace::payload_bytes)
      .def_readonly("arena_addr", &BlockSpace::arena_addr)
      .def_readonly("slot_bytes", &BlockSpace::slot_bytes)
      .def_readonly("num_slots", &BlockSpace::num_slots)
      .def_readonly("pid", &BlockSpace::pid)
      .def(
          "block_path", [](const BlockSpace& s, const py::bytes& digest) { return s.block_path(digest_of(digest)); },
          py::arg("digest"), "The block file of a 16-byte key digest (str); ValueError for another length.")
      .def(
          "tmp_path", [](const BlockSpace& s, const py::bytes& digest) { return s.tmp_path(digest_of(digest)); },
          py::arg("digest"),
          "A fresh temporary name (str) beside block_path(digest), never returned before in this\n"
          "process; ValueError for a digest that is not 16 bytes.")
      .def(
          "entries",
          [](const BlockSpace& s, py::handle op, py::handle digests, py::handle slots, py::handle victims) {
            const Op o = op_from_object(op);
            std::vector<Request> reqs;
            block_requests(s, o, digests, slots, victims, /*recycles=*/true, reqs);
            return as_entries(o, reqs);
          },
          py::arg("op"), py::arg("digests"), py::arg("slots") = py::none(), py::arg("victims") = py::none(),
          "The entry tuples (list of tuple, one per digest, in order) that an engine's submit takes for\n"
          "what submit_blocks(job_id, op, self, digests, slots, victims) queues, for engines written\n"
          "in Python: READ_BLOCK (path, payload_bytes, addr, digest); WRITE_BLOCK (tmp_path,\n"
          "block_path, payload_bytes, addr, digest[, the victim's block_path]); UNLINK (path,).\n"
          "Arguments and errors as submit_blocks'; each WRITE_BLOCK entry takes a fresh tmp_path.")
      .def("__repr__", [](const BlockSpace& s) {
        return "BlockSpace(blocks_dir=" + std::string(py::repr(py::str(s.blocks_dir))) +
               ", payload_bytes=" + std::to_string(s.payload_bytes) + ", arena_addr=" + hex(s.arena_addr) +
               ", slot_bytes=" + std::to_string(s.slot_bytes) + ", num_slots=" + std::to_string(s.num_slots) + ")";
      });
}

}  // namespace pykvtier::python
