// The interface every C++ engine of pykvtier implements (io_uring: uring/uring_engine.hpp, posix:
// posix/posix_engine.hpp, gds: gds_engine.hpp). Jobs and results: job.hpp. Implementations
// derive from detail::JobQueue (detail/job_queue.hpp), which keeps the finished-jobs queue, the
// counters and the leftovers. Every method is thread-safe; none takes the GIL (the bindings
// release it around every wait).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pykvtier/job.hpp"

namespace pykvtier {

class Engine {
 public:
  virtual ~Engine() = default;

  // "uring", "posix", "gds", ...
  virtual const char* name() const = 0;

  // Queues job and returns at once (loads go before stores). A job without requests is
  // finished at once. Throws std::runtime_error after shutdown(); nothing is queued then.
  virtual void submit(std::unique_ptr<Job> job) = 0;
  // Finished jobs since the last call, each exactly once. Never blocks for long.
  virtual std::vector<FinishedJob> poll() = 0;
  // Blocks until a finished job can be polled or nothing is pending, or timeout_s seconds
  // (< 0: no limit). Returns true if poll() has something.
  virtual bool wait(double timeout_s) = 0;
  // Blocks until every submitted job finished (their results stay for poll()).
  virtual void drain() = 0;
  // Jobs submitted and not yet finished.
  virtual size_t pending_jobs() = 0;
  // The counters (job.hpp: Stats).
  virtual const Stats& stats() const = 0;
  // Paths of files the engine created or renamed but could not remove after a failure, each
  // reported once: from then on they are the caller's.
  virtual std::vector<std::string> take_leftovers() = 0;

  // Memory the engine moves bytes to and from, registered with the kernel or driver where the
  // engine can (io_uring fixed buffers, cuFile). Must stay valid until unregister_buffers() or
  // shutdown(). Returns the first buffer index (0 for engines that register nothing), or
  // -errno where the registration was refused (counted in stats: I/O still works, unregistered).
  virtual int64_t register_buffer(uint64_t addr, uint64_t len) = 0;
  virtual void unregister_buffers() = 0;
  // Blocks until the registration is in effect for every thread of the engine, or timeout_s
  // (< 0: no limit). Returns false on timeout.
  virtual bool await_buffers(double timeout_s) = 0;

  // Finishes queued jobs, then stops the engine's threads. Idempotent.
  virtual void shutdown() = 0;
};

}  // namespace pykvtier
