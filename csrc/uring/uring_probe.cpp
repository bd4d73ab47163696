// What this kernel's io_uring can do, for `pykvtier doctor`: ring setup flags tried one by one,
// the features the kernel reports, which opcodes it supports, and -- in a directory -- whether the
// operations the engine relies on really work there (openat into a fixed-file slot, read/write
// through it, statx, renameat, unlinkat), plus registered-buffer pinning (RLIMIT_MEMLOCK).
#include "uring_probe.hpp"

#include "file_ops.hpp"

#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace pykvtier {

namespace {

std::string err_text(int err) { return detail::result_text(-int64_t(err)); }

// Runs the SQEs prepared on ring, returns the first CQE's res (or -errno of the submit).
int run_one(io_uring* ring) {
  int rc = io_uring_submit_and_wait(ring, 1);
  if (rc < 0) return rc;
  io_uring_cqe* cqe = nullptr;
  rc = io_uring_wait_cqe(ring, &cqe);
  if (rc < 0) return rc;
  int res = cqe->res;
  io_uring_cqe_seen(ring, cqe);
  return res;
}

void add_check(UringProbe& p, const std::string& name, int res, const char* ok_text = "ok") {
  p.checks.push_back({name, res >= 0, res >= 0 ? ok_text : err_text(-res)});
}

// Ring setup flags tried one by one, and the features the kernel reports for a plain ring.
void probe_setup(UringProbe& p, const io_uring_params& params) {
  struct Flag {
    const char* name;
    unsigned flags;
  };
  const Flag flags[] = {
      {"SUBMIT_ALL", IORING_SETUP_SUBMIT_ALL},
      {"COOP_TASKRUN", IORING_SETUP_COOP_TASKRUN},
      {"SINGLE_ISSUER", IORING_SETUP_SINGLE_ISSUER},
      {"DEFER_TASKRUN", IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN},
  };
  for (const Flag& f : flags) {
    io_uring r{};
    io_uring_params pp{};
    pp.flags = f.flags;
    int frc = io_uring_queue_init_params(8, &r, &pp);
    p.setup_flags.push_back({f.name, frc == 0});
    if (frc == 0) io_uring_queue_exit(&r);
  }
  struct Feat {
    const char* name;
    unsigned bit;
  };
  const Feat feats[] = {
      {"NODROP", IORING_FEAT_NODROP},         {"SUBMIT_STABLE", IORING_FEAT_SUBMIT_STABLE},
      {"FAST_POLL", IORING_FEAT_FAST_POLL},   {"EXT_ARG", IORING_FEAT_EXT_ARG},
      {"NATIVE_WORKERS", IORING_FEAT_NATIVE_WORKERS}, {"RSRC_TAGS", IORING_FEAT_RSRC_TAGS},
      {"CQE_SKIP", IORING_FEAT_CQE_SKIP},     {"LINKED_FILE", IORING_FEAT_LINKED_FILE},
  };
  for (const Feat& f : feats)
    if (params.features & f.bit) p.features.push_back(f.name);
}

// Which opcodes the kernel supports.
void probe_ops(UringProbe& p, io_uring& ring) {
  struct OpName {
    const char* name;
    int op;
  };
  const OpName ops[] = {
      {"OPENAT", IORING_OP_OPENAT},   {"CLOSE", IORING_OP_CLOSE},         {"READ", IORING_OP_READ},
      {"WRITE", IORING_OP_WRITE},     {"READ_FIXED", IORING_OP_READ_FIXED}, {"WRITE_FIXED", IORING_OP_WRITE_FIXED},
      {"FSYNC", IORING_OP_FSYNC},     {"STATX", IORING_OP_STATX},         {"RENAMEAT", IORING_OP_RENAMEAT},
      {"UNLINKAT", IORING_OP_UNLINKAT}, {"POLL_ADD", IORING_OP_POLL_ADD},
  };
  io_uring_probe* probe = io_uring_get_probe_ring(&ring);
  for (const OpName& o : ops) p.ops.push_back({o.name, probe && io_uring_opcode_supported(probe, o.op)});
  if (probe) io_uring_free_probe(probe);
}

// The file operations the engine relies on, run once in dir: openat into a fixed-file slot,
// write/read through it (from the registered buffer where fixed_buf), close, statx, rename
// (RENAME_NOREPLACE), unlink. The probe file is removed.
void probe_files(UringProbe& p, io_uring& ring, const std::string& dir, void* buf, bool fixed_buf) {
  int rc;
  const std::string a = dir + "/.pykvtier-uring-probe-" + std::to_string(getpid());
  const std::string b = a + ".renamed";
  io_uring_sqe* sqe = io_uring_get_sqe(&ring);
  io_uring_prep_openat_direct(sqe, AT_FDCWD, a.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600, 0);
  rc = run_one(&ring);
  add_check(p, "openat_direct", rc);
  if (rc >= 0) {
    sqe = io_uring_get_sqe(&ring);
    if (fixed_buf)
      io_uring_prep_write_fixed(sqe, 0, buf, 4096, 0, 0);
    else
      io_uring_prep_write(sqe, 0, buf, 4096, 0);
    sqe->flags |= IOSQE_FIXED_FILE;
    add_check(p, fixed_buf ? "write_fixed" : "write_fixed_file", run_one(&ring));
    sqe = io_uring_get_sqe(&ring);
    if (fixed_buf)
      io_uring_prep_read_fixed(sqe, 0, buf, 4096, 0, 0);
    else
      io_uring_prep_read(sqe, 0, buf, 4096, 0);
    sqe->flags |= IOSQE_FIXED_FILE;
    add_check(p, fixed_buf ? "read_fixed" : "read_fixed_file", run_one(&ring));
    sqe = io_uring_get_sqe(&ring);
    io_uring_prep_close_direct(sqe, 0);
    add_check(p, "close_direct", run_one(&ring));

    struct statx stx {};
    sqe = io_uring_get_sqe(&ring);
    io_uring_prep_statx(sqe, AT_FDCWD, a.c_str(), 0, STATX_SIZE, &stx);
    rc = run_one(&ring);
    add_check(p, "statx", rc >= 0 && stx.stx_size != 4096 ? -EIO : rc);
    sqe = io_uring_get_sqe(&ring);
    io_uring_prep_renameat(sqe, AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_NOREPLACE);
    rc = run_one(&ring);
    add_check(p, "renameat_noreplace", rc);
    sqe = io_uring_get_sqe(&ring);
    io_uring_prep_unlinkat(sqe, AT_FDCWD, rc >= 0 ? b.c_str() : a.c_str(), 0);
    add_check(p, "unlinkat", run_one(&ring));
  }
  ::unlink(a.c_str());
  ::unlink(b.c_str());
}

}  // namespace

UringProbe probe_uring(const std::string& dir) {
  UringProbe p;
  io_uring ring{};
  io_uring_params params{};
  int rc = io_uring_queue_init_params(8, &ring, &params);
  if (rc < 0) {
    p.available = false;
    p.error = "io_uring_setup: " + err_text(-rc);
    return p;
  }
  p.available = true;
  probe_setup(p, params);
  probe_ops(p, ring);
  rc = io_uring_register_files_sparse(&ring, 4);
  add_check(p, "fixed_file_table", rc);
  const bool fixed_files = rc >= 0;

  // Registered buffers pin memory (RLIMIT_MEMLOCK on older kernels / without CAP_IPC_LOCK).
  void* buf = nullptr;
  if (posix_memalign(&buf, 4096, 1 << 20) == 0) {
    std::memset(buf, 0, 1 << 20);
    iovec iov{buf, 1 << 20};
    rc = io_uring_register_buffers(&ring, &iov, 1);
    add_check(p, "register_buffers_1MiB", rc);
    const bool fixed_buf = rc >= 0;
    if (!dir.empty() && fixed_files) probe_files(p, ring, dir, buf, fixed_buf);
    if (fixed_buf) io_uring_unregister_buffers(&ring);
    free(buf);
  }
  io_uring_queue_exit(&ring);
  return p;
}

}  // namespace pykvtier
