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
#include <cstring>
#include <stdexcept>

#include "file_ops.hpp"

namespace pykvtier {

using detail::io_full;
using detail::io_unit;

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

// The last request of job finished (mu_ held by lk): its directories synced (fsync=True), then
// reported to poll().
void PosixEngine::job_done_locked(Job* job, std::unique_lock<std::mutex>& lk) {
  if (job->fsync) {
    lk.unlock();
    detail::sync_renamed_dirs(*job, stats_);
    lk.lock();
  }
  job->end_time = monotonic_seconds();
  finish_locked(*job);
  auto it = submitted_.find(job);
  retire_locked(std::move(it->second));
  submitted_.erase(it);
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
    if (++job->done == job->reqs.size()) job_done_locked(job, lk);
  }
  lk.unlock();
  free(hdr);
}

void PosixEngine::execute(const Job& job, Request& r, char* hdr) {
  switch (job.op) {
    case Op::Unlink: {
      ParentDir d;
      r.result = d.open(r.path, true);
      if (r.result == 0) r.result = ::unlinkat(d.fd(), d.name(), 0) == 0 ? 0 : -errno;
      return;
    }
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

// The bytes of r between fd and memory: [header,] payload. Bytes moved or -errno / kErrShort
// (reads) / -ENOSPC (writes that moved less).
int64_t PosixEngine::transfer(const Job& job, const Request& r, int fd, char* hdr, bool write) {
  const bool block = job.op == Op::ReadBlock || job.op == Op::WriteBlock;
  iovec iov[2];
  int cnt = 0;
  if (block) iov[cnt++] = {hdr, kHeaderBytes};
  iov[cnt++] = {reinterpret_cast<void*>(r.addr), r.length};
  const uint64_t total = r.length + (block ? kHeaderBytes : 0);
  const int64_t n = io_full(write, fd, iov, cnt, block ? 0 : r.offset, total, io_unit(job));
  if (n < 0) return n;
  if (uint64_t(n) != total) return write ? -ENOSPC : kErrShort;
  return n;
}

int64_t PosixEngine::read(const Job& job, const Request& r, char* hdr) {
  // O_NONBLOCK: a FIFO put at a block's name must not hang the open (regular files and block
  // devices ignore it); its read then fails (ESPIPE), as a directory's does (EISDIR).
  const bool block = job.op == Op::ReadBlock;
  const int flags = O_RDONLY | O_NONBLOCK | O_CLOEXEC | (job.direct ? O_DIRECT : 0);
  const int fd = block ? open_no_links(r.path, flags) : ::open(r.path.c_str(), flags);
  if (fd < 0) return -errno;
  int64_t res = 0;
  struct stat st;
  if (block && ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_nlink > 1) {
    res = -EMLINK;  // a hard link to a block file: never read (it may be anyone's file)
  } else {
    res = transfer(job, r, fd, hdr, false);
    if (res >= 0 && block && (res = detail::verify_block(hdr, job, r, stats_)) != 0) stats_.verify_failures++;
    if (res > 0) res = 0;
  }
  ::close(fd);
  if (res != 0) {
    // The file was opened: bytes may have reached the caller's memory. None stay there.
    if (block) std::memset(reinterpret_cast<void*>(r.addr), 0, r.length);
    return res;
  }
  stats_.bytes_read += r.length;
  return int64_t(r.length);
}

// Removes the temporary name d/d.name() of r after a failure; a file that cannot be removed is
// reported by take_leftovers().
void PosixEngine::remove_temporary(const ParentDir& d, const Request& r) {
  if (::unlinkat(d.fd(), d.name(), 0) != 0 && errno != ENOENT) add_leftover(r.path);
}

// Opens the file r writes, relative to d: a fresh temporary (kTemporaryOpenFlags), the recycled
// file renamed there (own: never created), or a raw in-place write's file. Its mode set to
// job.file_mode where needed. A descriptor or -errno (the temporary then removed if it is ours).
int PosixEngine::open_store_file(const Job& job, const Request& r, const ParentDir& d, bool own) {
  const int direct = job.direct ? O_DIRECT : 0;
  const bool tmp = !r.target.empty();
  // No open may wait for a FIFO's reader (O_NONBLOCK, dropped once open).
  const int flags = own   ? O_WRONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | direct
                    : tmp ? detail::kTemporaryOpenFlags | O_CLOEXEC | direct
                          : O_WRONLY | O_CREAT | O_NONBLOCK | O_CLOEXEC | direct | (op_is_block(job.op) ? O_NOFOLLOW : 0);
  const int fd = ::openat(d.fd(), d.name(), flags, mode_t(job.file_mode));
  if (fd < 0) {
    const int e = errno;
    if (own) remove_temporary(d, r);  // the recycled file, renamed there by us
    return -e;
  }
  int err = 0;
  struct stat st;
  if (own) {
    if (::fstat(fd, &st) != 0 || !detail::reusable_victim(st.st_mode, st.st_nlink, st.st_size, r.length))
      err = -EINVAL;  // swapped since the lstat
    else if ((st.st_mode & 07777) != job.file_mode && ::fchmod(fd, mode_t(job.file_mode)) != 0)
      err = -errno;
  } else if (tmp && job.fix_mode && ::fchmod(fd, mode_t(job.file_mode)) != 0) {  // (Job::fix_mode)
    err = -errno;
  }
  if (err == 0 && (flags & O_NONBLOCK) && ::fcntl(fd, F_SETFL, direct) != 0) err = -errno;
  if (err == 0) return fd;
  ::close(fd);
  if (tmp) remove_temporary(d, r);
  return err;
}

int64_t PosixEngine::write(const Job& job, const Request& r, char* hdr, bool own) {
  const bool tmp = !r.target.empty();
  ParentDir d;
  if (int e = d.open(r.path, op_is_block(job.op))) return e;
  const int fd = open_store_file(job, r, d, own);
  if (fd < 0) return fd;
  if (job.op == Op::WriteBlock) detail::fill_header(hdr, job, r);
  int64_t err = transfer(job, r, fd, hdr, true);
  if (err >= 0) err = job.fsync && ::fdatasync(fd) != 0 ? -errno : 0;
  if (::close(fd) != 0 && err == 0 && errno != EINTR) err = -errno;
  if (err != 0) {
    if (tmp) remove_temporary(d, r);
    return err;
  }
  if (tmp) {
    if (int64_t e = place(job, r, d)) return e;
  }
  stats_.bytes_written += r.length;
  return int64_t(r.length);
}

// The written temporary d/d.name() into place at r.target without replacing a block already
// there (another writer's, equally valid: kept, success), through the target's directory opened
// without links (that of the temporary if the same). 0 or -errno.
int64_t PosixEngine::place(const Job& job, const Request& r, const ParentDir& d) {
  const bool safe = op_is_block(job.op);
  ParentDir t;
  int e = 0, tfd = d.fd();
  const std::string tname = safe ? base_of(r.target) : r.target;
  if (safe && dir_of(r.target) != dir_of(r.path)) {
    e = t.open(r.target, true);
    tfd = t.fd();
  }
  bool left = true;
  if (e == 0) e = detail::rename_into_place(d.fd(), d.name(), tfd, tname.c_str(), &left);
  if (left) remove_temporary(d, r);
  if (e == -EEXIST) {
    stats_.rename_existing++;
    return 0;
  }
  return e;
}

// A victim that is no reusable block file, at the temporary name t after the rename: back to its
// name v (a directory renamed, anything else linked + unlinked: never replacing what may be at
// its name now). True if it is back (then removed after the store).
bool PosixEngine::put_back(const ParentDir& t, const ParentDir& v, const Request& r, mode_t mode) {
  int rc;
  if (S_ISDIR(mode)) {
    rc = ::renameat2(t.fd(), t.name(), v.fd(), v.name(), RENAME_NOREPLACE);
  } else {
    rc = ::linkat(t.fd(), t.name(), v.fd(), v.name(), 0);
    if (rc == 0 && ::unlinkat(t.fd(), t.name(), 0) != 0) add_leftover(r.path);
  }
  if (rc == 0) return true;
  stats_.recycle_failures++;  // left at the temporary name
  add_leftover(r.path);
  return false;
}

// write_block with a recycle path: the evicted file is renamed to the temporary name and
// overwritten if detail::reusable_victim; anything else is put back and removed after the store;
// one that cannot be renamed (other than: it is gone) is removed after a fresh store. Both names
// are reached through their directories opened without links: a directory that became a link is
// not entered (the victim is then left alone, not reported: removing it would follow the link).
int64_t PosixEngine::recycle_write(const Job& job, const Request& r, char* hdr) {
  bool renamed = false, remove_victim = false;
  ParentDir v, t;
  const int ve = v.open(r.recycle, true);
  const int te = ve == 0 ? t.open(r.path, true) : 0;
  if (ve != 0) {
    if (ve != -ENOENT) {
      stats_.recycle_failures++;
      if (ve != -ELOOP) add_leftover(r.recycle);
    }
  } else if (te != 0) {
    remove_victim = true;  // the store fails opening its temporary; the victim goes
  } else if (::renameat2(v.fd(), v.name(), t.fd(), t.name(), RENAME_NOREPLACE) == 0) {
    renamed = true;
  } else if (errno != ENOENT) {
    remove_victim = true;
  }
  struct stat st {};
  const bool present = te == 0 && ve == 0 && ::fstatat(t.fd(), t.name(), &st, AT_SYMLINK_NOFOLLOW) == 0;
  const bool reuse = present && detail::reusable_victim(st.st_mode, st.st_nlink, st.st_size, r.length);
  if (renamed && !reuse)
    remove_victim = put_back(t, v, r, st.st_mode);
  else if (renamed)
    stats_.recycled++;
  // (write() removes the temporary -- the recycled file, ours -- when the store fails)
  const int64_t res = write(job, r, hdr, reuse);
  if (remove_victim && ::unlinkat(v.fd(), v.name(), 0) != 0 && errno != ENOENT) {
    stats_.recycle_failures++;
    add_leftover(r.recycle);
  }
  return res;
}

}  // namespace pykvtier
