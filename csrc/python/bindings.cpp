// pybind11 module pykvtier._native: the C++ data path's engines (io_uring, posix), the job model's
// Python types (Op, FinishedJob, BlockError, STATS_KEYS), the block format's constants and parser,
// and the probes. Buffers cross as integer addresses (plus lengths) or the buffer protocol.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sys/vfs.h>

#include <cerrno>
#include <system_error>

#include "checksum.hpp"
#include "direct_probe.hpp"
#include "engine_bindings.hpp"
#include "file_ops.hpp"
#include "gds_build_info.hpp"
#include "module_parts.hpp"
#include "posix_engine.hpp"
#include "safe_path.hpp"
#include "uring_engine.hpp"
#include "uring_probe.hpp"
#include "xxh3_lanes.hpp"

namespace py = pybind11;
using namespace pykvtier;
using pykvtier::python::EngineTraits;

namespace {

py::tuple as_tuple(const FinishedJob& f) {
  return py::make_tuple(f.id, f.op, py::cast(f.results), f.submits, f.queued_s, f.transfer_s);
}

// Op, BlockError, FinishedJob, STATS_KEYS: the job model's Python side, for every engine module.
void register_job_types(py::module_& m) {
  py::enum_<Op>(m, "Op", "What a job does (pykvtier/job.hpp).")
      .value("READ", Op::Read)
      .value("WRITE", Op::Write)
      .value("READ_BLOCK", Op::ReadBlock)
      .value("WRITE_BLOCK", Op::WriteBlock)
      .value("UNLINK", Op::Unlink)
      .export_values();
  // Results stay plain ints: BlockError is an enum.IntEnum, equal to the ints it names.
  py::list members;
  for (auto [name, v] : {std::pair{"SHORT", kErrShort}, {"BAD_HEADER", kErrBadHeader},
                         {"KEY_MISMATCH", kErrKeyMismatch}, {"LENGTH", kErrLength}, {"CHECKSUM", kErrChecksum}})
    members.append(py::make_tuple(name, v));
  py::object block_error = py::module_::import("enum").attr("IntEnum")("BlockError", members);
  block_error.attr("__module__") = m.attr("__name__");
  block_error.attr("__doc__") = "Results beyond the errno range: a block file that failed its checks.";
  m.attr("BlockError") = block_error;
  py::tuple keys(std::size(kStatsKeys));
  for (size_t i = 0; i < std::size(kStatsKeys); ++i) keys[i] = py::str(kStatsKeys[i]);
  m.attr("STATS_KEYS") = keys;

  using python::SubmitOptions;
  py::class_<SubmitOptions>(m, "SubmitOptions", R"doc(
The submit options of a job, checked once: SubmitOptions(*, direct=True, align=4096,
mem_align=0, fsync=False, file_mode=0o600, verify="payload"), the keywords of every engine's
submit (pykvtier.engines.Engine). An engine's submit_blocks takes it as its options argument in
place of the keywords (nothing parsed per job). mem_align 0 means align (the attribute holds the
resolved value). Raises ValueError naming a bad option. Immutable.
)doc")
      .def(py::init(&python::make_options), py::kw_only(), py::arg("direct") = true, py::arg("align") = 4096,
           py::arg("mem_align") = 0, py::arg("fsync") = false, py::arg("file_mode") = 0600,
           py::arg("verify") = "payload")
      .def_readonly("direct", &SubmitOptions::direct)
      .def_readonly("align", &SubmitOptions::align)
      .def_readonly("mem_align", &SubmitOptions::mem_align)
      .def_readonly("fsync", &SubmitOptions::fsync)
      .def_readonly("file_mode", &SubmitOptions::file_mode)
      .def_property_readonly("verify", [](const SubmitOptions& o) { return o.verify == Verify::Header ? "header" : "payload"; })
      .def(
          "as_kwargs",
          [](const SubmitOptions& o) {
            return py::dict(py::arg("direct") = o.direct, py::arg("align") = o.align, py::arg("mem_align") = o.mem_align,
                            py::arg("fsync") = o.fsync, py::arg("file_mode") = o.file_mode,
                            py::arg("verify") = o.verify == Verify::Header ? "header" : "payload");
          },
          "The options as submit's keywords (a dict), for engines written in Python.")
      .def("__repr__", [](const SubmitOptions& o) {
        std::ostringstream r;
        r << "SubmitOptions(direct=" << (o.direct ? "True" : "False") << ", align=" << o.align
          << ", mem_align=" << o.mem_align << ", fsync=" << (o.fsync ? "True" : "False") << ", file_mode=0o"
          << std::oct << o.file_mode << ", verify='" << (o.verify == Verify::Header ? "header" : "payload") << "')";
        return r.str();
      });

  py::class_<FinishedJob>(m, "FinishedJob", R"doc(
A finished job, as every engine's poll() reports it: job_id (int), op (Op), results (list of int,
one per entry: bytes moved, -errno, or a BlockError value), submits (int), queued_s, transfer_s
(float seconds: submit -> first request issued -> last result). Also unpacks and indexes as the
6-tuple (job_id, op, results, submits, queued_s, transfer_s).
)doc")
      .def(py::init([](uint64_t job_id, py::handle op, std::vector<int64_t> results, uint32_t submits,
                       double queued_s, double transfer_s) {
             FinishedJob f;
             f.id = job_id;
             f.op = python::op_from_object(op);
             f.results = std::move(results);
             f.submits = submits;
             f.queued_s = queued_s;
             f.transfer_s = transfer_s;
             return f;
           }),
           py::arg("job_id"), py::arg("op"), py::arg("results"), py::arg("submits") = 0,
           py::arg("queued_s") = 0.0, py::arg("transfer_s") = 0.0)
      .def_readonly("job_id", &FinishedJob::id)
      .def_readonly("op", &FinishedJob::op)
      .def_property_readonly("results", [](const FinishedJob& f) { return py::cast(f.results); })
      .def_readonly("submits", &FinishedJob::submits)
      .def_readonly("queued_s", &FinishedJob::queued_s)
      .def_readonly("transfer_s", &FinishedJob::transfer_s)
      .def("__len__", [](const FinishedJob&) { return 6; })
      .def("__getitem__", [](const FinishedJob& f, py::object i) { return as_tuple(f).attr("__getitem__")(i); })
      .def("__iter__", [](const FinishedJob& f) { return py::iter(as_tuple(f)); })
      .def("__eq__", [](const FinishedJob& f, py::object other) { return as_tuple(f).equal(py::tuple(other)); })
      .def("__repr__", [](const FinishedJob& f) {
        return "FinishedJob(job_id=" + std::to_string(f.id) + ", op=" + std::string(py::repr(py::cast(f.op))) +
               ", results=" + std::string(py::repr(py::cast(f.results))) + ", submits=" +
               std::to_string(f.submits) + ", queued_s=" + std::string(py::repr(py::float_(f.queued_s))) +
               ", transfer_s=" + std::string(py::repr(py::float_(f.transfer_s))) + ")";
      });
}

// The block format's constants and parser.
void register_block_format(py::module_& m) {
  m.attr("HEADER_BYTES") = kHeaderBytes;
  m.attr("ERR_SHORT") = kErrShort;
  m.attr("ERR_BAD_HEADER") = kErrBadHeader;
  m.attr("ERR_KEY_MISMATCH") = kErrKeyMismatch;
  m.attr("ERR_LENGTH") = kErrLength;
  m.attr("ERR_CHECKSUM") = kErrChecksum;
  m.attr("FORMAT_VERSION") = kFormatV1;
  py::tuple versions(std::size(kFormatVersions));
  for (size_t i = 0; i < std::size(kFormatVersions); ++i) versions[i] = kFormatVersions[i];
  m.attr("FORMAT_VERSIONS") = versions;
  m.attr("HEADER_FLAG_NO_PAYLOAD_CHECKSUM") = kFlagNoPayloadChecksum;
  m.attr("MAGIC") = py::bytes(kMagic, sizeof(kMagic));
  m.attr("DIGEST_BYTES") = kDigestBytes;
  m.def(
      "parse_header",
      [](py::buffer b) {
        py::buffer_info info = b.request();
        const size_t n = size_t(info.size) * size_t(info.itemsize);
        const ParsedHeader h = parse_block_header(static_cast<const char*>(info.ptr), n);
        py::dict d;
        d["magic_ok"] = h.magic_ok;
        d["version"] = h.version;
        d["header_bytes"] = h.header_bytes;
        d["payload_bytes"] = h.payload_bytes;
        d["key_digest"] = py::bytes(reinterpret_cast<const char*>(h.key_digest), kDigestBytes);
        d["payload_xxh3"] = h.payload_xxh3;
        d["flags"] = h.flags;
        d["payload_checksum"] = h.payload_checksum();
        d["header_ok"] = h.header_ok;
        return d;
      },
      py::arg("buf"),
      "Parses the first bytes of a block file (a bytes-like object; 64 bytes suffice, HEADER_BYTES\n"
      "are the whole header) of any version in FORMAT_VERSIONS. Returns a dict: magic_ok, version,\n"
      "header_bytes, payload_bytes, key_digest (16 bytes), payload_xxh3, flags, payload_checksum\n"
      "(False: stored without one, verify=\"header\"), header_ok (magic, a known version, header\n"
      "size, known flags and the header's own checksum right). Never raises for short or garbage\n"
      "input: header_ok is False then.");
  m.def(
      "block_name",
      [](const py::bytes& digest) {
        const std::string d = digest;
        if (d.size() != kDigestBytes)
          throw py::value_error("key digest must be " + std::to_string(kDigestBytes) + " bytes, got " +
                                std::to_string(d.size()));
        return block_name(reinterpret_cast<const uint8_t*>(d.data()));
      },
      py::arg("digest"),
      "A block file's name under the root's blocks/ directory: '<2 hex>/<32 hex>.kvb' of the\n"
      "16-byte key digest (ValueError for another length).");
  m.def("result_text", &detail::result_text, py::arg("result"),
        "A request's result as text: 'ok (N bytes)', an errno's name and message, or what a\n"
        "BlockError value means.");
}

void no_check(Job&) {}

const char* kSubmitDoc =
    "submit(job_id, op, entries, *, direct=True, align=4096, mem_align=0, fsync=False,\n"
    "file_mode=0o600, verify=\"payload\"): queues a job (op: an Op member; TypeError for a str or\n"
    "anything else) and returns at once; loads (READ, READ_BLOCK) go before stores. Finished jobs\n"
    "are reported by poll(). Raises ValueError naming the entry or keyword for a malformed\n"
    "entry, a misaligned address/length/offset (direct=True) or a bad keyword, before anything\n"
    "is queued; RuntimeError after shutdown().";

// Checksums and the O_DIRECT probe.
void register_checksums_and_direct_probe(py::module_& m) {
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
        d["alignment_enforced"] = p.alignment_enforced < 0 ? py::object(py::none()) : py::bool_(p.alignment_enforced > 0);
        d["alignment_probe"] = p.alignment_probe;
        return d;
      },
      py::arg("dir"), py::arg("tmpfile") = true,
      "Whether dir's file system accepts O_DIRECT, and its alignment in bytes.\n"
      "Returns a dict: direct (bool), mem_align, offset_align (bytes; from statx STATX_DIOALIGN\n"
      "where the kernel reports it, else 4096), dioalign_from_statx, reason,\n"
      "alignment_enforced, alignment_probe. alignment_enforced (where direct): True when an\n"
      "unaligned O_DIRECT transfer (at file offset 1; from memory 1 byte past the alignment) is\n"
      "refused with EINVAL, as a file system that hands O_DIRECT to the block layer refuses it;\n"
      "False when both are taken: O_DIRECT there is not the block layer's direct path (FUSE,\n"
      "tmpfs and NFS take any alignment; btrfs falls back to buffered I/O for an unaligned\n"
      "transfer); None when unknown (no O_DIRECT, or another error). alignment_probe says what\n"
      "was tried and what each answered. direct means the same either way.\n"
      "The probe file is an O_TMPFILE (never named); where the file system has none (or\n"
      "tmpfile=False, for tests) a named .pykvtier-direct-probe-PID[-N] file, removed at once\n"
      "(a name taken already, e.g. a leftover of an earlier process, is skipped). No file is\n"
      "left. On a full file system (ENOSPC, EDQUOT) the answer comes from an O_DIRECT read of an\n"
      "existing file under dir (a block file), else direct=False with the reason. Raises\n"
      "ValueError if dir cannot be used otherwise (missing, not a directory, not writable).");
  m.def(
      "statfs_type",
      [](const std::string& path) {
        struct statfs st {};
        int rc, err = 0;
        {
          py::gil_scoped_release nogil;
          rc = ::statfs(path.c_str(), &st);
          if (rc != 0) err = errno;
        }
        if (rc != 0) {
          errno = err;  // (what taking the GIL back may have changed)
          PyErr_SetFromErrnoWithFilename(PyExc_OSError, path.c_str());
          throw py::error_already_set();
        }
        return uint64_t(static_cast<unsigned long>(st.f_type));
      },
      py::arg("path"),
      "statfs(2)'s f_type of the file system path is on (an int: a magic number of\n"
      "<linux/magic.h>, e.g. 0xEF53 ext4, 0x01021994 tmpfs, 0x65735546 FUSE). OSError naming path.");
  m.def(
      "_set_openat2_disabled",
      [](bool disabled) { openat2_disabled_for_tests() = disabled; },
      py::arg("disabled"),
      "Tests only: the posix engine opens as on a kernel without openat2 (the component walk).");
}

// The io_uring capability probe (doctor), the gds build record, the device kernel's reference.
void register_probes(py::module_& m) {
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
}

void register_uring_engine(py::module_& m) {
  auto cls = py::class_<UringEngine>(m, "Engine", R"doc(
Batched block I/O over io_uring.

Engine(queue_depth=64, max_inflight_bytes=256 MiB, workers=1, store_share=0.5)

queue_depth: requests in flight per ring (each request: open, read/write, close in one
SQE chain, the file held in a fixed-file slot). max_inflight_bytes: payload bytes in
flight per ring. workers: background threads (one ring each) serving submit().
store_share: the share of a ring's slots and bytes that stores and unlinks may hold, so
that loads submitted during a burst of stores start at once (loads have priority).
Thread-safe; every wait releases the GIL. name: "uring".

Entry tuples per op (an Op member, e.g. Op.READ_BLOCK; a str is a TypeError):
  READ / WRITE:  (path, file_offset, length, host_addr[, rename_target (WRITE only)])
  READ_BLOCK:    (path, payload_length, host_addr, key_digest: 16 bytes)
  WRITE_BLOCK:   (tmp_path, final_path, payload_length, host_addr, key_digest: 16 bytes
                  [, recycle_path]): recycle_path, if not "", names an evicted block file of
                  the same size that is renamed to tmp_path and overwritten instead of
                  creating tmp_path (unlinked afterwards if it cannot be renamed)
  UNLINK:        path
Results: per entry, bytes moved, -errno, or a BlockError value (block verification).
verify (submit keyword): "payload" (default: stores write the payload's XXH3, loads check it) or
"header" (header, key digest and length only; stored as a format-2 header flagged 'no payload
checksum', which a "payload" reader loads on its header checks, counted in
stats()["loads_unchecked_payload"]).

Block files (READ_BLOCK, WRITE_BLOCK, their rename targets and recycle paths) and unlinks
follow no symbolic link anywhere in their paths (openat2 RESOLVE_NO_SYMLINKS |
RESOLVE_NO_MAGICLINKS): a link fails the entry with -ELOOP; pass paths without links (DiskTier
resolves its root with realpath). Raw READ/WRITE open as open(2) does. A READ_BLOCK of a
regular file with more than one hard link fails -EMLINK. A failed READ_BLOCK whose file was
opened leaves zeros in its destination, never the bytes read. A short read is re-read from
where it ended: the result is then the real error (-EIO) or ERR_SHORT at the end of the file.
file_mode (default 0o600): the exact permission bits of the temporaries a job creates (set
after creation -- an open and fchmod -- when file_mode has group or other bits, or the umask
takes owner bits); in-place raw writes create files with file_mode minus the umask. fsync=True: each file is fdatasync'ed before its rename, then each
distinct directory of the job's renames fsync'ed once (stats()["dir_fsyncs"]) before the job is
reported; a failed directory fsync fails the entries renamed into it.
)doc");
  cls.def(py::init([](unsigned queue_depth, uint64_t max_inflight_bytes, unsigned workers, double store_share) {
            EngineConfig c;  // (checked by UringEngine: std::invalid_argument -> ValueError)
            c.queue_depth = queue_depth;
            c.max_inflight_bytes = max_inflight_bytes;
            c.workers = workers;
            c.store_share = store_share;
            try {
              return std::make_unique<UringEngine>(c);
            } catch (const std::system_error& e) {
              throw py::value_error(std::string("io_uring unavailable: ") + e.what());
            }
          }),
          py::arg("queue_depth") = 64, py::arg("max_inflight_bytes") = 256ull << 20, py::arg("workers") = 1,
          py::arg("store_share") = 0.5)
      .def_property_readonly("queue_depth", [](UringEngine& e) { return e.config().queue_depth; })
      .def_property_readonly("max_inflight_bytes", [](UringEngine& e) { return e.config().max_inflight_bytes; });
  python::def_engine(cls, EngineTraits{}, &mode_needs_fix, no_check, kSubmitDoc);
}

void register_posix_engine(py::module_& m) {
  auto posix = py::class_<PosixEngine>(m, "PosixEngine", R"doc(
Batched block I/O by plain system calls (open, preadv/pwritev, renameat2) on a thread pool:
the engine for machines where io_uring is refused (a container's seccomp profile,
io_uring_disabled, an old kernel). Same entries, results, block files and counters as Engine;
its threads are C++ threads that never take the GIL.

PosixEngine(queue_depth=64, max_inflight_bytes=256 MiB, threads=16, store_share=0.5)

threads: requests in flight (one blocking request per thread; at most queue_depth): the
device's queue depth, as an io_uring ring's. Threads waiting on the disk cost no CPU.
store_share: the share of the threads that stores and unlinks may hold at once, so a load
submitted during a burst of stores starts within one request (loads go first).
max_inflight_bytes is accepted for Engine's signature (threads bound the bytes in flight).
name: "posix".
register_buffer / await_buffers do nothing (no fixed buffers without io_uring).
Links, hard links, failed loads, short reads, file_mode and fsync as Engine's (the posix
engine reaches every name through its directory opened without links, and falls back to
walking the path with O_NOFOLLOW where the kernel has no openat2).
)doc");
  posix.def(py::init([](unsigned queue_depth, uint64_t max_inflight_bytes, unsigned threads, double store_share) {
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
            py::arg("queue_depth") = 64, py::arg("max_inflight_bytes") = 256ull << 20, py::arg("threads") = 16,
            py::arg("store_share") = 0.5)
      .def_property_readonly("queue_depth", [](PosixEngine& e) { return e.config().queue_depth; })
      .def_property_readonly("max_inflight_bytes", [](PosixEngine& e) { return e.config().max_inflight_bytes; })
      .def_property_readonly("threads", &PosixEngine::threads);
  python::def_engine(posix, EngineTraits{}, &mode_needs_fix, no_check, kSubmitDoc);
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "pykvtier's C++ data path: batched block I/O over io_uring (liburing) or plain system calls.";
  m.attr("CHECKSUM_IMPL") = payload_xxh3_impl();
  register_job_types(m);
  register_block_format(m);

  register_checksums_and_direct_probe(m);
  register_probes(m);
  register_uring_engine(m);
  register_posix_engine(m);
  python::register_key_digest(m);
  python::register_block_space(m);
  python::register_block_index(m);
}
