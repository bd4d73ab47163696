// pybind11 bindings of the gds engine (module pykvtier._gds, built only with kvikio). Device
// buffers cross as integer addresses. Import it through pykvtier.gpu, which loads libkvikio's
// dependencies first and reports why the engine is unavailable when it is.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime_api.h>

#include <optional>
#include <sstream>

#include "gds_engine.hpp"
#include "job_entries.hpp"

namespace py = pybind11;
using namespace pykvtier::gds;

namespace {

// Entry tuples as pykvtier._native.Engine (addresses are device addresses):
//   read / write:   (path, file_offset, length, device_addr[, rename_target])
//   read_block:     (path, payload_length, device_addr, key_digest16)
//   write_block:    (tmp_path, final_path, payload_length, device_addr, key_digest16)
//   unlink:         (path,) or path
// direct/align/mem_align are accepted for drop-in use; cuFile takes any alignment (aligned is
// faster), and the header is read with O_DIRECT when direct is set and the file system takes it.
std::unique_ptr<Job> make_job(uint64_t id, const std::string& op_s, const py::sequence& entries, bool direct,
                              bool fsync) {
  auto job = std::make_unique<Job>();
  job->id = id;
  job->direct = direct;
  job->fsync = fsync;
  pykvtier::parse_entries(*job, op_s, entries, "device");
  const size_t n = job->reqs.size();
  // Every address must be device memory (a host address here is a caller's bug, not an I/O error).
  for (size_t i = 0; i < n; ++i) {
    if (job->op == Op::Unlink) break;
    cudaPointerAttributes a{};
    cudaError_t err = cudaPointerGetAttributes(&a, reinterpret_cast<const void*>(job->reqs[i].addr));
    if (err != cudaSuccess) {
      cudaGetLastError();
      pykvtier::entry_error(i, job->reqs[i].path, std::string("cannot query the address: ") + cudaGetErrorString(err));
    }
    if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) {
      std::ostringstream o;
      o << "address 0x" << std::hex << job->reqs[i].addr << " is not device memory (the gds engine moves "
        << "blocks between files and GPU memory)";
      pykvtier::entry_error(i, job->reqs[i].path, o.str());
    }
  }
  return job;
}

py::dict stats_dict(Engine& e) {
  auto& s = e.stats();
  py::dict d;
  // The keys pykvtier.tier.DiskTier.stats() reads from any engine:
  d["submits"] = s.jobs_submitted.load();
  d["sqes"] = 0;
  d["cqes"] = 0;
  d["fixed_buffer_ios"] = s.registered_buffer_ios.load();
  d["buffer_registration_failures"] = s.buffer_registration_failures.load();
  d["buffer_registration_errno"] = 0;
  d["jobs_submitted"] = s.jobs_submitted.load();
  d["jobs_finished"] = s.jobs_finished.load();
  d["requests_ok"] = s.requests_ok.load();
  d["requests_failed"] = s.requests_failed.load();
  d["bytes_read"] = s.bytes_read.load();
  d["bytes_written"] = s.bytes_written.load();
  d["verify_failures"] = s.verify_failures.load();
  d["rename_existing"] = s.rename_existing.load();
  // gds-specific:
  d["device_verifications"] = s.device_verifications.load();
  d["host_verifications"] = s.host_verifications.load();
  d["unverified_payloads"] = s.unverified_payloads.load();
  d["verify_launches"] = s.verify_launches.load();
  d["compat_mode_files"] = s.compat_mode_files.load();
  d["gds_files"] = s.gds_files.load();
  d["cuda_errors"] = s.cuda_errors.load();
  return d;
}

}  // namespace

PYBIND11_MODULE(_gds, m) {
  m.doc() = "pykvtier's gds engine: block files <-> GPU memory through kvikio (cuFile / GPUDirect Storage).";
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

  auto cls = py::class_<Engine>(m, "GdsEngine", R"doc(
Block files <-> GPU memory through kvikio (cuFile / GPUDirect Storage, or kvikio's POSIX
compatibility mode), with the interface of pykvtier._native.Engine.

GdsEngine(io_threads=16, compat="auto", verify="auto")

io_threads: requests in flight (each thread runs one request at a time: open, header read to
host, payload read to device, close). compat: kvikio's compatibility mode for every file: "auto"
(cuFile where the file system and driver allow it, else POSIX), "on" (always POSIX I/O plus
copies: kvikio's fallback), "off" (cuFile only; errors where it cannot). verify: how payload
checksums are checked: "device" (a CUDA kernel over the job's blocks, one launch per job),
"host" (copy each payload to pinned host memory and hash it there), "header" (header checks
only, payload unverified), "auto" (device where built, else host).

Entries as _native.Engine, with device addresses. Results per entry: bytes moved, -errno, or
one of _native.ERR_*.
)doc")
      .def(py::init([](unsigned io_threads, const std::string& compat, const std::string& verify) {
             Config c;
             c.io_threads = io_threads;
             try {
               c.compat = parse_compat(compat);
               c.verify = parse_verify(verify);
               return std::make_unique<Engine>(c);
             } catch (const std::invalid_argument& e) {
               throw py::value_error(e.what());
             }
           }),
           py::arg("io_threads") = 16, py::arg("compat") = "auto", py::arg("verify") = "auto")
      .def(
          "submit",
          [](Engine& e, uint64_t job_id, const std::string& op, const py::sequence& entries, bool direct,
             uint32_t /*align*/, uint32_t /*mem_align*/, bool fsync) {
            auto job = make_job(job_id, op, entries, direct, fsync);
            e.submit(std::move(job));
          },
          py::arg("job_id"), py::arg("op"), py::arg("entries"), py::arg("direct") = true,
          py::arg("align") = 4096, py::arg("mem_align") = 0, py::arg("fsync") = false,
          "Queues a job (every request at once, loads before stores) and returns at once.")
      .def(
          "run",
          [](Engine& e, const std::string& op, const py::sequence& entries, bool direct, uint32_t, uint32_t,
             bool fsync, bool latencies) -> py::object {
            auto job = make_job(0, op, entries, direct, fsync);
            std::vector<int64_t> out;
            std::vector<double> lat;
            {
              py::gil_scoped_release nogil;
              out = e.run(std::move(job), latencies ? &lat : nullptr);
            }
            if (!latencies) return py::cast(out);
            return py::make_tuple(out, lat);
          },
          py::arg("op"), py::arg("entries"), py::arg("direct") = true, py::arg("align") = 4096,
          py::arg("mem_align") = 0, py::arg("fsync") = false, py::arg("latencies") = false,
          "Runs one batch and waits for it (GIL released); results per entry.");
  def_finished_jobs(cls)
      .def("shutdown",
           [](Engine& e) {
             py::gil_scoped_release nogil;
             e.shutdown();
           })
      .def(
          "register_buffer",
          [](Engine& e, uint64_t addr, uint64_t nbytes) {
            py::gil_scoped_release nogil;
            return e.register_buffer(addr, nbytes);
          },
          py::arg("addr"), py::arg("nbytes"),
          "Registers device memory with cuFile (cuFileBufRegister) where GDS is used; False (and\n"
          "counted) if cuFile refused it. Failures are\n"
          "counted in stats()['buffer_registration_failures'] (I/O then goes through cuFile's own\n"
          "bounce buffers).")
      .def("unregister_buffers",
           [](Engine& e) {
             py::gil_scoped_release nogil;
             e.unregister_buffers();
           })
      .def(
          "await_buffers", [](Engine&, std::optional<double>) { return true; }, py::arg("timeout_s") = py::none())
      .def("stats", &stats_dict)
      .def("last_error", &Engine::last_error, "The last error text (kvikio / CUDA), for diagnostics.")
      .def_property_readonly("io_threads", [](Engine& e) { return e.config().io_threads; })
      .def_property_readonly("verify", [](Engine& e) { return std::string(verify_name(e.config().verify)); })
      .def_property_readonly("compat", [](Engine& e) {
        switch (e.config().compat) {
          case Compat::On: return std::string("on");
          case Compat::Off: return std::string("off");
          default: return std::string("auto");
        }
      });
}
