// The posix engine: the same jobs, results and block files as the io_uring engine, moved by
// plain system calls (open, preadv/pwritev, renameat2, close) on a small pool of C++ threads.
// For machines where io_uring is refused (a container's seccomp profile, io_uring_disabled,
// an old kernel). No Python objects here (see bindings.cpp); no thread of the pool ever takes
// the GIL, so a request costs its system calls and its checksum, nothing of the interpreter.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "job.hpp"
#include "safe_path.hpp"

namespace pykvtier {

struct PosixEngineConfig {
  unsigned threads = 16;      // requests in flight (one blocking request per thread)
  unsigned queue_depth = 64;  // caps threads
  uint64_t max_inflight_bytes = 256ull << 20;  // reported only: threads x request bounds it
  double store_share = 0.5;   // share of the threads that stores and unlinks may hold at once
};

// poll(), wait(), drain(), pending_jobs() and stats() come from HostJobs.
class PosixEngine : public HostJobs {
 public:
  explicit PosixEngine(PosixEngineConfig cfg);
  ~PosixEngine();
  PosixEngine(const PosixEngine&) = delete;
  PosixEngine& operator=(const PosixEngine&) = delete;

  // Runs job on the pool and waits for it. Caller must not hold the GIL. Throws
  // std::runtime_error after shutdown().
  std::vector<int64_t> run(Job& job);
  // Queues a job and returns at once; loads go before stores. Throws after shutdown().
  void submit(std::unique_ptr<Job> job);
  // Finishes queued jobs, then stops the threads. Idempotent.
  void shutdown();

  const PosixEngineConfig& config() const { return cfg_; }
  unsigned threads() const { return nthreads_; }

 private:
  void thread_main();
  bool can_take() const;  // under mu_
  void execute(const Job& job, Request& r, char* hdr);
  int64_t read(const Job& job, const Request& r, char* hdr);
  int64_t write(const Job& job, const Request& r, char* hdr, bool own);
  int64_t recycle_write(const Job& job, const Request& r, char* hdr);
  void remove_temporary(const ParentDir& d, const Request& r);
  void sync_dirs(Job& job);  // fsync=True: each distinct directory of the job's renames

  PosixEngineConfig cfg_;
  unsigned nthreads_ = 1;
  unsigned store_limit_ = 1;
  unsigned stores_running_ = 0;
  // Jobs with requests not yet handed to a thread (under mu_); loads have priority.
  std::deque<Job*> loads_, stores_;
  std::unordered_map<Job*, std::unique_ptr<Job>> submitted_;  // submit()ted, not finished
  std::condition_variable work_cv_, run_cv_;
  std::mutex join_mu_;  // held by shutdown() while it joins the threads
  std::vector<std::thread> threads_;
};

}  // namespace pykvtier
