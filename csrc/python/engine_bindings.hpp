// Python side of the engine interface (include/pykvtier/engine.hpp), shared by the bindings of
// every engine module (pykvtier._native: io_uring, posix; pykvtier._gds): entry tuples -> a Job of
// the one model, the submit keywords, and def_engine(), which binds the interface's methods the
// same way for every engine. Only files under python/ (and gds_bindings.cpp) touch Python objects.
//
// Entries per op (an Op member; a str is a TypeError. addr: host or device memory, as the
// engine moves it):
//   READ / WRITE:  (path, file_offset, length, addr[, rename_target (WRITE only)])
//   READ_BLOCK:    (path, payload_length, addr, key_digest: 16 bytes)
//   WRITE_BLOCK:   (tmp_path, final_path, payload_length, addr, key_digest: 16 bytes
//                   [, recycle_path: an evicted block file to reuse, or ""])
//   UNLINK:        path, or (path,)
// submit_blocks builds the same requests from a BlockSpace (pykvtier/block_space.hpp), key
// digests and slots, without entry tuples.
//
// The Python types of the job model (Op, Verify, FinishedJob, BlockError) are registered once, by
// pykvtier._native (python/bindings.cpp: register_job_types); another engine module imports
// pykvtier._native in its init before it returns FinishedJob objects.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <bit>
#include <cstring>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "pykvtier/block_space.hpp"
#include "pykvtier/engine.hpp"

namespace pykvtier::python {

namespace py = pybind11;

inline constexpr uint64_t kMaxRequestBytes = 1ull << 30;  // CQE results are int32

// The name of h's type ("bytes", "list"), for TypeErrors.
inline std::string type_name(py::handle h) { return py::str(py::type::handle_of(h).attr("__name__")); }

[[noreturn]] inline void entry_error(size_t i, const std::string& path, const std::string& what) {
  std::string shown;  // a NUL byte would end the message: shown as \0; a long path shortened
  for (char ch : path.substr(0, 200)) shown += ch == '\0' ? std::string("\\0") : std::string(1, ch);
  if (path.size() > 200) shown += "...";
  throw py::value_error("entry " + std::to_string(i) + " (" + shown + "): " + what);
}

// Entry i's `what` (its path, rename target or recycle path) is one the kernel takes: not empty
// (unless optional), no NUL byte, shorter than PATH_MAX. (io_uring fails such a path while
// preparing the open, which cancels the rest of its chain without completions: it must never
// reach the ring.)
inline void check_path(size_t i, const std::string& entry_path, const char* what,
                       const std::string& path, bool optional) {
  if (path.empty()) {
    if (optional) return;
    entry_error(i, entry_path, std::string(what) + " is empty");
  }
  if (path.find('\0') != std::string::npos)
    entry_error(i, entry_path, std::string(what) + " contains a NUL byte");
  if (path.size() >= 4096)
    entry_error(i, entry_path, std::string(what) + " is " + std::to_string(path.size()) +
                                   " bytes, not shorter than PATH_MAX (4096)");
}

// op as an Op; TypeError for anything else, a str included ("op must be a pykvtier._native.Op
// (e.g. Op.READ_BLOCK), not str 'read_block'"): ops cross to Python as the enum only.
inline Op op_from_object(py::handle op) {
  if (py::isinstance<Op>(op)) return op.cast<Op>();
  std::string what = type_name(op);
  if (py::isinstance<py::str>(op)) what += " " + std::string(py::repr(op));
  throw py::type_error("op must be a pykvtier._native.Op (e.g. Op.READ_BLOCK), not " + what);
}

inline Verify verify_from_name(const std::string& s) {
  if (s == "payload") return Verify::Payload;
  if (s == "header") return Verify::Header;
  throw py::value_error("verify must be \"payload\" or \"header\", got '" + s + "'");
}

namespace entries_detail {

inline void read_digest(size_t i, Request& r, py::handle h) {
  std::string d = h.cast<py::bytes>();
  if (d.size() != kDigestBytes)
    entry_error(i, r.path, "key digest must be " + std::to_string(kDigestBytes) + " bytes");
  std::memcpy(r.digest, d.data(), kDigestBytes);
}

inline void need(size_t i, const py::tuple& t, size_t k, Op op) {
  if (t.size() != k)
    throw py::value_error("entry " + std::to_string(i) + ": expected a tuple of " + std::to_string(k) +
                          " items for op '" + op_name(op) + "', got " + std::to_string(t.size()));
}

// One tuple entry of a READ / WRITE / READ_BLOCK / WRITE_BLOCK job into r.
inline void parse_tuple(size_t i, Op op, const py::tuple& t, Request& r, bool recycles) {
  switch (op) {
    case Op::Read:
    case Op::Write:
      if (t.size() == 5 && op == Op::Write)
        r.target = t[4].cast<std::string>();
      else
        need(i, t, 4, op);
      r.path = t[0].cast<std::string>();
      r.offset = t[1].cast<uint64_t>();
      r.length = t[2].cast<uint64_t>();
      r.addr = t[3].cast<uint64_t>();
      return;
    case Op::ReadBlock:
      need(i, t, 4, op);
      r.path = t[0].cast<std::string>();
      r.length = t[1].cast<uint64_t>();
      r.addr = t[2].cast<uint64_t>();
      read_digest(i, r, t[3]);
      return;
    case Op::WriteBlock:
      if (t.size() != 6) need(i, t, 5, op);
      r.path = t[0].cast<std::string>();
      r.target = t[1].cast<std::string>();
      r.length = t[2].cast<uint64_t>();
      r.addr = t[3].cast<uint64_t>();
      read_digest(i, r, t[4]);
      if (t.size() == 6) r.recycle = t[5].cast<std::string>();
      if (!r.recycle.empty() && !recycles) entry_error(i, r.path, "this engine does not recycle block files");
      return;
    case Op::Unlink:
      return;
  }
}

}  // namespace entries_detail

// Request i's paths, length (1 byte .. 1 GiB) and address (not NULL) as the engine takes them;
// addr_kind names the memory in errors ("host", "device"). ValueError naming the entry.
inline void check_request(size_t i, Op op, const Request& r, const char* addr_kind) {
  check_path(i, r.path, "path", r.path, false);
  if (op == Op::Unlink) return;
  check_path(i, r.path, "rename target", r.target, true);
  check_path(i, r.path, "recycle path", r.recycle, true);
  if (r.length == 0) entry_error(i, r.path, "length is 0");
  if (r.length > kMaxRequestBytes)
    entry_error(i, r.path, "length " + std::to_string(r.length) + " exceeds the 1 GiB per-request limit");
  if (r.addr == 0) entry_error(i, r.path, std::string(addr_kind) + " address is NULL");
}

// Fills job.reqs from entries (job.op set), checking each entry's shape and check_request.
// recycles: whether the engine takes WRITE_BLOCK's recycle_path. Raises ValueError naming the
// entry; nothing is queued then.
inline void parse_entries(Job& job, const py::sequence& entries, const char* addr_kind, bool recycles) {
  const size_t n = py::len(entries);
  job.reqs.resize(n);
  for (size_t i = 0; i < n; ++i) {
    Request& r = job.reqs[i];
    py::handle e = entries[i];
    if (job.op == Op::Unlink)
      r.path = py::isinstance<py::str>(e) ? e.cast<std::string>()
                                          : py::reinterpret_borrow<py::sequence>(e)[0].cast<std::string>();
    else
      entries_detail::parse_tuple(i, job.op, py::reinterpret_borrow<py::object>(e).cast<py::tuple>(), r, recycles);
    check_request(i, job.op, r, addr_kind);
  }
}

// A contiguous buffer of a Python object, held for the call (PyBUF_ANY_CONTIGUOUS). what names
// the argument in errors: TypeError for an object without the buffer protocol or not contiguous.
class HeldBuffer {
 public:
  HeldBuffer(py::handle obj, const char* what) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_ANY_CONTIGUOUS | PyBUF_FORMAT) != 0) {
      PyErr_Clear();
      throw py::type_error(std::string(what) + " must be a contiguous buffer (bytes, bytearray, a numpy array), not " +
                           type_name(obj));
    }
  }
  ~HeldBuffer() { PyBuffer_Release(&view_); }
  HeldBuffer(const HeldBuffer&) = delete;
  HeldBuffer& operator=(const HeldBuffer&) = delete;
  const uint8_t* data() const { return static_cast<const uint8_t*>(view_.buf); }
  size_t nbytes() const { return size_t(view_.len); }
  size_t itemsize() const { return size_t(view_.itemsize); }
  std::string format() const { return view_.format ? view_.format : "B"; }

 private:
  Py_buffer view_{};
};

// submit_blocks' and BlockSpace.entries' arguments as requests of space: op (READ_BLOCK,
// WRITE_BLOCK or UNLINK), digests (a buffer of n * 16 bytes, n >= 1), slots (a buffer of n int64
// in [0, space.num_slots); None for UNLINK), victims (WRITE_BLOCK: None or {entry index: the
// digest of the evicted block whose file entry index recycles}). recycles: whether the engine
// takes victims. ValueError/TypeError naming the argument and index; reqs is then undefined.
inline void block_requests(const BlockSpace& space, Op op, py::handle digests, py::handle slots,
                           py::handle victims, bool recycles, std::vector<Request>& reqs) {
  if (op != Op::ReadBlock && op != Op::WriteBlock && op != Op::Unlink)
    throw py::value_error(std::string("op must be READ_BLOCK, WRITE_BLOCK or UNLINK for block requests, not ") +
                          op_name(op));
  HeldBuffer d(digests, "digests");
  if (d.nbytes() % kDigestBytes)
    throw py::value_error("digests must be n * 16 bytes (16-byte key digests), got " + std::to_string(d.nbytes()) +
                          " bytes");
  const size_t n = d.nbytes() / kDigestBytes;
  if (n == 0) throw py::value_error("digests is empty: no blocks");
  const uint8_t* slot_bytes = nullptr;
  std::optional<HeldBuffer> s;
  if (op == Op::Unlink) {
    if (!slots.is_none()) throw py::value_error("slots must be None for UNLINK (no memory is moved)");
  } else {
    if (slots.is_none()) throw py::value_error(std::string("slots is required for ") + op_name(op));
    s.emplace(slots, "slots");
    const std::string f = s->format();
    const bool raw = s->itemsize() == 1;  // bytes, bytearray, uint8: n * 8 bytes of native int64
    const bool little = std::endian::native == std::endian::little;
    const bool int64 = s->itemsize() == 8 && (f == "q" || f == "l" || f == "=q" || f == "=l" || f == "@q" ||
                                              f == "@l" || (little && (f == "<q" || f == "<l")));
    if (!raw && !int64)
      throw py::value_error("slots must be int64 (numpy int64, array('q'), or bytes of native int64), got items of "
                            "format '" + f + "' (" + std::to_string(s->itemsize()) + " bytes)");
    if (s->nbytes() != n * 8)
      throw py::value_error("slots has " + (raw ? std::to_string(s->nbytes()) + " bytes" : std::to_string(s->nbytes() / 8) +
                            " items") + " for " + std::to_string(n) + " digests (" + std::to_string(n) +
                            " int64 expected)");
    slot_bytes = s->data();
  }
  reqs.resize(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t slot = 0;
    if (slot_bytes) {
      std::memcpy(&slot, slot_bytes + 8 * i, 8);
      if (slot < 0 || uint64_t(slot) >= space.num_slots)
        throw py::value_error("slots[" + std::to_string(i) + "] = " + std::to_string(slot) + " is outside [0, " +
                              std::to_string(space.num_slots) + "), the space's slots");
    }
    space.fill(op, d.data() + kDigestBytes * i, uint64_t(slot), reqs[i]);
  }
  if (victims.is_none()) return;
  if (!py::isinstance<py::dict>(victims))
    throw py::type_error("victims must be None or a dict {entry index: victim digest}, not " +
                         type_name(victims));
  const auto v = py::reinterpret_borrow<py::dict>(victims);
  if (v.empty()) return;
  if (op != Op::WriteBlock) throw py::value_error("victims are for WRITE_BLOCK only, not " + std::string(op_name(op)));
  for (auto [key, value] : v) {
    if (!py::isinstance<py::int_>(key) || py::isinstance<py::bool_>(key))
      throw py::type_error("victims: keys must be entry indexes (int), not " +
                           type_name(key));
    const int64_t i = key.cast<int64_t>();
    if (i < 0 || uint64_t(i) >= n)
      throw py::value_error("victims: entry index " + std::to_string(i) + " is outside [0, " + std::to_string(n) +
                            ")");
    if (!recycles) entry_error(size_t(i), reqs[i].path, "this engine does not recycle block files");
    if (!py::isinstance<py::bytes>(value))
      throw py::type_error("victims[" + std::to_string(i) + "] must be a 16-byte key digest (bytes), not " +
                           type_name(value));
    const std::string victim = value.cast<std::string>();
    if (victim.size() != kDigestBytes)
      throw py::value_error("victims[" + std::to_string(i) + "]: key digest must be 16 bytes, got " +
                            std::to_string(victim.size()));
    reqs[i].recycle = space.block_path(reinterpret_cast<const uint8_t*>(victim.data()));
  }
}

// The submit keywords every engine takes (pykvtier.engines.Engine.submit), checked once
// (make_options); bound as pykvtier._native.SubmitOptions for callers that submit many jobs with
// the same options (submit_blocks' options argument: no keywords parsed per job).
struct SubmitOptions {
  bool direct = true;
  uint32_t align = 4096;
  uint32_t mem_align = 4096;  // resolved: 0 given means align
  bool fsync = false;
  uint32_t file_mode = 0600;
  Verify verify = Verify::Payload;
};

// The options, checked: ValueError naming the bad one (file_mode outside 0o777 or without 0o600,
// align or mem_align not a power of two, verify not "payload"/"header").
inline SubmitOptions make_options(bool direct, uint32_t align, uint32_t mem_align, bool fsync, uint32_t file_mode,
                                  const std::string& verify) {
  SubmitOptions o;
  o.direct = direct;
  o.fsync = fsync;
  o.verify = verify_from_name(verify);
  if ((file_mode & ~0777u) || (file_mode & 0600u) != 0600u) {
    std::ostringstream m;
    m << "file_mode must be permission bits (within 0o777) with owner read and write (0o600) set, got 0o"
      << std::oct << file_mode;
    throw py::value_error(m.str());
  }
  o.file_mode = file_mode;
  if (align == 0 || (align & (align - 1))) throw py::value_error("align must be a power of two");
  o.align = align;
  o.mem_align = mem_align == 0 ? align : mem_align;
  if (o.mem_align & (o.mem_align - 1)) throw py::value_error("mem_align must be a power of two");
  return o;
}

// What an engine's bindings tell make_job: how it names its memory, whether it recycles files,
// whether O_DIRECT's memory/offset/length alignment is checked here (host engines).
struct EngineTraits {
  const char* addr_kind = "host";
  bool recycles = true;
  bool check_direct_alignment = true;
};

inline std::string hex(uint64_t v) {
  std::ostringstream o;
  o << "0x" << std::hex << v;
  return o.str();
}

// O_DIRECT's alignment of every request's address, length and offset (host engines, direct).
inline void check_direct_alignment(const Job& job, uint32_t mem_align) {
  if (job.op == Op::Unlink) return;
  const std::string mult = " is not a multiple of ";
  for (size_t i = 0; i < job.reqs.size(); ++i) {
    const Request& r = job.reqs[i];
    if (r.addr % mem_align)
      entry_error(i, r.path, "host address " + hex(r.addr) + mult + std::to_string(mem_align) +
                                 " bytes, the memory alignment O_DIRECT needs here; use page-aligned memory");
    if (r.length % job.align)
      entry_error(i, r.path, "length " + std::to_string(r.length) + mult + std::to_string(job.align) +
                                 " bytes, the O_DIRECT I/O alignment here");
    if (r.offset % job.align)
      entry_error(i, r.path, "file offset " + std::to_string(r.offset) + mult + std::to_string(job.align) +
                                 " bytes, the O_DIRECT I/O alignment here");
  }
}

// A job of no requests yet with the options o applied. fix_mode(file_mode): whether created
// files need their mode set after creation (detail/safe_path.hpp mode_needs_fix for host engines).
// spare: a Job to build it in (JobQueue::spare_job; its requests are left for the caller), or
// null for a new one.
inline std::unique_ptr<Job> new_job(uint64_t id, py::handle op, const SubmitOptions& o, bool (*fix_mode)(uint32_t),
                                    std::unique_ptr<Job> spare = nullptr) {
  auto job = spare ? std::move(spare) : std::make_unique<Job>();
  job->next = job->done = 0;
  job->submits = 0;
  job->submit_time = job->start_time = job->end_time = 0;
  job->id = id;
  job->op = op_from_object(op);
  job->verify = o.verify;
  job->direct = o.direct;
  job->fsync = o.fsync;
  job->file_mode = o.file_mode;
  job->fix_mode = fix_mode ? fix_mode(o.file_mode) : false;
  job->align = o.align;
  return job;
}

// A job of entries (submit), every argument checked before anything is queued (ValueError
// naming it).
inline std::unique_ptr<Job> make_job(uint64_t id, py::handle op, const py::sequence& entries,
                                     const SubmitOptions& o, const EngineTraits& traits,
                                     bool (*fix_mode)(uint32_t)) {
  auto job = new_job(id, op, o, fix_mode);
  parse_entries(*job, entries, traits.addr_kind, traits.recycles);
  if (o.direct && traits.check_direct_alignment) check_direct_alignment(*job, o.mem_align);
  return job;
}

// A job of space's blocks (submit_blocks: block_requests' arguments), checked as make_job's.
inline std::unique_ptr<Job> make_block_job(uint64_t id, py::handle op, const BlockSpace& space, py::handle digests,
                                           py::handle slots, py::handle victims, const SubmitOptions& o,
                                           const EngineTraits& traits, bool (*fix_mode)(uint32_t),
                                           std::unique_ptr<Job> spare = nullptr) {
  auto job = new_job(id, op, o, fix_mode, std::move(spare));
  const uint32_t mem_align = o.mem_align;
  block_requests(space, job->op, digests, slots, victims, traits.recycles, job->reqs);
  // check_request holds by construction (BlockSpace: names under PATH_MAX without NUL, payload
  // in (0, 1 GiB], a non-NULL arena; victims' names alike); block requests have offset 0, so
  // every slot is aligned when the arena's address and slot pitch are.
  const bool aligned = space.arena_addr % mem_align == 0 && space.slot_bytes % mem_align == 0 &&
                       space.payload_bytes % job->align == 0;
  if (o.direct && traits.check_direct_alignment && !aligned) check_direct_alignment(*job, mem_align);
  return job;
}

inline constexpr const char* kSubmitBlocksDoc =
    "submit_blocks(job_id, op, space, digests, slots=None, victims=None, options=None, *,\n"
    "direct=True, align=4096, mem_align=0, fsync=False, file_mode=0o600, verify=\"payload\"):\n"
    "options: a SubmitOptions (checked once) in place of the keywords (ValueError for both). Queues a job of\n"
    "blocks of space (a pykvtier._native.BlockSpace) as submit does, its requests built in C++:\n"
    "op READ_BLOCK (block_path(d) -> slot), WRITE_BLOCK (slot -> tmp_path(d), renamed to\n"
    "block_path(d)) or UNLINK (block_path(d)). digests: a buffer of n * 16 bytes (n key digests,\n"
    "n >= 1); slots: a buffer of n int64 (numpy int64, array('q'), bytes), each in\n"
    "[0, space.num_slots), the memory at space.arena_addr + slot * space.slot_bytes, of\n"
    "space.payload_bytes; None for UNLINK. victims (WRITE_BLOCK): None or {entry index: the 16-byte\n"
    "digest of an evicted block}: that entry recycles the victim's block file. Results per entry,\n"
    "in digest order, as submit's. Raises ValueError (TypeError for a wrong type) naming the\n"
    "argument and index, or what submit raises, before anything is queued; victims on an engine\n"
    "that does not recycle block files is a ValueError.";

// Binds pykvtier/engine.hpp's interface on cls (a py::class_ of an Engine implementation):
// submit and submit_blocks (with SubmitOptions' keywords; check(Job&) runs after the requests
// are built: an engine's own checks, raising ValueError), poll (list of FinishedJob), wait, drain,
// pending_jobs, stats (dict, STATS_KEYS order), take_leftovers, register_buffer,
// unregister_buffers, await_buffers, shutdown, name. Every wait releases the GIL.
template <class Cls, class Check>
Cls& def_engine(Cls& cls, const EngineTraits& traits, bool (*fix_mode)(uint32_t), Check check,
                const char* submit_doc) {
  using E = typename Cls::type;
  cls.def(
         "submit",
         [traits, fix_mode, check](E& e, uint64_t job_id, py::handle op, const py::sequence& entries,
                                   bool direct, uint32_t align, uint32_t mem_align, bool fsync,
                                   uint32_t file_mode, const std::string& verify) {
           const SubmitOptions o = make_options(direct, align, mem_align, fsync, file_mode, verify);
           auto job = make_job(job_id, op, entries, o, traits, fix_mode);
           check(*job);
           e.submit(std::move(job));
         },
         py::arg("job_id"), py::arg("op"), py::arg("entries"), py::kw_only(), py::arg("direct") = true,
         py::arg("align") = 4096, py::arg("mem_align") = 0, py::arg("fsync") = false,
         py::arg("file_mode") = 0600, py::arg("verify") = "payload", submit_doc)
      .def(
          "submit_blocks",
          [traits, fix_mode, check](E& e, uint64_t job_id, py::handle op, const BlockSpace& space,
                                    py::handle digests, py::handle slots, py::handle victims, py::handle options,
                                    std::optional<bool> direct, std::optional<uint32_t> align,
                                    std::optional<uint32_t> mem_align, std::optional<bool> fsync,
                                    std::optional<uint32_t> file_mode, std::optional<std::string> verify) {
            const bool keywords = direct || align || mem_align || fsync || file_mode || verify;
            std::optional<SubmitOptions> made;
            const SubmitOptions* o;
            if (!options.is_none()) {
              if (keywords)
                throw py::value_error("submit_blocks takes options (a SubmitOptions) or the option keywords, not both");
              if (!py::isinstance<SubmitOptions>(options))
                throw py::type_error("options must be a pykvtier._native.SubmitOptions or None, not " +
                                     type_name(options));
              o = &options.cast<const SubmitOptions&>();
            } else {
              made = make_options(direct.value_or(true), align.value_or(4096), mem_align.value_or(0),
                                  fsync.value_or(false), file_mode.value_or(0600), verify.value_or("payload"));
              o = &*made;
            }
            auto job = make_block_job(job_id, op, space, digests, slots, victims, *o, traits, fix_mode, e.spare_job());
            check(*job);
            e.submit(std::move(job));
          },
          py::arg("job_id"), py::arg("op"), py::arg("space"), py::arg("digests"), py::arg("slots") = py::none(),
          py::arg("victims") = py::none(), py::arg("options") = py::none(), py::kw_only(),
          py::arg("direct") = py::none(), py::arg("align") = py::none(), py::arg("mem_align") = py::none(),
          py::arg("fsync") = py::none(), py::arg("file_mode") = py::none(), py::arg("verify") = py::none(),
          kSubmitBlocksDoc)
      .def("poll", [](E& e) { return e.poll(); },
           "Finished jobs since the last call, each exactly once: list of FinishedJob. Never blocks.")
      .def(
          "wait",
          [](E& e, std::optional<double> timeout_s) {
            py::gil_scoped_release nogil;
            return e.wait(timeout_s ? *timeout_s : -1.0);
          },
          py::arg("timeout_s") = py::none(),
          "Blocks (GIL released) until a finished job can be polled, nothing is pending, or\n"
          "timeout_s seconds passed. Returns True if poll() has something.")
      .def(
          "drain",
          [](E& e) {
            py::gil_scoped_release nogil;
            e.drain();
          },
          "Blocks (GIL released) until every submitted job finished; results stay for poll().")
      .def("pending_jobs", [](E& e) { return e.pending_jobs(); }, "Jobs submitted and not yet finished.")
      .def(
          "stats",
          [](E& e) {
            py::dict d;
            e.stats().for_each([&](const char* k, uint64_t v) { d[k] = v; });
            return d;
          },
          "The engine's counters: a dict with exactly the keys STATS_KEYS (ints).")
      .def("take_leftovers", [](E& e) { return e.take_leftovers(); },
           "Paths (list of str) of files this engine created or renamed but could not remove after\n"
           "a failure: a failed store's temporary whose unlink failed, a recycle victim neither\n"
           "reused nor removed. Each path is reported once; from then on it is the caller's (count\n"
           "it, retry its removal). Never blocks; any thread.")
      .def("register_buffer", [](E& e, uint64_t addr, uint64_t nbytes) { return e.register_buffer(addr, nbytes); },
           py::arg("addr"), py::arg("nbytes"),
           "Registers [addr, addr+nbytes) with the kernel or driver where the engine can (memory that\n"
           "must stay valid until unregister_buffers() or shutdown()). Returns the first buffer\n"
           "index (0 where the engine registers nothing), or -errno where it was refused.")
      .def("unregister_buffers", [](E& e) { e.unregister_buffers(); })
      .def(
          "await_buffers",
          [](E& e, std::optional<double> timeout_s) {
            py::gil_scoped_release nogil;
            return e.await_buffers(timeout_s ? *timeout_s : -1.0);
          },
          py::arg("timeout_s") = py::none(),
          "Blocks (GIL released) until every thread of the engine uses the registered buffers.\n"
          "Returns False on timeout.")
      .def(
          "shutdown",
          [](E& e) {
            py::gil_scoped_release nogil;
            e.shutdown();
          },
          "Finishes queued jobs, then stops the engine's threads. Idempotent.")
      .def_property_readonly("name", [](E& e) { return std::string(e.name()); });
  return cls;
}

}  // namespace pykvtier::python
