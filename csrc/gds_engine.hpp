// The gds data path of pykvtier: block files <-> GPU memory through kvikio (libkvikio), i.e.
// cuFile / GPUDirect Storage where the machine has it, kvikio's POSIX "compatibility mode" where
// it does not. Built only when CMake finds kvikio (see CMakeLists.txt); no Python objects here
// (see gds_bindings.cpp), never libtorch: device buffers are plain addresses.
//
// Same job model as the io_uring engine (uring_engine.hpp): a job is a batch of requests of one
// op; results are per request (bytes moved, -errno, or a kErr* code of block_format.hpp); finished
// jobs are reported once by poll(). Every request of a job is queued at once onto a pool of
// io_threads threads, so up to io_threads blocks of a job are in flight together; loads go before
// stores.
//
// A load (read_block) is: open (kvikio::FileHandle: registers the file with cuFile), fstat (a file
// shorter than header + payload is kErrShort without reading), the 4096-byte header read into host
// memory with pread and checked there (magic, version, header checksum, key digest, length), the
// payload read straight into device memory (FileHandle::read: cuFileRead, or POSIX read + copy
// in compatibility mode), close. When the last request of a job has landed, the payload checksums
// (XXH3-64) of all its blocks are verified in one batch:
//   verify "device": one kernel launch over all the job's payloads (gds_verify.cu; built when
//                    CMake has a CUDA compiler), 8 bytes of result per block come back;
//   verify "host":   each payload copied to pinned host memory and hashed on the CPU (what the
//                    io_uring path does for free, here at the cost of a device->host copy);
//   verify "header": the payload checksum is not checked (header checks only) -- for measuring.
// A store (write_block) hashes the device payload the same way, writes header (host) and payload
// (device, FileHandle::write) to a temporary, then renames it into place (RENAME_NOREPLACE; an
// existing block of the same key is kept, as in the io_uring engine).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "block_format.hpp"
#include "finished_jobs.hpp"
#include "job_ops.hpp"

namespace pykvtier::gds {

using ::pykvtier::Op;  // (job_ops.hpp: Op, op_name, op_is_write, monotonic_seconds)
using ::pykvtier::op_name;
using ::pykvtier::op_is_write;
using ::pykvtier::monotonic_seconds;
enum class Verify : uint8_t { Device, Host, Header };
enum class Compat : uint8_t { Off, On, Auto };  // kvikio::CompatMode

Verify parse_verify(const std::string& s);  // "auto" -> Device where built, else Host
Compat parse_compat(const std::string& s);
const char* verify_name(Verify v);

struct Request {
  std::string path;
  std::string target;  // writes: rename path -> target (RENAME_NOREPLACE) once written
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t addr = 0;  // device address
  uint8_t digest[kDigestBytes] = {};
  int64_t result = 0;
  uint64_t header_xxh3 = 0;  // loads: the payload checksum the header claims
  bool needs_payload_check = false;
  double start_time = 0, done_time = 0;
};

struct Job {
  uint64_t id = 0;
  Op op = Op::Read;
  bool direct = true;
  bool fsync = false;
  bool sync = false;  // run(): reported to the caller, not to poll()
  std::vector<Request> reqs;
  std::atomic<size_t> remaining{0};
  std::atomic<uint32_t> started{0};
  double submit_time = 0, start_time = 0, end_time = 0;
  bool done = false;  // guarded by the engine's mutex
};

struct FinishedJob {
  uint64_t id;
  Op op;
  std::vector<int64_t> results;
  uint32_t submits;
  double queued_s;
  double transfer_s;
};

struct Config {
  unsigned io_threads = 16;
  Compat compat = Compat::Auto;
  Verify verify = Verify::Device;
};

struct Stats {
  std::atomic<uint64_t> jobs_submitted{0}, jobs_finished{0};
  std::atomic<uint64_t> requests_ok{0}, requests_failed{0};
  std::atomic<uint64_t> bytes_read{0}, bytes_written{0};
  std::atomic<uint64_t> verify_failures{0}, rename_existing{0};
  std::atomic<uint64_t> device_verifications{0}, host_verifications{0}, unverified_payloads{0};
  std::atomic<uint64_t> verify_launches{0};
  std::atomic<uint64_t> registered_buffer_ios{0};
  std::atomic<uint64_t> buffer_registration_failures{0};
  std::atomic<uint64_t> compat_mode_files{0}, gds_files{0};
  std::atomic<uint64_t> cuda_errors{0};
};

struct Region {
  uint64_t addr, len;
  bool registered;  // with cuFile (cuFileBufRegister)
};

// poll(), wait(), drain() and pending_jobs() come from FinishedJobs.
class Engine : public FinishedJobs<FinishedJob> {
 public:
  explicit Engine(Config cfg);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  void submit(std::unique_ptr<Job> job);
  std::vector<int64_t> run(std::unique_ptr<Job> job, std::vector<double>* latencies);
  void shutdown();

  // Device memory the engine will read into / write from: registered with cuFile where GDS is
  // used (faster DMA), remembered in any case. Returns false if cuFile refused it (counted).
  bool register_buffer(uint64_t addr, uint64_t len);
  void unregister_buffers();

  const Config& config() const { return cfg_; }
  Stats& stats() { return stats_; }
  std::string last_error();

 private:
  struct Task {
    Job* job;
    uint32_t index;
  };
  struct ThreadCtx;
  void worker(unsigned idx);
  void do_request(ThreadCtx& t, Job& job, Request& r);
  int64_t read_block(ThreadCtx& t, Job& job, Request& r);
  int64_t write_block(ThreadCtx& t, Job& job, Request& r);
  int64_t read_raw(ThreadCtx& t, Job& job, Request& r);
  int64_t write_raw(ThreadCtx& t, Job& job, Request& r);
  void verify_job(ThreadCtx& t, Job& job);
  bool payload_hashes(ThreadCtx& t, const std::vector<const Request*>& reqs, std::vector<uint64_t>& out);
  void finish_job(Job& job);
  void note_error(const std::string& what);
  void note_mode(bool compat);
  std::pair<uint64_t, uint64_t> base_and_offset(uint64_t addr, uint64_t len);

  Config cfg_;
  Stats stats_;
  std::condition_variable work_cv_;  // (mu_, done_cv_: FinishedJobs)
  std::deque<Task> loads_, stores_;
  std::vector<std::unique_ptr<Job>> owned_;  // submitted jobs not yet finished
  bool stopping_ = false;
  std::vector<std::thread> threads_;
  std::vector<std::unique_ptr<ThreadCtx>> ctx_;

  std::mutex regions_mu_;
  std::vector<Region> regions_;

  std::mutex err_mu_;
  std::string last_error_;
};

// Versions and availability, for gds_status() / `pykvtier doctor`. Never throws.
struct Status {
  std::string kvikio_version;
  bool device_verify_built = false;
  bool cufile_library = false;   // libcufile could be loaded
  bool cufile_available = false; // ... and its driver opened
  int cufile_version = -1;
  std::string compat_mode_default;  // kvikio's (KVIKIO_COMPAT_MODE): ON, OFF, AUTO
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
