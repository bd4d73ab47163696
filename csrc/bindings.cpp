// pybind11 bindings of the C++ data path: the only file that touches Python objects.
// Buffers cross as integer addresses (plus lengths) or the buffer protocol.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sstream>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "gds_build_info.hpp"
#include "checksum.hpp"
#include "job_entries.hpp"
#include "posix_engine.hpp"
#include "safe_path.hpp"
#include "uring_engine.hpp"
#include "uring_probe.hpp"
#include "xxh3_lanes.hpp"

namespace py = pybind11;
using namespace pykvtier;

namespace {

std::string hex(uint64_t v) {
  std::ostringstream o;
  o << "0x" << std::hex << v;
  return o.str();
}


// Converts Python entries into a Job, validating every entry before anything is queued.
//   read / write:   (path, file_offset, length, host_addr[, rename_target])
//   read_block:     (path, payload_length, host_addr, key_digest16)
//   write_block:    (tmp_path, final_path, payload_length, host_addr, key_digest16[, recycle_path])
//   unlink:         (path,) or path
std::unique_ptr<Job> make_job(uint64_t id, const std::string& op_s, const py::sequence& entries,
                              bool direct, uint32_t align, uint32_t mem_align, bool fsync,
                              uint32_t file_mode) {
  auto job = std::make_unique<Job>();
  job->id = id;
  job->direct = direct;
  job->fsync = fsync;
  if ((file_mode & ~0777u) || (file_mode & 0600u) != 0600u) {
    std::ostringstream o;
    o << "file_mode must be permission bits (within 0o777) with owner read and write (0o600) set, got 0o"
      << std::oct << file_mode;
    throw py::value_error(o.str());
  }
  job->file_mode = file_mode;
  job->fix_mode = mode_needs_fix(file_mode);
  if (align == 0 || (align & (align - 1))) throw py::value_error("align must be a power of two");
  job->align = align;
  if (mem_align == 0) mem_align = align;
  if (mem_align & (mem_align - 1)) throw py::value_error("mem_align must be a power of two");
  parse_entries(*job, op_s, entries, "host");
  for (size_t i = 0; i < job->reqs.size(); ++i) {
    const Request& r = job->reqs[i];
    if (job->op == Op::Unlink) break;
    if (direct) {
      if (r.addr % mem_align)
        entry_error(i, r.path, "host address " + hex(r.addr) + " is not a multiple of " +
                                   std::to_string(mem_align) +
                                   " bytes, the memory alignment O_DIRECT needs here; "
                                   "use page-aligned memory");
      if (r.length % align)
        entry_error(i, r.path, "length " + std::to_string(r.length) + " is not a multiple of " +
                                   std::to_string(align) + " bytes, the O_DIRECT I/O alignment here");
      if (r.offset % align)
        entry_error(i, r.path, "file offset " + std::to_string(r.offset) + " is not a multiple of " +
                                   std::to_string(align) + " bytes, the O_DIRECT I/O alignment here");
    }
  }
  return job;
}

py::dict stats_dict(EngineStats& s) {
  py::dict d;
  d["submits"] = s.submits.load();
  d["sqes"] = s.sqes.load();
  d["cqes"] = s.cqes.load();
  d["jobs_submitted"] = s.jobs_submitted.load();
  d["jobs_finished"] = s.jobs_finished.load();
  d["requests_ok"] = s.requests_ok.load();
  d["requests_failed"] = s.requests_failed.load();
  d["bytes_read"] = s.bytes_read.load();
  d["bytes_written"] = s.bytes_written.load();
  d["fixed_buffer_ios"] = s.fixed_buffer_ios.load();
  d["verify_failures"] = s.verify_failures.load();
  d["rename_existing"] = s.rename_existing.load();
  d["recycled"] = s.recycled.load();
  d["recycle_failures"] = s.recycle_failures.load();
  d["dir_fsyncs"] = s.dir_fsyncs.load();
  d["buffer_registration_failures"] = s.buffer_registration_failures.load();
  d["buffer_registration_errno"] = s.buffer_registration_errno.load();
  return d;
}


// run / submit / shutdown / stats and the finished-job methods of a host engine (io_uring,
// posix): the same entries, results and counters for both.
template <class Cls>
Cls& def_host_engine(Cls& cls, const char* run_doc, const char* submit_doc, const char* shutdown_doc) {
  using E = typename Cls::type;
  cls.def(
         "run",
         [](E& e, const std::string& op, const py::sequence& entries, bool direct, uint32_t align,
            uint32_t mem_align, bool fsync, bool latencies, uint32_t file_mode) -> py::object {
           auto job = make_job(0, op, entries, direct, align, mem_align, fsync, file_mode);
           std::vector<int64_t> out;
           {
             py::gil_scoped_release nogil;
             out = e.run(*job);
           }
           if (!latencies) return py::cast(out);
           std::vector<double> lat;
           lat.reserve(job->reqs.size());
           for (auto& r : job->reqs) lat.push_back(r.done_time - r.issue_time);
           return py::make_tuple(out, lat);
         },
         py::arg("op"), py::arg("entries"), py::arg("direct") = true, py::arg("align") = 4096,
         py::arg("mem_align") = 0, py::arg("fsync") = false, py::arg("latencies") = false,
         py::arg("file_mode") = 0600, run_doc)
      .def(
          "submit",
          [](E& e, uint64_t job_id, const std::string& op, const py::sequence& entries, bool direct,
             uint32_t align, uint32_t mem_align, bool fsync, uint32_t file_mode) {
            e.submit(make_job(job_id, op, entries, direct, align, mem_align, fsync, file_mode));
          },
          py::arg("job_id"), py::arg("op"), py::arg("entries"), py::arg("direct") = true,
          py::arg("align") = 4096, py::arg("mem_align") = 0, py::arg("fsync") = false,
          py::arg("file_mode") = 0600, submit_doc)
      .def("take_leftovers", [](E& e) { return e.take_leftovers(); },
           "Paths (list of str) of files this engine created or renamed but could not remove after\n"
           "a failure: a failed store's temporary whose unlink failed, a recycle victim neither\n"
           "reused nor removed. Each path is reported once; from then on it is the caller's (count\n"
           "it, retry its removal). Never blocks; any thread.")
      .def(
          "shutdown",
          [](E& e) {
            py::gil_scoped_release nogil;
            e.shutdown();
          },
          shutdown_doc)
      .def("stats", [](E& e) { return stats_dict(e.stats()); },
           "Counters: submits (io_uring_submit calls carrying SQEs; 0 for the posix engine), sqes,\n"
           "cqes, jobs_*, requests_*, bytes_read, bytes_written, fixed_buffer_ios,\n"
           "verify_failures, rename_existing, recycled (files reused by write_block),\n"
           "recycle_failures (files to recycle that could be neither renamed nor removed),\n"
           "dir_fsyncs (directory fsyncs of fsync=True jobs: one per distinct directory per job).")
      .def_property_readonly("queue_depth", [](E& e) { return e.config().queue_depth; })
      .def_property_readonly("max_inflight_bytes", [](E& e) { return e.config().max_inflight_bytes; });
  return def_finished_jobs(cls);
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "pykvtier's C++ data path: batched block I/O over io_uring (liburing).";

  m.attr("HEADER_BYTES") = kHeaderBytes;
  m.attr("CHECKSUM_IMPL") = payload_xxh3_impl();
  m.attr("FORMAT_VERSION") = kFormatVersion;
  m.attr("MAGIC") = py::bytes(kMagic, sizeof(kMagic));
  m.attr("DIGEST_BYTES") = kDigestBytes;
  m.attr("ERR_SHORT") = kErrShort;
  m.attr("ERR_BAD_HEADER") = kErrBadHeader;
  m.attr("ERR_KEY_MISMATCH") = kErrKeyMismatch;
  m.attr("ERR_LENGTH") = kErrLength;
  m.attr("ERR_CHECKSUM") = kErrChecksum;

  m.def(
      "xxh3_64",
      [](py::buffer b) {
        py::buffer_info info = b.request();
        const size_t n = size_t(info.size) * size_t(info.itemsize);
        py::gil_scoped_release nogil;
        return payload_xxh3(info.ptr, n);
      },
      py::arg("buffer"), "XXH3-64 of a contiguous buffer (the block payload checksum).");

  m.def(
      "probe_direct",
      [](const std::string& dir, bool tmpfile) {
        DirectProbe p;
        {
          py::gil_scoped_release nogil;
          try {
            p = probe_direct(dir, tmpfile);
          } catch (const std::system_error& e) {
            py::gil_scoped_acquire gil;
            throw py::value_error(e.what());
          }
        }
        py::dict d;
        d["direct"] = p.direct;
        d["mem_align"] = p.mem_align;
        d["offset_align"] = p.offset_align;
        d["dioalign_from_statx"] = p.dioalign_from_statx;
        d["reason"] = p.reason;
        return d;
      },
      py::arg("dir"), py::arg("tmpfile") = true,
      "Whether dir's file system accepts O_DIRECT, and its alignment in bytes.\n"
      "Returns a dict: direct (bool), mem_align, offset_align (bytes; from statx STATX_DIOALIGN\n"
      "where the kernel reports it, else 4096), dioalign_from_statx, reason.\n"
      "The probe file is an O_TMPFILE (never named); where the file system has none (or\n"
      "tmpfile=False, for tests) a named .pykvtier-direct-probe-PID[-N] file, removed at once\n"
      "(a name taken already, e.g. a leftover of an earlier process, is skipped). No file is\n"
      "left. On a full file system (ENOSPC, EDQUOT) the answer comes from an O_DIRECT read of an\n"
      "existing file under dir (a block file), else direct=False with the reason. Raises\n"
      "ValueError if dir cannot be used otherwise (missing, not a directory, not writable).");
  m.def(
      "_set_openat2_disabled",
      [](bool disabled) { openat2_disabled_for_tests() = disabled; },
      py::arg("disabled"),
      "Tests only: the posix engine opens as on a kernel without openat2 (the component walk).");

  m.def(
      "probe_uring",
      [](const std::string& dir) {
        UringProbe p;
        {
          py::gil_scoped_release nogil;
          p = probe_uring(dir);
        }
        py::dict d;
        d["available"] = p.available;
        d["error"] = p.error;
        py::dict flags, ops, checks;
        for (auto& [k, v] : p.setup_flags) flags[py::str(k)] = v;
        for (auto& [k, v] : p.ops) ops[py::str(k)] = v;
        for (auto& c : p.checks) checks[py::str(c.name)] = py::make_tuple(c.ok, c.detail);
        d["setup_flags"] = flags;
        d["features"] = p.features;
        d["ops"] = ops;
        d["checks"] = checks;
        return d;
      },
      py::arg("dir") = "",
      "What io_uring can do here (for `pykvtier doctor`): dict with available, error, setup_flags\n"
      "(name -> ring setup accepted), features (names), ops (opcode -> supported), checks (name ->\n"
      "(ok, detail)) of operations really run: fixed-file table, registered buffers and, in dir\n"
      "when given, openat_direct, fixed reads/writes, close_direct, statx, renameat, unlinkat.\n"
      "Never raises.");

  m.def(
      "gds_build_info",
      [] {
        py::dict d;
        d["built"] = bool(PYKVTIER_GDS_BUILT);
        d["device_verify_built"] = bool(PYKVTIER_GDS_DEVICE_VERIFY_BUILT);
        d["reason"] = std::string(PYKVTIER_GDS_REASON);
        d["kvikio_version"] = std::string(PYKVTIER_GDS_KVIKIO_VERSION);
        return d;
      },
      "How the gds engine (pykvtier._gds) was built: built (bool), device_verify_built, reason,\n"
      "kvikio_version (at build time). See pykvtier.gpu.gds_status() for what works at run time.");

  m.def(
      "_xxh3_lanes",
      [](py::buffer b) {
        py::buffer_info info = b.request();
        const size_t n = size_t(info.size) * size_t(info.itemsize);
        if (n < xxh3::kMinLength) throw py::value_error("the lane formulation needs more than 240 bytes");
        py::gil_scoped_release nogil;
        return uint64_t(xxh3::hash_long_lanes(static_cast<const uint8_t*>(info.ptr), n));
      },
      py::arg("buffer"),
      "XXH3-64 through the 8-lane formulation the GPU checksum kernel uses (host reference, for tests).");

  auto cls = py::class_<Engine>(m, "Engine", R"doc(
Batched block I/O over io_uring.

Engine(queue_depth=64, max_inflight_bytes=256 MiB, workers=1, store_share=0.5)

queue_depth: requests in flight per ring (each request: open, read/write, close in one
SQE chain, the file held in a fixed-file slot). max_inflight_bytes: payload bytes in
flight per ring. workers: background threads (one ring each) serving submit().
store_share: the share of a ring's slots and bytes that stores and unlinks may hold, so
that loads submitted during a burst of stores start at once (loads have priority).
run() uses a ring of the calling thread's own. Thread-safe; every wait releases the GIL.

Entry tuples per op:
  read / write:  (path, file_offset, length, host_addr[, rename_target (write only)])
  read_block:    (path, payload_length, host_addr, key_digest: 16 bytes)
  write_block:   (tmp_path, final_path, payload_length, host_addr, key_digest: 16 bytes
                  [, recycle_path]): recycle_path, if not "", names an evicted block file of
                  the same size that is renamed to tmp_path and overwritten instead of
                  creating tmp_path (unlinked afterwards if it cannot be renamed)
  unlink:        path
Results: per entry, bytes moved, -errno, or one of ERR_* (block verification).

Block files (read_block, write_block, their rename targets and recycle paths) and unlinks
follow no symbolic link anywhere in their paths (openat2 RESOLVE_NO_SYMLINKS |
RESOLVE_NO_MAGICLINKS): a link fails the entry with -ELOOP; pass paths without links (DiskTier
resolves its root with realpath). Raw read/write open as open(2) does. A read_block of a
regular file with more than one hard link fails -EMLINK. A failed read_block whose file was
opened leaves zeros in its destination, never the bytes read. A short read is re-read from
where it ended: the result is then the real error (-EIO) or ERR_SHORT at the end of the file.
file_mode (default 0o600): the exact permission bits of the temporaries a job creates (set
after creation -- an open and fchmod -- when file_mode has group or other bits, or the umask
takes owner bits); in-place raw writes create files with file_mode minus the umask. fsync=True: each file is fdatasync'ed before its rename, then each
distinct directory of the job's renames fsync'ed once (stats()["dir_fsyncs"]) before the job is
reported; a failed directory fsync fails the entries renamed into it.
)doc")
      .def(py::init([](unsigned queue_depth, uint64_t max_inflight_bytes, unsigned workers,
                       double store_share) {
             EngineConfig c;  // (checked by Engine: std::invalid_argument -> ValueError)
             c.queue_depth = queue_depth;
             c.max_inflight_bytes = max_inflight_bytes;
             c.workers = workers;
             c.store_share = store_share;
             try {
               return std::make_unique<Engine>(c);
             } catch (const std::system_error& e) {
               throw py::value_error(std::string("io_uring unavailable: ") + e.what());
             }
           }),
           py::arg("queue_depth") = 64, py::arg("max_inflight_bytes") = 256ull << 20,
           py::arg("workers") = 1, py::arg("store_share") = 0.5);
  def_host_engine(cls,
      "Runs one batch on the calling thread's ring, as few io_uring_submit calls as the ring\n"
      "allows; the GIL is released while the kernel works. Returns one result per entry, or\n"
      "with latencies=True (results, seconds from each entry's SQEs being prepared to its\n"
      "result). Raises ValueError naming the entry for a misaligned address/length/offset\n"
      "(direct=True) or a malformed entry, before any I/O.",
      "Queues a job for the background ring(s) and returns at once. Loads (read, read_block)\n"
      "go before stores. Each job's SQEs are handed to the kernel in one io_uring_submit when\n"
      "the ring has room. Finished jobs are reported by poll().",
      "Finishes queued jobs, stops the worker threads, closes the rings. Idempotent.")
      .def("register_buffer", &Engine::register_buffer, py::arg("addr"), py::arg("nbytes"),
           "Registers [addr, addr+nbytes) as io_uring fixed buffers (split in 1 GiB pieces);\n"
           "requests whose memory lies inside use READ_FIXED/WRITE_FIXED. The memory must stay\n"
           "valid until unregister_buffers() or shutdown(). Returns the first buffer index.")
      .def("unregister_buffers", &Engine::unregister_buffers)
      .def(
          "await_buffers",
          [](Engine& e, std::optional<double> timeout_s) {
            py::gil_scoped_release nogil;
            return e.await_buffers(timeout_s ? *timeout_s : -1.0);
          },
          py::arg("timeout_s") = py::none(),
          "Blocks (GIL released) until the background rings have registered the current fixed\n"
          "buffers: registration pins (and faults in) the memory, a one-time cost this moves out\n"
          "of the first jobs. Returns False on timeout. Registration failures (e.g.\n"
          "RLIMIT_MEMLOCK) are counted in stats(): the rings then use plain READ/WRITE.");

  auto posix = py::class_<PosixEngine>(m, "PosixEngine", R"doc(
Batched block I/O by plain system calls (open, preadv/pwritev, renameat2) on a thread pool:
the engine for machines where io_uring is refused (a container's seccomp profile,
io_uring_disabled, an old kernel). Same entries, results, block files and counters as Engine;
its threads are C++ threads that never take the GIL.

PosixEngine(queue_depth=64, max_inflight_bytes=256 MiB, workers=1, threads=16, store_share=0.5)

threads: requests in flight (one blocking request per thread; at most queue_depth): the
device's queue depth, as an io_uring ring's. Threads waiting on the disk cost no CPU.
store_share: the share of the threads that stores and unlinks may hold at once, so a load
submitted during a burst of stores starts within one request (loads go first).
max_inflight_bytes and workers are accepted for Engine's signature; threads bound both.
register_buffer / await_buffers do nothing (no fixed buffers without io_uring).
Links, hard links, failed loads, short reads, file_mode and fsync as Engine's (the posix
engine reaches every name through its directory opened without links, and falls back to
walking the path with O_NOFOLLOW where the kernel has no openat2).
)doc");
  posix.def(py::init([](unsigned queue_depth, uint64_t max_inflight_bytes, unsigned /*workers*/,
                        unsigned threads, double store_share) {
             PosixEngineConfig c;  // (checked by PosixEngine: std::invalid_argument -> ValueError)
             c.queue_depth = queue_depth;
             c.max_inflight_bytes = max_inflight_bytes;
             c.threads = threads;
             c.store_share = store_share;
             try {
               return std::make_unique<PosixEngine>(c);
             } catch (const std::system_error& e) {
               throw py::value_error(std::string("cannot start the posix engine's threads: ") + e.what());
             }
           }),
           py::arg("queue_depth") = 64, py::arg("max_inflight_bytes") = 256ull << 20,
           py::arg("workers") = 1, py::arg("threads") = 16, py::arg("store_share") = 0.5);
  def_host_engine(posix,
      "Runs one batch on the engine's threads and waits (GIL released). Returns one result per\n"
      "entry, or with latencies=True (results, seconds each entry's system calls took). Raises\n"
      "ValueError naming the entry for a misaligned address/length/offset (direct=True) or a\n"
      "malformed entry, before any I/O; RuntimeError after shutdown().",
      "Queues a job for the engine's threads and returns at once; loads (read, read_block) go\n"
      "before stores. Finished jobs are reported by poll(). RuntimeError after shutdown().",
      "Finishes queued jobs and stops the threads. Idempotent.")
      .def("register_buffer", [](PosixEngine&, uint64_t, uint64_t) { return 0u; }, py::arg("addr"),
           py::arg("nbytes"), "No fixed buffers without io_uring: does nothing, returns 0.")
      .def("unregister_buffers", [](PosixEngine&) {})
      .def("await_buffers", [](PosixEngine&, std::optional<double>) { return true; },
           py::arg("timeout_s") = py::none(), "Nothing to register: returns True.")
      .def_property_readonly("threads", &PosixEngine::threads);
}
