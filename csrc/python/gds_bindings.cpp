// pybind11 bindings of the gds engine (module pykvtier._gds, built only with kvikio): the engine
// interface bound by python/engine_bindings.hpp's def_engine, as for every engine, plus status()
// and probe_file(). Device buffers cross as integer addresses. Import it through pykvtier.gpu,
// which loads libkvikio's dependencies first and reports why the engine is unavailable when it is.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime_api.h>

#include <optional>
#include <stdexcept>
#include <string>

#include "detail/safe_path.hpp"
#include "gds/gds_engine.hpp"
#include "python/engine_bindings.hpp"

namespace py = pybind11;
using namespace pykvtier;
using namespace pykvtier::gds;

namespace {

// Every address of a job must be device memory: a host address here is the caller's bug, not an
// I/O error (ValueError naming the entry).
void check_device_addresses(const Job& job) {
  if (job.op == Op::Unlink) return;
  for (size_t i = 0; i < job.reqs.size(); ++i) {
    const Request& r = job.reqs[i];
    cudaPointerAttributes a{};
    const cudaError_t err = cudaPointerGetAttributes(&a, reinterpret_cast<const void*>(r.addr));
    if (err != cudaSuccess) {
      cudaGetLastError();  // (clears it)
      python::entry_error(i, r.path, std::string("cannot query the address: ") + cudaGetErrorString(err));
    }
    if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
      python::entry_error(i, r.path, "address " + python::hex(r.addr) +
                                         " is not device memory (the gds engine moves blocks between files "
                                         "and GPU memory)");
  }
}

}  // namespace

PYBIND11_MODULE(_gds, m) {
  m.doc() = "pykvtier's gds engine: block files <-> GPU memory through kvikio (cuFile / GPUDirect Storage).";
  py::module_::import("pykvtier._native");  // registers Op, Verify, FinishedJob (the job model's types)
  m.attr("DEVICE_VERIFY_BUILT") = bool(PYKVTIER_DEVICE_VERIFY);

  m.def(
      "status",
      [] {
        Status s;
        {
          py::gil_scoped_release nogil;
          s = status();
        }
        py::dict d;
        d["kvikio_version"] = s.kvikio_version;
        d["device_verify_built"] = s.device_verify_built;
        d["cufile_library"] = s.cufile_library;
        d["cufile_available"] = s.cufile_available;
        d["cufile_version"] = s.cufile_version;
        d["compat_mode_default"] = s.compat_mode_default;
        d["compat_mode_preferred"] = s.compat_mode_preferred;
        d["gds_available"] = s.gds_available;
        d["nvfs_version"] = s.nvfs_major < 0 ? py::object(py::none())
                                             : py::object(py::str(std::to_string(s.nvfs_major) + "." +
                                                                  std::to_string(s.nvfs_minor)));
        d["nvfs_allow_compat_mode"] = s.nvfs_allow_compat;
        d["cuda_devices"] = s.cuda_devices;
        d["cuda_error"] = s.cuda_error;
        d["cuda_runtime_version"] = s.cuda_runtime_version;
        d["cuda_driver_version"] = s.cuda_driver_version;
        d["kvikio_threads"] = s.kvikio_threads;
        d["kvikio_task_size"] = s.kvikio_task_size;
        d["notes"] = s.notes;
        return d;
      },
      "Versions and availability: kvikio, libcufile, the cuFile driver (nvidia-fs), CUDA devices.\n"
      "Opening the cuFile driver can take a moment the first time. Never raises.");

  m.def(
      "probe_file",
      [](const std::string& dir) {
        FileProbe p;
        {
          py::gil_scoped_release nogil;
          p = probe_file(dir);
        }
        py::dict d;
        d["opened"] = p.opened;
        d["compat"] = p.compat;
        d["direct_fd"] = p.direct_fd;
        d["reason"] = p.reason;
        return d;
      },
      py::arg("dir"),
      "Opens a temporary file in dir the way the engine does (CompatMode AUTO) and reports whether\n"
      "kvikio would use cuFile (compat False) or POSIX I/O (compat True) there.");

  auto cls = py::class_<GdsEngine>(m, "GdsEngine", R"doc(
Block files <-> GPU memory through kvikio (cuFile / GPUDirect Storage, or kvikio's POSIX
compatibility mode): an engine of pykvtier.engines.Engine's interface, with device addresses.

GdsEngine(io_threads=16, compat="auto", checksum="auto")

io_threads: requests in flight (each thread runs one request at a time: open, header read to
host, payload read to device, close). compat: kvikio's compatibility mode for every file: "auto"
(cuFile where the file system and driver allow it, else POSIX), "on" (always POSIX I/O plus
copies: kvikio's fallback), "off" (cuFile only; errors where it cannot). checksum: where payload
checksums (submit's verify="payload") are computed: "device" (a CUDA kernel over the job's
blocks, one launch per job), "host" (each payload copied to pinned host memory and hashed
there), "auto" (device where built, else host). verify= is checksum's former name ("header" is
now submit's verify="header"). ValueError for a bad value, naming it.

Entries and results as every engine (pykvtier.engines): results per entry are bytes moved,
-errno, or a _native.BlockError value.
)doc");
  cls.def(py::init([](unsigned io_threads, const std::string& compat, const std::string& checksum,
                      std::optional<std::string> verify) {
             Config c;
             c.io_threads = io_threads;
             std::string where = checksum;
             if (verify) {
               if (*verify == "header")
                 throw py::value_error("GdsEngine(verify='header'): header-only checks are chosen per job "
                                       "now, submit(..., verify=\"header\"); checksum= (formerly verify=) "
                                       "says where payload checksums are computed: auto, device or host");
               where = *verify;
             }
             try {
               c.compat = parse_compat(compat);
               c.checksum = parse_checksum(where);
               return std::make_unique<GdsEngine>(c);
             } catch (const std::invalid_argument& e) {
               throw py::value_error(e.what());
             }
           }),
           py::arg("io_threads") = 16, py::arg("compat") = "auto", py::arg("checksum") = "auto", py::kw_only(),
           py::arg("verify") = py::none());
  const python::EngineTraits traits{"device", /*recycles=*/false, /*check_direct_alignment=*/false};
  python::def_engine(cls, traits, &mode_needs_fix, &check_device_addresses,
                     "Queues a job (every request at once, loads before stores) and returns at once.\n"
                     "direct: the header is read with O_DIRECT where the file system takes it (cuFile\n"
                     "takes any alignment; aligned is faster); align and mem_align are not checked.");
  cls.def("last_error", &GdsEngine::last_error, "The last error text (kvikio / CUDA), for diagnostics.")
      .def_property_readonly("io_threads", [](GdsEngine& e) { return e.config().io_threads; })
      .def_property_readonly("checksum", [](GdsEngine& e) { return std::string(checksum_name(e.config().checksum)); })
      .def_property_readonly("compat", [](GdsEngine& e) { return std::string(compat_name(e.config().compat)); })
      .def_property_readonly("verify", [](GdsEngine& e) { return std::string(checksum_name(e.config().checksum)); },
                             "checksum's former name (until every caller reads checksum).");
}
