// The gds engine: block files <-> GPU memory through kvikio (libkvikio), i.e. cuFile / GPUDirect
// Storage where the machine has it, kvikio's POSIX "compatibility mode" where it does not. Built
// only when CMake finds kvikio (CMakeLists.txt); no Python objects here (python/gds_bindings.cpp),
// never libtorch: device buffers are plain addresses.
//
// It implements pykvtier::Engine (include/pykvtier/engine.hpp) on the one job model
// (include/pykvtier/job.hpp): results per request are bytes moved, -errno or a BlockError;
// finished jobs are reported once by poll() (detail::JobQueue). Every request of a job is queued
// at once, loads before stores, and run by the engine's own kvikio::ThreadPool of io_threads
// threads, one request at a time each (a pool task takes whichever queued request comes first).
//
// A load (ReadBlock): the file opened without links (a hard-linked block is -EMLINK, as in the
// host engines) and by kvikio (its inode checked to be the same file); a file shorter than header
// + payload is Short; the 4096-byte header read into host memory and checked there (magic,
// version, header checksum, key digest, length); the payload read straight into device memory
// (FileHandle::read: cuFileRead, or POSIX read + copy in compatibility mode). When the last
// request of a job has landed, the payload checksums (XXH3-64) of its blocks are checked in one
// batch (Job::verify Payload, and the header has a checksum), where Config::checksum says:
//   Device: one kernel launch over all the job's payloads (gds_verify.cu; built where CMake has a
//           CUDA compiler), 8 bytes of result per block come back;
//   Host:   each payload copied to pinned host memory and hashed on the CPU.
// A store (WriteBlock): the device payload hashed the same way (not with Verify::Header: header
// version 2 flagged "no payload checksum"), header (host) and payload (device, FileHandle::write)
// written to a new temporary (detail::kTemporaryOpenFlags), which is renamed into place
// (detail::rename_into_place: an existing block of the same key is kept); fsync=True: the file
// and then the job's directories are synced (detail::renamed_dirs) before the job is reported.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <kvikio/threadpool_wrapper.hpp>

#include "detail/job_queue.hpp"

namespace pykvtier::gds {

enum class Checksum : uint8_t { Device, Host };  // where payload checksums are computed
enum class Compat : uint8_t { Off, On, Auto };   // kvikio::CompatMode

// "auto" -> Device where the kernel was built, else Host; "device" (refused where not built),
// "host". std::invalid_argument otherwise.
Checksum parse_checksum(const std::string& s);
const char* checksum_name(Checksum c);
Compat parse_compat(const std::string& s);  // "auto", "on", "off"
const char* compat_name(Compat c);

struct Config {
  unsigned io_threads = 16;  // 1..256
  Compat compat = Compat::Auto;
  Checksum checksum = Checksum::Device;
};

class GdsEngine final : public detail::JobQueue {
 public:
  explicit GdsEngine(Config cfg);  // std::invalid_argument for a bad io_threads
  ~GdsEngine() override;
  GdsEngine(const GdsEngine&) = delete;
  GdsEngine& operator=(const GdsEngine&) = delete;

  const char* name() const override { return "gds"; }
  void submit(std::unique_ptr<Job> job) override;
  void shutdown() override;

  // Device memory the engine reads into / writes from: registered with cuFile where GDS is used
  // (faster DMA), remembered in any case (cuFile takes the registered base and an offset).
  // Returns 0, or -EIO where cuFile refused it (counted; I/O then goes through cuFile's own
  // bounce buffers).
  int64_t register_buffer(uint64_t addr, uint64_t len) override;
  void unregister_buffers() override;
  bool await_buffers(double) override { return true; }  // registration is synchronous

  const Config& config() const { return cfg_; }
  std::string last_error();  // the last kvikio / CUDA error text, for diagnostics

 private:
  struct ThreadCtx;
  struct LoadCheck {           // per request of a ReadBlock job
    uint64_t payload_xxh3 = 0;  // what the header claims
    bool check = false;         // the payload's checksum is to be checked
  };
  struct Pending {  // a submitted job, until reported
    std::unique_ptr<Job> job;
    std::vector<LoadCheck> checks;
  };
  struct Task {
    Pending* p;
    uint32_t index;
  };

  void run_next();  // a pool task: the first queued request
  void run_request(ThreadCtx& t, Pending& p, uint32_t i);
  int64_t read_block(ThreadCtx& t, const Job& job, const Request& r, LoadCheck& c);
  int64_t write_block(ThreadCtx& t, const Job& job, const Request& r);
  int64_t read_raw(const Request& r);
  int64_t write_raw(const Job& job, const Request& r);
  int64_t unlink_block(const Request& r);
  int64_t store(const Job& job, const Request& r, const char* hdr);
  int64_t device_write(const Request& r, int fd, uint64_t file_offset);
  void verify_job(ThreadCtx& t, Pending& p);
  void zero_failed_loads(ThreadCtx& t, const Job& job);
  void count_results(const Job& job);
  bool payload_hashes(ThreadCtx& t, const std::vector<const Request*>& reqs, std::vector<uint64_t>& out);
  void note_error(const std::string& what);
  void note_mode(bool compat);
  std::pair<uint64_t, uint64_t> base_and_offset(uint64_t addr, uint64_t len);

  struct Region {
    uint64_t addr, len;
    bool registered;  // with cuFile (cuFileBufRegister)
  };

  Config cfg_;
  std::deque<Task> loads_, stores_;  // under mu_ (JobQueue's)
  std::unordered_map<Pending*, std::unique_ptr<Pending>> pending_;  // submitted, not yet reported
  std::vector<std::unique_ptr<ThreadCtx>> ctx_;  // one per pool thread, by its index
  std::mutex shutdown_mu_;
  kvikio::ThreadPool pool_;  // (last: destroyed, its tasks finished, before what they use)

  std::mutex regions_mu_;
  std::vector<Region> regions_;

  std::mutex err_mu_;
  std::string last_error_;
};

// Versions and availability, for gds_status() / `pykvtier doctor`. Never throws.
struct Status {
  std::string kvikio_version;
  bool device_verify_built = false;
  bool cufile_library = false;    // libcufile could be loaded
  bool cufile_available = false;  // ... and its driver opened
  int cufile_version = -1;
  std::string compat_mode_default;    // kvikio's (KVIKIO_COMPAT_MODE): ON, OFF, AUTO
  bool compat_mode_preferred = true;  // kvikio would use POSIX I/O by default
  bool gds_available = false;         // cuFile driver says GDS (nvidia-fs) is usable
  int nvfs_major = -1, nvfs_minor = -1;
  bool nvfs_allow_compat = false;
  int cuda_devices = 0;
  std::string cuda_error;
  int cuda_runtime_version = 0, cuda_driver_version = 0;
  unsigned kvikio_threads = 0;
  uint64_t kvikio_task_size = 0;
  std::vector<std::string> notes;
};
Status status();

// Whether kvikio would use cuFile (false) or its compatibility mode (true) for a file in dir
// (opens a temporary file with CompatMode::AUTO). reason says why, where known.
struct FileProbe {
  bool opened = false;
  bool compat = true;
  bool direct_fd = false;
  std::string reason;
};
FileProbe probe_file(const std::string& dir);

}  // namespace pykvtier::gds
