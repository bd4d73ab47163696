// A job and its requests, as every host engine (io_uring, posix) runs them, with the block
// header each writes and checks. No Python objects here (see bindings.cpp).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

#include "block_format.hpp"
#include "finished_jobs.hpp"
#include "job_ops.hpp"

namespace pykvtier {

struct Request {
  std::string path;
  std::string target;  // writes: rename path -> target (RENAME_NOREPLACE) once written
  // write_block: an evicted block file of the same size to reuse instead of creating one. It is
  // renamed to path first (RENAME_NOREPLACE) and overwritten in place, which spares the file
  // system an inode and extent allocation (and the freeing of the evicted file). If it cannot
  // be renamed (other than: it is gone) path is created afresh and it is unlinked afterwards.
  std::string recycle;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t addr = 0;
  uint8_t digest[kDigestBytes] = {};
  int64_t result = 0;
  double issue_time = 0, done_time = 0;  // CLOCK_MONOTONIC seconds: chain prepared, result known
};

struct Job {
  uint64_t id = 0;
  Op op = Op::Read;
  bool direct = true;
  // Durable writes: each file fdatasync'ed before its rename, then each distinct directory of
  // the job's renames fsync'ed once before the job is reported.
  bool fsync = false;
  uint32_t align = 4096;      // O_DIRECT file offset / length alignment (direct only)
  uint32_t file_mode = 0600;  // permission bits of the files the job creates, exactly
  bool fix_mode = false;      // set file_mode after creating (the umask may take bits of it)
  bool complete = false;      // reported (posix engine's run(): its waiter's condition)
  std::vector<Request> reqs;
  size_t next = 0;  // next request to issue
  size_t done = 0;  // requests finished
  uint32_t submits = 0;
  double submit_time = 0, start_time = 0, end_time = 0;  // CLOCK_MONOTONIC seconds
};

struct FinishedJob {
  uint64_t id;
  Op op;
  std::vector<int64_t> results;
  uint32_t submits;
  double queued_s;    // submit -> first SQE handed to the kernel
  double transfer_s;  // first SQE -> last completion
};

struct EngineStats {
  std::atomic<uint64_t> submits{0}, sqes{0}, cqes{0};
  std::atomic<uint64_t> jobs_submitted{0}, jobs_finished{0};
  std::atomic<uint64_t> requests_ok{0}, requests_failed{0};
  std::atomic<uint64_t> bytes_read{0}, bytes_written{0};
  std::atomic<uint64_t> fixed_buffer_ios{0}, verify_failures{0}, rename_existing{0};
  std::atomic<uint64_t> buffer_registration_failures{0};
  std::atomic<uint64_t> recycled{0}, recycle_failures{0};  // reused files; victims left behind
  std::atomic<uint64_t> dir_fsyncs{0};  // directory fsyncs of fsync=True jobs (one per directory)
  std::atomic<int> buffer_registration_errno{0};
};

FinishedJob make_finished(Job& job);

// The submit and finish bookkeeping of a host engine (io_uring, posix): poll(), wait(),
// drain() and pending_jobs() from FinishedJobs, the counters, and the shut-down flag. The
// *_locked methods are called with mu_ held.
class HostJobs : public FinishedJobs<FinishedJob> {
 public:
  EngineStats& stats() { return stats_; }

  // Paths of files the engine created or renamed but could not remove after a failure (a failed
  // store's temporary, a recycle victim neither reused nor removed), each reported once: the
  // caller owns them from then on (counts them, retries their removal).
  std::vector<std::string> take_leftovers() {
    std::lock_guard<std::mutex> lk(leftovers_mu_);
    std::vector<std::string> out;
    out.swap(leftovers_);
    leftover_set_.clear();
    return out;
  }
  // Called by the engine's threads.
  void add_leftover(const std::string& path) {
    std::lock_guard<std::mutex> lk(leftovers_mu_);
    if (leftover_set_.insert(path).second) leftovers_.push_back(path);
  }

 protected:
  // Counts a submitted job. Returns false when it is empty: then it is finished already.
  // Throws std::runtime_error after shutdown.
  bool admit_locked(Job& job) {
    if (stopping_) throw std::runtime_error("engine is shut down");
    stats_.jobs_submitted++;
    ++outstanding_;
    if (!job.reqs.empty()) return true;
    job.end_time = job.start_time = job.submit_time;
    finish_locked(job);
    return false;
  }
  // A submitted job whose last request finished: queued for poll(), waiters woken.
  void finish_locked(Job& job) {
    finished_.push_back(make_finished(job));
    --outstanding_;
    stats_.jobs_finished++;
    done_cv_.notify_all();
  }

  EngineStats stats_;
  bool stopping_ = false;  // shutdown() began: no new jobs

 private:
  std::mutex leftovers_mu_;
  std::vector<std::string> leftovers_;  // not yet taken, in the order found
  std::unordered_set<std::string> leftover_set_;
};

// Distinct directories of the rename targets of job's requests that succeeded (result >= 0), in
// first-seen order: what an fsync=True job fsyncs before it is reported.
std::vector<std::string> renamed_dirs(const Job& job);
// After the directory fsyncs: the requests renamed into dirs[i] whose fsync failed (err[i] < 0)
// fail with that error (their rename is not durable). Counters adjusted.
void apply_dir_errors(Job& job, const std::vector<std::string>& dirs, const std::vector<int>& err,
                      EngineStats& stats);

// Fills hdr (kHeaderBytes) with the header of the block r writes: r.length payload bytes at
// r.addr, key digest r.digest.
void fill_header(char* hdr, const Request& r);
// Checks the header hdr (kHeaderBytes, read from a block file) and the payload read into
// r.addr against r: 0 if the block is whole and r's key, else one of the kErr* codes.
int64_t verify_block(const char* hdr, const Request& r);

}  // namespace pykvtier
