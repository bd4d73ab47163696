// The posix engine: the jobs, results and block files of the io_uring engine, moved by plain
// system calls (open, preadv/pwritev, renameat2, close) on a pool of C++ threads. For machines
// where io_uring is refused (a container's seccomp profile, io_uring_disabled, an old kernel).
// No thread of the pool ever takes the GIL.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "job_queue.hpp"
#include "safe_path.hpp"

namespace pykvtier {

struct PosixEngineConfig {
  unsigned threads = 16;      // requests in flight (one blocking request per thread)
  unsigned queue_depth = 64;  // caps threads
  uint64_t max_inflight_bytes = 256ull << 20;  // reported only: threads x request bounds it
  double store_share = 0.5;   // share of the threads that stores and unlinks may hold at once
};

class PosixEngine final : public detail::JobQueue {
 public:
  explicit PosixEngine(PosixEngineConfig cfg);
  ~PosixEngine() override;
  PosixEngine(const PosixEngine&) = delete;
  PosixEngine& operator=(const PosixEngine&) = delete;

  const char* name() const override { return "posix"; }
  void submit(std::unique_ptr<Job> job) override;
  // No fixed buffers without io_uring: nothing is registered.
  int64_t register_buffer(uint64_t, uint64_t) override { return 0; }
  void unregister_buffers() override {}
  bool await_buffers(double) override { return true; }
  void shutdown() override;

  const PosixEngineConfig& config() const { return cfg_; }
  unsigned threads() const { return nthreads_; }

 private:
  void thread_main();
  bool can_take() const;  // under mu_
  void job_done_locked(Job* job, std::unique_lock<std::mutex>& lk);
  void execute(const Job& job, Request& r, char* hdr);
  int64_t read(const Job& job, const Request& r, char* hdr);
  int64_t transfer(const Job& job, const Request& r, int fd, char* hdr, bool write);
  int64_t write(const Job& job, const Request& r, char* hdr, bool own);
  int open_store_file(const Job& job, const Request& r, const ParentDir& d, bool own);
  int64_t place(const Job& job, const Request& r, const ParentDir& d);
  int64_t recycle_write(const Job& job, const Request& r, char* hdr);
  bool put_back(const ParentDir& t, const ParentDir& v, const Request& r, mode_t mode);
  void remove_temporary(const ParentDir& d, const Request& r);

  PosixEngineConfig cfg_;
  unsigned nthreads_ = 1;
  unsigned store_limit_ = 1;
  unsigned stores_running_ = 0;
  // Jobs with requests not yet handed to a thread (under mu_); loads have priority.
  std::deque<Job*> loads_, stores_;
  std::unordered_map<Job*, std::unique_ptr<Job>> submitted_;  // submit()ted, not finished
  std::condition_variable work_cv_;
  std::mutex join_mu_;  // held by shutdown() while it joins the threads
  std::vector<std::thread> threads_;
};

}  // namespace pykvtier
