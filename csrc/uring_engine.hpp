// The io_uring data path of pykvtier: batched block I/O over one ring per
// submitting thread. No Python objects here (see bindings.cpp).
//
// A job is a batch of requests of one kind (Op). Each request opens its file
// inside the ring into a fixed-file slot, moves its bytes and closes the slot,
// as one chain of SQEs; a job's requests are prepared together and handed to the
// kernel with one io_uring_submit where the ring has room. Results are per
// request: bytes moved, -errno, or one of the kErr* codes of block_format.hpp.
#pragma once

#include <liburing.h>
#include <linux/openat2.h>
#include <sys/stat.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "finished_jobs.hpp"
#include "job.hpp"

namespace pykvtier {


struct EngineConfig {
  unsigned queue_depth = 64;                 // requests in flight per ring
  uint64_t max_inflight_bytes = 256ull << 20;  // payload bytes in flight per ring
  unsigned workers = 1;                      // background rings for submit()
  double store_share = 0.5;                  // share of slots and bytes stores may hold
};

struct BufferRegion {
  uint64_t addr;
  uint64_t len;
};

class Engine;

// One io_uring with its fixed-file table, header buffers and registered buffers.
// Used by exactly one thread.
class Ring {
 public:
  Ring(Engine& engine, unsigned depth, int wake_fd, bool single_issuer);
  ~Ring();
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  // Prepares as many of job's pending requests as fit; returns how many.
  unsigned issue(Job& job);
  // Hands prepared SQEs to the kernel (one io_uring_submit); waits for wait_nr CQEs.
  void submit(unsigned wait_nr);
  // Waits for at least one CQE (if anything is in flight), then handles all ready CQEs.
  // Jobs whose last request finished are appended to finished.
  void reap(bool wait, std::vector<Job*>& finished);
  // submit(1) then reap whatever is ready, or a plain waiting reap when nothing is prepared.
  void submit_and_reap(std::vector<Job*>& finished);
  void sync_buffers();  // re-register the engine's fixed buffers if they changed (idle only)
  uint64_t buffers_generation() const { return buffers_generation_; }

  unsigned inflight() const { return inflight_; }
  bool has_capacity(uint64_t len, bool store) const;
  bool can_take_whole(const Job& job) const;
  uint64_t byte_budget(bool store) const;
  unsigned slot_budget(bool store) const;
  bool has_unsubmitted() const { return unsubmitted_ > 0; }

 private:
  struct Ctx {
    Job* job = nullptr;
    uint32_t index = 0;
    uint8_t pending = 0;
    // 0 main chain, 1 rename, 2 cleanup unlink, 3/4 unlink of a duplicate temporary, 5 unlink of
    // a recycle victim, 6 recycle probe (checks, rename victim -> temporary, statx of the
    // temporary), 7 rename of a victim that is no reusable block file back to its name,
    // 8 re-read after a short read, 9 the job's directory fsyncs (its last request's slot)
    uint8_t phase = 0;
    bool reuse = false;  // the main chain overwrites the regular file at path (no O_EXCL)
    bool open_failed = false;  // the main chain's open failed: nothing reached the destination
    int flags = 0;             // the main chain's open flags (a re-read opens the same way)
    int32_t recycle_res = 0;  // result of renaming the recycled file to the temporary name
    int32_t stat_res = 0;     // result of the statx of the temporary (phase 6)
    int32_t check_res[2] = {0, 0};  // phase 6: -errno opening the directory of 0: the victim, 1: the temporary
    int32_t pre_res = 0;      // the -errno a stand-in NOP reports for an op never issued (prep_failed)
    int32_t unlink_res = 0;   // phase 5: the victim's unlink
    struct statx stx {};
    open_how how[2] = {};     // of the opens being submitted (the kernel copies them then)
    bool merged = false;      // header and payload written by one WRITEV (a new file)
    iovec iov[2] = {};        // its iovecs (live until the request finishes)
    int64_t err = 0;
    int err_stage = 99;
    uint64_t moved = 0;
    uint64_t hdr_got = 0, data_got = 0;  // reads: header / payload bytes read so far
    uint64_t reread_pos = 0;  // phase 8: where the re-read starts in its part
    bool reread_header = false;  // phase 8 re-reads the header (else the payload)
    uint8_t rereads = 0;
    std::vector<std::string> sync_dirs;  // phase 9
    std::vector<int> sync_fds, sync_err;
    char* header = nullptr;
  };
  io_uring_sqe* get_sqe();
  void prep_chain(uint32_t slot);
  void prep_recycle(uint32_t slot);
  void prep_followup(uint32_t slot, uint8_t phase);
  bool prep_open(uint32_t slot, int flags);  // false: not issued (a NOP reports why)
  int at(const Job& job, const std::string& path, int* dfd, const char** name);
  int dir_fd(const std::string& dir);
  void prep_failed(uint32_t slot, uint64_t stage, int err);
  void prep_reread(uint32_t slot);
  bool start_dirsync(uint32_t slot);
  void release(uint32_t slot, std::vector<Job*>& finished);
  void on_cqe(uint64_t user_data, int32_t res, uint32_t flags, std::vector<Job*>& finished);
  void finish(uint32_t slot, std::vector<Job*>& finished);
  void record_error(Ctx& c, int stage, int64_t err);
  void arm_wake();
  int fixed_index(uint64_t addr, uint64_t len) const;

  Engine& engine_;
  io_uring ring_{};
  unsigned depth_;
  int wake_fd_;
  std::vector<Ctx> ctx_;
  std::vector<uint32_t> free_slots_;
  char* headers_ = nullptr;
  unsigned inflight_ = 0;
  uint64_t inflight_bytes_ = 0;
  uint64_t inflight_store_bytes_ = 0;
  unsigned inflight_stores_ = 0;
  unsigned unsubmitted_ = 0;
  unsigned wake_sqes_ = 0;
  bool skip_open_cqe_ = false;
  uint64_t buffers_generation_ = 0;
  std::vector<BufferRegion> buffers_;
  // Link-free directory descriptors (O_PATH, opened with open_no_links on first use, by this
  // ring's thread) of block files' directories: renames, unlinks, statx and opens of block files
  // go relative to them with the base name, so a directory later swapped for a link cannot
  // redirect them. Kept for the ring's life (reopened if the directory was removed).
  std::unordered_map<std::string, int> dir_fds_;
};

// poll(), wait(), drain(), pending_jobs() and stats() come from HostJobs.
class Engine : public HostJobs {
 public:
  explicit Engine(EngineConfig cfg);
  ~Engine();

  // Synchronous batch on the calling thread's own ring. Caller must not hold the GIL.
  std::vector<int64_t> run(Job& job);
  // Queues a job for the background rings; returns at once.
  void submit(std::unique_ptr<Job> job);
  void shutdown();

  unsigned register_buffer(uint64_t addr, uint64_t len);
  void unregister_buffers();
  // Blocks until every background ring has registered the current buffers (pinning the
  // memory), or timeout (<0: none). Returns false on timeout.
  bool await_buffers(double timeout_s);
  std::vector<BufferRegion> buffers(uint64_t* generation) const;

  const EngineConfig& config() const { return cfg_; }

 private:
  void worker_main(unsigned idx);
  void wake_workers();

  EngineConfig cfg_;
  mutable std::mutex buf_mu_;
  std::vector<BufferRegion> buffers_;
  uint64_t buffers_generation_ = 0;

  std::deque<std::unique_ptr<Job>> loads_, stores_;  // loads have priority (under mu_)
  std::vector<int> wake_fds_;
  std::vector<uint64_t> worker_buffer_gen_;  // buffers generation each worker's ring has
  std::vector<std::thread> workers_;

  std::mutex rings_mu_;
  std::unordered_map<std::thread::id, std::unique_ptr<Ring>> sync_rings_;
};

struct DirectProbe {
  bool direct = false;
  uint32_t mem_align = 4096;
  uint32_t offset_align = 4096;
  bool dioalign_from_statx = false;
  std::string reason;
};
// Probes whether dir's file system takes O_DIRECT, and its alignment (statx STATX_DIOALIGN
// where the kernel reports it, else 4096). Leaves no file (an O_TMPFILE; else a named file
// removed at once, a taken name skipped; use_tmpfile=false: the named one, for tests). On a
// full file system (ENOSPC, EDQUOT) answers from an O_DIRECT read of an existing file under
// dir, else direct=false with the reason. Throws std::system_error when no file can be
// created in dir for another reason.
DirectProbe probe_direct(const std::string& dir, bool use_tmpfile = true);

}  // namespace pykvtier
