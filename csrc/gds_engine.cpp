// gds engine: see gds_engine.hpp.
#include "gds_engine.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
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

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "block_header.hpp"
#include "xxh3_lanes.hpp"
#if PYKVTIER_DEVICE_VERIFY
#include "gds_verify.hpp"
#endif

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)
#endif

namespace pykvtier::gds {

namespace {

constexpr uint64_t kMaxRequestBytes = 1ull << 30;

kvikio::CompatMode to_kvikio(Compat c) {
  switch (c) {
    case Compat::Off: return kvikio::CompatMode::OFF;
    case Compat::On: return kvikio::CompatMode::ON;
    default: return kvikio::CompatMode::AUTO;
  }
}

const char* compat_name(kvikio::CompatMode c) {
  switch (c) {
    case kvikio::CompatMode::OFF: return "OFF";
    case kvikio::CompatMode::ON: return "ON";
    default: return "AUTO";
  }
}

int rename_noreplace(const char* from, const char* to) {
  return int(::syscall(SYS_renameat2, AT_FDCWD, from, AT_FDCWD, to, RENAME_NOREPLACE));
}

void fill_header(char* hdr, const Request& r, uint64_t payload_xxh3) {
  fill_block_header(hdr, r.digest, r.length, payload_xxh3);
}

// Header checks that need no payload bytes; 0 or a kErr* code. Sets *payload_xxh3.
int64_t check_header(const char* hdr, const Request& r, uint64_t* payload_xxh3) {
  return check_block_header(hdr, r.digest, r.length, payload_xxh3);
}

// pread until n bytes or EOF; bytes read or -errno.
int64_t pread_full(int fd, void* buf, size_t n, uint64_t off) {
  size_t got = 0;
  while (got < n) {
    ssize_t k = ::pread(fd, static_cast<char*>(buf) + got, n - got, off_t(off + got));
    if (k < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (k == 0) break;
    got += size_t(k);
  }
  return int64_t(got);
}

int64_t pwrite_full(int fd, const void* buf, size_t n, uint64_t off) {
  size_t put = 0;
  while (put < n) {
    ssize_t k = ::pwrite(fd, static_cast<const char*>(buf) + put, n - put, off_t(off + put));
    if (k < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (k == 0) return -ENOSPC;
    put += size_t(k);
  }
  return int64_t(put);
}

}  // namespace

Verify parse_verify(const std::string& s) {
  if (s == "auto") return PYKVTIER_DEVICE_VERIFY ? Verify::Device : Verify::Host;
  if (s == "device") {
    if (!PYKVTIER_DEVICE_VERIFY)
      throw std::invalid_argument(
          "verify='device': this build has no device checksum kernel (no CUDA compiler at build time)");
    return Verify::Device;
  }
  if (s == "host") return Verify::Host;
  if (s == "header") return Verify::Header;
  throw std::invalid_argument("unknown verify '" + s + "': expected auto, device, host or header");
}

const char* verify_name(Verify v) {
  switch (v) {
    case Verify::Device: return "device";
    case Verify::Host: return "host";
    case Verify::Header: return "header";
  }
  return "?";
}

Compat parse_compat(const std::string& s) {
  if (s == "auto") return Compat::Auto;
  if (s == "on") return Compat::On;
  if (s == "off") return Compat::Off;
  throw std::invalid_argument("unknown compat '" + s + "': expected auto, on or off");
}

// ------------------------------------------------------------------------------ per thread

// CUDA resources of one pool thread: a stream, a header buffer, scratch for checksums.
struct Engine::ThreadCtx {
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

// ------------------------------------------------------------------------------ Engine

Engine::Engine(Config cfg) : cfg_(cfg) {
  if (cfg_.io_threads == 0 || cfg_.io_threads > 256) throw std::invalid_argument("io_threads must be in 1..256");
  for (unsigned i = 0; i < cfg_.io_threads; ++i) ctx_.push_back(std::make_unique<ThreadCtx>());
  for (unsigned i = 0; i < cfg_.io_threads; ++i) threads_.emplace_back([this, i] { worker(i); });
}

Engine::~Engine() { shutdown(); }

void Engine::shutdown() {
  {
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [this] { return outstanding_ == 0; });
    if (stopping_ && threads_.empty()) return;
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  threads_.clear();
  ctx_.clear();
  unregister_buffers();
}

void Engine::note_error(const std::string& what) {
  std::lock_guard<std::mutex> lk(err_mu_);
  last_error_ = what;
}

std::string Engine::last_error() {
  std::lock_guard<std::mutex> lk(err_mu_);
  return last_error_;
}

void Engine::note_mode(bool compat) { (compat ? stats_.compat_mode_files : stats_.gds_files)++; }

bool Engine::register_buffer(uint64_t addr, uint64_t len) {
  bool ok = true;
  bool registered = false;
  if (cfg_.compat != Compat::On && !kvikio::defaults::is_compat_mode_preferred(to_kvikio(cfg_.compat))) {
    try {
      kvikio::buffer_register(reinterpret_cast<const void*>(addr), len);
      registered = true;
    } catch (const std::exception& e) {
      stats_.buffer_registration_failures++;
      note_error(std::string("cuFileBufRegister: ") + e.what());
      ok = false;
    }
  }
  std::lock_guard<std::mutex> lk(regions_mu_);
  regions_.push_back({addr, len, registered});
  return ok;
}

void Engine::unregister_buffers() {
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
std::pair<uint64_t, uint64_t> Engine::base_and_offset(uint64_t addr, uint64_t len) {
  std::lock_guard<std::mutex> lk(regions_mu_);
  for (auto& r : regions_)
    if (r.registered && addr >= r.addr && addr + len <= r.addr + r.len) {
      stats_.registered_buffer_ios++;
      return {r.addr, addr - r.addr};
    }
  return {addr, 0};
}

void Engine::submit(std::unique_ptr<Job> job) {
  job->submit_time = monotonic_seconds();
  job->remaining = job->reqs.size();
  stats_.jobs_submitted++;
  std::unique_lock<std::mutex> lk(mu_);
  if (stopping_) throw std::runtime_error("engine is shut down");
  ++outstanding_;
  Job* j = job.get();
  owned_.push_back(std::move(job));
  if (j->reqs.empty()) {
    lk.unlock();
    finish_job(*j);
    return;
  }
  auto& q = op_is_write(j->op) ? stores_ : loads_;
  for (uint32_t i = 0; i < j->reqs.size(); ++i) q.push_back({j, i});
  lk.unlock();
  work_cv_.notify_all();
}

std::vector<int64_t> Engine::run(std::unique_ptr<Job> job, std::vector<double>* latencies) {
  job->sync = true;
  Job* j = job.get();
  submit(std::move(job));
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, [j] { return j->done; });
  std::vector<int64_t> out;
  for (auto& r : j->reqs) {
    out.push_back(r.result);
    if (latencies) latencies->push_back(r.done_time - r.start_time);
  }
  owned_.erase(std::find_if(owned_.begin(), owned_.end(), [j](auto& p) { return p.get() == j; }));
  --outstanding_;
  done_cv_.notify_all();
  return out;
}

void Engine::worker(unsigned idx) {
  ThreadCtx& t = *ctx_[idx];
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lk(mu_);
      work_cv_.wait(lk, [this] { return stopping_ || !loads_.empty() || !stores_.empty(); });
      auto& q = !loads_.empty() ? loads_ : stores_;
      if (q.empty()) return;  // stopping, nothing left
      task = q.front();
      q.pop_front();
    }
    Job& job = *task.job;
    Request& r = job.reqs[task.index];
    r.start_time = monotonic_seconds();
    if (job.started++ == 0) job.start_time = r.start_time;
    do_request(t, job, r);
    if (--job.remaining == 0) {
      if (job.op == Op::ReadBlock) verify_job(t, job);
      finish_job(job);
    }
  }
}

void Engine::do_request(ThreadCtx& t, Job& job, Request& r) {
  int64_t res;
  try {
    switch (job.op) {
      case Op::ReadBlock: res = read_block(t, job, r); break;
      case Op::WriteBlock: res = write_block(t, job, r); break;
      case Op::Read: res = read_raw(t, job, r); break;
      case Op::Write: res = write_raw(t, job, r); break;
      case Op::Unlink: res = ::unlink(r.path.c_str()) == 0 ? 0 : -errno; break;
      default: res = -EINVAL;
    }
  } catch (const std::system_error& e) {
    note_error(r.path + ": " + e.what());
    res = e.code().value() > 0 ? -int64_t(e.code().value()) : -EIO;
  } catch (const std::exception& e) {
    note_error(r.path + ": " + e.what());
    res = -EIO;
  }
  r.result = res;
  r.done_time = monotonic_seconds();
}

int64_t Engine::read_block(ThreadCtx& t, Job& job, Request& r) {
  kvikio::FileHandle fh(r.path, "r", kvikio::FileHandle::m644, to_kvikio(cfg_.compat));
  const bool compat = fh.get_compat_mode_manager().is_compat_mode_preferred();
  note_mode(compat);
  if (fh.nbytes() < kHeaderBytes + r.length) return kErrShort;
  const int hfd = job.direct && fh.fd(true) >= 0 ? fh.fd(true) : fh.fd(false);
  int64_t n = pread_full(hfd, t.header, kHeaderBytes, 0);
  if (n < 0) return n;
  if (uint64_t(n) < kHeaderBytes) return kErrShort;
  if (int64_t e = check_header(t.header, r, &r.header_xxh3)) return e;
  auto [base, off] = base_and_offset(r.addr, r.length);
  size_t got = fh.read(reinterpret_cast<void*>(base), r.length, kHeaderBytes, off, false);
  if (got < r.length) return kErrShort;
  r.needs_payload_check = cfg_.verify != Verify::Header;
  if (!r.needs_payload_check) stats_.unverified_payloads++;
  return int64_t(r.length);
}

int64_t Engine::read_raw(ThreadCtx&, Job&, Request& r) {
  kvikio::FileHandle fh(r.path, "r", kvikio::FileHandle::m644, to_kvikio(cfg_.compat));
  note_mode(fh.get_compat_mode_manager().is_compat_mode_preferred());
  if (fh.nbytes() < r.offset + r.length) return kErrShort;
  auto [base, off] = base_and_offset(r.addr, r.length);
  size_t got = fh.read(reinterpret_cast<void*>(base), r.length, r.offset, off, false);
  if (got < r.length) return kErrShort;
  stats_.bytes_read += r.length;
  return int64_t(r.length);
}

static int sync_producer(uint64_t addr);

int64_t Engine::write_raw(ThreadCtx&, Job& job, Request& r) {
  if (int err = sync_producer(r.addr)) {
    stats_.cuda_errors++;
    note_error(std::string("cudaStreamSynchronize: ") + cudaGetErrorString(cudaError_t(err)));
    return -EIO;
  }
  int64_t res;
  {
    // In place (no target): the file is updated, not truncated; with a target: a new temporary.
    const bool in_place = r.target.empty() && ::access(r.path.c_str(), F_OK) == 0;
    kvikio::FileHandle fh(r.path, in_place ? "r+" : "w", kvikio::FileHandle::m644, to_kvikio(cfg_.compat));
    note_mode(fh.get_compat_mode_manager().is_compat_mode_preferred());
    auto [base, off] = base_and_offset(r.addr, r.length);
    size_t put = fh.write(reinterpret_cast<const void*>(base), r.length, r.offset, off, true);
    res = put < r.length ? -ENOSPC : int64_t(r.length);
    if (res > 0 && job.fsync && ::fdatasync(fh.fd(false)) != 0) res = -errno;
  }
  if (!r.target.empty()) {
    if (res > 0 && rename_noreplace(r.path.c_str(), r.target.c_str()) != 0) {
      if (errno == EEXIST) stats_.rename_existing++;
      else res = -errno;
    }
    ::unlink(r.path.c_str());  // the temporary, if still there
  }
  if (res > 0) stats_.bytes_written += r.length;
  return res;
}

// Work queued on the legacy default stream (torch's default) before the store was submitted has
// produced the payload: wait for it (a non-blocking stream would not). Producers on other streams
// must synchronize before submitting stores.
static int sync_producer(uint64_t addr) {
  cudaPointerAttributes attr{};
  cudaError_t e = cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(addr));
  if (e == cudaSuccess) e = cudaSetDevice(attr.device);
  if (e == cudaSuccess) e = cudaStreamSynchronize(nullptr);
  return int(e);
}

int64_t Engine::write_block(ThreadCtx& t, Job& job, Request& r) {
  if (int err = sync_producer(r.addr)) {
    stats_.cuda_errors++;
    note_error(std::string("cudaStreamSynchronize: ") + cudaGetErrorString(cudaError_t(err)));
    return -EIO;
  }
  std::vector<uint64_t> sum;
  if (!payload_hashes(t, {&r}, sum)) return -EIO;
  int64_t res;
  {
    kvikio::FileHandle fh;
    try {
      // A new temporary (its name is unique to the writer); "w" truncates a stale one.
      fh = kvikio::FileHandle(r.path, "w", kvikio::FileHandle::m644, to_kvikio(cfg_.compat));
    } catch (const std::system_error& e) {
      note_error(r.path + ": " + e.what());
      return e.code().value() > 0 ? -int64_t(e.code().value()) : -EIO;
    }
    note_mode(fh.get_compat_mode_manager().is_compat_mode_preferred());
    fill_header(t.header, r, sum[0]);
    res = pwrite_full(fh.fd(false), t.header, kHeaderBytes, 0);
    if (res >= 0) {
      auto [base, off] = base_and_offset(r.addr, r.length);
      try {
        size_t put = fh.write(reinterpret_cast<const void*>(base), r.length, kHeaderBytes, off, true);
        res = put < r.length ? -ENOSPC : int64_t(r.length);
      } catch (const std::system_error& e) {
        note_error(r.path + ": " + e.what());
        res = e.code().value() > 0 ? -int64_t(e.code().value()) : -EIO;
      } catch (const std::exception& e) {
        note_error(r.path + ": " + e.what());
        res = -EIO;
      }
    }
    if (res > 0 && job.fsync && ::fdatasync(fh.fd(false)) != 0) res = -errno;
  }
  if (res > 0) {
    if (rename_noreplace(r.path.c_str(), r.target.c_str()) != 0) {
      if (errno == EEXIST) {
        stats_.rename_existing++;  // content-addressed: keep the block already there
      } else {
        res = -errno;
      }
      ::unlink(r.path.c_str());
    }
  } else {
    ::unlink(r.path.c_str());
  }
  if (res > 0) stats_.bytes_written += r.length;
  return res;
}

// XXH3-64 of the payloads of reqs (device memory), into out. False on a CUDA error (noted).
bool Engine::payload_hashes(ThreadCtx& t, const std::vector<const Request*>& reqs, std::vector<uint64_t>& out) {
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
  if (cfg_.verify != Verify::Host) {  // (stores under "header" still need the checksum)
    for (size_t i = 0; i < reqs.size(); ++i) {
      const Request& r = *reqs[i];
      if (r.length >= xxh3::kMinLength && r.addr % 16 == 0)
        on_device.push_back(i);
      else
        on_host.push_back(i);
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
  } else {
    for (size_t i = 0; i < reqs.size(); ++i) on_host.push_back(i);
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
    out[i] = XXH3_64bits(t.staging, r.length);
    stats_.host_verifications++;
  }
  return true;
}

// Payload checksums of a load job's landed blocks, in one batch (one kernel launch).
void Engine::verify_job(ThreadCtx& t, Job& job) {
  std::vector<const Request*> todo;
  for (auto& r : job.reqs)
    if (r.result >= 0 && r.needs_payload_check) todo.push_back(&r);
  std::vector<uint64_t> sums;
  if (!payload_hashes(t, todo, sums)) {
    for (auto* r : todo) const_cast<Request*>(r)->result = -EIO;
    return;
  }
  for (size_t i = 0; i < todo.size(); ++i) {
    auto* r = const_cast<Request*>(todo[i]);
    if (sums[i] != r->header_xxh3) {
      r->result = kErrChecksum;
    }
  }
}

void Engine::finish_job(Job& job) {
  job.end_time = monotonic_seconds();
  for (auto& r : job.reqs) {
    if (r.result < 0) {
      stats_.requests_failed++;
      if (r.result <= kErrShort && r.result >= kErrChecksum && job.op == Op::ReadBlock) stats_.verify_failures++;
    } else {
      stats_.requests_ok++;
      if (job.op == Op::ReadBlock) stats_.bytes_read += r.length;
    }
  }
  stats_.jobs_finished++;
  std::lock_guard<std::mutex> lk(mu_);
  job.done = true;
  if (!job.sync) {
    FinishedJob f;
    f.id = job.id;
    f.op = job.op;
    for (auto& r : job.reqs) f.results.push_back(r.result);
    f.submits = 1;
    f.queued_s = job.start_time > 0 ? job.start_time - job.submit_time : 0;
    f.transfer_s = job.start_time > 0 ? job.end_time - job.start_time : 0;
    finished_.push_back(std::move(f));
    Job* j = &job;
    owned_.erase(std::find_if(owned_.begin(), owned_.end(), [j](auto& p) { return p.get() == j; }));
    --outstanding_;
  }
  done_cv_.notify_all();
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
    s.compat_mode_default = compat_name(kvikio::defaults::compat_mode());
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
