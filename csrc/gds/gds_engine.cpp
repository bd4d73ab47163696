// gds engine: see gds_engine.hpp.
#include "gds/gds_engine.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <system_error>

#include <cuda_runtime_api.h>

#include <kvikio/buffer.hpp>
#include <kvikio/compat_mode.hpp>
#include <kvikio/cufile/driver.hpp>
#include <kvikio/defaults.hpp>
#include <kvikio/file_handle.hpp>
#include <kvikio/shim/cufile.hpp>
#include <kvikio/version_config.hpp>

#include "detail/checksum.hpp"
#include "detail/file_ops.hpp"
#include "detail/safe_path.hpp"
#include "detail/xxh3_lanes.hpp"
#if PYKVTIER_DEVICE_VERIFY
#include "gds/gds_verify.hpp"
#endif

namespace pykvtier::gds {

namespace {

kvikio::CompatMode to_kvikio(Compat c) {
  switch (c) {
    case Compat::Off: return kvikio::CompatMode::OFF;
    case Compat::On: return kvikio::CompatMode::ON;
    default: return kvikio::CompatMode::AUTO;
  }
}

const char* kvikio_mode_name(kvikio::CompatMode c) {
  switch (c) {
    case kvikio::CompatMode::OFF: return "OFF";
    case kvikio::CompatMode::ON: return "ON";
    default: return "AUTO";
  }
}

// The errno of a kvikio / CUDA exception: its own where it carries one, else EIO.
int64_t errno_of(const std::exception& e) {
  if (auto* s = dynamic_cast<const std::system_error*>(&e))
    if (s->code().value() > 0) return -int64_t(s->code().value());
  return -EIO;
}

// Whether descriptors a and b are the same file (kvikio opens by path: the file it opened must
// be the one this engine opened without links).
bool same_file(int a, int b) {
  struct stat sa, sb;
  return ::fstat(a, &sa) == 0 && ::fstat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

// Work queued on the legacy default stream (torch's default) before the store was submitted has
// produced the payload: wait for it (a non-blocking stream would not). Producers on other streams
// must synchronize before submitting stores. Returns a cudaError_t.
int sync_producer(uint64_t addr) {
  cudaPointerAttributes attr{};
  cudaError_t e = cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(addr));
  if (e == cudaSuccess) e = cudaSetDevice(attr.device);
  if (e == cudaSuccess) e = cudaStreamSynchronize(nullptr);
  return int(e);
}

}  // namespace

Checksum parse_checksum(const std::string& s) {
  if (s == "auto") return PYKVTIER_DEVICE_VERIFY ? Checksum::Device : Checksum::Host;
  if (s == "device") {
    if (!PYKVTIER_DEVICE_VERIFY)
      throw std::invalid_argument(
          "checksum='device': this build has no device checksum kernel (no CUDA compiler at build time)");
    return Checksum::Device;
  }
  if (s == "host") return Checksum::Host;
  throw std::invalid_argument("unknown checksum '" + s + "': expected auto, device or host");
}

const char* checksum_name(Checksum c) { return c == Checksum::Device ? "device" : "host"; }

Compat parse_compat(const std::string& s) {
  if (s == "auto") return Compat::Auto;
  if (s == "on") return Compat::On;
  if (s == "off") return Compat::Off;
  throw std::invalid_argument("unknown compat '" + s + "': expected auto, on or off");
}

const char* compat_name(Compat c) {
  switch (c) {
    case Compat::On: return "on";
    case Compat::Off: return "off";
    default: return "auto";
  }
}

// ------------------------------------------------------------------------------ per thread

// CUDA resources of one pool thread: a stream, a header buffer, scratch for checksums.
struct GdsEngine::ThreadCtx {
  int device = -1;
  cudaStream_t stream = nullptr;
  char* header = nullptr;  // kHeaderBytes, 4096-aligned (O_DIRECT)
  // checksums: device task array + results, pinned host mirrors, host staging for "host" verify
  void* d_tasks = nullptr;
  uint64_t* d_out = nullptr;
  void* h_tasks = nullptr;
  uint64_t* h_out = nullptr;
  size_t task_cap = 0;
  void* staging = nullptr;  // pinned
  size_t staging_cap = 0;

  ThreadCtx() {
    if (posix_memalign(reinterpret_cast<void**>(&header), 4096, kHeaderBytes) != 0) throw std::bad_alloc();
  }
  ~ThreadCtx() {
    free(header);
    // CUDA may already be torn down at process exit: errors are ignored.
    if (d_tasks) cudaFree(d_tasks);
    if (d_out) cudaFree(d_out);
    if (h_tasks) cudaFreeHost(h_tasks);
    if (h_out) cudaFreeHost(h_out);
    if (staging) cudaFreeHost(staging);
    if (stream) cudaStreamDestroy(stream);
  }
  // Makes `dev` current on this thread, with a stream on it. Returns a cudaError_t.
  int use_device(int dev) {
    cudaError_t e = cudaSetDevice(dev);
    if (e != cudaSuccess) return int(e);
    if (device != dev) {
      if (stream) cudaStreamDestroy(stream);
      stream = nullptr;
      for (void** p : {&d_tasks, reinterpret_cast<void**>(&d_out)}) {
        if (*p) cudaFree(*p);
        *p = nullptr;
      }
      task_cap = 0;
      e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      if (e != cudaSuccess) return int(e);
      device = dev;
    }
    return 0;
  }
  int reserve_tasks(size_t n, size_t task_bytes) {
    if (n <= task_cap) return 0;
    size_t cap = std::max<size_t>(n, 64);
    if (d_tasks) cudaFree(d_tasks);
    if (d_out) cudaFree(d_out);
    if (h_tasks) cudaFreeHost(h_tasks);
    if (h_out) cudaFreeHost(h_out);
    d_tasks = h_tasks = nullptr;
    d_out = h_out = nullptr;
    task_cap = 0;
    cudaError_t e;
    if ((e = cudaMalloc(&d_tasks, cap * task_bytes)) != cudaSuccess) return int(e);
    if ((e = cudaMalloc(reinterpret_cast<void**>(&d_out), cap * sizeof(uint64_t))) != cudaSuccess) return int(e);
    if ((e = cudaMallocHost(&h_tasks, cap * task_bytes)) != cudaSuccess) return int(e);
    if ((e = cudaMallocHost(reinterpret_cast<void**>(&h_out), cap * sizeof(uint64_t))) != cudaSuccess) return int(e);
    task_cap = cap;
    return 0;
  }
  int reserve_staging(size_t n) {
    if (n <= staging_cap) return 0;
    if (staging) cudaFreeHost(staging);
    staging = nullptr;
    staging_cap = 0;
    cudaError_t e = cudaMallocHost(&staging, n);
    if (e != cudaSuccess) return int(e);
    staging_cap = n;
    return 0;
  }
};

// ------------------------------------------------------------------------------ GdsEngine

GdsEngine::GdsEngine(Config cfg)
    : cfg_(cfg),
      ctx_([&] {
        if (cfg.io_threads == 0 || cfg.io_threads > 256) throw std::invalid_argument("io_threads must be in 1..256");
        std::vector<std::unique_ptr<ThreadCtx>> v;
        for (unsigned i = 0; i < cfg.io_threads; ++i) v.push_back(std::make_unique<ThreadCtx>());
        return v;
      }()),
      pool_(cfg.io_threads, kvikio::make_thread_pool_init_task("pykvtier-gds")) {}

GdsEngine::~GdsEngine() { shutdown(); }

void GdsEngine::shutdown() {
  std::lock_guard<std::mutex> once(shutdown_mu_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;  // no new jobs
  }
  pool_.wait();  // every queued request has run, every job is reported
  ctx_.clear();
  unregister_buffers();
}

void GdsEngine::note_error(const std::string& what) {
  std::lock_guard<std::mutex> lk(err_mu_);
  last_error_ = what;
}

std::string GdsEngine::last_error() {
  std::lock_guard<std::mutex> lk(err_mu_);
  return last_error_;
}

void GdsEngine::note_mode(bool compat) { (compat ? stats_.compat_mode_files : stats_.gds_files)++; }

int64_t GdsEngine::register_buffer(uint64_t addr, uint64_t len) {
  int64_t rc = 0;
  bool registered = false;
  if (cfg_.compat != Compat::On && !kvikio::defaults::is_compat_mode_preferred(to_kvikio(cfg_.compat))) {
    try {
      kvikio::buffer_register(reinterpret_cast<const void*>(addr), len);
      registered = true;
    } catch (const std::exception& e) {
      stats_.buffer_registration_failures++;
      stats_.buffer_registration_errno = EIO;
      note_error(std::string("cuFileBufRegister: ") + e.what());
      rc = -EIO;
    }
  }
  std::lock_guard<std::mutex> lk(regions_mu_);
  regions_.push_back({addr, len, registered});
  return rc;
}

void GdsEngine::unregister_buffers() {
  std::vector<Region> regions;
  {
    std::lock_guard<std::mutex> lk(regions_mu_);
    regions.swap(regions_);
  }
  for (auto& r : regions) {
    if (!r.registered) continue;
    try {
      kvikio::buffer_deregister(reinterpret_cast<const void*>(r.addr));
    } catch (const std::exception& e) {
      note_error(std::string("cuFileBufDeregister: ") + e.what());
    }
  }
}

// cuFile wants the registered base address and an offset into it; unregistered memory is passed
// as its own base.
std::pair<uint64_t, uint64_t> GdsEngine::base_and_offset(uint64_t addr, uint64_t len) {
  std::lock_guard<std::mutex> lk(regions_mu_);
  for (auto& r : regions_)
    if (r.registered && addr >= r.addr && addr + len <= r.addr + r.len) {
      stats_.fixed_buffer_ios++;
      return {r.addr, addr - r.addr};
    }
  return {addr, 0};
}

void GdsEngine::submit(std::unique_ptr<Job> job) {
  job->submit_time = monotonic_seconds();
  std::lock_guard<std::mutex> lk(mu_);
  if (!admit_locked(*job)) return;
  auto p = std::make_unique<Pending>();
  p->checks.resize(job->op == Op::ReadBlock ? job->reqs.size() : 0);
  p->job = std::move(job);
  Pending* raw = p.get();
  auto& q = op_is_write(raw->job->op) ? stores_ : loads_;
  for (uint32_t i = 0; i < raw->job->reqs.size(); ++i) q.push_back({raw, i});
  pending_.emplace(raw, std::move(p));
  // (under mu_: a shutdown() that begins after admit_locked finds these tasks in the pool; its
  // tasks take mu_ only once running, never while the pool holds its own lock)
  for (size_t i = 0; i < raw->job->reqs.size(); ++i) pool_.detach_task([this] { run_next(); });
}

// One task of the pool per queued request, so there is one queued when it runs: the first load,
// else the first store.
void GdsEngine::run_next() {
  ThreadCtx& t = *ctx_[BS::this_thread::get_index().value()];
  std::unique_lock<std::mutex> lk(mu_);
  auto& q = !loads_.empty() ? loads_ : stores_;
  const Task task = q.front();
  q.pop_front();
  Job& job = *task.p->job;
  Request& r = job.reqs[task.index];
  r.issue_time = monotonic_seconds();
  if (job.start_time == 0) job.start_time = r.issue_time;
  lk.unlock();
  run_request(t, *task.p, task.index);
  lk.lock();
  if (++job.done < job.reqs.size()) return;
  lk.unlock();  // the last request of the job: its checks, counters, directory fsyncs
  if (job.op == Op::ReadBlock) {
    verify_job(t, *task.p);
    zero_failed_loads(t, job);
  }
  count_results(job);
  if (job.fsync) detail::sync_renamed_dirs(job, stats_);
  lk.lock();
  job.end_time = monotonic_seconds();
  finish_locked(job);
  pending_.erase(task.p);
}

void GdsEngine::run_request(ThreadCtx& t, Pending& p, uint32_t i) {
  const Job& job = *p.job;
  Request& r = p.job->reqs[i];
  int64_t res;
  try {
    switch (job.op) {
      case Op::ReadBlock: res = read_block(t, job, r, p.checks[i]); break;
      case Op::WriteBlock: res = write_block(t, job, r); break;
      case Op::Read: res = read_raw(r); break;
      case Op::Write: res = write_raw(job, r); break;
      case Op::Unlink: res = unlink_block(r); break;
      default: res = -EINVAL;
    }
  } catch (const std::exception& e) {
    note_error(r.path + ": " + e.what());
    res = errno_of(e);
  }
  r.result = res;
  r.done_time = monotonic_seconds();
}

int64_t GdsEngine::unlink_block(const Request& r) {
  ParentDir d;
  if (int e = d.open(r.path, true)) return e;
  return ::unlinkat(d.fd(), d.name(), 0) == 0 ? 0 : -errno;
}

int64_t GdsEngine::read_block(ThreadCtx& t, const Job& job, const Request& r, LoadCheck& c) {
  // As the host engines open a block: no link anywhere in its path, no wait on a FIFO, never a
  // hard-linked file (it may be anyone's).
  const int fd = open_no_links(r.path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return -errno;
  struct stat st;
  int64_t res = ::fstat(fd, &st) != 0 ? -errno : 0;
  if (res == 0 && !S_ISREG(st.st_mode)) res = S_ISDIR(st.st_mode) ? -EISDIR : -ESPIPE;
  if (res == 0 && st.st_nlink > 1) res = -EMLINK;
  if (res == 0 && uint64_t(st.st_size) < kHeaderBytes + r.length) res = kErrShort;
  if (res != 0) {
    ::close(fd);
    return res;
  }
  kvikio::FileHandle fh;
  try {
    fh = kvikio::FileHandle(r.path, "r", kvikio::FileHandle::m644, to_kvikio(cfg_.compat));
  } catch (...) {
    ::close(fd);
    throw;
  }
  const bool same = same_file(fd, fh.fd(false));
  ::close(fd);
  if (!same) return -ELOOP;  // the name was swapped between the opens (as a link would be)
  note_mode(fh.get_compat_mode_manager().is_compat_mode_preferred());
  const bool direct = job.direct && fh.fd(true) >= 0;
  iovec iov{t.header, kHeaderBytes};
  const int64_t n = detail::io_full(false, direct ? fh.fd(true) : fh.fd(false), &iov, 1, 0, kHeaderBytes,
                                    direct ? detail::io_unit(job) : 1);
  if (n < 0) return n;
  if (uint64_t(n) < kHeaderBytes) return kErrShort;
  ParsedHeader h;
  if (int64_t e = check_block_header(t.header, r.digest, r.length, &h)) return e;
  auto [base, off] = base_and_offset(r.addr, r.length);
  if (fh.read(reinterpret_cast<void*>(base), r.length, kHeaderBytes, off, false) < r.length) return kErrShort;
  c.payload_xxh3 = h.payload_xxh3;
  c.check = job.verify == Verify::Payload && h.payload_checksum();
  if (job.verify == Verify::Header)
    stats_.unverified_payloads++;
  else if (!h.payload_checksum())
    stats_.loads_unchecked_payload++;
  return int64_t(r.length);
}

int64_t GdsEngine::read_raw(const Request& r) {
  kvikio::FileHandle fh(r.path, "r", kvikio::FileHandle::m644, to_kvikio(cfg_.compat));
  note_mode(fh.get_compat_mode_manager().is_compat_mode_preferred());
  if (fh.nbytes() < r.offset + r.length) return kErrShort;
  auto [base, off] = base_and_offset(r.addr, r.length);
  if (fh.read(reinterpret_cast<void*>(base), r.length, r.offset, off, false) < r.length) return kErrShort;
  return int64_t(r.length);
}

// The payload of r from device memory into the file fd has open (at file_offset), through kvikio,
// which opens r.path again: 0 or -errno.
int64_t GdsEngine::device_write(const Request& r, int fd, uint64_t file_offset) {
  try {
    kvikio::FileHandle fh(r.path, "r+", kvikio::FileHandle::m644, to_kvikio(cfg_.compat));
    if (!same_file(fd, fh.fd(false))) return -ELOOP;  // swapped since created (as a link would be)
    note_mode(fh.get_compat_mode_manager().is_compat_mode_preferred());
    auto [base, off] = base_and_offset(r.addr, r.length);
    return fh.write(reinterpret_cast<const void*>(base), r.length, file_offset, off, true) < r.length ? -ENOSPC : 0;
  } catch (const std::exception& e) {
    note_error(r.path + ": " + e.what());
    return errno_of(e);
  }
}

// Writes r to its file: a new temporary (target set: detail::kTemporaryOpenFlags, then renamed
// into place) or, a raw write without target, the file itself, created if missing. hdr: the
// block header to write first (WriteBlock), else nullptr. Bytes written or -errno.
int64_t GdsEngine::store(const Job& job, const Request& r, const char* hdr) {
  const bool tmp = !r.target.empty();
  const bool block = op_is_block(job.op);
  ParentDir d;
  if (int e = d.open(r.path, block)) return e;
  const int flags = tmp ? detail::kTemporaryOpenFlags | O_CLOEXEC
                        : O_WRONLY | O_CREAT | O_NONBLOCK | O_CLOEXEC | (block ? O_NOFOLLOW : 0);
  const int fd = ::openat(d.fd(), d.name(), flags, mode_t(job.file_mode));
  if (fd < 0) return -errno;
  int64_t res = 0;
  if (tmp && job.fix_mode && ::fchmod(fd, mode_t(job.file_mode)) != 0) res = -errno;  // (Job::fix_mode)
  if (res == 0 && hdr) {
    iovec iov{const_cast<char*>(hdr), kHeaderBytes};
    const int64_t n = detail::io_full(true, fd, &iov, 1, 0, kHeaderBytes, 1);
    res = n < 0 ? n : uint64_t(n) < kHeaderBytes ? -ENOSPC : 0;
  }
  if (res == 0) res = device_write(r, fd, hdr ? kHeaderBytes : r.offset);
  if (res == 0 && job.fsync && ::fdatasync(fd) != 0) res = -errno;
  if (::close(fd) != 0 && res == 0 && errno != EINTR) res = -errno;
  if (!tmp) return res < 0 ? res : int64_t(r.length);
  // Into place without replacing a block already there (another writer's, equally valid: kept).
  bool left = true;
  if (res == 0) {
    ParentDir to;
    res = to.open(r.target, block);
    if (res == 0) res = detail::rename_into_place(d.fd(), d.name(), to.fd(), to.name(), &left);
    if (res == -EEXIST) {
      stats_.rename_existing++;
      res = 0;
    }
  }
  if (left && ::unlinkat(d.fd(), d.name(), 0) != 0 && errno != ENOENT) add_leftover(r.path);
  return res < 0 ? res : int64_t(r.length);
}

int64_t GdsEngine::write_raw(const Job& job, const Request& r) {
  if (int err = sync_producer(r.addr)) {
    stats_.cuda_errors++;
    note_error(std::string("cudaStreamSynchronize: ") + cudaGetErrorString(cudaError_t(err)));
    return -EIO;
  }
  return store(job, r, nullptr);
}

int64_t GdsEngine::write_block(ThreadCtx& t, const Job& job, const Request& r) {
  if (int err = sync_producer(r.addr)) {
    stats_.cuda_errors++;
    note_error(std::string("cudaStreamSynchronize: ") + cudaGetErrorString(cudaError_t(err)));
    return -EIO;
  }
  if (job.verify == Verify::Header) {
    fill_block_header(t.header, r.digest, r.length, 0, kFlagNoPayloadChecksum);
  } else {
    std::vector<uint64_t> sum;
    if (!payload_hashes(t, {&r}, sum)) return -EIO;
    fill_block_header(t.header, r.digest, r.length, sum[0]);
  }
  return store(job, r, t.header);
}

// XXH3-64 of the payloads of reqs (device memory), into out. False on a CUDA error (noted).
bool GdsEngine::payload_hashes(ThreadCtx& t, const std::vector<const Request*>& reqs, std::vector<uint64_t>& out) {
  out.assign(reqs.size(), 0);
  if (reqs.empty()) return true;
  auto fail = [&](const char* what, int err) {
    stats_.cuda_errors++;
    note_error(std::string(what) + ": " + cudaGetErrorString(cudaError_t(err)));
    return false;
  };
  cudaPointerAttributes attr{};
  cudaError_t e = cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(reqs[0]->addr));
  if (e != cudaSuccess) return fail("cudaPointerGetAttributes", int(e));
  if (int err = t.use_device(attr.device)) return fail("cudaSetDevice", err);

  std::vector<size_t> on_host;  // indexes hashed on the host
#if PYKVTIER_DEVICE_VERIFY
  std::vector<size_t> on_device;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const Request& r = *reqs[i];
    const bool device = cfg_.checksum == Checksum::Device && r.length >= xxh3::kMinLength && r.addr % 16 == 0;
    (device ? on_device : on_host).push_back(i);
  }
  if (!on_device.empty()) {
    if (int err = t.reserve_tasks(on_device.size(), sizeof(HashTask))) return fail("cudaMalloc", err);
    auto* tasks = static_cast<HashTask*>(t.h_tasks);
    for (size_t k = 0; k < on_device.size(); ++k)
      tasks[k] = {reinterpret_cast<const uint8_t*>(reqs[on_device[k]]->addr), reqs[on_device[k]]->length};
    const size_t n = on_device.size();
    if ((e = cudaMemcpyAsync(t.d_tasks, t.h_tasks, n * sizeof(HashTask), cudaMemcpyHostToDevice, t.stream)))
      return fail("cudaMemcpyAsync", int(e));
    if (int err = launch_xxh3_long(static_cast<const HashTask*>(t.d_tasks), t.d_out, unsigned(n), t.stream))
      return fail("xxh3 kernel launch", err);
    if ((e = cudaMemcpyAsync(t.h_out, t.d_out, n * sizeof(uint64_t), cudaMemcpyDeviceToHost, t.stream)))
      return fail("cudaMemcpyAsync", int(e));
    if ((e = cudaStreamSynchronize(t.stream))) return fail("xxh3 kernel", int(e));
    for (size_t k = 0; k < n; ++k) out[on_device[k]] = t.h_out[k];
    stats_.device_verifications += n;
    stats_.verify_launches++;
  }
#else
  for (size_t i = 0; i < reqs.size(); ++i) on_host.push_back(i);
#endif
  for (size_t i : on_host) {
    const Request& r = *reqs[i];
    if (int err = t.reserve_staging(r.length)) return fail("cudaMallocHost", err);
    if ((e = cudaMemcpyAsync(t.staging, reinterpret_cast<const void*>(r.addr), r.length, cudaMemcpyDeviceToHost,
                             t.stream)))
      return fail("cudaMemcpyAsync", int(e));
    if ((e = cudaStreamSynchronize(t.stream))) return fail("cudaStreamSynchronize", int(e));
    out[i] = payload_xxh3(t.staging, r.length);
    stats_.host_verifications++;
  }
  return true;
}

// Payload checksums of a load job's landed blocks, in one batch (one kernel launch).
void GdsEngine::verify_job(ThreadCtx& t, Pending& p) {
  std::vector<const Request*> todo;
  std::vector<uint64_t> want;
  for (size_t i = 0; i < p.job->reqs.size(); ++i)
    if (p.job->reqs[i].result >= 0 && p.checks[i].check) {
      todo.push_back(&p.job->reqs[i]);
      want.push_back(p.checks[i].payload_xxh3);
    }
  std::vector<uint64_t> sums;
  const bool ok = payload_hashes(t, todo, sums);
  for (size_t i = 0; i < todo.size(); ++i) {
    auto* r = const_cast<Request*>(todo[i]);
    if (!ok)
      r->result = -EIO;
    else if (sums[i] != want[i])
      r->result = kErrChecksum;
  }
}

// A failed load: bytes (a torn or foreign block) may have reached the caller's memory. None stay,
// as with the host engines: each failed request's memory is zeroed (a CUDA error is counted and
// noted; the request fails either way).
void GdsEngine::zero_failed_loads(ThreadCtx& t, const Job& job) {
  bool queued = false;  // memsets on t.stream not synchronized yet
  auto sync = [&] {
    if (!queued) return;
    queued = false;
    if (cudaError_t e = cudaStreamSynchronize(t.stream)) {
      stats_.cuda_errors++;
      note_error(std::string("cudaStreamSynchronize after zeroing failed loads: ") + cudaGetErrorString(e));
    }
  };
  for (const auto& r : job.reqs) {
    if (r.result >= 0) continue;
    cudaPointerAttributes attr{};
    cudaError_t e = cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(r.addr));
    if (e == cudaSuccess && attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
      std::memset(reinterpret_cast<void*>(r.addr), 0, r.length);  // (host memory)
      continue;
    }
    if (e == cudaSuccess && attr.device != t.device) sync();  // (use_device replaces the stream)
    if (e == cudaSuccess) {
      if (int err = t.use_device(attr.device)) e = cudaError_t(err);
    }
    if (e == cudaSuccess) e = cudaMemsetAsync(reinterpret_cast<void*>(r.addr), 0, r.length, t.stream);
    if (e != cudaSuccess) {
      stats_.cuda_errors++;
      note_error(std::string("zeroing a failed load's memory: ") + cudaGetErrorString(e));
      continue;
    }
    queued = true;
  }
  sync();
}

void GdsEngine::count_results(const Job& job) {
  for (const auto& r : job.reqs) {
    if (r.result < 0) {
      stats_.requests_failed++;
      if (job.op == Op::ReadBlock && is_block_error(r.result)) stats_.verify_failures++;
      continue;
    }
    stats_.requests_ok++;
    if (job.op == Op::ReadBlock || job.op == Op::Read) stats_.bytes_read += r.length;
    if (job.op == Op::WriteBlock || job.op == Op::Write) stats_.bytes_written += r.length;
  }
}


// ------------------------------------------------------------------------------ status

Status status() {
  Status s;
  s.kvikio_version = KvikIO_VERSION;
  s.device_verify_built = PYKVTIER_DEVICE_VERIFY;
  int rv = 0, dv = 0;
  cudaRuntimeGetVersion(&rv);
  s.cuda_runtime_version = rv;
  if (cudaDriverGetVersion(&dv) == cudaSuccess) s.cuda_driver_version = dv;
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaSuccess) {
    s.cuda_devices = n;
  } else {
    s.cuda_error = cudaGetErrorString(e);
    cudaGetLastError();  // clear it
  }
  try {
    s.compat_mode_default = kvikio_mode_name(kvikio::defaults::compat_mode());
    s.kvikio_threads = kvikio::defaults::thread_pool_nthreads();
    s.kvikio_task_size = kvikio::defaults::task_size();
  } catch (const std::exception& ex) {
    s.notes.push_back(std::string("kvikio defaults: ") + ex.what());
  }
  s.cufile_library = kvikio::is_cufile_library_available();
  s.cufile_available = kvikio::is_cufile_available();
  s.cufile_version = kvikio::cufile_version();
  if (!s.cufile_library) s.notes.push_back("libcufile could not be loaded");
  else if (!s.cufile_available)
    s.notes.push_back("cuFile unusable here: /run/udev is not readable (typical of containers) or WSL");
  try {
    s.compat_mode_preferred = kvikio::defaults::is_compat_mode_preferred();
  } catch (const std::exception& ex) {
    s.notes.push_back(std::string("compat mode: ") + ex.what());
  }
  if (s.cufile_available && s.cuda_devices > 0) {
    try {
      kvikio::DriverProperties p;
      s.nvfs_major = int(p.get_nvfs_major_version());
      s.nvfs_minor = int(p.get_nvfs_minor_version());
      s.gds_available = p.is_gds_available();
      s.nvfs_allow_compat = p.get_nvfs_allow_compat_mode();
      if (!s.gds_available)
        s.notes.push_back("cuFile driver reports no nvidia-fs (GDS kernel module not loaded): cuFile would "
                          "run in its own compatibility mode");
    } catch (const std::exception& ex) {
      s.notes.push_back(std::string("cuFile driver properties: ") + ex.what());
    }
  }
  return s;
}

FileProbe probe_file(const std::string& dir) {
  FileProbe p;
  std::string path = dir + "/.pykvtier-gds-probe-" + std::to_string(getpid());
  try {
    {
      kvikio::FileHandle fh(path, "w", kvikio::FileHandle::m644, kvikio::CompatMode::AUTO);
      p.opened = true;
      p.compat = fh.get_compat_mode_manager().is_compat_mode_preferred();
      p.direct_fd = fh.fd(true) >= 0;
      p.reason = p.compat ? "kvikio chose its compatibility mode (POSIX I/O) for this file system"
                          : "cuFile registered the file: GDS I/O";
    }
  } catch (const std::exception& e) {
    p.reason = std::string("kvikio could not open a file there: ") + e.what();
  }
  ::unlink(path.c_str());
  return p;
}

}  // namespace pykvtier::gds
