// The one job model of every pykvtier engine (io_uring, posix, gds): a Job is a batch of
// Requests of one Op; each request's result is bytes moved (>= 0), -errno, or a BlockError
// (block_format.hpp); a finished job is reported once as a FinishedJob; every engine counts the
// same Stats. No Python objects here.
#pragma once

#include <time.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "pykvtier/block_format.hpp"

namespace pykvtier {

enum class Op : uint8_t {
  Read,        // read [offset, offset+length) of path into addr
  Write,       // write addr into path at offset (in place, or path then rename to target)
  ReadBlock,   // read a block file: header checked, payload (length bytes) into addr
  WriteBlock,  // write a block file to path (a temporary), then rename it to target
  Unlink,      // remove path
};

inline const char* op_name(Op op) {
  switch (op) {
    case Op::Read: return "read";
    case Op::Write: return "write";
    case Op::ReadBlock: return "read_block";
    case Op::WriteBlock: return "write_block";
    case Op::Unlink: return "unlink";
  }
  return "?";
}

// Stores, and unlinks (which share the stores' budget: loads have priority).
inline bool op_is_write(Op op) { return op == Op::Write || op == Op::WriteBlock || op == Op::Unlink; }
// Ops on block files (and unlinks): their paths are opened following no symbolic link.
inline bool op_is_block(Op op) { return op == Op::ReadBlock || op == Op::WriteBlock || op == Op::Unlink; }

// What a block's loads and stores check (Job::verify).
enum class Verify : uint8_t {
  Payload,  // header, key digest, length and the payload's XXH3 (stored, checked on load)
  Header,   // header, key digest and length only: no payload checksum computed or checked
};

struct Request {
  std::string path;
  std::string target;   // writes: path is renamed to target (never replacing it) once written
  std::string recycle;  // write_block: an evicted block file to overwrite in place of a new one
  uint64_t offset = 0;  // read / write: file offset
  uint64_t length = 0;  // bytes (block ops: payload bytes)
  uint64_t addr = 0;    // memory the bytes go to / come from (host or device, by engine)
  uint8_t digest[kDigestBytes] = {};  // block ops: the key digest in the header
  int64_t result = 0;
  double issue_time = 0, done_time = 0;  // CLOCK_MONOTONIC seconds: issued, result known
};

struct Job {
  uint64_t id = 0;
  Op op = Op::Read;
  Verify verify = Verify::Payload;
  bool direct = true;    // O_DIRECT
  // Durable writes: each file fdatasync'ed before its rename, then each distinct directory of
  // the job's renames fsync'ed once before the job is reported.
  bool fsync = false;
  uint32_t align = 4096;      // O_DIRECT file offset / length alignment (direct only)
  uint32_t file_mode = 0600;  // permission bits of the files the job creates, exactly
  bool fix_mode = false;      // set file_mode after creating (the umask may take bits of it)
  std::vector<Request> reqs;
  size_t next = 0;  // engine's: next request to issue
  size_t done = 0;  // engine's: requests finished
  uint32_t submits = 0;  // kernel submissions carrying the job's I/O (io_uring_submit calls)
  double submit_time = 0, start_time = 0, end_time = 0;  // CLOCK_MONOTONIC seconds
};

struct FinishedJob {
  uint64_t id = 0;
  Op op = Op::Read;
  std::vector<int64_t> results;  // one per request, in entry order
  uint32_t submits = 0;
  double queued_s = 0;    // submit -> first request issued
  double transfer_s = 0;  // first request issued -> last result
};

// The counters every engine keeps (pykvtier._native.STATS_KEYS lists them, in this order).
// An engine that has no such event leaves its counter at 0.
#define PYKVTIER_STATS_FIELDS(X)                                                                 \
  X(submits)                      /* io_uring_submit calls carrying SQEs */                      \
  X(sqes)                                                                                        \
  X(cqes)                                                                                        \
  X(jobs_submitted)                                                                              \
  X(jobs_finished)                                                                               \
  X(requests_ok)                                                                                 \
  X(requests_failed)                                                                             \
  X(bytes_read)                   /* payload bytes */                                            \
  X(bytes_written)                                                                               \
  X(fixed_buffer_ios)             /* I/Os from registered buffers */                             \
  X(buffer_registration_failures)                                                                \
  X(buffer_registration_errno)    /* the last failure's errno */                                 \
  X(verify_failures)              /* loads failed with a BlockError */                           \
  X(loads_unchecked_payload)      /* payload-verified loads of blocks stored without checksum */ \
  X(rename_existing)              /* stores that found the block in place (kept) */              \
  X(recycled)                     /* evicted files overwritten by write_block */                 \
  X(recycle_failures)             /* victims neither reused nor removed */                       \
  X(dir_fsyncs)                   /* directory fsyncs of fsync=True jobs */                      \
  X(device_verifications)         /* gds: payloads checked by the device kernel */               \
  X(host_verifications)           /* gds: payloads copied to the host and checked there */       \
  X(unverified_payloads)          /* gds: loads whose payload was not checked */                 \
  X(verify_launches)              /* gds: device checksum kernel launches */                     \
  X(compat_mode_files)            /* gds: files opened in kvikio's POSIX mode */                 \
  X(gds_files)                    /* gds: files opened through cuFile */                         \
  X(cuda_errors)

struct Stats {
#define PYKVTIER_STATS_MEMBER(name) std::atomic<uint64_t> name{0};
  PYKVTIER_STATS_FIELDS(PYKVTIER_STATS_MEMBER)
#undef PYKVTIER_STATS_MEMBER

  // Calls f(const char* key, uint64_t value) for every counter, in STATS_KEYS order.
  template <class F>
  void for_each(F&& f) const {
#define PYKVTIER_STATS_VISIT(name) f(#name, name.load(std::memory_order_relaxed));
    PYKVTIER_STATS_FIELDS(PYKVTIER_STATS_VISIT)
#undef PYKVTIER_STATS_VISIT
  }
};

inline constexpr const char* kStatsKeys[] = {
#define PYKVTIER_STATS_NAME(name) #name,
    PYKVTIER_STATS_FIELDS(PYKVTIER_STATS_NAME)
#undef PYKVTIER_STATS_NAME
};

// CLOCK_MONOTONIC in seconds.
inline double monotonic_seconds() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

// The report of a job whose last request finished.
inline FinishedJob make_finished(const Job& job) {
  FinishedJob f;
  f.id = job.id;
  f.op = job.op;
  f.results.reserve(job.reqs.size());
  for (const auto& r : job.reqs) f.results.push_back(r.result);
  f.submits = job.submits;
  f.queued_s = job.start_time > 0 ? job.start_time - job.submit_time : 0;
  f.transfer_s = job.start_time > 0 ? job.end_time - job.start_time : 0;
  return f;
}

}  // namespace pykvtier
