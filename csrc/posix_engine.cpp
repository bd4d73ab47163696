// posix engine: see posix_engine.hpp.
#include "posix_engine.hpp"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <stdexcept>

namespace pykvtier {

namespace {

// preadv/pwritev until total bytes moved, EOF or an error, retrying EINTR. Returns the bytes
// moved or -errno.
int64_t io_full(bool write, int fd, iovec* iov, int cnt, uint64_t offset, uint64_t total) {
  uint64_t done = 0;
  while (done < total && cnt > 0) {
    ssize_t n = write ? ::pwritev(fd, iov, cnt, off_t(offset + done))
                      : ::preadv(fd, iov, cnt, off_t(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (n == 0) break;
    done += uint64_t(n);
    size_t k = size_t(n);
    while (k > 0 && cnt > 0) {
      if (k >= iov->iov_len) {
        k -= iov->iov_len;
        ++iov;
        --cnt;
      } else {
        iov->iov_base = static_cast<char*>(iov->iov_base) + k;
        iov->iov_len -= k;
        k = 0;
      }
    }
  }
  return int64_t(done);
}

// A file a store may overwrite in place: regular, one link, no longer than a block.
bool reusable(const struct stat& st, uint64_t length) {
  return S_ISREG(st.st_mode) && st.st_nlink == 1 && uint64_t(st.st_size) <= kHeaderBytes + length;
}

void unlink_quiet(const std::string& path) { ::unlink(path.c_str()); }

}  // namespace

PosixEngine::PosixEngine(PosixEngineConfig cfg) : cfg_(cfg) {
  if (cfg_.queue_depth == 0 || cfg_.queue_depth > 4096)
    throw std::invalid_argument("queue_depth must be in 1..4096");
  if (cfg_.threads == 0 || cfg_.threads > 4096) throw std::invalid_argument("threads must be in 1..4096");
  if (!(cfg_.store_share > 0.0 && cfg_.store_share <= 1.0))
    throw std::invalid_argument("store_share must be in (0, 1]");
  const unsigned n = std::min(cfg_.threads, cfg_.queue_depth);
  nthreads_ = n;
  store_limit_ = std::max(1u, unsigned(std::floor(double(n) * cfg_.store_share)));
  threads_.reserve(n);
  try {
    for (unsigned i = 0; i < n; ++i) threads_.emplace_back([this] { thread_main(); });
  } catch (...) {  // e.g. EAGAIN: no more threads allowed; stop the ones started, then report
    shutdown();
    throw;
  }
}

PosixEngine::~PosixEngine() { shutdown(); }

void PosixEngine::shutdown() {
  std::lock_guard<std::mutex> joining(join_mu_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
}

bool PosixEngine::can_take() const {
  return !loads_.empty() || (!stores_.empty() && stores_running_ < store_limit_);
}

void PosixEngine::submit(std::unique_ptr<Job> job) {
  job->submit_time = monotonic_seconds();
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!admit_locked(*job)) return;
    Job* j = job.get();
    submitted_.emplace(j, std::move(job));
    (op_is_write(j->op) ? stores_ : loads_).push_back(j);
  }
  work_cv_.notify_all();
}

std::vector<int64_t> PosixEngine::run(Job& job) {
  job.submit_time = monotonic_seconds();
  if (!job.reqs.empty()) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stopping_) throw std::runtime_error("engine is shut down");
      stats_.jobs_submitted++;
      (op_is_write(job.op) ? stores_ : loads_).push_back(&job);
    }
    work_cv_.notify_all();
    std::unique_lock<std::mutex> lk(mu_);
    run_cv_.wait(lk, [&] { return job.done == job.reqs.size(); });
  }
  std::vector<int64_t> out;
  out.reserve(job.reqs.size());
  for (auto& r : job.reqs) out.push_back(r.result);
  return out;
}

void PosixEngine::thread_main() {
  // The block header of this thread's requests: one O_DIRECT unit, page-aligned.
  char* hdr = nullptr;
  if (posix_memalign(reinterpret_cast<void**>(&hdr), 4096, kHeaderBytes) != 0) hdr = nullptr;
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    work_cv_.wait(lk, [&] { return can_take() || (stopping_ && loads_.empty() && stores_.empty()); });
    if (!can_take()) {  // stopping, nothing queued: wake the others to see it too
      work_cv_.notify_all();
      break;
    }
    const bool load = !loads_.empty();
    auto& q = load ? loads_ : stores_;
    Job* job = q.front();
    Request& r = job->reqs[job->next++];
    if (job->next == job->reqs.size()) q.pop_front();
    if (!load) ++stores_running_;
    r.issue_time = monotonic_seconds();
    if (job->start_time == 0) job->start_time = r.issue_time;
    lk.unlock();

    if (hdr == nullptr)
      r.result = -ENOMEM;
    else
      execute(*job, r, hdr);
    r.done_time = monotonic_seconds();
    (r.result >= 0 ? stats_.requests_ok : stats_.requests_failed)++;

    lk.lock();
    if (!load) {
      --stores_running_;
      if (!stores_.empty()) work_cv_.notify_one();
    }
    if (++job->done < job->reqs.size()) continue;
    job->end_time = r.done_time;
    auto it = submitted_.find(job);
    if (it == submitted_.end()) {  // a run() job: its caller owns it
      stats_.jobs_finished++;
      run_cv_.notify_all();
      continue;
    }
    finish_locked(*job);
    submitted_.erase(it);
  }
  lk.unlock();
  free(hdr);
}

void PosixEngine::execute(const Job& job, Request& r, char* hdr) {
  switch (job.op) {
    case Op::Unlink:
      r.result = ::unlink(r.path.c_str()) == 0 ? 0 : -errno;
      return;
    case Op::Read:
    case Op::ReadBlock:
      r.result = read(job, r, hdr);
      return;
    case Op::Write:
    case Op::WriteBlock:
      r.result = r.recycle.empty() ? write(job, r, hdr, false) : recycle_write(job, r, hdr);
      return;
  }
}

int64_t PosixEngine::read(const Job& job, const Request& r, char* hdr) {
  // O_NONBLOCK: a FIFO put at a block's name must not hang the open (regular files and block
  // devices ignore it); its read then fails (ESPIPE), as a directory's does (EISDIR).
  const int fd = ::open(r.path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | (job.direct ? O_DIRECT : 0));
  if (fd < 0) return -errno;
  const bool block = job.op == Op::ReadBlock;
  iovec iov[2];
  int cnt = 0;
  if (block) iov[cnt++] = {hdr, kHeaderBytes};
  iov[cnt++] = {reinterpret_cast<void*>(r.addr), r.length};
  const uint64_t total = r.length + (block ? kHeaderBytes : 0);
  const int64_t n = io_full(false, fd, iov, cnt, block ? 0 : r.offset, total);
  ::close(fd);
  if (n < 0) return n;
  if (uint64_t(n) != total) return kErrShort;
  if (block) {
    if (int64_t v = verify_block(hdr, r); v != 0) {
      stats_.verify_failures++;
      return v;
    }
  }
  stats_.bytes_read += r.length;
  return int64_t(r.length);
}

int64_t PosixEngine::write(const Job& job, const Request& r, char* hdr, bool own) {
  const int direct = job.direct ? O_DIRECT : 0;
  const bool tmp = !r.target.empty();
  // A fresh temporary is new (O_EXCL). A recycled file (own) is never opened through a symlink
  // and never created. Neither it nor a file written in place (no temporary) may make the open
  // wait for a FIFO's reader (O_NONBLOCK, dropped once open).
  const int flags = own ? O_WRONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | direct
                        : O_WRONLY | O_CREAT | O_CLOEXEC | direct | (tmp ? O_EXCL : O_NONBLOCK);
  const int fd = ::open(r.path.c_str(), flags, 0644);
  if (fd < 0) return -errno;
  int64_t err = 0;
  if (own) {
    struct stat st;
    if (::fstat(fd, &st) != 0 || !reusable(st, r.length))  // swapped since the lstat
      err = -EINVAL;
  }
  if (err == 0 && (flags & O_NONBLOCK) && ::fcntl(fd, F_SETFL, direct) != 0) err = -errno;
  if (err == 0) {
    const bool block = job.op == Op::WriteBlock;
    iovec iov[2];
    int cnt = 0;
    if (block) {
      fill_header(hdr, r);
      iov[cnt++] = {hdr, kHeaderBytes};
    }
    iov[cnt++] = {reinterpret_cast<void*>(r.addr), r.length};
    const uint64_t total = r.length + (block ? kHeaderBytes : 0);
    const int64_t n = io_full(true, fd, iov, cnt, block ? 0 : r.offset, total);
    if (n < 0)
      err = n;
    else if (uint64_t(n) != total)
      err = -ENOSPC;
    else if (job.fsync && ::fdatasync(fd) != 0)
      err = -errno;
  }
  if (::close(fd) != 0 && err == 0 && errno != EINTR) err = -errno;
  if (err != 0) {
    if (tmp) unlink_quiet(r.path);
    return err;
  }
  if (tmp) {
    // Into place without replacing a block already there (another writer's, equally valid).
    if (::renameat2(AT_FDCWD, r.path.c_str(), AT_FDCWD, r.target.c_str(), RENAME_NOREPLACE) != 0) {
      int e = errno;
      if (e == EINVAL || e == ENOSYS)  // a file system without RENAME_NOREPLACE
        e = ::link(r.path.c_str(), r.target.c_str()) == 0 ? 0 : errno;
      unlink_quiet(r.path);
      if (e == EEXIST)
        stats_.rename_existing++;
      else if (e != 0)
        return -e;
    }
  }
  stats_.bytes_written += r.length;
  return int64_t(r.length);
}

int64_t PosixEngine::recycle_write(const Job& job, const Request& r, char* hdr) {
  // As the io_uring engine's recycle chain: the evicted file is renamed to the temporary name
  // and overwritten if it is a regular file of one link, no longer than a block. Anything else
  // found at its name (a directory, FIFO, symlink, longer or hard-linked file) is put back and
  // removed after the store: opening it could block forever, write through the link, or leave
  // a block file longer than a block. If it cannot be renamed (other than: it is gone) the
  // temporary is created afresh and the file removed afterwards.
  bool renamed = false, remove_victim = false;
  if (::renameat2(AT_FDCWD, r.recycle.c_str(), AT_FDCWD, r.path.c_str(), RENAME_NOREPLACE) == 0)
    renamed = true;
  else if (errno != ENOENT)
    remove_victim = true;
  struct stat st;
  const bool present = ::lstat(r.path.c_str(), &st) == 0;
  const bool reuse = present && reusable(st, r.length);
  if (renamed && !reuse) {
    renamed = false;
    int rc;
    if (S_ISDIR(st.st_mode)) {
      rc = ::renameat2(AT_FDCWD, r.path.c_str(), AT_FDCWD, r.recycle.c_str(), RENAME_NOREPLACE);
    } else {  // link + unlink: never replaces what may be at its name now
      rc = ::linkat(AT_FDCWD, r.path.c_str(), AT_FDCWD, r.recycle.c_str(), 0);
      if (rc == 0) rc = ::unlink(r.path.c_str());
    }
    if (rc == 0)
      remove_victim = true;  // back at its name: removed below
    else
      stats_.recycle_failures++;  // left at the temporary name
  } else if (renamed) {
    stats_.recycled++;
  }
  const int64_t res = write(job, r, hdr, reuse);
  if (res < 0 && renamed) unlink_quiet(r.path);  // the recycled file is ours: not left behind
  if (remove_victim && ::unlink(r.recycle.c_str()) != 0 && errno != ENOENT) stats_.recycle_failures++;
  return res;
}

}  // namespace pykvtier
