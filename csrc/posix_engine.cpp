// posix engine: see posix_engine.hpp.
#include "posix_engine.hpp"

#include "safe_path.hpp"

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

namespace pykvtier {

namespace {

// preadv/pwritev of total bytes (iov0: cnt0 buffers) at file offset offset until all are moved,
// EOF or an error, retrying EINTR. After a short transfer the next one starts where the last
// ended -- rounded down to unit bytes (O_DIRECT: the alignment it needs; else 1), so a short
// O_DIRECT read at an unaligned end of file is followed by an aligned one that finds the real
// end (or the error: EIO on a bad sector) instead of failing EINVAL. Returns the bytes moved
// or -errno.
int64_t io_full(bool write, int fd, const iovec* iov0, int cnt0, uint64_t offset, uint64_t total,
                uint64_t unit) {
  uint64_t done = 0;
  while (done < total) {
    const uint64_t pos = done - done % unit;
    iovec iov[2];
    int cnt = 0;
    uint64_t skip = pos;
    for (int i = 0; i < cnt0; ++i) {
      if (skip >= iov0[i].iov_len) {
        skip -= iov0[i].iov_len;
        continue;
      }
      iov[cnt++] = {static_cast<char*>(iov0[i].iov_base) + skip, iov0[i].iov_len - skip};
      skip = 0;
    }
    ssize_t n = write ? ::pwritev(fd, iov, cnt, off_t(offset + pos)) : ::preadv(fd, iov, cnt, off_t(offset + pos));
    if (n < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (pos + uint64_t(n) <= done) break;  // nothing new: the end of the file (or no room)
    done = pos + uint64_t(n);
  }
  return int64_t(done);
}

// A file a store may overwrite in place: regular, one link, no longer than a block.
bool reusable(const struct stat& st, uint64_t length) {
  return S_ISREG(st.st_mode) && st.st_nlink == 1 && uint64_t(st.st_size) <= kHeaderBytes + length;
}

// Block files (read_block, write_block) and unlinks follow no symlink; raw reads and writes
// (benchmark files the caller names) open as open(2) does.
bool no_links(Op op) { return op == Op::ReadBlock || op == Op::WriteBlock || op == Op::Unlink; }

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
    run_cv_.wait(lk, [&] { return job.complete; });
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
    if (job->fsync) {  // the last request: the directories of the job's renames, once each
      lk.unlock();
      sync_dirs(*job);
      lk.lock();
    }
    job->end_time = monotonic_seconds();
    job->complete = true;
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

void PosixEngine::sync_dirs(Job& job) {
  const std::vector<std::string> dirs = renamed_dirs(job);
  std::vector<int> err(dirs.size(), 0);
  for (size_t i = 0; i < dirs.size(); ++i) {
    const int flags = O_RDONLY | O_DIRECTORY | O_CLOEXEC;
    const int fd = no_links(job.op) ? open_no_links(dirs[i], flags) : ::open(dirs[i].c_str(), flags);
    if (fd < 0) {
      err[i] = -errno;
      continue;
    }
    stats_.dir_fsyncs++;
    if (::fsync(fd) != 0) err[i] = -errno;
    ::close(fd);
  }
  apply_dir_errors(job, dirs, err, stats_);
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
    iovec iov[2];
    int cnt = 0;
    if (block) iov[cnt++] = {hdr, kHeaderBytes};
    iov[cnt++] = {reinterpret_cast<void*>(r.addr), r.length};
    const uint64_t total = r.length + (block ? kHeaderBytes : 0);
    const uint64_t unit = job.direct ? std::max<uint64_t>(4096, job.align) : 1;
    const int64_t n = io_full(false, fd, iov, cnt, block ? 0 : r.offset, total, unit);
    if (n < 0)
      res = n;
    else if (uint64_t(n) != total)
      res = kErrShort;
    else if (block && (res = verify_block(hdr, r)) != 0)
      stats_.verify_failures++;
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

int64_t PosixEngine::write(const Job& job, const Request& r, char* hdr, bool own) {
  const int direct = job.direct ? O_DIRECT : 0;
  const bool tmp = !r.target.empty();
  const bool safe = no_links(job.op);
  // A fresh temporary is new (O_EXCL). A recycled file (own) is never created. No open follows
  // a symlink at the last component (O_NOFOLLOW; the directory is opened without links), and
  // none may wait for a FIFO's reader (O_NONBLOCK, dropped once open).
  const int flags = own ? O_WRONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | direct
                        : O_WRONLY | O_CREAT | O_CLOEXEC | direct | (tmp ? O_EXCL : O_NONBLOCK) |
                              (safe ? O_NOFOLLOW : 0);
  ParentDir d;
  if (int e = d.open(r.path, safe)) return e;
  const int fd = ::openat(d.fd(), d.name(), flags, mode_t(job.file_mode));
  if (fd < 0) {
    const int e = errno;
    if (own) remove_temporary(d, r);  // the recycled file, renamed there by us
    return -e;
  }
  int64_t err = 0;
  struct stat st;
  if (own) {
    if (::fstat(fd, &st) != 0 || !reusable(st, r.length))  // swapped since the lstat
      err = -EINVAL;
    else if ((st.st_mode & 07777) != job.file_mode && ::fchmod(fd, mode_t(job.file_mode)) != 0)
      err = -errno;
  } else if (tmp && job.fix_mode && ::fchmod(fd, mode_t(job.file_mode)) != 0) {  // (Job::fix_mode)
    err = -errno;
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
    const uint64_t unit = job.direct ? std::max<uint64_t>(4096, job.align) : 1;
    const int64_t n = io_full(true, fd, iov, cnt, block ? 0 : r.offset, total, unit);
    if (n < 0)
      err = n;
    else if (uint64_t(n) != total)
      err = -ENOSPC;
    else if (job.fsync && ::fdatasync(fd) != 0)
      err = -errno;
  }
  if (::close(fd) != 0 && err == 0 && errno != EINTR) err = -errno;
  if (err != 0) {
    if (tmp) remove_temporary(d, r);
    return err;
  }
  if (tmp) {
    // Into place without replacing a block already there (another writer's, equally valid),
    // through the target's directory opened without links (that of the temporary if the same).
    ParentDir t;
    int e = 0, tfd = d.fd();
    std::string tname = safe ? base_of(r.target) : r.target;
    if (safe && dir_of(r.target) != dir_of(r.path)) {
      e = -t.open(r.target, true);
      tfd = t.fd();
    }
    if (e == 0 && ::renameat2(d.fd(), d.name(), tfd, tname.c_str(), RENAME_NOREPLACE) != 0) {
      e = errno;
      if (e == EINVAL || e == ENOSYS)  // a file system without RENAME_NOREPLACE
        e = ::linkat(d.fd(), d.name(), tfd, tname.c_str(), 0) == 0 ? 0 : errno;
      remove_temporary(d, r);
    } else if (e != 0) {
      remove_temporary(d, r);
    }
    if (e == EEXIST)
      stats_.rename_existing++;
    else if (e != 0)
      return -e;
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
  // temporary is created afresh and the file removed afterwards. Both names are reached through
  // their directories opened without links: a directory that became a link is not entered
  // (the victim is then left alone, not reported: removing it would follow the link).
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
  const bool reuse = present && reusable(st, r.length);
  if (renamed && !reuse) {
    renamed = false;
    int rc;
    if (S_ISDIR(st.st_mode)) {
      rc = ::renameat2(t.fd(), t.name(), v.fd(), v.name(), RENAME_NOREPLACE);
    } else {  // link + unlink: never replaces what may be at its name now
      rc = ::linkat(t.fd(), t.name(), v.fd(), v.name(), 0);
      if (rc == 0 && ::unlinkat(t.fd(), t.name(), 0) != 0) add_leftover(r.path);
    }
    if (rc == 0) {
      remove_victim = true;  // back at its name: removed below
    } else {
      stats_.recycle_failures++;  // left at the temporary name
      add_leftover(r.path);
    }
  } else if (renamed) {
    stats_.recycled++;
  }
  // (write() removes the temporary -- the recycled file, ours -- when the store fails)
  const int64_t res = write(job, r, hdr, reuse);
  if (remove_victim && ::unlinkat(v.fd(), v.name(), 0) != 0 && errno != ENOENT) {
    stats_.recycle_failures++;
    add_leftover(r.recycle);
  }
  return res;
}

}  // namespace pykvtier
