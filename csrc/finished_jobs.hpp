// The finished-job queue every engine (io_uring, gds) reports through: jobs are counted as
// outstanding when submitted, moved to the queue by the engine's threads when their last request
// finished, and handed out once by poll(). Engines derive from it and guard their own job state
// with the same mutex (mu_), notifying done_cv_ when a job finishes.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <vector>

namespace pykvtier {

template <class Finished>
class FinishedJobs {
 public:
  // Finished jobs since the last call (each job exactly once). Never blocks for long.
  std::vector<Finished> poll() {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<Finished> out;
    out.swap(finished_);
    return out;
  }
  // Blocks until a finished job is available or nothing is pending, or timeout_s seconds
  // (< 0: no timeout). Returns true if a finished job is available.
  bool wait(double timeout_s) {
    std::unique_lock<std::mutex> lk(mu_);
    auto ready = [this] { return !finished_.empty() || outstanding_ == 0; };
    if (timeout_s < 0)
      done_cv_.wait(lk, ready);
    else
      done_cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), ready);
    return !finished_.empty();
  }
  // Blocks until every submitted job has finished (results stay available to poll()).
  void drain() {
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [this] { return outstanding_ == 0; });
  }
  // Jobs submitted and not yet finished.
  size_t pending_jobs() {
    std::lock_guard<std::mutex> lk(mu_);
    return outstanding_;
  }

 protected:
  std::mutex mu_;
  std::condition_variable done_cv_;
  std::vector<Finished> finished_;
  size_t outstanding_ = 0;  // submitted and not yet finished
};

}  // namespace pykvtier
