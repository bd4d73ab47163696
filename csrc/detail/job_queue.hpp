// The bookkeeping every engine shares: jobs counted when submitted, moved to the finished queue
// by the engine's threads when their last request finished, handed out once by poll(); the
// counters; the leftovers. Engines derive from it and guard their own job state with mu_,
// notifying done_cv_ when a job finishes. The *_locked methods are called with mu_ held.
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

#include "pykvtier/engine.hpp"

namespace pykvtier::detail {

class JobQueue : public Engine {
 public:
  std::vector<FinishedJob> poll() override {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<FinishedJob> out;
    out.swap(finished_);
    return out;
  }
  // A Job to build a new job in: a finished one kept by retire_locked (its requests and their
  // names keep their capacity: building a job of no more requests allocates nothing), else a
  // new one. Its fields are the caller's to set. Any thread.
  std::unique_ptr<Job> spare_job() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!spare_.empty()) {
        auto job = std::move(spare_.back());
        spare_.pop_back();
        return job;
      }
    }
    return std::make_unique<Job>();
  }
  bool wait(double timeout_s) override {
    std::unique_lock<std::mutex> lk(mu_);
    auto ready = [this] { return !finished_.empty() || outstanding_ == 0; };
    if (timeout_s < 0)
      done_cv_.wait(lk, ready);
    else
      done_cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), ready);
    return !finished_.empty();
  }
  void drain() override {
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [this] { return outstanding_ == 0; });
  }
  size_t pending_jobs() override {
    std::lock_guard<std::mutex> lk(mu_);
    return outstanding_;
  }
  const Stats& stats() const override { return stats_; }
  std::vector<std::string> take_leftovers() override {
    std::lock_guard<std::mutex> lk(leftovers_mu_);
    std::vector<std::string> out;
    out.swap(leftovers_);
    leftover_set_.clear();
    return out;
  }

  Stats& counters() { return stats_; }
  // A file the engine could not remove (reported once by take_leftovers). Any thread.
  void add_leftover(const std::string& path) {
    std::lock_guard<std::mutex> lk(leftovers_mu_);
    if (leftover_set_.insert(path).second) leftovers_.push_back(path);
  }

 protected:
  // Counts a submitted job. Returns false when it has no requests: then it is finished already.
  // Throws std::runtime_error after shutdown began.
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
  void finish_locked(const Job& job) {
    finished_.push_back(make_finished(job));
    --outstanding_;
    stats_.jobs_finished++;
    done_cv_.notify_all();
  }

  // A finished job (after finish_locked) kept for spare_job(), up to kSpareJobs of them: an
  // engine thread freeing the many small allocations the submitting thread made costs that
  // thread's allocator tens of microseconds at its next submit (glibc).
  static constexpr size_t kSpareJobs = 64;
  void retire_locked(std::unique_ptr<Job> job) {
    if (spare_.size() < kSpareJobs) spare_.push_back(std::move(job));
  }

  std::mutex mu_;
  std::condition_variable done_cv_;
  std::vector<FinishedJob> finished_;
  std::vector<std::unique_ptr<Job>> spare_;  // finished jobs to build new ones in
  size_t outstanding_ = 0;  // submitted and not yet finished
  bool stopping_ = false;   // shutdown() began: no new jobs
  Stats stats_;

 private:
  std::mutex leftovers_mu_;
  std::vector<std::string> leftovers_;  // not yet taken, in the order found
  std::unordered_set<std::string> leftover_set_;
};

}  // namespace pykvtier::detail
