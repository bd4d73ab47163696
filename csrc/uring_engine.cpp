// io_uring engine: see uring_engine.hpp.
#include "uring_engine.hpp"

#include "checksum.hpp"
#include "safe_path.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <system_error>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace pykvtier {

namespace {

// Stages of a request's SQE chain, kept in the low bits of user_data.
enum Stage : uint64_t {
  kOpen = 0,
  kHeader = 1,
  kData = 2,
  kFsync = 3,
  kClose = 4,
  kRename = 5,
  kUnlink = 6,
  kRecycle = 7,  // rename of a recycled file to the temporary name (not an error of the request)
  kStatx = 8,    // statx of the temporary after that rename: is it a reusable block file?
  kRestore = 9,  // rename of a victim that is not a reusable block file back to its name
  kLinks = 11,   // read_block: statx of the opened path (a hard-linked block file is refused)
  kReread = 12,  // a read's re-read of what a short read left out
  kDirSync = 13, // fsync=True: fsync of one directory of the job's renames (sub: which)
};
constexpr uint64_t kStageBits = 4;
constexpr uint64_t kWakeTag = ~0ull;
constexpr uint64_t kMaxIoBytes = 1ull << 30;  // per-SQE limit (CQE res is int32)
constexpr uint64_t kMaxFixedChunk = 1ull << 30;  // the kernel's limit per registered buffer

constexpr unsigned kMaxRereads = 8;  // re-reads of one request after short reads
constexpr uint32_t kPreFailed = 1u << 31;  // sub bit: a NOP standing in for an op never issued
constexpr size_t kMaxDirFds = 4096;        // cached directory descriptors per ring (then cleared, idle)
// user_data: sub (bits 32..63: which directory, which check) | slot | stage
uint64_t encode(uint32_t slot, Stage stage, uint32_t sub = 0) {
  return (uint64_t(sub) << 32) | (uint64_t(slot) << kStageBits) | stage;
}

// Block files (read_block, write_block) and unlinks follow no symlink; raw reads and writes
// (benchmark files the caller names) open as open(2) does.
bool no_links(Op op) { return op == Op::ReadBlock || op == Op::WriteBlock || op == Op::Unlink; }

// Sets path's permission bits to mode without following a link (opened, then fchmod). 0 or -errno.
int set_mode(const std::string& path, bool safe, uint32_t mode) {
  const int flags = O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC;
  const int fd = safe ? open_no_links(path, flags) : ::open(path.c_str(), flags);
  if (fd < 0) return -errno;
  const int rc = ::fchmod(fd, mode_t(mode)) == 0 ? 0 : -errno;
  ::close(fd);
  return rc;
}

[[noreturn]] void throw_errno(const char* what, int err) {
  throw std::system_error(err, std::generic_category(), what);
}

}  // namespace

// ---------------------------------------------------------------------------- Ring

Ring::Ring(Engine& engine, unsigned depth, int wake_fd, bool single_issuer)
    : engine_(engine), depth_(depth), wake_fd_(wake_fd) {
  // A request has at most 6 SQEs unsubmitted at once in one chain (open, statx, header, data,
  // close; open, header, data, fsync, close; the 6 of a recycle probe; 3 of a checked unlink or
  // a re-read); 7 per request leaves room to spare. (A job's directory fsyncs are independent
  // SQEs: they may be split across submits.)
  unsigned entries = 8;
  while (entries < depth * 7 + 2) entries <<= 1;
  // A worker's ring lives and dies with its thread: let the kernel run completion work only
  // when that thread waits (SINGLE_ISSUER + DEFER_TASKRUN, Linux 6.1). Rings of run() may be
  // reused by a later thread, so they only run completion work cooperatively (5.19). Older
  // kernels take plain rings.
  const unsigned flag_sets[] = {
      IORING_SETUP_SUBMIT_ALL | IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
      IORING_SETUP_SUBMIT_ALL | IORING_SETUP_COOP_TASKRUN,
      0,
  };
  io_uring_params p{};
  int rc = -EINVAL;
  for (unsigned f : flag_sets) {
    if (!single_issuer && (f & IORING_SETUP_SINGLE_ISSUER)) continue;
    p = io_uring_params{};
    p.flags = f;
    rc = io_uring_queue_init_params(entries, &ring_, &p);
    if (rc != -EINVAL) break;
  }
  skip_open_cqe_ = (p.features & IORING_FEAT_CQE_SKIP) != 0;
  if (rc < 0) throw_errno("io_uring_queue_init", -rc);
  rc = io_uring_register_files_sparse(&ring_, depth);
  if (rc < 0) {
    io_uring_queue_exit(&ring_);
    throw_errno("io_uring_register_files_sparse (fixed-file table, Linux >= 5.19 needed)", -rc);
  }
  ctx_.resize(depth);
  free_slots_.reserve(depth);
  for (unsigned i = depth; i > 0; --i) free_slots_.push_back(i - 1);
  if (posix_memalign(reinterpret_cast<void**>(&headers_), 4096, size_t(depth) * kHeaderBytes) != 0) {
    io_uring_queue_exit(&ring_);
    throw std::bad_alloc();
  }
  for (unsigned i = 0; i < depth; ++i) ctx_[i].header = headers_ + size_t(i) * kHeaderBytes;
  if (wake_fd_ >= 0) arm_wake();
}

Ring::~Ring() {
  std::vector<Job*> ignored;
  try {
    while (inflight_ > 0) reap(true, ignored);
  } catch (const std::exception&) {
    // Nothing to report to from a destructor; closing the ring cancels what is left.
  }
  io_uring_queue_exit(&ring_);
  free(headers_);
  for (auto& kv : dir_fds_) ::close(kv.second);
}

// The link-free descriptor of directory dir (cached), or -errno (ELOOP: a link in its path).
int Ring::dir_fd(const std::string& dir) {
  auto it = dir_fds_.find(dir);
  if (it != dir_fds_.end()) {
    struct stat st;
    if (::fstat(it->second, &st) == 0 && st.st_nlink > 0) return it->second;
    ::close(it->second);  // removed (perhaps made again): opened anew
    dir_fds_.erase(it);
  }
  const int fd = open_no_links(dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return -errno;
  dir_fds_.emplace(dir, fd);
  return fd;
}

// Where an *at() SQE names path: for block files (no_links) the cached link-free descriptor of
// its directory and its base name (a pointer into path), else AT_FDCWD and path. 0 or -errno.
int Ring::at(const Job& job, const std::string& path, int* dfd, const char** name) {
  if (!no_links(job.op)) {
    *dfd = AT_FDCWD;
    *name = path.c_str();
    return 0;
  }
  const int fd = dir_fd(dir_of(path));
  if (fd < 0) return fd;
  const size_t i = path.rfind('/');
  *dfd = fd;
  *name = path.c_str() + (i == std::string::npos ? 0 : i + 1);
  return 0;
}

// A NOP in place of an op of stage that cannot be issued (its directory cannot be opened
// without a link): its CQE is handled as that op's, with result err.
void Ring::prep_failed(uint32_t slot, uint64_t stage, int err) {
  Ctx& c = ctx_[slot];
  c.pre_res = err;
  io_uring_sqe* sqe = get_sqe();
  io_uring_prep_nop(sqe);
  io_uring_sqe_set_data64(sqe, encode(slot, Stage(stage), kPreFailed));
  ++c.pending;
  ++unsubmitted_;
}

void Ring::arm_wake() {
  io_uring_sqe* sqe = get_sqe();
  io_uring_prep_poll_multishot(sqe, wake_fd_, POLLIN);
  io_uring_sqe_set_data64(sqe, kWakeTag);
  ++unsubmitted_;
  ++wake_sqes_;  // not counted as a data submit
}

io_uring_sqe* Ring::get_sqe() {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (!sqe) {
    // Sized so this cannot happen with the per-request bound; submit to make room.
    submit(0);
    sqe = io_uring_get_sqe(&ring_);
    if (!sqe) throw std::runtime_error("io_uring submission queue full");
  }
  return sqe;
}

// Stores (and unlinks) may hold only part of the ring (EngineConfig::store_share), so a load
// that arrives during a burst of stores is issued at once: loads have priority.
uint64_t Ring::byte_budget(bool store) const {
  uint64_t b = engine_.config().max_inflight_bytes;
  return store ? std::max<uint64_t>(1, uint64_t(double(b) * engine_.config().store_share)) : b;
}

unsigned Ring::slot_budget(bool store) const {
  return store ? std::max(1u, unsigned(double(depth_) * engine_.config().store_share)) : depth_;
}

bool Ring::has_capacity(uint64_t len, bool store) const {
  if (free_slots_.empty()) return false;
  if (store && inflight_stores_ >= slot_budget(true)) return false;
  if (inflight_ == 0) return true;
  const uint64_t used = store ? inflight_store_bytes_ : inflight_bytes_;
  return used + len <= byte_budget(store);
}

bool Ring::can_take_whole(const Job& job) const {
  // One io_uring_submit per job: admit a job when all its requests fit. A job that can never
  // fit whole streams through the ring, admitted as soon as its first request fits.
  const bool store = op_is_write(job.op);
  uint64_t bytes = 0;
  if (job.op != Op::Unlink)
    for (const auto& r : job.reqs) bytes += r.length;
  if (job.reqs.size() > slot_budget(store) || bytes > byte_budget(store))
    return has_capacity(job.op == Op::Unlink ? 0 : job.reqs[0].length, store);
  if (job.reqs.size() > free_slots_.size()) return false;
  if (store && inflight_stores_ + job.reqs.size() > slot_budget(true)) return false;
  if (inflight_ == 0) return true;
  const uint64_t used = store ? inflight_store_bytes_ : inflight_bytes_;
  return used + bytes <= byte_budget(store);
}

int Ring::fixed_index(uint64_t addr, uint64_t len) const {
  for (size_t i = 0; i < buffers_.size(); ++i) {
    const auto& b = buffers_[i];
    if (addr >= b.addr && addr + len <= b.addr + b.len) return int(i);
  }
  return -1;
}

void Ring::sync_buffers() {
  uint64_t gen = 0;
  auto bufs = engine_.buffers(&gen);
  if (gen == buffers_generation_ || inflight_ > 0) return;
  if (!buffers_.empty()) io_uring_unregister_buffers(&ring_);
  buffers_.clear();
  buffers_generation_ = gen;
  if (bufs.empty()) return;
  std::vector<iovec> iov;
  for (auto& b : bufs) iov.push_back({reinterpret_cast<void*>(b.addr), size_t(b.len)});
  int rc = io_uring_register_buffers(&ring_, iov.data(), unsigned(iov.size()));
  if (rc == 0) {
    buffers_ = std::move(bufs);
  } else {
    // E.g. RLIMIT_MEMLOCK: the ring keeps using plain READ/WRITE; counted and reported.
    engine_.stats().buffer_registration_failures++;
    engine_.stats().buffer_registration_errno = -rc;
  }
}

void Ring::record_error(Ctx& c, int stage, int64_t err) {
  if (stage < c.err_stage) {
    c.err = err;
    c.err_stage = stage;
  }
}

unsigned Ring::issue(Job& job) {
  if (inflight_ == 0 && dir_fds_.size() > kMaxDirFds) {  // no SQE refers to them now
    for (auto& kv : dir_fds_) ::close(kv.second);
    dir_fds_.clear();
  }
  const double now = monotonic_seconds();
  const bool store = op_is_write(job.op);
  if (job.next == 0 && job.start_time == 0) job.start_time = now;
  unsigned n = 0;
  while (job.next < job.reqs.size()) {
    Request& r = job.reqs[job.next];
    uint64_t len = job.op == Op::Unlink ? 0 : r.length;
    if (!has_capacity(len, store)) break;
    uint32_t slot = free_slots_.back();
    free_slots_.pop_back();
    Ctx& c = ctx_[slot];
    c.job = &job;
    c.index = uint32_t(job.next);
    c.pending = 0;
    c.phase = 0;
    c.err = 0;
    c.err_stage = 99;
    c.recycle_res = 0;
    c.stat_res = 0;
    c.reuse = false;
    c.merged = false;
    c.moved = 0;
    c.open_failed = false;
    c.check_res[0] = c.check_res[1] = 0;
    c.unlink_res = 0;
    c.hdr_got = c.data_got = 0;
    c.rereads = 0;
    r.issue_time = now;
    ++job.next;
    ++inflight_;
    inflight_bytes_ += len;
    if (store) {
      inflight_store_bytes_ += len;
      ++inflight_stores_;
    }
    if (job.op == Op::WriteBlock && !r.recycle.empty())
      prep_recycle(slot);  // the main chain follows once the victim is known to be reusable
    else
      prep_chain(slot);
    ++n;
  }
  if (n) ++job.submits;
  return n;
}

void Ring::prep_chain(uint32_t slot) {
  Ctx& c = ctx_[slot];
  Job& job = *c.job;
  Request& r = job.reqs[c.index];
  auto finish_sqe = [&](io_uring_sqe* sqe, Stage st, unsigned flags) {
    io_uring_sqe_set_data64(sqe, encode(slot, st));
    sqe->flags |= flags;
    ++c.pending;
    ++unsubmitted_;
  };

  int dfd;
  const char* name;
  if (int e = at(job, r.path, &dfd, &name)) {  // no directory without a link: nothing issued
    if (job.op != Op::Unlink) c.open_failed = true;
    prep_failed(slot, job.op == Op::Unlink ? kUnlink : kOpen, e);
    return;
  }
  if (job.op == Op::Unlink) {  // relative to the link-free directory descriptor
    io_uring_sqe* sqe = get_sqe();
    io_uring_prep_unlinkat(sqe, dfd, name, 0);
    finish_sqe(sqe, kUnlink, 0);
    return;
  }

  const bool write = op_is_write(job.op);
  const bool block = job.op == Op::ReadBlock || job.op == Op::WriteBlock;
  const uint64_t data_off = block ? kHeaderBytes : r.offset;
  const bool recycle = c.reuse;  // overwriting a recycled file (checked by prep_recycle)
  int flags = write ? O_WRONLY | O_CREAT : O_RDONLY;
  // A fresh temporary must be new (O_EXCL). A recycled one was checked by prep_recycle's statx
  // (a regular file, one link, no longer than a block): opened without O_CREAT (so the kernel
  // tries the open without blocking first) and never through a symlink put there meanwhile.
  if (write && !r.target.empty()) flags = recycle ? O_WRONLY | O_NOFOLLOW : flags | O_EXCL;
  if (job.direct) flags |= O_DIRECT;
  c.flags = flags;
  // (O_CLOEXEC is refused for direct descriptors: they are never in the fd table.)
  if (job.op == Op::WriteBlock) fill_header(c.header, r);

  // open -> [statx] -> [header] -> data -> [fsync] -> close, hard-linked so that the close
  // always runs and every stage reports its own result (a recycled file: after prep_recycle's
  // probe). Block files are opened with no link anywhere in their path (openat2).
  if (!prep_open(slot, flags)) return;
  io_uring_sqe* sqe;
  if (job.op == Op::ReadBlock) {
    // The open's descriptor cannot be statx'ed in the ring (a fixed file): the path is. A
    // regular file of more than one link fails -EMLINK (its bytes, read meanwhile, are zeroed).
    sqe = get_sqe();
    io_uring_prep_statx(sqe, dfd, name, AT_SYMLINK_NOFOLLOW, STATX_TYPE | STATX_NLINK, &c.stx);
    finish_sqe(sqe, kLinks, IOSQE_IO_HARDLINK);
  }

  void* buf = reinterpret_cast<void*>(r.addr);
  // A new block file: header and payload in one write. Writes that extend a file cannot be
  // issued without blocking (the kernel hands each to an io-wq worker, and ext4 waits for an
  // extending O_DIRECT write there), so one write instead of two halves that cost; the page
  // pinning of a plain write is the smaller price. Recycled files are overwritten in place:
  // those writes go inline, from the registered buffers.
  c.merged = job.op == Op::WriteBlock && !recycle;
  if (c.merged) {
    c.iov[0] = {c.header, kHeaderBytes};
    c.iov[1] = {buf, r.length};
    sqe = get_sqe();
    io_uring_prep_writev(sqe, int(slot), c.iov, 2, 0);
    finish_sqe(sqe, kData, IOSQE_FIXED_FILE | IOSQE_IO_HARDLINK);
  } else if (block) {
    sqe = get_sqe();
    if (write)
      io_uring_prep_write(sqe, int(slot), c.header, unsigned(kHeaderBytes), 0);
    else
      io_uring_prep_read(sqe, int(slot), c.header, unsigned(kHeaderBytes), 0);
    finish_sqe(sqe, kHeader, IOSQE_FIXED_FILE | IOSQE_IO_HARDLINK);
  }

  sqe = c.merged ? nullptr : get_sqe();
  int fixed = c.merged ? -1 : fixed_index(r.addr, r.length);
  if (c.merged) {
    // prepared above
  } else if (fixed >= 0) {
    if (write)
      io_uring_prep_write_fixed(sqe, int(slot), buf, unsigned(r.length), data_off, fixed);
    else
      io_uring_prep_read_fixed(sqe, int(slot), buf, unsigned(r.length), data_off, fixed);
    engine_.stats().fixed_buffer_ios++;
  } else {
    if (write)
      io_uring_prep_write(sqe, int(slot), buf, unsigned(r.length), data_off);
    else
      io_uring_prep_read(sqe, int(slot), buf, unsigned(r.length), data_off);
  }
  if (sqe) finish_sqe(sqe, kData, IOSQE_FIXED_FILE | IOSQE_IO_HARDLINK);

  if (write && job.fsync) {
    sqe = get_sqe();
    io_uring_prep_fsync(sqe, int(slot), IORING_FSYNC_DATASYNC);
    finish_sqe(sqe, kFsync, IOSQE_FIXED_FILE | IOSQE_IO_HARDLINK);
  }

  sqe = get_sqe();
  io_uring_prep_close_direct(sqe, slot);
  finish_sqe(sqe, kClose, 0);
}

bool Ring::prep_open(uint32_t slot, int flags) {
  Ctx& c = ctx_[slot];
  Job& job = *c.job;
  Request& r = job.reqs[c.index];
  int dfd;
  const char* name;
  if (int e = at(job, r.path, &dfd, &name)) {
    if (c.phase == 0) c.open_failed = true;
    prep_failed(slot, kOpen, e);
    return false;
  }
  c.how[0] = open_how{};
  c.how[0].flags = uint64_t(flags);
  c.how[0].mode = (flags & O_CREAT) ? job.file_mode : 0;
  c.how[0].resolve = no_links(job.op) ? kResolveNoLinks : 0;
  io_uring_sqe* sqe = get_sqe();
  io_uring_prep_openat2_direct(sqe, dfd, name, &c.how[0], slot);
  io_uring_sqe_set_data64(sqe, encode(slot, kOpen));
  sqe->flags |= IOSQE_IO_HARDLINK;
  ++unsubmitted_;
  if (skip_open_cqe_)  // a successful open posts no CQE; a failed one does (before the chain's)
    sqe->flags |= IOSQE_CQE_SKIP_SUCCESS;
  else
    ++c.pending;
  return true;
}

// A read that came back short (a buffered read stops before a bad sector, or the file was
// truncated meanwhile): the file is opened again and the first missing part re-read from
// where the short read ended (rounded down to the O_DIRECT unit), so the result is the real
// one: the bytes, the error (EIO), or kErrShort at the end of the file.
void Ring::prep_reread(uint32_t slot) {
  Ctx& c = ctx_[slot];
  Job& job = *c.job;
  Request& r = job.reqs[c.index];
  const bool block = job.op == Op::ReadBlock;
  const uint64_t unit = job.direct ? std::max<uint64_t>(4096, job.align) : 1;
  c.reread_header = block && c.hdr_got < kHeaderBytes;
  const uint64_t got = c.reread_header ? c.hdr_got : c.data_got;
  const uint64_t len = c.reread_header ? kHeaderBytes : r.length;
  char* buf = c.reread_header ? c.header : reinterpret_cast<char*>(r.addr);
  const uint64_t file_off = c.reread_header ? 0 : (block ? kHeaderBytes : r.offset);
  c.reread_pos = got - got % unit;
  c.err = 0;
  c.err_stage = 99;
  c.phase = 8;
  ++c.rereads;
  if (!prep_open(slot, c.flags)) return;
  io_uring_sqe* sqe = get_sqe();
  io_uring_prep_read(sqe, int(slot), buf + c.reread_pos, unsigned(len - c.reread_pos), file_off + c.reread_pos);
  io_uring_sqe_set_data64(sqe, encode(slot, kReread));
  sqe->flags |= IOSQE_FIXED_FILE | IOSQE_IO_HARDLINK;
  sqe = get_sqe();
  io_uring_prep_close_direct(sqe, slot);
  io_uring_sqe_set_data64(sqe, encode(slot, kClose));
  c.pending += 2;
  unsubmitted_ += 2;
}

// fsync=True, the job's last request done: each distinct directory of the job's renames is
// opened (no links for block files; a directory lookup, not I/O) and fsync'ed in the ring, all
// at once. Returns false when there is nothing to wait for.
bool Ring::start_dirsync(uint32_t slot) {
  Ctx& c = ctx_[slot];
  Job& job = *c.job;
  c.sync_dirs = renamed_dirs(job);
  if (c.sync_dirs.empty()) return false;
  const size_t n = c.sync_dirs.size();
  c.sync_fds.assign(n, -1);
  c.sync_err.assign(n, 0);
  c.phase = 9;
  c.pending = 0;
  for (size_t i = 0; i < n; ++i) {
    const int flags = O_RDONLY | O_DIRECTORY | O_CLOEXEC;
    const int fd = no_links(job.op) ? open_no_links(c.sync_dirs[i], flags) : ::open(c.sync_dirs[i].c_str(), flags);
    if (fd < 0) {
      c.sync_err[i] = -errno;
      continue;
    }
    c.sync_fds[i] = fd;
    io_uring_sqe* sqe = get_sqe();
    io_uring_prep_fsync(sqe, fd, 0);
    io_uring_sqe_set_data64(sqe, encode(slot, kDirSync, uint32_t(i)));
    ++c.pending;
    ++unsubmitted_;
    engine_.stats().dir_fsyncs++;
  }
  if (c.pending > 0) return true;
  apply_dir_errors(job, c.sync_dirs, c.sync_err, engine_.stats());
  return false;
}

// write_block with a recycle_path, before its main chain: rename the victim to the temporary
// name, then statx what is there (hard-linked: whatever the rename returned). on_cqe decides
// from both: overwrite it (a regular file of one link, no longer than a block), put it back
// (anything else: a directory, FIFO, symlink, a longer or hard-linked file), or write afresh.
// Opening what the rename brought without that check could block forever (a FIFO), write
// through a symlink out of the root, or leave a block file longer than a block.
//
// Both go relative to the link-free descriptors of the victim's and the temporary's directories;
// if either cannot be opened without a link, nothing is issued or moved (check_res).
void Ring::prep_recycle(uint32_t slot) {
  Ctx& c = ctx_[slot];
  Job& job = *c.job;
  Request& r = job.reqs[c.index];
  c.phase = 6;
  int vfd, tfd;
  const char *vname, *tname;
  c.check_res[0] = at(job, r.recycle, &vfd, &vname);
  c.check_res[1] = c.check_res[0] < 0 ? 0 : at(job, r.path, &tfd, &tname);
  if (c.check_res[0] < 0 || c.check_res[1] < 0) {
    prep_failed(slot, kStatx, -ENOENT);
    return;
  }
  io_uring_sqe* sqe = get_sqe();
  io_uring_prep_renameat(sqe, vfd, vname, tfd, tname, RENAME_NOREPLACE);
  io_uring_sqe_set_data64(sqe, encode(slot, kRecycle));
  sqe->flags |= IOSQE_IO_HARDLINK;
  sqe = get_sqe();
  io_uring_prep_statx(sqe, tfd, tname, AT_SYMLINK_NOFOLLOW,
                      STATX_TYPE | STATX_MODE | STATX_NLINK | STATX_SIZE, &c.stx);
  io_uring_sqe_set_data64(sqe, encode(slot, kStatx));
  c.pending += 2;
  unsubmitted_ += 2;
}

// The rename or unlink after a main chain (phase 1, 2/4, 5, 7), relative to the link-free
// descriptors of the directories involved; one that cannot be opened: a NOP reporting its errno.
void Ring::prep_followup(uint32_t slot, uint8_t phase) {
  Ctx& c = ctx_[slot];
  Job& job = *c.job;
  Request& r = job.reqs[c.index];
  c.phase = phase;
  if (phase == 5) {
    c.check_res[0] = 0;
    c.unlink_res = 0;
  }
  const Stage st = phase == 1 ? kRename : phase == 7 ? kRestore : kUnlink;
  const std::string& from = phase == 5 ? r.recycle : r.path;
  int ffd, tfd = AT_FDCWD;
  const char *fname, *tname = nullptr;
  int e = at(job, from, &ffd, &fname);
  if (e == 0 && (phase == 1 || phase == 7)) e = at(job, phase == 1 ? r.target : r.recycle, &tfd, &tname);
  if (e < 0) {
    prep_failed(slot, st, e);
    return;
  }
  io_uring_sqe* sqe = get_sqe();
  if (phase == 1 || phase == 7)
    io_uring_prep_renameat(sqe, ffd, fname, tfd, tname, RENAME_NOREPLACE);
  else
    io_uring_prep_unlinkat(sqe, ffd, fname, 0);
  io_uring_sqe_set_data64(sqe, encode(slot, st));
  ++c.pending;
  ++unsubmitted_;
}

void Ring::submit(unsigned wait_nr) {
  if (unsubmitted_ == 0 && wait_nr == 0) return;
  unsigned carried = unsubmitted_ - wake_sqes_;
  int rc;
  do {
    rc = wait_nr ? io_uring_submit_and_wait(&ring_, wait_nr) : io_uring_submit(&ring_);
  } while (rc == -EINTR);
  if (rc < 0 && rc != -EBUSY && rc != -EAGAIN) throw_errno("io_uring_submit", -rc);
  if (carried) {
    engine_.stats().submits++;
    engine_.stats().sqes += carried;
  }
  unsubmitted_ = 0;
  wake_sqes_ = 0;
}

void Ring::submit_and_reap(std::vector<Job*>& finished) {
  if (unsubmitted_ > 0) {
    submit(1);
    reap(false, finished);
  } else {
    reap(true, finished);
  }
}

void Ring::reap(bool wait, std::vector<Job*>& finished) {
  if (wait) {
    io_uring_cqe* cqe = nullptr;
    int rc;
    do {
      rc = io_uring_wait_cqe(&ring_, &cqe);
    } while (rc == -EINTR);
    if (rc < 0) throw_errno("io_uring_wait_cqe", -rc);
  }
  io_uring_cqe* cqes[64];
  for (;;) {
    unsigned n = io_uring_peek_batch_cqe(&ring_, cqes, 64);
    if (n == 0) break;
    for (unsigned i = 0; i < n; ++i) {
      uint64_t ud = cqes[i]->user_data;
      int32_t res = cqes[i]->res;
      uint32_t fl = cqes[i]->flags;
      io_uring_cq_advance(&ring_, 1);
      on_cqe(ud, res, fl, finished);
    }
    engine_.stats().cqes += n;
  }
}

void Ring::on_cqe(uint64_t ud, int32_t res, uint32_t flags, std::vector<Job*>& finished) {
  if (ud == kWakeTag) {
    uint64_t v;
    while (::read(wake_fd_, &v, sizeof(v)) == sizeof(v)) {
    }
    if (!(flags & IORING_CQE_F_MORE)) arm_wake();
    return;
  }
  uint32_t sub = uint32_t(ud >> 32);
  const uint32_t slot = uint32_t((ud & 0xffffffffull) >> kStageBits);
  Stage st = Stage(ud & ((1u << kStageBits) - 1));
  Ctx& c = ctx_[slot];
  Job& job = *c.job;
  Request& r = job.reqs[c.index];
  const bool reading = job.op == Op::Read || job.op == Op::ReadBlock;
  const bool pre_failed = (sub & kPreFailed) != 0;
  if (pre_failed) {  // prep_failed's NOP: the op's result is the errno it stands for
    sub &= ~kPreFailed;
    res = c.pre_res;
  }
  if (st == kOpen && skip_open_cqe_ && !pre_failed) {  // only failures get here, and they are not counted
    record_error(c, st, res);
    if (c.phase == 0) c.open_failed = true;
    return;
  }
  switch (st) {
    case kOpen:
      if (res < 0) {
        record_error(c, st, res);
        if (c.phase == 0) c.open_failed = true;
      }
      break;
    case kFsync:
      if (res < 0) record_error(c, st, res);
      break;
    case kLinks:
      // (before the bytes count: reported with the open's priority)
      if (res == 0 && S_ISREG(c.stx.stx_mode) && c.stx.stx_nlink > 1) record_error(c, kOpen, -EMLINK);
      break;
    case kHeader:
      if (res >= 0 && reading) c.hdr_got = uint64_t(res);
      if (res < 0)
        record_error(c, st, res);
      else if (uint64_t(res) < kHeaderBytes)
        record_error(c, st, reading ? kErrShort : -ENOSPC);
      break;
    case kData: {
      const uint64_t head = c.merged ? kHeaderBytes : 0;  // a merged write carries the header
      if (res >= 0 && reading) c.data_got = uint64_t(res);
      if (res < 0)
        record_error(c, st, res);
      else if (uint64_t(res) < head + r.length)
        record_error(c, st, op_is_write(job.op) ? -ENOSPC : kErrShort);
      else
        c.moved = uint64_t(res) - head;
      break;
    }
    case kReread: {
      uint64_t& got = c.reread_header ? c.hdr_got : c.data_got;
      if (res < 0)
        record_error(c, kData, res);
      else if (c.reread_pos + uint64_t(res) > got)
        got = c.reread_pos + uint64_t(res);
      else
        record_error(c, kData, kErrShort);  // nothing new: the file ends there
      break;
    }
    case kClose:
      // A close error matters for writes only (the data may not have reached the file).
      if (res < 0 && op_is_write(job.op) && c.err == 0) record_error(c, st, res);
      break;
    case kRename:
      if (res == -EEXIST) {
        // Content-addressed: another writer already placed this block. Keep theirs.
        engine_.stats().rename_existing++;
        c.err = 0;
        c.phase = 3;  // unlink our temporary, then report success
      } else if (res < 0) {
        record_error(c, st, res);
      }
      break;
    case kUnlink:
      if (job.op == Op::Unlink && res < 0) {
        record_error(c, st, res);
      }
      if (c.phase == 5) c.unlink_res = res;
      if ((c.phase == 2 || c.phase == 4) && res < 0 && res != -ENOENT)
        engine_.add_leftover(r.path);  // our temporary stays: the caller is told
      break;
    case kRecycle:
      c.recycle_res = res;
      break;
    case kStatx:
      c.stat_res = res;
      break;
    case kRestore:
      if (res < 0) {
        // Left at the temporary name (start-up moves stale temporaries out of the way).
        engine_.stats().recycle_failures++;
        engine_.add_leftover(r.path);
        c.recycle_res = -ENOENT;  // whatever is at the victim's name now is not the victim
      } else {
        c.recycle_res = -EINVAL;  // back at its name: removed after the store
      }
      break;
    case kDirSync:
      ::close(c.sync_fds[sub]);
      c.sync_fds[sub] = -1;
      if (res < 0) c.sync_err[sub] = res;
      break;
  }
  if (--c.pending > 0) return;

  if (c.phase == 9) {  // the job's directories are synced: report it
    apply_dir_errors(job, c.sync_dirs, c.sync_err, engine_.stats());
    release(slot, finished);
    return;
  }
  if (c.phase == 6) {  // the recycle probe is complete: choose how the main chain opens
    if (c.check_res[0] < 0) {
      // The victim's path does not lead to it without a link (or it is gone): never moved,
      // never removed (removing it by that path would follow the link).
      if (c.check_res[0] != -ENOENT) {
        engine_.stats().recycle_failures++;
        if (c.check_res[0] != -ELOOP) engine_.add_leftover(r.recycle);
      }
      c.recycle_res = -ENOENT;
      c.stat_res = -ENOENT;
    } else if (c.check_res[1] < 0) {
      // The temporary's directory is gone or a link: the store fails opening its temporary;
      // the victim, untouched, is removed afterwards.
      c.recycle_res = -ECANCELED;
      c.stat_res = -ENOENT;
    }
    const bool usable = c.stat_res == 0 && S_ISREG(c.stx.stx_mode) && c.stx.stx_nlink == 1 &&
                        c.stx.stx_size <= kHeaderBytes + r.length;
    if (c.recycle_res == 0 && !usable) {
      prep_followup(slot, 7);  // not a block file we may overwrite: put it back
      return;
    }
    if (c.recycle_res == 0) engine_.stats().recycled++;
    // (usable without the rename: a leftover regular file at this process's own temporary name)
    c.reuse = usable;
    c.phase = 0;
    prep_chain(slot);
    return;
  }
  if (c.phase == 7) {  // put back (or left behind, counted): write a fresh temporary
    c.reuse = false;
    c.phase = 0;
    prep_chain(slot);
    return;
  }
  if (c.phase == 5) {  // the victim that stayed where it was: removed, or reported
    const int e = c.check_res[0] < 0 ? c.check_res[0] : c.unlink_res;
    if (e < 0 && e != -ENOENT) {
      engine_.stats().recycle_failures++;
      if (e != -ELOOP) engine_.add_leftover(r.recycle);
    }
    finish(slot, finished);
    return;
  }

  // The chain (or follow-up) is complete.
  if (reading && (c.phase == 0 || c.phase == 8) && !c.open_failed) {
    const bool missing = (job.op == Op::ReadBlock && c.hdr_got < kHeaderBytes) || c.data_got < r.length;
    if (c.phase == 8 && c.err == 0 && !missing) {
      // every byte is there now: verified as a whole read
    } else if ((c.phase == 0 ? c.err == kErrShort : c.err == 0) && missing) {
      if (c.rereads < kMaxRereads) {
        prep_reread(slot);
        return;
      }
      record_error(c, kData, kErrShort);
    }
  }
  const bool tmp_write = op_is_write(job.op) && job.op != Op::Unlink && !r.target.empty();
  if (tmp_write && c.phase == 0 && c.err == 0) {
    // file_mode may not have survived the umask (Job::fix_mode), or a recycled file has another
    // mode: set it exactly
    // (a synchronous open + fchmod, only then).
    const bool fix = c.reuse ? (c.stx.stx_mode & 07777) != job.file_mode : job.fix_mode;
    if (fix) {
      if (int e = set_mode(r.path, no_links(job.op), job.file_mode)) record_error(c, kClose, e);
    }
  }
  if (tmp_write && c.phase == 0 && !(c.err != 0 && c.err_stage == kOpen && !c.reuse)) {
    // Rename into place, or remove our temporary (not when the open failed: then the file,
    // if any, is not ours -- unless it is the recycled file we renamed there).
    prep_followup(slot, c.err == 0 ? 1 : 2);
    return;
  }
  if (tmp_write && c.phase == 1 && c.err != 0) {
    prep_followup(slot, 2);  // the rename failed (e.g. the final directory is gone): remove ours
    return;
  }
  if (tmp_write && c.phase == 3) {
    prep_followup(slot, 2);
    c.phase = 4;  // unlink of a duplicate temporary: success whatever it returns
    return;
  }
  if (job.op == Op::WriteBlock && !r.recycle.empty() && c.recycle_res < 0 &&
      c.recycle_res != -ENOENT && c.phase != 5) {
    prep_followup(slot, 5);  // the file to recycle stayed where it was: remove it
    return;
  }
  finish(slot, finished);
}

void Ring::finish(uint32_t slot, std::vector<Job*>& finished) {
  Ctx& c = ctx_[slot];
  Job& job = *c.job;
  Request& r = job.reqs[c.index];
  int64_t result = c.err;
  if (result == 0) {
    if (job.op == Op::ReadBlock) result = verify_block(c.header, r);
    if (result == 0) {
      result = int64_t(job.op == Op::Unlink ? 0 : r.length);
      if (job.op == Op::Read || job.op == Op::ReadBlock)
        engine_.stats().bytes_read += r.length;
      else if (job.op != Op::Unlink)
        engine_.stats().bytes_written += r.length;
    } else {
      engine_.stats().verify_failures++;
    }
  }
  // A failed load whose file was opened: bytes may have reached the caller's memory. None stay.
  if (job.op == Op::ReadBlock && result < 0 && !c.open_failed)
    std::memset(reinterpret_cast<void*>(r.addr), 0, r.length);
  r.result = result;
  r.done_time = monotonic_seconds();
  (result < 0 ? engine_.stats().requests_failed : engine_.stats().requests_ok)++;
  // The job's last request: with fsync, its directories first (the slot is kept till then).
  if (++job.done == job.reqs.size() && job.fsync && start_dirsync(slot)) return;
  release(slot, finished);
}

void Ring::release(uint32_t slot, std::vector<Job*>& finished) {
  Ctx& c = ctx_[slot];
  Job& job = *c.job;
  Request& r = job.reqs[c.index];
  const uint64_t len = job.op == Op::Unlink ? 0 : r.length;
  inflight_bytes_ -= len;
  if (op_is_write(job.op)) {
    inflight_store_bytes_ -= len;
    --inflight_stores_;
  }
  --inflight_;
  c.job = nullptr;
  free_slots_.push_back(slot);
  if (job.done == job.reqs.size()) {
    job.end_time = monotonic_seconds();
    finished.push_back(&job);
  }
}

// ---------------------------------------------------------------------------- Engine

Engine::Engine(EngineConfig cfg) : cfg_(cfg) {
  if (cfg_.queue_depth == 0 || cfg_.queue_depth > 4096)
    throw std::invalid_argument("queue_depth must be in 1..4096");
  if (cfg_.workers == 0 || cfg_.workers > 16) throw std::invalid_argument("workers must be in 1..16");
  if (!(cfg_.store_share > 0.0 && cfg_.store_share <= 1.0))
    throw std::invalid_argument("store_share must be in (0, 1]");
  // Fail early (and clearly) where io_uring is unavailable: build one ring now.
  { Ring probe(*this, 1, -1, false); }
  for (unsigned i = 0; i < cfg_.workers; ++i) {
    int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd < 0) throw_errno("eventfd", errno);
    wake_fds_.push_back(fd);
  }
  worker_buffer_gen_.assign(cfg_.workers, 0);
  for (unsigned i = 0; i < cfg_.workers; ++i) workers_.emplace_back([this, i] { worker_main(i); });
}

Engine::~Engine() { shutdown(); }

void Engine::shutdown() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_ && workers_.empty()) return;
    stopping_ = true;
  }
  wake_workers();
  for (auto& t : workers_)
    if (t.joinable()) t.join();
  workers_.clear();
  for (int fd : wake_fds_) ::close(fd);
  wake_fds_.clear();
  std::lock_guard<std::mutex> lk(rings_mu_);
  sync_rings_.clear();
}

unsigned Engine::register_buffer(uint64_t addr, uint64_t len) {
  std::lock_guard<std::mutex> lk(buf_mu_);
  unsigned first = unsigned(buffers_.size());
  for (uint64_t off = 0; off < len; off += kMaxFixedChunk)
    buffers_.push_back({addr + off, std::min(kMaxFixedChunk, len - off)});
  ++buffers_generation_;
  wake_workers();  // idle workers register the buffers now, not on their first job
  return first;
}

void Engine::unregister_buffers() {
  std::lock_guard<std::mutex> lk(buf_mu_);
  buffers_.clear();
  ++buffers_generation_;
  wake_workers();
}

void Engine::wake_workers() {
  for (int fd : wake_fds_) {
    uint64_t one = 1;
    (void)!::write(fd, &one, sizeof(one));
  }
}

std::vector<BufferRegion> Engine::buffers(uint64_t* generation) const {
  std::lock_guard<std::mutex> lk(buf_mu_);
  *generation = buffers_generation_;
  return buffers_;
}

std::vector<int64_t> Engine::run(Job& job) {
  Ring* ring;
  {
    std::lock_guard<std::mutex> lk(rings_mu_);
    auto& slot = sync_rings_[std::this_thread::get_id()];
    if (!slot) slot = std::make_unique<Ring>(*this, cfg_.queue_depth, -1, false);
    ring = slot.get();
  }
  stats_.jobs_submitted++;
  job.submit_time = monotonic_seconds();
  ring->sync_buffers();
  std::vector<Job*> finished;
  while (finished.empty() && !job.reqs.empty()) {
    if (job.next < job.reqs.size()) ring->issue(job);
    ring->submit_and_reap(finished);
  }
  if (job.reqs.empty()) job.end_time = monotonic_seconds();
  stats_.jobs_finished++;
  std::vector<int64_t> out;
  out.reserve(job.reqs.size());
  for (auto& r : job.reqs) out.push_back(r.result);
  return out;
}

void Engine::submit(std::unique_ptr<Job> job) {
  job->submit_time = monotonic_seconds();
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!admit_locked(*job)) return;
    (op_is_write(job->op) ? stores_ : loads_).push_back(std::move(job));
  }
  wake_workers();
}

void Engine::worker_main(unsigned idx) {
  std::unique_ptr<Ring> ring;
  try {
    ring = std::make_unique<Ring>(*this, cfg_.queue_depth, wake_fds_[idx], true);
  } catch (const std::exception&) {
    // Leave the jobs to the other workers (Engine() already proved a ring can be built).
    return;
  }
  std::vector<std::unique_ptr<Job>> active;  // issued (partly or wholly), not finished
  uint64_t reported_generation = 0;
  std::vector<Job*> done;
  for (;;) {
    // Issue: first continue partly issued jobs, then take new ones, loads before stores.
    // Each job's SQEs go to the kernel in their own io_uring_submit.
    if (ring->inflight() == 0) ring->sync_buffers();
    if (ring->buffers_generation() != reported_generation) {
      reported_generation = ring->buffers_generation();
      std::lock_guard<std::mutex> lk(mu_);
      worker_buffer_gen_[idx] = reported_generation;
      done_cv_.notify_all();
    }
    for (auto& j : active) {
      if (j->next < j->reqs.size() && ring->issue(*j) > 0) ring->submit(0);
    }
    for (;;) {
      std::unique_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lk(mu_);
        // Take a new job only when the ring has room for at least one of its requests.
        std::deque<std::unique_ptr<Job>>* q = !loads_.empty() ? &loads_ : &stores_;
        if (q->empty()) break;
        if (!ring->can_take_whole(*q->front())) break;
        job = std::move(q->front());
        q->pop_front();
      }
      if (ring->inflight() == 0) ring->sync_buffers();
      ring->issue(*job);
      ring->submit(0);
      active.push_back(std::move(job));
    }
    bool stop;
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop = stopping_ && loads_.empty() && stores_.empty();
    }
    if (stop && ring->inflight() == 0) break;

    // Hand over follow-ups and wake re-arms, wait for completions (or a wake-up from
    // submit()/shutdown()), in one io_uring_enter where possible.
    ring->submit_and_reap(done);
    if (!done.empty()) {
      std::lock_guard<std::mutex> lk(mu_);
      for (Job* j : done) {
        finish_locked(*j);
        active.erase(std::find_if(active.begin(), active.end(),
                                  [j](const std::unique_ptr<Job>& p) { return p.get() == j; }));
      }
      done.clear();
    }
  }
}

bool Engine::await_buffers(double timeout_s) {
  uint64_t gen;
  {
    std::lock_guard<std::mutex> lk(buf_mu_);
    gen = buffers_generation_;
  }
  std::unique_lock<std::mutex> lk(mu_);
  auto ready = [&] {
    for (size_t i = 0; i < workers_.size(); ++i)
      if (worker_buffer_gen_[i] < gen) return false;
    return true;
  };
  if (timeout_s < 0) {
    done_cv_.wait(lk, ready);
    return true;
  }
  return done_cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), ready);
}

// ---------------------------------------------------------------------------- probe

namespace {

// statx STATX_DIOALIGN of fd into out, where the kernel reports it.
void dio_align(int fd, DirectProbe& out) {
#ifdef STATX_DIOALIGN
  struct statx stx {};
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 && (stx.stx_mask & STATX_DIOALIGN) &&
      stx.stx_dio_mem_align > 0) {
    out.mem_align = stx.stx_dio_mem_align;
    out.offset_align = stx.stx_dio_offset_align;
    out.dioalign_from_statx = true;
  }
#else
  (void)fd;
  (void)out;
#endif
}

bool no_room(int err) { return err == ENOSPC || err == EDQUOT; }

// One aligned O_DIRECT transfer of a unit at offset 0 of fd: 0 or errno (-1: short).
int direct_io_once(int fd, const DirectProbe& out, bool write) {
  void* buf = nullptr;
  const size_t unit = std::max<size_t>(4096, out.offset_align);
  if (posix_memalign(&buf, std::max<size_t>(4096, out.mem_align), unit) != 0) return ENOMEM;
  std::memset(buf, 0, unit);
  const ssize_t n = write ? ::pwrite(fd, buf, unit, 0) : ::pread(fd, buf, unit, 0);
  const int err = n < 0 ? errno : (n == ssize_t(unit) ? 0 : -1);
  free(buf);
  return err;
}

// A full file system: the probe cannot write, so it reads. The first regular file of at least
// one O_DIRECT unit under dir (dir itself, then its subdirectories: blocks/ab/*.kvb), reached
// without following links, is read with O_DIRECT. Returns true when that answered.
bool probe_by_reading(const std::string& dir, int full_err, DirectProbe& out) {
  const std::string why = std::string("the file system is full (") + std::strerror(full_err) + ")";
  std::vector<std::string> dirs{dir};
  size_t seen = 0;
  for (size_t di = 0; di < dirs.size() && seen < 100000; ++di) {
    const int dfd = open_no_links(dirs[di], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) continue;
    DIR* d = fdopendir(dfd);
    if (!d) {
      ::close(dfd);
      continue;
    }
    while (dirent* e = readdir(d)) {
      if (++seen >= 100000) break;
      if (e->d_name[0] == '.' && (e->d_name[1] == 0 || (e->d_name[1] == '.' && e->d_name[2] == 0)))
        continue;
      struct stat st;
      if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
      if (S_ISDIR(st.st_mode)) {
        if (di == 0) dirs.push_back(dirs[di] + "/" + e->d_name);  // one level down
        continue;
      }
      if (!S_ISREG(st.st_mode) || st.st_size < off_t(std::max<uint32_t>(4096, out.offset_align))) continue;
      const int fd = ::openat(dirfd(d), e->d_name, O_RDONLY | O_DIRECT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
      const std::string name = dirs[di] + "/" + e->d_name;
      if (fd < 0) {
        if (errno != EINVAL) continue;
        out.reason = why + "; open(O_DIRECT) of " + name + " failed: " + std::strerror(EINVAL);
        closedir(d);
        return true;
      }
      dio_align(fd, out);
      const int err = direct_io_once(fd, out, false);
      ::close(fd);
      out.direct = err == 0;
      out.reason = err == 0 ? "ok (" + why + ": an aligned O_DIRECT read of " + name + ")"
                            : why + "; aligned O_DIRECT read of " + name + " failed: " +
                                  (err < 0 ? "short read" : std::strerror(err));
      closedir(d);
      return true;
    }
    closedir(d);
  }
  out.direct = false;
  out.reason = "cannot probe O_DIRECT: " + why + " and no file under " + dir + " to read";
  return false;
}

}  // namespace

DirectProbe probe_direct(const std::string& dir, bool use_tmpfile) {
  DirectProbe out;
  // The probe file: an O_TMPFILE, which has no name to leave behind. Where the file system has
  // none, a named file, removed the moment it is open; a name already taken (a leftover of a
  // crashed process of the same pid, in a restarted container) is skipped for the next.
  int fd = -1, err = 0;
  if (use_tmpfile) {
    fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) err = errno;
  }
  if (fd < 0 && (!use_tmpfile || err == EOPNOTSUPP || err == EISDIR || err == EINVAL)) {
    const std::string stem = dir + "/.pykvtier-direct-probe-" + std::to_string(getpid());
    for (unsigned i = 0; i < 64; ++i) {
      const std::string path = i == 0 ? stem : stem + "-" + std::to_string(i);
      fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0600);
      if (fd >= 0) {
        ::unlink(path.c_str());  // (if this fails the file is a leftover, swept at start-up)
        break;
      }
      err = errno;
      if (err != EEXIST) break;
    }
  }
  if (fd < 0) {
    if (no_room(err)) {
      probe_by_reading(dir, err, out);
      return out;
    }
    // Not an O_DIRECT question: e.g. the directory does not exist or is not writable.
    throw_errno(("cannot create a file in " + dir).c_str(), err);
  }
  // O_DIRECT on the open file: refused (EINVAL) where the file system cannot take it.
  if (::fcntl(fd, F_SETFL, O_DIRECT) != 0) {
    out.reason = std::string("open(O_DIRECT) failed: ") + std::strerror(errno);
    ::close(fd);
    return out;
  }
  dio_align(fd, out);
  const int werr = direct_io_once(fd, out, true);
  ::close(fd);
  if (werr == 0) {
    out.direct = true;
    out.reason = "ok";
  } else if (werr > 0 && no_room(werr)) {
    probe_by_reading(dir, werr, out);
  } else {
    out.reason = std::string("aligned O_DIRECT write failed: ") + (werr < 0 ? "short write" : std::strerror(werr));
  }
  return out;
}

}  // namespace pykvtier
