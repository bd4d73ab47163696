// io_uring engine: see uring_engine.hpp.
#include "uring_engine.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <system_error>

#include "file_ops.hpp"
#include "safe_path.hpp"

namespace pykvtier {

namespace {

constexpr uint64_t kStageBits = 4;
constexpr uint64_t kWakeTag = ~0ull;
constexpr uint64_t kMaxFixedChunk = 1ull << 30;  // the kernel's limit per registered buffer
constexpr unsigned kMaxRereads = 8;         // re-reads of one request after short reads
constexpr uint32_t kPreFailed = 1u << 31;   // sub bit: a NOP standing in for an op never issued
constexpr size_t kMaxDirFds = 4096;         // cached directory descriptors per ring (then cleared, idle)

// user_data: sub (bits 32..63: which directory, kPreFailed) | slot | stage
uint64_t encode(uint32_t slot, Stage stage, uint32_t sub = 0) {
  return (uint64_t(sub) << 32) | (uint64_t(slot) << kStageBits) | stage;
}

[[noreturn]] void throw_errno(const char* what, int err) {
  throw std::system_error(err, std::generic_category(), what);
}

bool is_read(Op op) { return op == Op::Read || op == Op::ReadBlock; }
// A store through a temporary renamed into place (every write_block; a write with a target).
bool is_tmp_write(const Job& job, const Request& r) {
  return (job.op == Op::Write || job.op == Op::WriteBlock) && !r.target.empty();
}

}  // namespace

// ---------------------------------------------------------------------------- Ring

Ring::Ring(UringEngine& engine, unsigned depth, int wake_fd, bool single_issuer)
    : engine_(engine), depth_(depth), wake_fd_(wake_fd) {
  // A request has at most 6 SQEs unsubmitted at once in one chain (open, statx, header, data,
  // close; open, header, data, fsync, close; the 6 of a recycle probe; 3 of a checked unlink or
  // a re-read); 7 per request leaves room to spare. (A job's directory fsyncs are independent
  // SQEs: they may be split across submits.)
  unsigned entries = 8;
  while (entries < depth * 7 + 2) entries <<= 1;
  // A worker's ring lives and dies with its thread: let the kernel run completion work only
  // when that thread waits (SINGLE_ISSUER + DEFER_TASKRUN, Linux 6.1). The constructor's probe
  // ring (single_issuer false) runs completion work cooperatively (5.19). Older kernels take
  // plain rings.
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
  if (!op_is_block(job.op)) {
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
void Ring::prep_failed(uint32_t slot, Stage stage, int err) {
  Ctx& c = ctx_[slot];
  c.pre_res = err;
  io_uring_sqe* sqe = get_sqe();
  io_uring_prep_nop(sqe);
  io_uring_sqe_set_data64(sqe, encode(slot, stage, kPreFailed));
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

bool Ring::store_batch_ready(const Job& job) const {
  // A batch of a store job's requests: its remaining ones, at most a quarter of the store slots.
  const unsigned budget = slot_budget(true);
  const size_t want = std::min<size_t>(job.reqs.size() - job.next, std::max(1u, budget / 4));
  if (want > free_slots_.size() || inflight_stores_ + want > budget) return false;
  return has_capacity(job.op == Op::Unlink ? 0 : job.reqs[job.next].length, true);
}

bool Ring::can_take_whole(const Job& job) const {
  // A load: one io_uring_submit per job, admitted when all its requests fit (a job that can never
  // fit whole streams through the ring, admitted as soon as its first request fits). A store or
  // unlink streams in batches (store_batch_ready): the ring never drains between store jobs, and
  // a store takes one io_uring_submit per quarter of the store slots at most.
  const bool store = op_is_write(job.op);
  if (store) return store_batch_ready(job);
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
    engine_.counters().buffer_registration_failures++;
    engine_.counters().buffer_registration_errno = -rc;
  }
}

void Ring::record_error(Ctx& c, Stage stage, int64_t err) {
  if (stage < c.err_stage) {
    c.err = err;
    c.err_stage = stage;
  }
}

// ------------------------------------------------------------------ preparing

void Ring::start_request(Job& job, uint32_t slot, double now) {
  Ctx& c = ctx_[slot];
  char* header = c.header;
  c = Ctx{};
  c.header = header;
  c.job = &job;
  c.index = uint32_t(job.next);
  job.reqs[job.next].issue_time = now;
  ++job.next;
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
    const Request& r = job.reqs[job.next];
    const uint64_t len = job.op == Op::Unlink ? 0 : r.length;
    if (!has_capacity(len, store)) break;
    const uint32_t slot = free_slots_.back();
    free_slots_.pop_back();
    start_request(job, slot, now);
    ++inflight_;
    inflight_bytes_ += len;
    if (store) {
      inflight_store_bytes_ += len;
      ++inflight_stores_;
    }
    if (job.op == Op::WriteBlock && !r.recycle.empty())
      prep_recycle(slot);  // the main chain follows once the victim is known to be reusable
    else
      prep_request(slot);
    ++n;
  }
  if (n) ++job.submits;
  return n;
}

// A prepared SQE of the slot's request: tagged with its stage, given its link flags, counted.
void Ring::mark(uint32_t slot, io_uring_sqe* sqe, Stage st, unsigned flags, uint32_t sub) {
  io_uring_sqe_set_data64(sqe, encode(slot, st, sub));
  sqe->flags |= flags;
  ++ctx_[slot].pending;
  ++unsubmitted_;
}

// The main chain of the slot's request, one function per op. Every chain but unlink's is
// open -> ... -> close, hard-linked so that the close always runs and every stage reports its
// own result (a store's open comes first, alone: prep_store_open); block files are opened with
// no link anywhere in their path (openat2).
void Ring::prep_request(uint32_t slot) {
  Ctx& c = ctx_[slot];
  c.phase = Phase::Main;
  switch (c.job->op) {
    case Op::Unlink: return prep_unlink(slot);
    case Op::Read: return prep_read(slot);
    case Op::ReadBlock: return prep_read_block(slot);
    case Op::Write:
    case Op::WriteBlock: return prep_store_open(slot);
  }
}

// The descriptor a request's SQEs name: a store's regular one once open, else its fixed-file slot.
int Ring::file_of(uint32_t slot) const { return ctx_[slot].fd >= 0 ? ctx_[slot].fd : int(slot); }
unsigned Ring::file_flag(uint32_t slot) const { return ctx_[slot].fd >= 0 ? 0u : unsigned(IOSQE_FIXED_FILE); }

void Ring::prep_unlink(uint32_t slot) {
  const Job& job = *ctx_[slot].job;
  int dfd;
  const char* name;
  if (int e = at(job, job.reqs[ctx_[slot].index].path, &dfd, &name)) return prep_failed(slot, kUnlink, e);
  io_uring_sqe* sqe = get_sqe();
  io_uring_prep_unlinkat(sqe, dfd, name, 0);
  mark(slot, sqe, kUnlink, 0);
}

// Open flags of the main chain. A fresh temporary is new (kTemporaryOpenFlags). A victim being
// reused (checked by the recycle probe's statx) is opened without O_CREAT (so the kernel tries
// the open without blocking first) and never through a symlink put there meanwhile. (O_CLOEXEC:
// prep_open adds it for a store's regular descriptor; it is refused for direct descriptors,
// which are never in the fd table.)
int Ring::main_open_flags(const Job& job, const Request& r, bool reuse) const {
  int flags = O_RDONLY;
  if (op_is_write(job.op))
    flags = r.target.empty() ? O_WRONLY | O_CREAT : reuse ? O_WRONLY | O_NOFOLLOW : detail::kTemporaryOpenFlags;
  return flags | (job.direct ? O_DIRECT : 0);
}

void Ring::prep_read(uint32_t slot) {
  Ctx& c = ctx_[slot];
  const Request& r = c.job->reqs[c.index];
  c.flags = main_open_flags(*c.job, r, false);
  if (!prep_open(slot, c.flags)) return;
  prep_payload(slot, false, r.offset);
  prep_sync_and_close(slot, false);
}

void Ring::prep_read_block(uint32_t slot) {
  Ctx& c = ctx_[slot];
  const Job& job = *c.job;
  const Request& r = job.reqs[c.index];
  c.flags = main_open_flags(job, r, false);
  if (!prep_open(slot, c.flags)) return;
  int dfd;
  const char* name;
  at(job, r.path, &dfd, &name);  // (prep_open opened it: cached)
  // The open's descriptor cannot be statx'ed in the ring (a fixed file): the path is. A regular
  // file of more than one link fails -EMLINK (its bytes, read meanwhile, are zeroed).
  io_uring_sqe* sqe = get_sqe();
  io_uring_prep_statx(sqe, dfd, name, AT_SYMLINK_NOFOLLOW, STATX_TYPE | STATX_NLINK, &c.stx);
  mark(slot, sqe, kLinks, IOSQE_IO_HARDLINK);
  sqe = get_sqe();
  io_uring_prep_read(sqe, int(slot), c.header, unsigned(kHeaderBytes), 0);
  mark(slot, sqe, kHeader, IOSQE_FIXED_FILE | IOSQE_IO_HARDLINK);
  prep_payload(slot, false, kHeaderBytes);
  prep_sync_and_close(slot, false);
}

// A store (write, write_block) opens its file alone, into a regular descriptor (Phase::Open);
// its chain, prepared once the open's CQE gives the number (after_open), writes and closes that
// descriptor. The contract: a store is reported only after its file was closed as close(2)
// closes it, with the file system's ->flush, and before its rename publishes the name; what
// another client that opens the name then reads is the whole file (close-to-open).
// Why not a fixed-file slot, as loads use: io_uring's close of a slot (IORING_OP_CLOSE with a
// file_index: io_uring/openclose.c io_close_fixed -> io_fixed_fd_remove) only drops the table's
// reference (fput, then ->release at the last one); ->flush is called by filp_close alone, which
// IORING_OP_CLOSE of a regular descriptor calls (io_close; punted to io-wq when the file has a
// ->flush). FUSE sends FLUSH only from ->flush (fuse_flush), and JuiceFS commits a file's data
// and length at FLUSH (else at the asynchronous RELEASE): with a slot, the rename published a
// name whose file another mount saw 0 bytes long for a few ms. NFS writes back a buffered
// file's dirty pages at ->flush (close-to-open) the same way. Local file systems (ext4, XFS,
// btrfs, tmpfs) have no ->flush; there the cost is the open's own CQE and a later submit for
// the chain (0.70 -> 0.95 io_uring_submit calls per 256 KiB store), and no CPU per store that
// bench/store_cpu.py could tell from the spread of its rounds (ext4, medians of 8-10 A/B rounds:
// 64 KiB 425 -> 418 us, 256 KiB 514 -> 559 us, 1 MiB 599 -> 592 us; rounds spread +-40 %), so
// every file system takes this path. Payloads still move from the registered (fixed) buffers.
// A regular descriptor counts against RLIMIT_NOFILE (at most the ring's store slots at once;
// EMFILE fails the store) and is O_CLOEXEC.
void Ring::prep_store_open(uint32_t slot) {
  Ctx& c = ctx_[slot];
  c.flags = main_open_flags(*c.job, c.job->reqs[c.index], c.reuse);
  c.phase = Phase::Open;
  prep_open(slot, c.flags);
}

void Ring::prep_store_chain(uint32_t slot) {
  Ctx& c = ctx_[slot];
  const Job& job = *c.job;
  const Request& r = job.reqs[c.index];
  if (job.op == Op::Write) {
    prep_payload(slot, true, r.offset);
    return prep_sync_and_close(slot, true);
  }
  detail::fill_header(c.header, job, r);
  // A new block file: header and payload in one write (writes that extend a file go to an
  // io-wq worker, which waits for an extending O_DIRECT write: one write instead of two). A
  // reused victim is overwritten in place: two writes, inline, from the registered buffers.
  c.merged = !c.reuse;
  if (c.merged) {
    c.iov[0] = {c.header, kHeaderBytes};
    c.iov[1] = {reinterpret_cast<void*>(r.addr), r.length};
    io_uring_sqe* sqe = get_sqe();
    io_uring_prep_writev(sqe, file_of(slot), c.iov, 2, 0);
    mark(slot, sqe, kData, file_flag(slot) | IOSQE_IO_HARDLINK);
  } else {
    io_uring_sqe* sqe = get_sqe();
    io_uring_prep_write(sqe, file_of(slot), c.header, unsigned(kHeaderBytes), 0);
    mark(slot, sqe, kHeader, file_flag(slot) | IOSQE_IO_HARDLINK);
    prep_payload(slot, true, kHeaderBytes);
  }
  prep_sync_and_close(slot, true);
}

// The payload's read or write at file_off, from the registered buffers where they hold it.
void Ring::prep_payload(uint32_t slot, bool write, uint64_t file_off) {
  const Request& r = ctx_[slot].job->reqs[ctx_[slot].index];
  void* buf = reinterpret_cast<void*>(r.addr);
  io_uring_sqe* sqe = get_sqe();
  const int fixed = fixed_index(r.addr, r.length);
  const int fd = file_of(slot);
  if (fixed >= 0) {
    if (write)
      io_uring_prep_write_fixed(sqe, fd, buf, unsigned(r.length), file_off, fixed);
    else
      io_uring_prep_read_fixed(sqe, fd, buf, unsigned(r.length), file_off, fixed);
    engine_.counters().fixed_buffer_ios++;
  } else if (write) {
    io_uring_prep_write(sqe, fd, buf, unsigned(r.length), file_off);
  } else {
    io_uring_prep_read(sqe, fd, buf, unsigned(r.length), file_off);
  }
  mark(slot, sqe, kData, file_flag(slot) | IOSQE_IO_HARDLINK);
}

// The chain's end: [fdatasync (durable writes)] -> close: of a store's regular descriptor (with
// the file system's ->flush, as close(2)), else of the fixed-file slot.
void Ring::prep_sync_and_close(uint32_t slot, bool write) {
  io_uring_sqe* sqe;
  if (write && ctx_[slot].job->fsync) {
    sqe = get_sqe();
    io_uring_prep_fsync(sqe, file_of(slot), IORING_FSYNC_DATASYNC);
    mark(slot, sqe, kFsync, file_flag(slot) | IOSQE_IO_HARDLINK);
  }
  sqe = get_sqe();
  if (ctx_[slot].fd >= 0)
    io_uring_prep_close(sqe, ctx_[slot].fd);
  else
    io_uring_prep_close_direct(sqe, slot);
  mark(slot, sqe, kClose, 0);
}

// The open of the slot's request: a store's (Phase::Open) into a regular descriptor, alone (its
// CQE gives the number); else into the fixed-file slot, first of a hard-linked chain.
bool Ring::prep_open(uint32_t slot, int flags) {
  Ctx& c = ctx_[slot];
  const Job& job = *c.job;
  const bool store = c.phase == Phase::Open;
  int dfd;
  const char* name;
  if (int e = at(job, job.reqs[c.index].path, &dfd, &name)) {
    if (c.phase == Phase::Main || store) c.open_failed = true;
    prep_failed(slot, kOpen, e);
    return false;
  }
  c.how = open_how{};
  c.how.flags = uint64_t(flags | (store ? O_CLOEXEC : 0));
  c.how.mode = (flags & O_CREAT) ? job.file_mode : 0;
  c.how.resolve = op_is_block(job.op) ? kResolveNoLinks : 0;
  io_uring_sqe* sqe = get_sqe();
  if (store) {
    io_uring_prep_openat2(sqe, dfd, name, &c.how);
    mark(slot, sqe, kOpen, 0);
    return true;
  }
  io_uring_prep_openat2_direct(sqe, dfd, name, &c.how, slot);
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
// truncated meanwhile): the file is opened again and the first missing part re-read from where
// the short read ended (rounded down to the O_DIRECT unit), so the result is the real one: the
// bytes, the error (EIO), or kErrShort at the end of the file.
void Ring::prep_reread(uint32_t slot) {
  Ctx& c = ctx_[slot];
  const Job& job = *c.job;
  const Request& r = job.reqs[c.index];
  const bool block = job.op == Op::ReadBlock;
  c.reread_header = block && c.hdr_got < kHeaderBytes;
  const uint64_t got = c.reread_header ? c.hdr_got : c.data_got;
  const uint64_t len = c.reread_header ? kHeaderBytes : r.length;
  char* buf = c.reread_header ? c.header : reinterpret_cast<char*>(r.addr);
  const uint64_t file_off = c.reread_header ? 0 : (block ? kHeaderBytes : r.offset);
  c.reread_pos = got - got % detail::io_unit(job);
  c.err = 0;
  c.err_stage = kNoErrorStage;
  c.phase = Phase::Reread;
  ++c.rereads;
  if (!prep_open(slot, c.flags)) return;
  io_uring_sqe* sqe = get_sqe();
  io_uring_prep_read(sqe, int(slot), buf + c.reread_pos, unsigned(len - c.reread_pos), file_off + c.reread_pos);
  mark(slot, sqe, kReread, IOSQE_FIXED_FILE | IOSQE_IO_HARDLINK);
  sqe = get_sqe();
  io_uring_prep_close_direct(sqe, slot);
  mark(slot, sqe, kClose, 0);
}

// fsync=True, the job's last request done: each distinct directory of the job's renames is
// opened (no links for block files; a lookup, not I/O) and fsync'ed in the ring, all at once.
// Returns false when there is nothing to wait for.
bool Ring::start_dirsync(uint32_t slot) {
  Ctx& c = ctx_[slot];
  Job& job = *c.job;
  c.sync_dirs = detail::renamed_dirs(job);
  if (c.sync_dirs.empty()) return false;
  const size_t n = c.sync_dirs.size();
  c.sync_fds.assign(n, -1);
  c.sync_err.assign(n, 0);
  c.phase = Phase::DirSync;
  c.pending = 0;
  for (size_t i = 0; i < n; ++i) {
    const int fd = detail::open_dir_for_sync(c.sync_dirs[i], op_is_block(job.op));
    if (fd < 0) {
      c.sync_err[i] = fd;
      continue;
    }
    c.sync_fds[i] = fd;
    io_uring_sqe* sqe = get_sqe();
    io_uring_prep_fsync(sqe, fd, 0);
    mark(slot, sqe, kDirSync, 0, uint32_t(i));
    engine_.counters().dir_fsyncs++;
  }
  if (c.pending > 0) return true;
  detail::apply_dir_errors(job, c.sync_dirs, c.sync_err, engine_.counters());
  return false;
}

// write_block with a recycle path, before its main chain: rename the victim to the temporary
// name, then statx what is there (hard-linked: whatever the rename returned). after_recycle_probe
// decides from both: overwrite it (detail::reusable_victim), put it back (anything else: a
// directory, FIFO, symlink, a longer or hard-linked file), or write afresh. Both go relative to
// the link-free descriptors of the two directories; if either cannot be opened without a link,
// nothing is issued or moved (check_res).
void Ring::prep_recycle(uint32_t slot) {
  Ctx& c = ctx_[slot];
  const Job& job = *c.job;
  const Request& r = job.reqs[c.index];
  c.phase = Phase::RecycleProbe;
  int vfd, tfd;
  const char *vname, *tname;
  c.check_res[0] = at(job, r.recycle, &vfd, &vname);
  c.check_res[1] = c.check_res[0] < 0 ? 0 : at(job, r.path, &tfd, &tname);
  if (c.check_res[0] < 0 || c.check_res[1] < 0) return prep_failed(slot, kStatx, -ENOENT);
  io_uring_sqe* sqe = get_sqe();
  io_uring_prep_renameat(sqe, vfd, vname, tfd, tname, RENAME_NOREPLACE);
  mark(slot, sqe, kRecycle, IOSQE_IO_HARDLINK);
  sqe = get_sqe();
  io_uring_prep_statx(sqe, tfd, tname, AT_SYMLINK_NOFOLLOW, STATX_TYPE | STATX_MODE | STATX_NLINK | STATX_SIZE, &c.stx);
  mark(slot, sqe, kStatx, 0);
}

// A rename (never replacing) of from to to in phase, relative to the link-free descriptors of
// their directories; one that cannot be opened: a NOP reporting its errno.
void Ring::prep_rename(uint32_t slot, Phase phase, Stage st, const std::string& from, const std::string& to) {
  Ctx& c = ctx_[slot];
  c.phase = phase;
  int ffd, tfd;
  const char *fname, *tname;
  int e = at(*c.job, from, &ffd, &fname);
  if (e == 0) e = at(*c.job, to, &tfd, &tname);
  if (e < 0) return prep_failed(slot, st, e);
  io_uring_sqe* sqe = get_sqe();
  io_uring_prep_renameat(sqe, ffd, fname, tfd, tname, RENAME_NOREPLACE);
  mark(slot, sqe, st, 0);
}

// An unlink of path in phase (relative to its link-free directory descriptor).
void Ring::prep_remove(uint32_t slot, Phase phase, const std::string& path) {
  Ctx& c = ctx_[slot];
  c.phase = phase;
  int dfd;
  const char* name;
  if (int e = at(*c.job, path, &dfd, &name)) return prep_failed(slot, kUnlink, e);
  io_uring_sqe* sqe = get_sqe();
  io_uring_prep_unlinkat(sqe, dfd, name, 0);
  mark(slot, sqe, kUnlink, 0);
}

// ------------------------------------------------------------------ kernel

void Ring::submit(unsigned wait_nr) {
  if (unsubmitted_ == 0 && wait_nr == 0) return;
  unsigned carried = unsubmitted_ - wake_sqes_;
  int rc;
  do {
    rc = wait_nr ? io_uring_submit_and_wait(&ring_, wait_nr) : io_uring_submit(&ring_);
  } while (rc == -EINTR);
  if (rc < 0 && rc != -EBUSY && rc != -EAGAIN) throw_errno("io_uring_submit", -rc);
  if (carried) {
    engine_.counters().submits++;
    engine_.counters().sqes += carried;
  }
  unsubmitted_ = 0;
  wake_sqes_ = 0;
}

void Ring::submit_and_reap(Finished& finished) {
  if (unsubmitted_ > 0) {
    submit(1);
    reap(false, finished);
  } else {
    reap(true, finished);
  }
}

void Ring::reap(bool wait, Finished& finished) {
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
      const uint64_t ud = cqes[i]->user_data;
      const int32_t res = cqes[i]->res;
      const uint32_t fl = cqes[i]->flags;
      io_uring_cq_advance(&ring_, 1);
      on_cqe(ud, res, fl, finished);
    }
    engine_.counters().cqes += n;
  }
}

// ------------------------------------------------------------------ completing

void Ring::drain_wake(uint32_t flags) {
  uint64_t v;
  while (::read(wake_fd_, &v, sizeof(v)) == sizeof(v)) {
  }
  if (!(flags & IORING_CQE_F_MORE)) arm_wake();
}

void Ring::on_cqe(uint64_t ud, int32_t res, uint32_t flags, Finished& finished) {
  if (ud == kWakeTag) return drain_wake(flags);
  uint32_t sub = uint32_t(ud >> 32);
  const uint32_t slot = uint32_t((ud & 0xffffffffull) >> kStageBits);
  const Stage st = Stage(ud & ((1u << kStageBits) - 1));
  Ctx& c = ctx_[slot];
  const bool pre_failed = (sub & kPreFailed) != 0;
  if (pre_failed) {  // prep_failed's NOP: the op's result is the errno it stands for
    sub &= ~kPreFailed;
    res = c.pre_res;
  }
  if (st == kOpen && skip_open_cqe_ && !pre_failed && c.phase != Phase::Open) {  // only failures post, not counted
    record_error(c, kOpen, res);
    if (c.phase == Phase::Main) c.open_failed = true;
    return;
  }
  record(c, st, sub, res);
  if (--c.pending == 0) next_step(slot, finished);
}

// The bytes moved by a main chain's or a re-read's transfer CQE.
void Ring::record_transfer(Ctx& c, Stage st, int32_t res) {
  const Job& job = *c.job;
  const Request& r = job.reqs[c.index];
  const bool reading = is_read(job.op);
  if (res < 0) return record_error(c, st == kReread ? kData : st, res);
  const uint64_t n = uint64_t(res);
  if (st == kHeader) {
    if (reading) c.hdr_got = n;
    if (n < kHeaderBytes) record_error(c, kHeader, reading ? kErrShort : -ENOSPC);
  } else if (st == kData) {
    if (reading) c.data_got = n;
    if (n < (c.merged ? kHeaderBytes : 0) + r.length) record_error(c, kData, reading ? kErrShort : -ENOSPC);
  } else {  // kReread
    uint64_t& got = c.reread_header ? c.hdr_got : c.data_got;
    if (c.reread_pos + n > got)
      got = c.reread_pos + n;
    else
      record_error(c, kData, kErrShort);  // nothing new: the file ends there
  }
}

void Ring::record(Ctx& c, Stage st, uint32_t sub, int32_t res) {
  const Job& job = *c.job;
  const Request& r = job.reqs[c.index];
  switch (st) {
    case kOpen:
      if (res >= 0 && c.phase == Phase::Open) c.fd = res;  // a store's descriptor (closed by its chain)
      if (res < 0) record_error(c, kOpen, res);
      if (res < 0 && (c.phase == Phase::Main || c.phase == Phase::Open)) c.open_failed = true;
      return;
    case kLinks:  // (reported with the open's priority: before any bytes count)
      if (res == 0 && S_ISREG(c.stx.stx_mode) && c.stx.stx_nlink > 1) record_error(c, kOpen, -EMLINK);
      return;
    case kHeader:
    case kData:
    case kReread:
      return record_transfer(c, st, res);
    case kFsync:
      if (res < 0) record_error(c, kFsync, res);
      return;
    case kClose:  // matters for writes only (the data may not have reached the file)
      // (a regular descriptor is released whatever the close returns, a flush's error included)
      c.fd = -1;
      if (res < 0 && op_is_write(job.op) && c.err == 0) record_error(c, kClose, res);
      return;
    case kRename:
      c.rename_res = res;
      return;
    case kUnlink:
      if (job.op == Op::Unlink && res < 0) record_error(c, kUnlink, res);
      if (c.phase == Phase::RemoveVictim) c.unlink_res = res;
      if ((c.phase == Phase::RemoveTemp || c.phase == Phase::RemoveDupTemp) && res < 0 && res != -ENOENT)
        engine_.add_leftover(r.path);  // our temporary stays: the caller is told
      return;
    case kRecycle:
      c.recycle_res = res;
      return;
    case kStatx:
      c.stat_res = res;
      return;
    case kRestore:
      if (res < 0) {  // left at the temporary name (start-up moves stale temporaries away)
        engine_.counters().recycle_failures++;
        engine_.add_leftover(r.path);
      }
      // back at its name: removed after the store; else what is at its name is not the victim
      c.recycle_res = res < 0 ? -ENOENT : -EINVAL;
      return;
    case kDirSync:
      ::close(c.sync_fds[sub]);
      c.sync_fds[sub] = -1;
      if (res < 0) c.sync_err[sub] = res;
      return;
  }
}

// Every CQE of the slot's phase is in: the next phase, or the request's result.
void Ring::next_step(uint32_t slot, Finished& finished) {
  Ctx& c = ctx_[slot];
  switch (c.phase) {
    case Phase::Open:
      return after_open(slot, finished);
    case Phase::Main:
    case Phase::Reread:
      return after_main(slot, finished);
    case Phase::RecycleProbe:
      return after_recycle_probe(slot);
    case Phase::RestoreVictim:  // put back (or left behind, counted): a fresh temporary
      c.reuse = false;
      return prep_request(slot);
    case Phase::Rename:
      return after_rename(slot, finished);
    case Phase::RemoveTemp:
    case Phase::RemoveDupTemp:
      return after_store(slot, finished);
    case Phase::RemoveVictim:
      return after_remove_victim(slot, finished);
    case Phase::DirSync:  // the job's directories are synced: report it
      detail::apply_dir_errors(*c.job, c.sync_dirs, c.sync_err, engine_.counters());
      return release(slot, finished);
  }
}

// Whether a read that opened its file must re-read: bytes are missing after a short read
// (Main: kErrShort) or after a re-read that moved some (Reread without error).
bool Ring::wants_reread(const Ctx& c) const {
  const Job& job = *c.job;
  const bool missing = (job.op == Op::ReadBlock && c.hdr_got < kHeaderBytes) || c.data_got < job.reqs[c.index].length;
  return missing && (c.phase == Phase::Main ? c.err == kErrShort : c.err == 0);
}

// A store's open is in: its chain from the descriptor, or (the open failed) what follows a main
// chain whose open failed.
void Ring::after_open(uint32_t slot, Finished& finished) {
  Ctx& c = ctx_[slot];
  c.phase = Phase::Main;
  if (c.fd < 0) return after_main(slot, finished);
  prep_store_chain(slot);
}

void Ring::after_main(uint32_t slot, Finished& finished) {
  Ctx& c = ctx_[slot];
  const Job& job = *c.job;
  const Request& r = job.reqs[c.index];
  if (is_read(job.op) && !c.open_failed && wants_reread(c)) {
    if (c.rereads < kMaxRereads) return prep_reread(slot);
    record_error(c, kData, kErrShort);
  }
  if (!is_tmp_write(job, r)) return finish(slot, finished);
  // file_mode may not have survived the umask (Job::fix_mode), or a reused victim has another
  // mode: set it exactly (a synchronous open + fchmod, only then).
  const bool fix = c.reuse ? (c.stx.stx_mode & 07777) != job.file_mode : job.fix_mode;
  if (c.err == 0 && fix) {
    if (int e = detail::set_mode(r.path, op_is_block(job.op), job.file_mode)) record_error(c, kClose, e);
  }
  // The open failed: whatever is at the temporary name is not ours (unless it is the victim we
  // renamed there), so nothing is removed.
  if (c.err != 0 && c.err_stage == kOpen && !c.reuse) return after_store(slot, finished);
  if (c.err == 0) return prep_rename(slot, Phase::Rename, kRename, r.path, r.target);
  prep_remove(slot, Phase::RemoveTemp, r.path);
}

// The rename into place is in: where the file system has no RENAME_NOREPLACE, the hard link
// fallback (detail::link_into_place, synchronous); a block already in place (another writer's,
// equally valid) is kept, counted, and the store succeeds; then our temporary is removed.
void Ring::after_rename(uint32_t slot, Finished& finished) {
  Ctx& c = ctx_[slot];
  const Request& r = c.job->reqs[c.index];
  int e = c.rename_res;
  bool temp_left = e < 0;
  if (e < 0 && detail::noreplace_unsupported(-e)) {
    int ffd, tfd;
    const char *fname, *tname;
    e = at(*c.job, r.path, &ffd, &fname);
    if (e == 0) e = at(*c.job, r.target, &tfd, &tname);
    if (e == 0) e = detail::link_into_place(ffd, fname, tfd, tname);
  }
  if (e == -EEXIST) {
    engine_.counters().rename_existing++;
    e = 0;
  }
  if (e < 0) {
    record_error(c, kRename, e);
    return prep_remove(slot, Phase::RemoveTemp, r.path);
  }
  if (temp_left) return prep_remove(slot, Phase::RemoveDupTemp, r.path);  // success whatever it returns
  after_store(slot, finished);
}

// The recycle probe is in: how the main chain opens (reuse the victim, or a fresh temporary),
// or first the victim put back.
void Ring::after_recycle_probe(uint32_t slot) {
  Ctx& c = ctx_[slot];
  const Request& r = c.job->reqs[c.index];
  if (c.check_res[0] < 0) {
    // The victim's path does not lead to it without a link (or it is gone): never moved, never
    // removed (removing it by that path would follow the link).
    if (c.check_res[0] != -ENOENT) {
      engine_.counters().recycle_failures++;
      if (c.check_res[0] != -ELOOP) engine_.add_leftover(r.recycle);
    }
    c.recycle_res = c.stat_res = -ENOENT;
  } else if (c.check_res[1] < 0) {
    // The temporary's directory is gone or a link: the store fails opening its temporary; the
    // victim, untouched, is removed afterwards.
    c.recycle_res = -ECANCELED;
    c.stat_res = -ENOENT;
  }
  const bool usable = c.stat_res == 0 && detail::reusable_victim(c.stx.stx_mode, c.stx.stx_nlink, c.stx.stx_size, r.length);
  if (c.recycle_res == 0 && !usable) return prep_rename(slot, Phase::RestoreVictim, kRestore, r.path, r.recycle);
  if (c.recycle_res == 0) engine_.counters().recycled++;
  c.reuse = usable;  // (usable without the rename: a leftover regular file at our own temporary name)
  prep_request(slot);
}

// A store is done with its temporary: a victim that stayed at its name is removed, then the result.
void Ring::after_store(uint32_t slot, Finished& finished) {
  Ctx& c = ctx_[slot];
  const Request& r = c.job->reqs[c.index];
  if (c.job->op == Op::WriteBlock && !r.recycle.empty() && c.recycle_res < 0 && c.recycle_res != -ENOENT)
    return prep_remove(slot, Phase::RemoveVictim, r.recycle);
  finish(slot, finished);
}

void Ring::after_remove_victim(uint32_t slot, Finished& finished) {
  Ctx& c = ctx_[slot];
  const int e = c.unlink_res;
  if (e < 0 && e != -ENOENT) {
    engine_.counters().recycle_failures++;
    if (e != -ELOOP) engine_.add_leftover(c.job->reqs[c.index].recycle);
  }
  finish(slot, finished);
}

void Ring::finish(uint32_t slot, Finished& finished) {
  Ctx& c = ctx_[slot];
  Job& job = *c.job;
  Request& r = job.reqs[c.index];
  Stats& s = engine_.counters();
  int64_t result = c.err;
  if (result == 0 && job.op == Op::ReadBlock) {
    result = detail::verify_block(c.header, job, r, s);
    if (result != 0) s.verify_failures++;
  }
  if (result == 0) {
    result = int64_t(job.op == Op::Unlink ? 0 : r.length);
    if (is_read(job.op))
      s.bytes_read += r.length;
    else if (job.op != Op::Unlink)
      s.bytes_written += r.length;
  }
  // A failed load whose file was opened: bytes may have reached the caller's memory. None stay.
  if (job.op == Op::ReadBlock && result < 0 && !c.open_failed)
    std::memset(reinterpret_cast<void*>(r.addr), 0, r.length);
  r.result = result;
  r.done_time = monotonic_seconds();
  (result < 0 ? s.requests_failed : s.requests_ok)++;
  // The job's last request: with fsync, its directories first (the slot is kept till then).
  if (++job.done == job.reqs.size() && job.fsync && start_dirsync(slot)) return;
  release(slot, finished);
}

void Ring::release(uint32_t slot, Finished& finished) {
  Ctx& c = ctx_[slot];
  Job& job = *c.job;
  const uint64_t len = job.op == Op::Unlink ? 0 : job.reqs[c.index].length;
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

// ---------------------------------------------------------------------------- UringEngine

UringEngine::UringEngine(EngineConfig cfg) : cfg_(cfg) {
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
  wake_pending_.assign(cfg_.workers, 0);
  for (unsigned i = 0; i < cfg_.workers; ++i) workers_.emplace_back([this, i] { worker_main(i); });
}

UringEngine::~UringEngine() { shutdown(); }

void UringEngine::shutdown() {
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
}

int64_t UringEngine::register_buffer(uint64_t addr, uint64_t len) {
  std::lock_guard<std::mutex> lk(buf_mu_);
  const int64_t first = int64_t(buffers_.size());
  for (uint64_t off = 0; off < len; off += kMaxFixedChunk)
    buffers_.push_back({addr + off, std::min(kMaxFixedChunk, len - off)});
  ++buffers_generation_;
  wake_workers();  // idle workers register the buffers now, not on their first job
  return first;
}

void UringEngine::unregister_buffers() {
  std::lock_guard<std::mutex> lk(buf_mu_);
  buffers_.clear();
  ++buffers_generation_;
  wake_workers();
}

void UringEngine::wake_workers() {
  for (int fd : wake_fds_) {
    uint64_t one = 1;
    (void)!::write(fd, &one, sizeof(one));
  }
}

std::vector<BufferRegion> UringEngine::buffers(uint64_t* generation) const {
  std::lock_guard<std::mutex> lk(buf_mu_);
  *generation = buffers_generation_;
  return buffers_;
}

void UringEngine::submit(std::unique_ptr<Job> job) {
  job->submit_time = monotonic_seconds();
  bool wake[16];  // workers <= 16 (the constructor's limit)
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!admit_locked(*job)) return;
    (op_is_write(job->op) ? stores_ : loads_).push_back(std::move(job));
    for (size_t i = 0; i < wake_pending_.size(); ++i) {
      wake[i] = !wake_pending_[i];
      wake_pending_[i] = 1;
    }
  }
  for (size_t i = 0; i < wake_fds_.size(); ++i) {
    if (!wake[i]) continue;
    uint64_t one = 1;
    (void)!::write(wake_fds_[i], &one, sizeof(one));
  }
}

// The worker's ring reports the buffers generation it registered (await_buffers waits for it).
void UringEngine::report_buffers(unsigned idx, uint64_t generation) {
  std::lock_guard<std::mutex> lk(mu_);
  worker_buffer_gen_[idx] = generation;
  done_cv_.notify_all();
}

// New jobs onto ring, loads before stores, each only when the ring has room for it whole (or,
// for a job that can never fit whole, for its first request); each job's SQEs go to the kernel
// in their own io_uring_submit.
// Clears worker idx's pending wake-up first: a job queued after that writes a new one.
void UringEngine::take_jobs(Ring& ring, std::vector<std::unique_ptr<Job>>& active, unsigned idx) {
  for (bool first = true;; first = false) {
    std::unique_ptr<Job> job;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (first) wake_pending_[idx] = 0;
      std::deque<std::unique_ptr<Job>>* q = !loads_.empty() ? &loads_ : &stores_;
      if (q->empty() || !ring.can_take_whole(*q->front())) return;
      job = std::move(q->front());
      q->pop_front();
    }
    if (ring.inflight() == 0) ring.sync_buffers();
    ring.issue(*job);
    ring.submit(0);
    active.push_back(std::move(job));
  }
}

void UringEngine::worker_main(unsigned idx) {
  std::unique_ptr<Ring> ring;
  try {
    ring = std::make_unique<Ring>(*this, cfg_.queue_depth, wake_fds_[idx], true);
  } catch (const std::exception&) {
    // Leave the jobs to the other workers (the constructor already proved a ring can be built).
    return;
  }
  std::vector<std::unique_ptr<Job>> active;  // issued (partly or wholly), not finished
  uint64_t reported_generation = 0;
  std::vector<Job*> done;
  for (;;) {
    if (ring->inflight() == 0) ring->sync_buffers();
    if (ring->buffers_generation() != reported_generation) {
      reported_generation = ring->buffers_generation();
      report_buffers(idx, reported_generation);
    }
    // First continue partly issued jobs, then take new ones; a partly issued store waits while a
    // load is queued (the load takes the slots its completions free: loads go first).
    bool load_queued;
    {
      std::lock_guard<std::mutex> lk(mu_);
      load_queued = !loads_.empty();
    }
    for (auto& j : active) {
      const bool store = op_is_write(j->op);
      if (j->next < j->reqs.size() && (!store || (!load_queued && ring->store_batch_ready(*j))) &&
          ring->issue(*j) > 0)
        ring->submit(0);
    }
    take_jobs(*ring, active, idx);
    bool stop;
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop = stopping_ && loads_.empty() && stores_.empty();
    }
    if (stop && ring->inflight() == 0) break;
    // Hand over follow-ups and wake re-arms, wait for completions (or a wake-up from
    // submit()/shutdown()), in one io_uring_enter where possible.
    ring->submit_and_reap(done);
    if (done.empty()) continue;
    std::lock_guard<std::mutex> lk(mu_);
    for (Job* j : done) {
      finish_locked(*j);
      auto it = std::find_if(active.begin(), active.end(), [j](const std::unique_ptr<Job>& p) { return p.get() == j; });
      retire_locked(std::move(*it));
      active.erase(it);
    }
    done.clear();
  }
}

bool UringEngine::await_buffers(double timeout_s) {
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

}  // namespace pykvtier
